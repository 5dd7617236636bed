"""Pricing a redistribution: the bytes each rank sends in each step, for every rank at once.

Pure numpy over the mesh (no loop over ranks, never over pairs of ranks), so plans price in
milliseconds on 10,000-device meshes. Bytes follow the ring model of ``comm/core.py``; an
``exchange`` sends each rank exactly the elements it lacks.
"""

from __future__ import annotations

import math

import numpy as np

from ..algebra.layout import Layout, chunk_bounds, chunk_size
from ..algebra.mesh import AbstractMesh
from . import core as comm


def _per_rank(values: np.ndarray, price) -> tuple[int, ...]:
    """``price(v)`` for every rank's value ``v``, as Python ints: priced once per distinct value
    (a mesh of 10,000 ranks has a handful), with the same function execution counts with."""
    if len(values) and values.min() == values.max():
        return (price(int(values[0])),) * len(values)
    uniq, inverse = np.unique(values, return_inverse=True)
    table = [price(int(v)) for v in uniq.tolist()]
    return tuple(map(table.__getitem__, inverse.ravel().tolist()))


def _int_dtype(shape: tuple[int, ...], mesh: AbstractMesh):
    """int64 where per-rank element counts (times the group size) cannot overflow it, else object."""
    return np.int64 if math.prod(shape) * max(mesh.size, 1) < 2 ** 62 else object


def _bounds(lay: Layout, shape: tuple[int, ...], rank: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, stops)`` of shape ``(ndim, ranks)``: every rank's, or one ``rank``'s."""
    if rank is None:
        return lay.local_bounds(shape)
    box = lay.local_slices(shape, rank)
    return (np.array([[b.start] for b in box], dtype=np.int64).reshape(len(shape), 1),
            np.array([[b.stop] for b in box], dtype=np.int64).reshape(len(shape), 1))


def step_bytes(op: str, axes: tuple[str, ...], src: Layout, dst: Layout, d: int | None, e: int | None,
                shape: tuple[int, ...], itemsize: int, rank: int | None = None) -> tuple[int, ...] | int:
    """Bytes each rank sends in one step (or ``rank`` alone, as an int), priced by the same
    ``core`` functions that count them when the step runs (on the padded buffers it passes)."""
    mesh = src.mesh
    n = mesh.size if rank is None else 1
    if op in ("slice", "make_partial"):
        out = (0,) * n
    elif op == "exchange":
        out = _exchange_bytes(src, dst, axes, shape, itemsize, rank)
    else:
        k = mesh.axis_size(axes)
        starts, stops = _bounds(src, shape, rank)
        loc = (stops - starts).astype(_int_dtype(shape, mesh))
        if op == "all_gather":
            loc[d] = chunk_size(shape[d], src.dim_shards(d))
        elif op == "reduce_scatter":
            loc[d] = chunk_size(shape[d], dst.dim_shards(d))
        elif op == "all_to_all":
            loc[d] = chunk_size(shape[d], src.dim_shards(d))
            loc[e] = chunk_size(shape[e], dst.dim_shards(e))
        numel = np.prod(loc, axis=0) if len(shape) else np.ones(n, dtype=np.int64)
        price = {"copy": lambda m: m * itemsize,
                 "all_gather": lambda m: comm.all_gather_bytes(m, k, itemsize),
                 "reduce_scatter": lambda m: comm.reduce_scatter_bytes(m, k, itemsize),
                 "all_reduce": lambda m: comm.all_reduce_bytes(m, k, itemsize),
                 "all_to_all": lambda m: (k - 1) * m * itemsize}[op]
        out = _per_rank(numel, price)
    return out if rank is None else out[0]


def _exchange_bytes(src: Layout, dst: Layout, axes, shape, itemsize, rank: int | None = None
                    ) -> tuple[int, ...]:
    """Bytes each rank (or ``rank`` alone) sends in an exchange, in O(ranks + chunks) numpy
    work — never a loop over pairs of ranks.

    Rank ``r`` sends to the peers ``q`` of its group that agree with it on the axes replicated in
    ``src`` (so peers range over ``vary``, the group's axes that shard ``src``); it sends ``q``
    the box ``src(r) ∩ dst(q)``. Summed over peers this factorizes per dim: on dim ``d`` with
    destination axes ``t``, the peers' chunks are those whose digits on ``t`` minus ``vary``
    equal ``r``'s coordinates on those axes (the ``key``), so the dim contributes the overlap of
    ``r``'s source chunk with every destination chunk of its key (``_peer_overlap``). Peer
    coordinates no destination dim depends on multiply (``free``); what ``r`` keeps itself is
    subtracted."""
    mesh = src.mesh
    canon = mesh.canonical_axes(axes)
    vary = [x for x in canon if x in src.spec.axes]           # peers range over these coordinates
    free = math.prod(mesh.axis_size(x) for x in vary if x not in dst.spec.axes)
    dtype = _int_dtype(shape, mesh)
    s_lo, s_hi = _bounds(src, shape, rank)
    d_lo, d_hi = _bounds(dst, shape, rank)
    total = np.full(s_lo.shape[1], free, dtype=dtype)
    kept = np.ones(s_lo.shape[1], dtype=dtype)
    for d, n in enumerate(shape):
        kept *= np.clip(np.minimum(s_hi[d], d_hi[d]) - np.maximum(s_lo[d], d_lo[d]), 0, None).astype(dtype)
        t = dst.dim_axes(d)
        if not t:
            total *= (s_hi[d] - s_lo[d]).astype(dtype)
        else:
            fixed = [x for x in t if x not in vary]
            total *= _peer_overlap(src, d, n, t, fixed, rank).astype(dtype)
    return _per_rank((total - kept) * itemsize, lambda v: v)


def _chunk_keys(j: np.ndarray, t: tuple[str, ...], fixed: list[str], mesh: AbstractMesh) -> np.ndarray:
    """The digits of destination chunks ``j`` (over axes ``t``, first major) on the ``fixed``
    axes, as one mixed-radix number — comparable with ``mesh.group_index(r, fixed)``."""
    key = np.zeros_like(j)
    for x in fixed:
        stride = mesh.axis_size(t[t.index(x) + 1:])
        key = key * mesh.axis_size(x) + (j // stride) % mesh.axis_size(x)
    return key


def _peer_overlap(src: Layout, d: int, n: int, t: tuple[str, ...], fixed: list[str], rank: int | None
                  ) -> np.ndarray:
    """Per rank ``r`` (every rank, or ``rank`` alone): how many elements of ``r``'s source chunk
    on dim ``d`` fall in destination chunks (over axes ``t``) whose digits on the ``fixed`` axes
    equal ``r``'s coordinates.

    Source and destination chunk boundaries, merged, cut ``[0, n)`` into at most
    ``k_src + k_dst`` segments, each inside one source chunk ``g`` and one destination chunk
    ``j``; summing segment lengths by ``(g, key(j))`` gives every rank's answer at once."""
    mesh = src.mesh
    s_axes = src.dim_axes(d)
    k_src, k_dst = src.dim_shards(d), mesh.axis_size(t)
    c_src, c_dst = chunk_size(n, k_src), chunk_size(n, k_dst)
    if rank is not None:   # one rank: the destination chunks its source chunk overlaps
        lo, hi = chunk_bounds(n, k_src, mesh.group_index(rank, s_axes) if s_axes else 0)
        if hi <= lo:
            return np.zeros(1, dtype=np.int64)
        j = np.arange(lo // c_dst, (hi - 1) // c_dst + 1, dtype=np.int64)
        length = np.minimum((j + 1) * c_dst, hi) - np.maximum(j * c_dst, lo)
        mine = _chunk_keys(j, t, fixed, mesh) == mesh.group_index(rank, fixed)
        return np.array([int(length[mine].sum())], dtype=np.int64)
    if n == 0:
        return np.zeros(mesh.size, dtype=np.int64)
    bounds = np.union1d(np.minimum(np.arange(k_src + 1, dtype=np.int64) * c_src, n),
                        np.minimum(np.arange(k_dst + 1, dtype=np.int64) * c_dst, n))
    lo, length = bounds[:-1], np.diff(bounds)
    n_keys = mesh.axis_size(fixed)
    seg = (lo // c_src) * n_keys + _chunk_keys(lo // c_dst, t, fixed, mesh)
    g_rank = mesh.group_indices(s_axes) if s_axes else np.zeros(mesh.size, dtype=np.int64)
    want = g_rank * n_keys + mesh.group_indices(fixed)
    if k_src * n_keys <= 4 * (mesh.size + len(seg)):      # a dense table indexed by (g, key)
        table = np.zeros(k_src * n_keys, dtype=np.int64)
        np.add.at(table, seg, length)
        return table[want]
    combos, inverse = np.unique(seg, return_inverse=True)   # sparse: only the pairs that occur
    sums = np.zeros(len(combos), dtype=np.int64)
    np.add.at(sums, inverse.ravel(), length)
    pos = np.minimum(np.searchsorted(combos, want), len(combos) - 1)
    return np.where(combos[pos] == want, sums[pos], 0)
