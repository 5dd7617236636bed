"""shardlib: say where each tensor lives; the library derives the rest.

The public surface is listed in ``__all__``; everything else is internal.
"""

from .collectives import all_gather as all_gather
from .collectives import all_to_all as all_to_all
from .collectives import axis_index as axis_index
from .collectives import pbroadcast as pbroadcast
from .collectives import ppermute as ppermute
from .collectives import psum as psum
from .collectives import psum_scatter as psum_scatter
from .comm import CollectiveCounter as CollectiveCounter
from .comm import CollectiveRecord as CollectiveRecord
from .comm import count_collectives as count_collectives
from .comm import format_bytes as format_bytes
from .engine import Engine as Engine
from .engine import NonFiniteLossError as NonFiniteLossError
from .engine import parallelize as parallelize
from .errors import CollectiveError as CollectiveError
from .errors import MeshError as MeshError
from .errors import ShardingError as ShardingError
from .errors import ShardingTypeError as ShardingTypeError
from .errors import SpecError as SpecError
from .interop import from_dtensor as from_dtensor
from .interop import to_dtensor as to_dtensor
from .launcher import WorkerError as WorkerError
from .launcher import launch as launch
from .layout import Layout as Layout
from .mesh import AbstractMesh as AbstractMesh
from .mesh import Mesh as Mesh
from .mesh import current_mesh as current_mesh
from .mesh import use_mesh as use_mesh
from .planner import CommEntry as CommEntry
from .planner import Plan as Plan
from .planner import StateLayouts as StateLayouts
from .planner import plan as plan
from .redistribute import RedistributePlan as RedistributePlan
from .redistribute import Step as Step
from .redistribute import plan_redistribute as plan_redistribute
from .redistribute import redistribute as redistribute
from .shard_map import shard_map as shard_map
from .spec import P as P
from .spec import PartitionSpec as PartitionSpec

__version__ = "0.1.0"

__all__ = [
    "AbstractMesh", "CollectiveCounter", "CommEntry", "Engine", "NonFiniteLossError", "Plan", "StateLayouts",
    "parallelize", "plan", "CollectiveError", "CollectiveRecord", "Layout", "Mesh", "MeshError",
    "P", "PartitionSpec", "RedistributePlan", "ShardingError", "ShardingTypeError", "SpecError", "Step",
    "WorkerError", "all_gather", "all_to_all", "axis_index", "count_collectives", "current_mesh",
    "format_bytes", "from_dtensor", "launch", "pbroadcast", "plan_redistribute", "ppermute", "psum",
    "psum_scatter", "redistribute", "shard_map", "to_dtensor", "use_mesh",
]
