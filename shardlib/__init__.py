"""shardlib: say where each tensor lives; the library derives the rest.

The public surface is listed in ``__all__``; everything else is internal.
"""

from .algebra.layout import Layout as Layout
from .algebra.mesh import AbstractMesh as AbstractMesh
from .algebra.mesh import Mesh as Mesh
from .algebra.mesh import current_mesh as current_mesh
from .algebra.mesh import use_mesh as use_mesh
from .algebra.spec import Fused as Fused
from .algebra.spec import P as P
from .algebra.spec import PartitionSpec as PartitionSpec
from .comm.collectives import all_gather as all_gather
from .comm.collectives import all_to_all as all_to_all
from .comm.collectives import axis_index as axis_index
from .comm.collectives import pbroadcast as pbroadcast
from .comm.collectives import ppermute as ppermute
from .comm.collectives import psum as psum
from .comm.collectives import psum_scatter as psum_scatter
from .comm.core import CollectiveCounter as CollectiveCounter
from .comm.core import CollectiveRecord as CollectiveRecord
from .comm.core import count_collectives as count_collectives
from .comm.core import format_bytes as format_bytes
from .comm.interop import from_dtensor as from_dtensor
from .comm.interop import to_dtensor as to_dtensor
from .comm.redistribute import RedistributePlan as RedistributePlan
from .comm.redistribute import Step as Step
from .comm.redistribute import plan_redistribute as plan_redistribute
from .comm.redistribute import redistribute as redistribute
from .errors import CollectiveError as CollectiveError
from .errors import MeshError as MeshError
from .errors import ShardingError as ShardingError
from .errors import ShardingTypeError as ShardingTypeError
from .errors import SpecError as SpecError
from .frontend.launch.outcomes import WorkerError as WorkerError
from .frontend.launch.launcher import launch as launch
from .frontend.shard_map import shard_map as shard_map
from .quant.api import quantize as quantize
from .planner.rules import AxisRules as AxisRules
from .planner.specs import shard as shard
from .planner.build import plan as plan
from .planner.hf_dims import hf_dims as hf_dims
from .planner.hf_tp import tp_table as tp_table
from .planner.peak import activation_bytes as activation_bytes
from .planner.plan import Plan as Plan
from .planner.policies import DataPolicy as DataPolicy
from .planner.policies import MemoryPolicy as MemoryPolicy
from .planner.policies import MeshRoles as MeshRoles
from .planner.policies import PipelinePolicy as PipelinePolicy
from .planner.policies import TensorPolicy as TensorPolicy
from .planner.policies import TrainingPolicy as TrainingPolicy
from .planner.states import StateLayouts as StateLayouts
from .planner.traffic import CommEntry as CommEntry
from .cli.autoplan import autoplan as autoplan
from .runtime.engine import Engine as Engine
from .runtime.checkpoint.files import CheckpointError as CheckpointError
from .runtime.engine import NonFiniteLossError as NonFiniteLossError
from .runtime.parallelize import parallelize as parallelize
from .runtime.replicas import check_replicas as check_replicas
from .runtime.replicas import replica_mismatches as replica_mismatches
from .frontend.plots.timeline import plot_timeline as plot_timeline

__version__ = "0.2.0"

__all__ = [
    "AbstractMesh", "AxisRules", "CheckpointError", "CollectiveCounter", "CommEntry", "Engine", "Fused", "NonFiniteLossError", "Plan", "StateLayouts",
    "DataPolicy", "hf_dims", "MemoryPolicy", "MeshRoles", "PipelinePolicy", "TensorPolicy", "TrainingPolicy",
    "parallelize", "plan", "autoplan", "CollectiveError", "CollectiveRecord", "Layout", "Mesh", "MeshError",
    "P", "PartitionSpec", "RedistributePlan", "ShardingError", "ShardingTypeError", "SpecError", "Step",
    "WorkerError", "all_gather", "all_to_all", "axis_index", "count_collectives", "current_mesh",
    "format_bytes", "from_dtensor", "launch", "pbroadcast", "plan_redistribute", "ppermute", "psum",
    "psum_scatter", "redistribute", "shard", "shard_map", "to_dtensor", "use_mesh",
    "tp_table", "activation_bytes", "check_replicas", "replica_mismatches", "plot_timeline", "quantize",
]
