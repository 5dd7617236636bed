"""Named, autograd-aware collectives for per-shard code (JAX's ``lax`` collectives by axis name).

Each forward is a collective over the ranks that differ only along ``axis`` (a name or a
tuple of names, first major); each backward is the transposed collective:

============================  ==========================  =============================
op                            forward                     backward
============================  ==========================  =============================
``psum(x, axis)``             all-reduce (sum)            identity (cotangent replicated)
``pbroadcast(x, axis)``       identity                    all-reduce (sum)
``all_gather(x, axis, dim)``  all-gather, concat on dim   reduce-scatter on dim
``psum_scatter(x, axis, d)``  reduce-scatter on dim       all-gather on dim
``all_to_all(x, axis, s, c)`` split s, concat c           all-to-all split c, concat s
``ppermute(x, axis, perm)``   send/recv by ``perm``       send/recv by the inverse
============================  ==========================  =============================

``psum`` and ``pbroadcast`` are Megatron's *g* and *f*: a value that is the same on every rank
of an axis (replicated, "invariant") and enters per-rank computation needs ``pbroadcast`` so
its gradient sums the ranks' contributions. Inside ``sl.shard_map`` this is automatic: values
carry the set of axes they vary over, and ``pbroadcast`` is inserted where an invariant value
meets a varying one (JAX's ``check_vma``). ``all_gather``/``psum_scatter`` are tiled: they
concatenate or split along ``dim`` (JAX's ``tiled=True``).

Shards along the axis must have equal shapes; for uneven shards use ``sl.redistribute``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from ..algebra.mesh import Mesh, current_mesh
from ..errors import CollectiveError, ShardingTypeError
from . import core as comm
from .autograd import AllGather, AllToAll, PBroadcast, PPermute, Psum, PsumScatter
from .vma import current_tracker, tracked

AxisArg = str | Sequence[str]


def _axes(axis: AxisArg, mesh, api: str) -> tuple[str, ...]:
    if isinstance(axis, str):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)) and all(isinstance(a, str) for a in axis):
        axes = tuple(axis)
    else:
        raise ShardingTypeError(f"{api}: axis must be a mesh axis name or a tuple of names — got {axis!r}.")
    for a in axes:
        mesh.axis_index(a)  # clear error for an unknown name
    if len(set(axes)) != len(axes):
        raise CollectiveError(f"{api}: axis names repeat in {axes} — expected each axis once.")
    return axes


def _mesh(mesh, api: str) -> Mesh:
    mesh = mesh if mesh is not None else current_mesh(api)
    if not isinstance(mesh, Mesh):
        raise ShardingTypeError(f"{api}: needs a Mesh over running processes — got {type(mesh).__name__}.")
    return mesh


def _tensor(x: object, api: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShardingTypeError(f"{api}: expected a torch.Tensor — got {type(x).__name__}.")
    return x


def _dim(x: torch.Tensor, dim: int, api: str) -> int:
    if x.dim() == 0:
        raise CollectiveError(f"{api}: got a scalar (shape ()) — expected a tensor with at least one dim to "
                              "split or concatenate. Reshape it to (1,) first.")
    try:
        dim = operator.index(dim)
    except TypeError:
        raise ShardingTypeError(f"{api}: dim must be an int — got {dim!r} of type {type(dim).__name__}.") from None
    if not -x.dim() <= dim < x.dim():
        raise CollectiveError(f"{api}: dim {dim} is out of range — got a tensor of shape {tuple(x.shape)}; "
                              f"expected -{x.dim()} <= dim < {x.dim()}.")
    return dim % x.dim()


def psum(x: torch.Tensor, axis: AxisArg, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Sum ``x`` over ``axis``; every rank gets the sum. Backward: identity.

    A bool tensor is summed as integers (JAX), so ``psum(mask, axis)`` counts."""
    x = _tensor(x, "psum")
    if x.dtype == torch.bool:
        x = x.long()
    mesh = _mesh(mesh, "psum")
    axes = _axes(axis, mesh, "psum")
    with tracked(x, axes, drop=axes) as (x, done):
        return done(Psum.apply(x, mesh, axes))


def pbroadcast(x: torch.Tensor, axis: AxisArg, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``axis`` (JAX ``pvary``, Megatron *f*).

    Use it where a value replicated over ``axis`` enters computation that differs per rank. Inside
    ``shard_map`` it is inserted automatically, and axes the value already varies over are skipped."""
    x = _tensor(x, "pbroadcast")
    mesh = _mesh(mesh, "pbroadcast")
    axes = _axes(axis, mesh, "pbroadcast")
    tracker = current_tracker()
    if tracker is not None:
        # inside shard_map: a value that already varies over an axis has a per-rank cotangent there,
        # which must not be summed again; broadcast over the other axes only
        axes = tuple(a for a in axes if a not in tracker.vma(x))
        if not axes:
            return x
    with tracked(x, (), add=axes) as (x, done):
        return done(PBroadcast.apply(x, mesh, axes))


def all_gather(x: torch.Tensor, axis: AxisArg, dim: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Concatenate the shards of ``axis`` along ``dim``. Backward: reduce-scatter."""
    x = _tensor(x, "all_gather")
    mesh = _mesh(mesh, "all_gather")
    axes = _axes(axis, mesh, "all_gather")
    dim = _dim(x, dim, "all_gather")
    with tracked(x, axes) as (x, done):
        return done(AllGather.apply(x, mesh, axes, dim))


def psum_scatter(x: torch.Tensor, axis: AxisArg, dim: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Sum over ``axis`` and keep this rank's chunk of ``dim``. Backward: all-gather."""
    x = _tensor(x, "psum_scatter")
    mesh = _mesh(mesh, "psum_scatter")
    axes = _axes(axis, mesh, "psum_scatter")
    dim = _dim(x, dim, "psum_scatter")
    k = comm.group_size(mesh, axes)
    if x.shape[dim] % k:
        raise CollectiveError(f"psum_scatter: dim {dim} of shape {tuple(x.shape)} does not divide by the "
                              f"size {k} of axis {axes} — expected a multiple of {k}. Pad the dim, or use "
                              "sl.redistribute for uneven shards.")
    with tracked(x, axes) as (x, done):
        return done(PsumScatter.apply(x, mesh, axes, dim))


def all_to_all(x: torch.Tensor, axis: AxisArg, split_dim: int, concat_dim: int, *,
               mesh: Mesh | None = None) -> torch.Tensor:
    """Split ``split_dim`` over the ranks of ``axis`` and concatenate what arrives on ``concat_dim``."""
    x = _tensor(x, "all_to_all")
    mesh = _mesh(mesh, "all_to_all")
    axes = _axes(axis, mesh, "all_to_all")
    split_dim, concat_dim = _dim(x, split_dim, "all_to_all"), _dim(x, concat_dim, "all_to_all")
    k = comm.group_size(mesh, axes)
    if x.shape[split_dim] % k:
        raise CollectiveError(f"all_to_all: split dim {split_dim} of shape {tuple(x.shape)} does not divide "
                              f"by the size {k} of axis {axes} — expected a multiple of {k}.")
    with tracked(x, axes) as (x, done):
        return done(AllToAll.apply(x, mesh, axes, split_dim, concat_dim))


def ppermute(x: torch.Tensor, axis: AxisArg, perm: Sequence[tuple[int, int]], *,
             mesh: Mesh | None = None) -> torch.Tensor:
    """Send ``x`` from index ``src`` to index ``dst`` along ``axis`` for each ``(src, dst)`` in ``perm``;
    a rank no one sends to gets zeros (JAX semantics). Backward: the inverse permutation."""
    x = _tensor(x, "ppermute")
    mesh = _mesh(mesh, "ppermute")
    axes = _axes(axis, mesh, "ppermute")
    k = mesh.axis_size(axes)
    pairs = _pairs(perm, k)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if any(not 0 <= i < k for i in srcs + dsts) or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise CollectiveError(f"ppermute: perm {pairs} is not a partial permutation of 0..{k - 1} (the size of "
                              f"axis {axes}) — expected each source and each destination at most once.")
    with tracked(x, axes) as (x, done):
        return done(PPermute.apply(x, mesh, axes, pairs))


def _pairs(perm: object, k: int) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(operator.index(i) for i in p) for p in perm]
    except TypeError:
        pairs = None
    if pairs is None or any(len(p) != 2 for p in pairs):
        raise ShardingTypeError(f"ppermute: perm must be a list of (source, destination) index pairs along the "
                                f"axis — got {perm!r}; expected e.g. [(i, (i + 1) % {k}) for i in range({k})].")
    return pairs


def axis_index(axis: AxisArg, *, mesh: Mesh | None = None) -> int:
    """This rank's index along ``axis`` (first axis major for a tuple)."""
    mesh = _mesh(mesh, "axis_index")
    axes = _axes(axis, mesh, "axis_index")
    return mesh.group_index(mesh.rank, axes)
