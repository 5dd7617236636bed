"""Meshes: an N-d grid of devices with named axes.

``AbstractMesh`` is pure data (plan a 10,000-device mesh on a laptop); ``Mesh`` is the same
grid over the running process world, with a process group for every axis and every
combination of axes (built with torch's ``DeviceMesh``).

Rank ``r`` sits at coordinate ``numpy.unravel_index(r, mesh.shape)``: row-major in the order the
axes were declared, exactly as JAX's ``Mesh(np.arange(n).reshape(shape), names)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import difflib
import itertools
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..allocator import set_mmap_threshold
from ..errors import MeshError, Problems, ShardingTypeError, SpecError
from ..validate import is_int
from .world_env import adopt_launcher_env


class MeshShape(tuple):
    """The mesh's axis sizes in declaration order; also indexable by axis name."""

    def __new__(cls, sizes: Sequence[int], names: Sequence[str]) -> MeshShape:
        obj = super().__new__(cls, tuple(sizes))
        obj._names = tuple(names)
        return obj

    def __getitem__(self, key):
        if isinstance(key, str):
            try:
                return tuple.__getitem__(self, self._names.index(key))
            except ValueError:
                raise KeyError(key) from None
        return tuple.__getitem__(self, key)

    def __reduce__(self):
        return (MeshShape, (tuple(self), self._names))

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self._names, self))


def _parse_shape(shape: Any, axis_names: Sequence[str] | None, api: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if isinstance(shape, Mapping):
        if axis_names is not None:
            raise ShardingTypeError(f"{api}: axis_names is given twice — pass either a dict "
                                    "{{name: size}} or (sizes, axis_names), not both.")
        pairs = list(shape.items())
    elif axis_names is not None:
        sizes = list(shape) if isinstance(shape, (tuple, list)) else None
        names = list(axis_names) if isinstance(axis_names, (tuple, list)) else None
        if sizes is None or names is None:
            raise ShardingTypeError(f"{api}: expected (sizes, axis_names) as two sequences — got "
                                    f"{type(shape).__name__} and {type(axis_names).__name__}.")
        if len(sizes) != len(names):
            raise MeshError(f"{api}: {len(sizes)} sizes but {len(names)} axis names — got sizes "
                            f"{tuple(sizes)} and names {tuple(names)}; expected one name per axis.")
        pairs = list(zip(names, sizes))
    elif isinstance(shape, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in shape):
        pairs = [tuple(p) for p in shape]
    else:
        raise ShardingTypeError(
            f"{api}: expected a mapping of axis name to size, e.g. {{'data': 2, 'tensor': 2}} — got "
            f"{shape!r} of type {type(shape).__name__}.")
    with Problems(api, MeshError) as problems:
        if not pairs:
            problems.add(f"{api}: a mesh needs at least one axis — got none. Use {{'data': 1}} for one device.")
        seen: set[str] = set()
        for name, size in pairs:
            if not isinstance(name, str) or not name.isidentifier():
                problems.add(f"{api}: axis name {name!r} is not a valid name — expected a non-empty "
                             "identifier such as 'data', 'pipe' or 'tensor'.")
            elif name in seen:
                problems.add(f"{api}: axis name {name!r} is declared twice — got names "
                             f"{tuple(n for n, _ in pairs)}; expected distinct names. Rename one axis.")
            else:
                seen.add(name)
            if not (is_int(size) or isinstance(size, np.integer)) or size < 1:
                problems.add(f"{api}: axis {name!r} has size {size!r} — expected a positive integer. "
                             "An axis of size 1 is allowed and means 'not split'.")
    return tuple(n for n, _ in pairs), tuple(int(s) for _, s in pairs)


class AbstractMesh:
    """A named device grid with no processes behind it: for planning and tests."""

    def __init__(self, shape: Mapping[str, int] | Sequence, axis_names: Sequence[str] | None = None):
        names, sizes = _parse_shape(shape, axis_names, type(self).__name__)
        self._names = names
        self._sizes = sizes
        self._strides = tuple(int(math.prod(sizes[i + 1:])) for i in range(len(sizes)))

    # ---- shape ---------------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def shape(self) -> MeshShape:
        """Axis sizes in declaration order; ``mesh.shape['data']`` also works."""
        return MeshShape(self._sizes, self._names)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self._names, self._sizes))

    @property
    def size(self) -> int:
        return int(math.prod(self._sizes))

    @property
    def ndim(self) -> int:
        return len(self._names)

    def axis_size(self, axes: str | Sequence[str]) -> int:
        """Size of one axis, or the product of several."""
        if isinstance(axes, str):
            return self._sizes[self.axis_index(axes)]
        return int(math.prod(self._sizes[self.axis_index(a)] for a in axes))

    def axis_index(self, axis: str) -> int:
        """Position of ``axis`` among the mesh axes; a clear error for an unknown name."""
        try:
            return self._names.index(axis)
        except ValueError:
            raise SpecError(unknown_axis_message(axis, self, "mesh")) from None

    # ---- coordinates ---------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of ``rank`` (row-major, first axis slowest)."""
        self._check_rank(rank)
        return tuple(int(c) for c in np.unravel_index(rank, self._sizes))

    def coord(self, rank: int, axis: str) -> int:
        """Coordinate of ``rank`` along one axis."""
        i = self.axis_index(axis)
        return (rank // self._strides[i]) % self._sizes[i]

    def rank_at(self, coords: Sequence[int]) -> int:
        return int(sum(c * s for c, s in zip(coords, self._strides)))

    def group_index(self, rank: int, axes: Sequence[str]) -> int:
        """Index of ``rank`` within its group over ``axes``, the first axis major (JAX order)."""
        idx = 0
        for a in axes:
            idx = idx * self.axis_size(a) + self.coord(rank, a)
        return idx

    def group_indices(self, axes: Sequence[str]) -> np.ndarray:
        """``group_index(r, axes)`` for every rank ``r`` at once: an int64 array of length ``size``
        (vectorized, so planning on a 10,000-device mesh loops in numpy, not Python)."""
        ranks = np.arange(self.size, dtype=np.int64)
        idx = np.zeros(self.size, dtype=np.int64)
        for a in axes:
            i = self.axis_index(a)
            idx = idx * self._sizes[i] + (ranks // self._strides[i]) % self._sizes[i]
        return idx

    def group_ranks(self, rank: int, axes: Sequence[str]) -> list[int]:
        """Ranks that differ from ``rank`` only along ``axes``, listed by ``group_index`` order."""
        axes = tuple(axes)
        base = rank - sum(self.coord(rank, a) * self._strides[self.axis_index(a)] for a in axes)
        sizes = [self.axis_size(a) for a in axes]
        strides = [self._strides[self.axis_index(a)] for a in axes]
        return [base + sum(c * s for c, s in zip(cs, strides)) for cs in itertools.product(*map(range, sizes))]

    def all_groups(self, axes: Sequence[str]) -> list[list[int]]:
        """Every group over ``axes``, each in ``group_index`` order."""
        seen, out = set(), []
        for r in range(self.size):
            g = self.group_ranks(r, axes)
            if g[0] not in seen:
                seen.add(g[0])
                out.append(g)
        return out

    def canonical_axes(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        """``axes`` in mesh order with size-1 axes dropped: the key of a process group."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            self.axis_index(a)
        return tuple(a for a in self._names if a in axes and self.axis_size(a) > 1)

    def _check_rank(self, rank: int) -> None:
        if not (is_int(rank) or isinstance(rank, np.integer)) or not 0 <= rank < self.size:
            raise MeshError(f"{type(self).__name__}.coords: rank {rank!r} is outside the mesh — expected "
                            f"0 <= rank < {self.size} for mesh {self.axis_sizes}.")

    def abstract(self) -> AbstractMesh:
        return AbstractMesh(self.axis_sizes)

    def with_axis(self, name: str) -> AbstractMesh:
        """This mesh with a size-1 axis ``name`` in front (itself when it has the axis): the same
        devices and ranks, one more name. The planner reads a mesh without a ``data`` axis as this
        mesh with ``data`` = 1."""
        if name in self._names:
            return self
        out = object.__new__(type(self))         # not copy.copy: a Mesh refuses pickling
        out.__dict__.update(self.__dict__)         # shares the process groups (keys skip size-1 axes)
        out._names = (name, *self._names)
        out._sizes = (1, *self._sizes)
        out._strides = (self.size, *self._strides)
        return out

    # ---- value semantics -----------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, AbstractMesh) and (self._names, self._sizes) == (other._names, other._sizes)

    def __hash__(self) -> int:
        return hash((self._names, self._sizes))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.axis_sizes})"

    def __reduce__(self):
        return (AbstractMesh, (self.axis_sizes,))


def unknown_axis_message(axis: object, mesh: AbstractMesh, where: str) -> str:
    close = difflib.get_close_matches(str(axis), mesh.axis_names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"{where}: unknown mesh axis {axis!r} — the mesh {mesh.axis_sizes} has axes "
            f"{mesh.axis_names}.{hint} Use one of them, or add the axis to the mesh (size 1 if unused).")


# ---------------------------------------------------------------------------------------------
# Mesh over real processes
# ---------------------------------------------------------------------------------------------

def default_timeout() -> datetime.timedelta:
    """Collective timeout: ``SHARDLIB_TIMEOUT`` seconds, else 300 s. A hang becomes an error."""
    return datetime.timedelta(seconds=float(os.environ.get("SHARDLIB_TIMEOUT", "300")))


def auto_backend() -> str:
    """nccl where every rank of this host has a GPU of its own; else gloo (NCCL refuses two ranks on
    one device, so several ranks sharing one GPU run over gloo)."""
    import torch
    if not torch.cuda.is_available():
        return "gloo"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return "nccl" if torch.cuda.device_count() >= local else "gloo"


def check_backend(backend: object, api: str = "Mesh") -> str:
    """Validate a backend name before any process group exists: a clear error, not a hang.

    Accepts a plain name (``"gloo"``) or torch's per-device form (``"cpu:gloo,cuda:nccl"``).
    """
    import torch
    import torch.distributed as dist

    if not isinstance(backend, str) or not backend:
        raise ShardingTypeError(f"{api}: backend must be a name such as 'gloo' or 'nccl' — got {backend!r} "
                                f"of type {type(backend).__name__}.")
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                 "mpi": dist.is_mpi_available(), "ucc": dist.is_ucc_available()}
    usable = sorted(n for n, ok in available.items() if ok)
    for part in backend.lower().split(","):
        name = part.split(":")[-1].strip()
        if name in available:
            if not available[name] and name == "mpi":
                raise MeshError(f"{api}: backend 'mpi' is not available — this torch was built without MPI "
                                "(torch.distributed.is_mpi_available() is False; the PyPI wheels are). Under mpirun "
                                "use backend='gloo' (CPU) or 'nccl' (GPU): the world is read from Open MPI's or "
                                "MPICH's variables; or build torch from source against your MPI.")
            if not available[name]:
                raise MeshError(f"{api}: backend {name!r} is not available in this torch build — expected one "
                                f"of {usable}. Pass backend='gloo' on CPU, or leave backend unset to pick "
                                "nccl on CUDA and gloo otherwise.")
            if name == "nccl" and not torch.cuda.is_available():
                raise MeshError(f"{api}: backend 'nccl' needs CUDA devices, and none is visible — use "
                                "backend='gloo' on CPU, or leave backend unset.")
        elif name not in dist.Backend.backend_list:
            raise MeshError(f"{api}: unknown backend {name!r} — expected one of {usable} (or a backend "
                            "registered with torch.distributed.Backend.register_backend).")
    return backend


def _world_timeout(device) -> datetime.timedelta:
    """The collective timeout of the world's default group (``SHARDLIB_TIMEOUT`` if unreadable)."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except Exception:  # a backend that does not expose its options
        return default_timeout()


def _group_options(backend: str | None, timeout: datetime.timedelta):
    """Per-group backend options that carry ``timeout`` (None where torch's defaults must do)."""
    import torch.distributed as dist

    if backend == "gloo":
        from torch._C._distributed_c10d import Backend
        return Backend.Options("gloo", timeout)
    if backend == "nccl" and dist.is_nccl_available():
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        return opts
    return None


class Mesh(AbstractMesh):
    """A mesh over the running process world.

    * Under ``sl.launch`` or ``torchrun`` the world is read from the environment (``env://``).
    * If the program already called ``torch.distributed.init_process_group``, that world is used.
    * A mesh of size 1 needs no process group at all (the single-process reference run).

    The backend is ``nccl`` where CUDA is available, else ``gloo``; pass ``backend=`` to override
    (it then also applies to the mesh's groups on a world the program started itself).
    Process groups are built for every axis and every combination of axes of size > 1; their
    collective ``timeout`` (seconds or ``timedelta``) defaults to the world's.
    """

    def __init__(self, shape: Mapping[str, int] | Sequence, axis_names: Sequence[str] | None = None, *,
                 backend: str | None = None, device: Any = None,
                 timeout: datetime.timedelta | float | None = None):
        super().__init__(shape, axis_names)
        import torch
        import torch.distributed as dist

        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        if backend is not None:
            check_backend(backend)
        self._backend_override = backend   # the caller's choice; applies to the mesh's groups too
        if not (dist.is_available() and dist.is_initialized()):   # srun / mpirun: their variables, as torchrun's
            adopt_launcher_env(rendezvous=backend != "mpi")
        env_world = "WORLD_SIZE" in os.environ and "RANK" in os.environ
        if not dist.is_available():
            initialized = False
        else:
            initialized = dist.is_initialized()
        if not initialized and (self.size > 1 or env_world):
            if not env_world:
                raise MeshError(
                    f"Mesh: no process world to run on — got a mesh of {self.size} devices "
                    f"{self.axis_sizes}, but torch.distributed is not initialized and RANK/WORLD_SIZE "
                    f"are not set; expected a world of {self.size} processes. Start the program with "
                    f"sl.launch(fn, nprocs={self.size}) or torchrun --nproc-per-node {self.size}, or plan "
                    "without processes with sl.AbstractMesh(...).")
            env_size = int(os.environ["WORLD_SIZE"])
            if env_size != self.size:
                raise MeshError(self._size_mismatch(env_size))
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ and backend != "mpi"]
            if missing:
                raise MeshError(f"Mesh: RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} not — expected the full env:// "
                                "rendezvous that torchrun sets. Start the program with torchrun or "
                                "sl.launch, or export the missing variables.")
            backend = backend or auto_backend()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            timeout = timeout or default_timeout()
            set_mmap_threshold()          # this rank's host allocator, as sl.launch's ranks get it
            dist.init_process_group(backend, timeout=timeout)
            initialized = True

        self._device_mesh = None
        self._groups: dict[tuple[str, ...], Any] = {}
        if initialized:
            world = dist.get_world_size()
            if world != self.size:
                raise MeshError(self._size_mismatch(world))
            self._rank = dist.get_rank()
            self._backend = backend or str(dist.get_backend())
        else:
            self._rank = 0
            self._backend = None
        self._device = self._pick_device(device)
        if initialized:
            self._build_groups(timeout or _world_timeout(self._device))

    def _size_mismatch(self, world: int) -> str:
        return (f"Mesh: the mesh {self.axis_sizes} has {self.size} devices but the process world has "
                f"{world} — expected equal sizes. Change the axis sizes so their product is {world}, "
                f"or start {self.size} processes (sl.launch(fn, nprocs={self.size}) or torchrun "
                f"--nproc-per-node {self.size}).")

    def _pick_device(self, device: Any):
        """The device this process computes on. A GPU without an index is this host's ``LOCAL_RANK``
        modulo its GPU count (several ranks may share one, over gloo), made current before the
        DeviceMesh is built (it would otherwise pick ``LOCAL_RANK`` itself, which may not exist)."""
        import torch
        if device is not None:
            picked = torch.device(device)
        elif self._backend and "nccl" in self._backend:
            picked = torch.device("cuda", torch.cuda.current_device())
        else:
            return torch.device("cpu")
        if picked.type == "cuda":
            if picked.index is None:
                local = int(os.environ.get("LOCAL_RANK", "0"))
                picked = torch.device("cuda", local % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(picked)
        return picked

    def _build_groups(self, timeout: datetime.timedelta) -> None:
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        # An explicit backend= applies to every group the mesh builds, even on a world the program
        # started with another one. The options carry the timeout: without them torch gives
        # sub-groups its 30-minute default, whatever the world's timeout is.
        override = self._backend_override
        config = (override, _group_options(override or self._backend, timeout))
        mesh_tensor = torch.arange(self.size).reshape(self._sizes)
        self._device_mesh = DeviceMesh(self._device.type, mesh_tensor, mesh_dim_names=self._names,
                                       backend_override=(config,) * self.ndim)
        live = [a for a in self._names if self.axis_size(a) > 1]
        for r in range(1, len(live) + 1):
            for combo in itertools.combinations(live, r):
                if r == 1:
                    self._groups[combo] = self._device_mesh.get_group(combo[0])
                else:
                    flat = self._device_mesh[combo]._flatten("_".join(("sl",) + combo), backend_override=config)
                    self._groups[combo] = flat.get_group()

    # ---- this process --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the mesh (0 in a world of one)."""
        return self._rank

    @property
    def my_coords(self) -> tuple[int, ...]:
        return self.coords(self._rank)

    @property
    def device(self):
        """The torch device this process computes on."""
        return self._device

    @property
    def backend(self) -> str | None:
        return self._backend

    @property
    def device_mesh(self):
        """torch's ``DeviceMesh`` over the same grid, or None in a world of one with no process group
        (and on a mesh made by ``with_axis``, whose grid torch's mesh does not have)."""
        dm = self._device_mesh
        return dm if dm is None or dm.ndim == self.ndim else None

    def group(self, axes: str | Sequence[str]):
        """The process group over ``axes`` (any order), or None when their product is 1."""
        key = self.canonical_axes(axes)
        if not key:
            return None
        return self._groups[key]

    def __reduce__(self):
        raise TypeError("Mesh holds process groups and cannot be pickled; send mesh.abstract() "
                        "(or the shape dict) and build the Mesh in the receiving process.")

    def __repr__(self) -> str:
        return f"Mesh({self.axis_sizes}, rank={self._rank}, backend={self._backend!r})"


# ---------------------------------------------------------------------------------------------
# Scoped mesh
# ---------------------------------------------------------------------------------------------

_CURRENT_MESH: contextvars.ContextVar[AbstractMesh | None] = contextvars.ContextVar("shardlib_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: AbstractMesh) -> Iterator[AbstractMesh]:
    """Make ``mesh`` the mesh of APIs that are not given one, inside the ``with`` block."""
    if not isinstance(mesh, AbstractMesh):
        raise ShardingTypeError(f"use_mesh: expected a Mesh or AbstractMesh — got {type(mesh).__name__}.")
    token = _CURRENT_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _CURRENT_MESH.reset(token)


def current_mesh(api: str = "shardlib") -> AbstractMesh:
    """The mesh of the innermost ``with sl.use_mesh(...)``; a clear error outside one."""
    mesh = _CURRENT_MESH.get()
    if mesh is None:
        raise MeshError(f"{api}: no mesh given and none in scope — pass mesh=..., or wrap the call in "
                        "`with sl.use_mesh(mesh):`.")
    return mesh
