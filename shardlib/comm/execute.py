"""Executing a redistribution on this rank's shard: one function per step op (``EXEC``), the
exchange's routing, and the dim-wise collectives the named collectives also use.

Layer 2, below ``redistribute.py`` (which plans; a plan's ``execute`` calls ``EXEC``): steps are
read by their fields (``op``, ``axes``, ``src``, ``dst``, ``dim``, ``dim2``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..algebra.layout import Layout, chunk_bounds, chunk_size
from ..algebra.mesh import Mesh
from . import core as comm

if TYPE_CHECKING:
    from .redistribute import Step


def _intersect(a: tuple[slice, ...], b: tuple[slice, ...]) -> tuple[slice, ...] | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if hi <= lo:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _box_numel(box: tuple[slice, ...] | None) -> int:
    return 0 if box is None else math.prod(s.stop - s.start for s in box)


def _exchange_sends(src: Layout, dst: Layout, axes: tuple[str, ...], shape, me: int) -> list[tuple[int, tuple | None]]:
    """For rank ``me``: ``[(peer, box)]`` over its exchange group (mesh order) — the global box of
    the data ``me`` sends to ``peer`` (None if nothing). The sender of an element to ``peer`` is
    the holder whose coordinates on axes replicated in ``src`` equal the peer's."""
    mesh = src.mesh
    canon = mesh.canonical_axes(axes)
    rep = [x for x in canon if x not in src.spec.axes]
    mine = src.local_slices(shape, me)
    out = []
    for q in mesh.group_ranks(me, canon):
        if all(mesh.coord(me, x) == mesh.coord(q, x) for x in rep):
            out.append((q, _intersect(mine, dst.local_slices(shape, q))))
        else:
            out.append((q, None))
    return out


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def gather_dim(x: torch.Tensor, mesh: Mesh, axes: Sequence[str], dim: int) -> torch.Tensor:
    """All-gather equal shards along ``dim``; chunks ordered by ``axes`` (first major)."""
    k = comm.group_size(mesh, axes)
    if k == 1:
        return x
    out = comm.all_gather(x.movedim(dim, 0).contiguous(), mesh, axes)
    perm = comm.group_perm(mesh, axes)
    if perm != sorted(perm):
        chunks = out.chunk(k)
        ordered = [None] * k
        for g, p in enumerate(perm):
            ordered[p] = chunks[g]
        out = torch.cat(ordered)
    return out.movedim(0, dim)


def scatter_dim(x: torch.Tensor, mesh: Mesh, axes: Sequence[str], dim: int, op: str = "sum") -> torch.Tensor:
    """Reduce over the group and keep this rank's chunk of ``dim`` (chunks ordered by ``axes``)."""
    k = comm.group_size(mesh, axes)
    if k == 1:
        return x
    xt = x.movedim(dim, 0)
    perm = comm.group_perm(mesh, axes)
    if perm != sorted(perm):
        chunks = xt.chunk(k)
        xt = torch.cat([chunks[p] for p in perm])
    return comm.reduce_scatter(xt.contiguous(), mesh, axes, op=op).movedim(0, dim)


def all_to_all_dims(x: torch.Tensor, mesh: Mesh, axes: Sequence[str], split_dim: int, concat_dim: int
                    ) -> torch.Tensor:
    """Split ``split_dim`` into k chunks, send chunk i to the member at index i (``axes`` order),
    concatenate what arrives along ``concat_dim`` in member order."""
    k = comm.group_size(mesh, axes)
    if k == 1:
        return x
    perm = comm.group_perm(mesh, axes)
    chunks = x.movedim(split_dim, 0).chunk(k)
    send = torch.cat([chunks[p] for p in perm]).contiguous()
    got = comm.all_to_all(send, mesh, axes).chunk(k)
    ordered = [None] * k
    for g, p in enumerate(perm):
        ordered[p] = got[g].movedim(0, split_dim)
    return torch.cat(ordered, dim=concat_dim)


def _narrow(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    start = max(0, min(start, x.shape[dim]))
    return x.narrow(dim, start, max(0, min(length, x.shape[dim] - start)))


def _exec_all_gather(x, s: Step, shape, mesh: Mesh):
    d = s.dim
    n, k_outer = shape[d], s.dst.dim_shards(d)
    c_new = chunk_size(n, s.src.dim_shards(d))
    g = gather_dim(_pad_dim(x, d, c_new), mesh, s.axes, d)
    outer = s.dst.dim_axes(d)
    c = mesh.group_index(mesh.rank, outer) if outer else 0
    lo, hi = chunk_bounds(n, k_outer, c)
    base = chunk_bounds(n, s.src.dim_shards(d), c * mesh.axis_size(s.axes))[0]
    return _narrow(g, d, lo - base, hi - lo).contiguous()


def _exec_slice(x, s: Step, shape, mesh: Mesh):
    d = s.dim
    old = s.src.local_slices(shape, mesh.rank)[d]
    new = s.dst.local_slices(shape, mesh.rank)[d]
    return _narrow(x, d, new.start - old.start, new.stop - new.start).contiguous()


def _exec_reduce_scatter(x, s: Step, shape, mesh: Mesh):
    d = s.dim
    k = mesh.axis_size(s.axes)
    c_new = chunk_size(shape[d], s.dst.dim_shards(d))
    out = scatter_dim(_pad_dim(x, d, k * c_new), mesh, s.axes, d)
    new = s.dst.local_slices(shape, mesh.rank)[d]
    return _narrow(out, d, 0, new.stop - new.start).contiguous()


def _exec_all_to_all(x, s: Step, shape, mesh: Mesh):
    d, e = s.dim, s.dim2
    k = mesh.axis_size(s.axes)
    cd = chunk_size(shape[d], s.src.dim_shards(d))
    ce = chunk_size(shape[e], s.dst.dim_shards(e))
    xp = _pad_dim(_pad_dim(x, d, cd), e, k * ce)
    y = all_to_all_dims(xp, mesh, s.axes, split_dim=e, concat_dim=d)
    mine = s.dst.local_slices(shape, mesh.rank)
    outer = s.dst.dim_axes(d)
    c = mesh.group_index(mesh.rank, outer) if outer else 0
    base = chunk_bounds(shape[d], s.src.dim_shards(d), c * k)[0]
    y = _narrow(y, d, mine[d].start - base, mine[d].stop - mine[d].start)
    return _narrow(y, e, 0, mine[e].stop - mine[e].start).contiguous()


def _exec_all_reduce(x, s: Step, shape, mesh: Mesh):
    return comm.all_reduce(x, mesh, s.axes)


def _exec_make_partial(x, s: Step, shape, mesh: Mesh):
    if all(mesh.coord(mesh.rank, a) == 0 for a in s.axes):
        return x
    return torch.zeros_like(x)


def _exec_copy(x, s: Step, shape, mesh: Mesh):
    return comm.copy_to(x, mesh.device if s.dst.memory == "device" else "cpu")


def _exec_exchange(x, s: Step, shape, mesh: Mesh):
    me = mesh.rank
    canon = mesh.canonical_axes(s.axes)
    my_src = s.src.local_slices(shape, me)
    my_dst = s.dst.local_slices(shape, me)
    sends, in_splits = [], []
    for _peer, box in _exchange_sends(s.src, s.dst, s.axes, shape, me):
        if box is None:
            in_splits.append(0)
            continue
        region = x[tuple(slice(b.start - m.start, b.stop - m.start) for b, m in zip(box, my_src))]
        sends.append(region.reshape(-1))
        in_splits.append(region.numel())
    # what each peer q sends me: src(q) ∩ dst(me), from the peers that agree with me on the axes
    # replicated in src (the mirror of _exchange_sends, without computing every peer's sends)
    rep = [a for a in canon if a not in s.src.spec.axes]
    boxes_in, out_splits = [], []
    for q in mesh.group_ranks(me, canon):
        box = (_intersect(s.src.local_slices(shape, q), my_dst)
               if all(mesh.coord(me, a) == mesh.coord(q, a) for a in rep) else None)
        boxes_in.append(box)
        out_splits.append(_box_numel(box))
    flat = torch.cat(sends) if sends else x.new_empty((0,))
    got = comm.all_to_all(flat, mesh, canon, in_splits=in_splits, out_splits=out_splits)
    out = x.new_zeros(tuple(b.stop - b.start for b in my_dst))
    offset = 0
    for box, n in zip(boxes_in, out_splits):
        if box is None:
            continue
        shape_b = tuple(b.stop - b.start for b in box)
        out[tuple(slice(b.start - m.start, b.stop - m.start) for b, m in zip(box, my_dst))] = \
            got[offset:offset + n].reshape(shape_b)
        offset += n
    return out


EXEC = {"all_gather": _exec_all_gather, "slice": _exec_slice, "reduce_scatter": _exec_reduce_scatter,
         "all_to_all": _exec_all_to_all, "all_reduce": _exec_all_reduce, "make_partial": _exec_make_partial,
         "copy": _exec_copy, "exchange": _exec_exchange}
