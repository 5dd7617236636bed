"""Redistribution: layout A -> layout B as a list of collectives, with exact bytes.

``plan_redistribute(src, dst, shape, dtype)`` is pure (no processes): it returns a
``RedistributePlan`` that prints as ``S(0)R -> RR: all_gather(data) 1.5 MiB``.
``plan.execute(local)`` runs it on a ``Mesh``; ``redistribute(local, src, dst, shape)`` does
both and is differentiable (its backward is the reverse redistribution of the gradient, the
global value being unchanged).

How plans are made. Each dim's sharding is a stack of axes (major first). Steps change the
*end* of one dim's stack:

* ``all_gather(A, d)``   pops axes ``A`` off dim ``d``           (S -> R)
* ``slice(A, d)``        pushes replicated axes ``A`` onto ``d`` (R -> S, no traffic)
* ``reduce_scatter(A, d)`` pushes partial axes ``A`` onto ``d``  (P -> S)
* ``all_to_all(a, d->e)`` moves axis ``a`` from dim ``d`` to ``e`` (S(d) -> S(e))
* ``all_reduce(A)``      sums partial axes                        (P -> R)
* ``make_partial(A)``    keeps the value on coordinate 0 only    (R -> P, no traffic)
* ``copy``               device <-> cpu memory

A greedy search picks shrinking steps first (slice, reduce-scatter, all-to-all), then
reductions, then gathers, so ``P -> S`` is one reduce-scatter, never all-reduce then slice;
adjacent steps on one dim are merged into one collective over several axes.

Uneven shapes. Ceil chunking over a product of axes does not nest: a dim of 5 split 2 ways
is ``[0:3],[3:5]``, split 4 ways ``[0:2],[2:4],[4:5],[5:5]``, so going from one to the other
is not a gather within a group. Each step is checked for exactness on the actual shape;
when one is not exact the plan sends exactly the elements each rank lacks instead
(``exchange``: one uneven all-to-all over the axes that change).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..algebra.layout import Layout, chunk_bounds, chunk_size
from ..algebra.mesh import AbstractMesh, Mesh
from ..algebra.spec import PartitionSpec
from ..errors import ShardingError, ShardingTypeError
from . import core as comm
from .core import format_bytes

NETWORK = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "exchange")


@dataclass(frozen=True)
class Step:
    """One step of a plan: ``op`` over mesh ``axes`` (tuple order = chunk order), src -> dst."""

    op: str
    axes: tuple[str, ...]
    src: Layout
    dst: Layout
    dim: int | None = None
    dim2: int | None = None
    bytes_by_rank: tuple[int, ...] = field(default=(), repr=False)

    @property
    def bytes(self) -> int:
        """Most bytes any rank sends in this step."""
        return max(self.bytes_by_rank, default=0)

    def __str__(self) -> str:
        if self.op == "copy":
            return f"copy({self.src.memory}->{self.dst.memory}) {format_bytes(self.bytes)}"
        where = ", ".join(self.axes)
        if self.op == "all_to_all":
            where += f", dim {self.dim}->{self.dim2}"
        text = f"{self.op}({where})"
        if self.op in NETWORK:
            lo = min(self.bytes_by_rank, default=0)
            text += f" {format_bytes(self.bytes)}" if lo == self.bytes else f" <= {format_bytes(self.bytes)}"
        return text


@dataclass(frozen=True)
class RedistributePlan:
    """Steps that turn a local shard in ``src`` into the local shard in ``dst``."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    dtype: torch.dtype
    steps: tuple[Step, ...]

    @functools.cached_property
    def bytes_by_rank(self) -> tuple[int, ...]:
        """Network bytes each rank sends, summed over steps (copies excluded)."""
        network = [s.bytes_by_rank for s in self.steps if s.op in NETWORK]
        if not network:
            return (0,) * self.src.mesh.size
        return network[0] if len(network) == 1 else tuple(map(sum, zip(*network)))

    @functools.cached_property
    def bytes(self) -> int:
        """Most network bytes any rank sends."""
        return max(self.bytes_by_rank, default=0)

    def bytes_for(self, rank: int) -> int:
        return self.bytes_by_rank[rank]

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(s.op for s in self.steps)

    def __str__(self) -> str:
        body = ", ".join(str(s) for s in self.steps) if self.steps else "no-op"
        return f"{self.src.short()} -> {self.dst.short()}: {body}"

    def explain(self) -> str:
        """One line per step with the layout after it."""
        lines = [f"redistribute {_dtype_name(self.dtype)}{list(self.shape)} on {self.src.mesh.axis_sizes}",
                 f"  from {self.src.short():<16} {self.src.spec}"]
        for s in self.steps:
            lines.append(f"  -> {s.dst.short():<16} {str(s):<40} {s.dst.spec}")
        lines.append(f"  total: {format_bytes(self.bytes)} sent per rank (max)")
        return "\n".join(lines)

    def execute(self, x: torch.Tensor, mesh: Mesh | None = None) -> torch.Tensor:
        """Run the plan on this rank's shard ``x`` (not differentiable; see ``redistribute``)."""
        mesh = mesh if mesh is not None else self.src.mesh
        if not isinstance(mesh, Mesh):
            raise ShardingTypeError("RedistributePlan.execute: needs a Mesh over running processes — the "
                                    "plan was made on an AbstractMesh; pass mesh=sl.Mesh(...).")
        expect = self.src.local_shape(self.shape, mesh.rank)
        if tuple(x.shape) != expect:
            raise ShardingError(f"redistribute: the local shard on rank {mesh.rank} has shape {tuple(x.shape)} "
                                f"— expected {expect}, rank {mesh.rank}'s piece of global shape "
                                f"{list(self.shape)} in {self.src}. Pass the global shape, not the local one.")
        if x.dtype != self.dtype:
            raise ShardingError(f"redistribute: local shard has dtype {x.dtype} — the plan was made for "
                                f"{self.dtype}. Plan with dtype={x.dtype}.")
        with torch.no_grad():
            for s in self.steps:
                x = _EXEC[s.op](x, s, self.shape, mesh)
        return x

    def reverse(self) -> RedistributePlan:
        """The plan that carries a gradient back: dst -> src, partial axes read as replicated."""
        return plan_redistribute(_cotangent(self.dst), _cotangent(self.src), self.shape, self.dtype)


def _cotangent(lay: Layout) -> Layout:
    return lay.replace(partial=())


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}.get(
        dtype, str(dtype).replace("torch.", ""))


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------

def plan_redistribute(src: Layout, dst: Layout, shape: Sequence[int], dtype: torch.dtype = torch.float32
                      ) -> RedistributePlan:
    """The plan that turns a ``src`` shard into a ``dst`` shard of a tensor of global ``shape``."""
    return _plan(src, dst, shape, dtype, "plan_redistribute")


def _plan(src: Layout, dst: Layout, shape: Sequence[int], dtype: torch.dtype, api: str) -> RedistributePlan:
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise ShardingTypeError(f"{api}: expected two Layouts — got {type(src).__name__} and "
                                f"{type(dst).__name__}.")
    if src.mesh != dst.mesh:
        raise ShardingError(f"{api}: source and destination are on different meshes — got "
                            f"{src.mesh.axis_sizes} and {dst.mesh.axis_sizes}; expected one mesh.")
    if not isinstance(dtype, torch.dtype):
        raise ShardingTypeError(f"{api}: dtype must be a torch.dtype — got {dtype!r}.")
    shape = src.check(shape, api=api)
    dst.check(shape, api=api)
    return _plan_cached(src, dst, shape, dtype)


@functools.lru_cache(maxsize=4096)
def _plan_cached(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> RedistributePlan:
    """The structured plan when every step is exact on ``shape``, unless the exchange sends fewer
    bytes (uneven all-to-alls, gather-then-slice moves); the exchange plan otherwise.

    Cost: the exactness check is per step and O(1) (``_nested``); bytes are per-rank numpy
    arithmetic, O(ranks) per step, and the exchange's O(ranks + chunks) (``_exchange_bytes``) —
    never a loop over pairs of ranks. A structured plan that sends nothing is not compared."""
    mesh = src.mesh
    a, b = src.normalized(), dst.normalized()
    ndim = len(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    start = _State.of(a, ndim)

    def build(comm_steps: list[tuple]) -> RedistributePlan:
        steps = list(comm_steps)
        if a.memory == "cpu" and b.memory == "device":
            steps.insert(0, ("copy", (), None, None, {"memory": "device"}))
        if a.memory == "device" and b.memory == "cpu":
            steps.append(("copy", (), None, None, {"memory": "cpu"}))
        return RedistributePlan(src, dst, shape, dtype, _materialize(steps, start, mesh, shape, itemsize))

    structured = _merge(_greedy(a, b, ndim))
    fallback = _fallback(a, b, ndim)
    best = None
    if all(_exact(s, st, shape, mesh) for s, st in zip(structured, _states(start, structured))):
        best = build(structured)
        # the structured plan wins ties (ring collectives, clearer steps), so when it sends no
        # more than rank 0 alone would in the exchange plan, that plan need not be priced
        if best.bytes <= _rank_bytes(fallback, start, mesh, shape, itemsize, rank=0):
            return best
    plan = build(fallback)
    return plan if best is None or plan.bytes < best.bytes else best


def _materialize(steps: list[tuple], start: _State, mesh: AbstractMesh, shape: tuple[int, ...],
                 itemsize: int) -> tuple[Step, ...]:
    out: list[Step] = []
    cur = start
    for op, axes, d, e, extra in steps:
        nxt = cur.apply(op, axes, d, e, extra)
        s_lay, d_lay = cur.layout(mesh), nxt.layout(mesh)
        out.append(Step(op, axes, s_lay, d_lay, d, e, _step_bytes(op, axes, s_lay, d_lay, d, e, shape, itemsize)))
        cur = nxt
    return tuple(out)


def _rank_bytes(steps: list[tuple], start: _State, mesh: AbstractMesh, shape: tuple[int, ...],
                itemsize: int, rank: int) -> int:
    """Network bytes one ``rank`` sends in ``steps`` (a lower bound on the plan's ``bytes``),
    in O(chunks) work for that rank alone."""
    total, cur = 0, start
    for op, axes, d, e, extra in steps:
        nxt = cur.apply(op, axes, d, e, extra)
        if op in NETWORK:
            total += _step_bytes(op, axes, cur.layout(mesh), nxt.layout(mesh), d, e, shape, itemsize, rank)
        cur = nxt
    return total


@dataclass(frozen=True)
class _State:
    dims: tuple[tuple[str, ...], ...]
    partial: frozenset[str]
    memory: str

    @staticmethod
    def of(lay: Layout, ndim: int) -> _State:
        return _State(tuple(lay.dim_axes(d) for d in range(ndim)), frozenset(lay.partial), lay.memory)

    def layout(self, mesh: AbstractMesh) -> Layout:
        return Layout(mesh, PartitionSpec.from_dim_axes(list(self.dims)), partial=self.partial, memory=self.memory)

    def owner(self, axis: str) -> int | None:
        return next((d for d, ax in enumerate(self.dims) if axis in ax), None)

    def apply(self, op: str, axes: tuple[str, ...], d: int | None, e: int | None, extra: dict | None) -> _State:
        dims, partial, memory = list(self.dims), set(self.partial), self.memory
        if op == "all_gather":
            assert dims[d][-len(axes):] == axes
            dims[d] = dims[d][:-len(axes)]
        elif op in ("slice", "reduce_scatter"):
            dims[d] = dims[d] + axes
            partial -= set(axes)
        elif op == "all_to_all":
            assert dims[d][-1:] == axes
            dims[d] = dims[d][:-1]
            dims[e] = dims[e] + axes
        elif op == "all_reduce":
            partial -= set(axes)
        elif op == "make_partial":
            partial |= set(axes)
        elif op == "exchange":
            dims = list(extra["dims"])
        elif op == "copy":
            memory = extra["memory"]
        return _State(tuple(dims), frozenset(partial), memory)


def _states(start: _State, steps: list[tuple]) -> list[_State]:
    """The state *before* each step."""
    out, cur = [], start
    for op, axes, d, e, extra in steps:
        out.append(cur)
        cur = cur.apply(op, axes, d, e, extra)
    return out


def _greedy(a: Layout, b: Layout, ndim: int) -> list[tuple]:
    """Single-axis steps from ``a`` to ``b`` (normalized layouts), shrinking steps first."""
    cur = _State.of(a, ndim)
    want = _State.of(b, ndim)
    steps: list[tuple] = []

    def prefix_ok(s: _State, d: int) -> bool:
        return want.dims[d][:len(s.dims[d])] == s.dims[d]

    def next_push(s: _State, d: int) -> str | None:
        if prefix_ok(s, d) and len(s.dims[d]) < len(want.dims[d]):
            return want.dims[d][len(s.dims[d])]
        return None

    for _ in range(4 * (len(a.mesh.axis_names) + 1) * (ndim + 1)):
        if cur.dims == want.dims and cur.partial == want.partial:
            return steps
        choice = None
        pushes = [(d, next_push(cur, d)) for d in range(ndim)]
        # 1. slice a replicated axis onto a dim (no traffic, shrinks)
        choice = choice or next((("slice", (x,), d, None) for d, x in pushes
                                 if x and cur.owner(x) is None and x not in cur.partial), None)
        # 2. reduce-scatter a partial axis onto a dim
        choice = choice or next((("reduce_scatter", (x,), d, None) for d, x in pushes
                                 if x and x in cur.partial), None)
        # 3. move an axis from a dim that must lose it to a dim that wants it next
        if choice is None:
            for d in range(ndim):
                if not prefix_ok(cur, d):
                    x = cur.dims[d][-1]
                    e = next((e for e, y in pushes if y == x), None)
                    if e is not None:
                        choice = ("all_to_all", (x,), d, e)
                        break
        # 4. sum partial axes that the destination neither shards on nor keeps partial
        choice = choice or next((("all_reduce", (x,), None, None) for x in a.mesh.axis_names
                                 if x in cur.partial and x not in want.partial and want.owner(x) is None), None)
        # 5. gather an axis a dim must lose
        choice = choice or next((("all_gather", (cur.dims[d][-1],), d, None) for d in range(ndim)
                                 if not prefix_ok(cur, d)), None)
        # 6. make an axis partial
        choice = choice or next((("make_partial", (x,), None, None) for x in a.mesh.axis_names
                                 if x in want.partial and x not in cur.partial and cur.owner(x) is None), None)
        if choice is None:  # pragma: no cover - the search always makes progress
            raise AssertionError(f"redistribute planner stuck at {cur} -> {want}")
        op, axes, d, e = choice
        steps.append((op, axes, d, e, None))
        cur = cur.apply(op, axes, d, e, None)
    raise AssertionError(f"redistribute planner did not converge: {a} -> {b}")  # pragma: no cover


def _merge(steps: list[tuple]) -> list[tuple]:
    """Fuse adjacent steps of one kind on one dim into one collective over several axes."""
    out: list[tuple] = []
    for s in steps:
        if out:
            op, axes, d, e, extra = out[-1]
            if s[0] == op and s[2] == d and op in ("all_gather", "slice", "reduce_scatter"):
                merged = s[1] + axes if op == "all_gather" else axes + s[1]
                out[-1] = (op, merged, d, e, extra)
                continue
            if s[0] == op and op in ("all_reduce", "make_partial"):
                out[-1] = (op, axes + s[1], None, None, extra)
                continue
        out.append(s)
    return out


def _nested(n: int, k_outer: int, k_inner: int) -> bool:
    """True when ceil chunking ``n`` into ``k_outer*k_inner`` refines chunking into ``k_outer``:
    every outer chunk is exactly the union of its ``k_inner`` inner chunks.

    O(1): with ``c = ceil(n/k_outer)`` the inner chunk is ``ceil(n/(k_outer*k_inner)) =
    ceil(c/k_inner)``, and outer chunk ``i`` starts at ``i*c`` while its inner chunks start at
    ``i*k_inner*ceil(c/k_inner)`` (both capped at ``n``). These agree for every ``i`` iff
    ``k_inner`` divides ``c``; otherwise they already differ at ``i = 1`` — unless there is only
    one outer chunk (``k_outer == 1``) or at most one element (``n <= 1``), where any split nests."""
    return n <= 1 or k_outer == 1 or chunk_size(n, k_outer) % k_inner == 0


def _exact(step: tuple, before: _State, shape: tuple[int, ...], mesh: AbstractMesh) -> bool:
    op, axes, d, e, _ = step
    size = mesh.axis_size
    if op == "all_gather":
        return _nested(shape[d], size(before.dims[d][:-len(axes)]), size(axes))
    if op in ("slice", "reduce_scatter"):
        return _nested(shape[d], size(before.dims[d]), size(axes))
    if op == "all_to_all":
        return (_nested(shape[d], size(before.dims[d][:-1]), size(axes))
                and _nested(shape[e], size(before.dims[e]), size(axes)))
    return True


def _fallback(a: Layout, b: Layout, ndim: int) -> list[tuple]:
    """Exact plan for shapes whose chunks do not nest: sum partials, one exchange, mark partials."""
    cur, want = _State.of(a, ndim), _State.of(b, ndim)
    steps: list[tuple] = []
    reduce = tuple(x for x in a.mesh.axis_names if x in cur.partial and x not in want.partial)
    if reduce:
        steps.append(("all_reduce", reduce, None, None, None))
    if cur.dims != want.dims:
        changed = {x for d in range(ndim) if cur.dims[d] != want.dims[d] for x in cur.dims[d] + want.dims[d]}
        axes = tuple(x for x in a.mesh.axis_names if x in changed)
        steps.append(("exchange", axes, None, None, {"dims": want.dims}))
    mark = tuple(x for x in a.mesh.axis_names if x in want.partial and x not in cur.partial)
    if mark:
        steps.append(("make_partial", mark, None, None, None))
    return steps


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------

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


def _step_bytes(op: str, axes: tuple[str, ...], src: Layout, dst: Layout, d: int | None, e: int | None,
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


# ---------------------------------------------------------------------------------------------
# Execution (one function per op, on this rank's shard)
# ---------------------------------------------------------------------------------------------

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


_EXEC = {"all_gather": _exec_all_gather, "slice": _exec_slice, "reduce_scatter": _exec_reduce_scatter,
         "all_to_all": _exec_all_to_all, "all_reduce": _exec_all_reduce, "make_partial": _exec_make_partial,
         "copy": _exec_copy, "exchange": _exec_exchange}


# ---------------------------------------------------------------------------------------------
# Differentiable entry point
# ---------------------------------------------------------------------------------------------

class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: RedistributePlan, mesh: Mesh):
        ctx.plan, ctx.mesh = plan, mesh
        return plan.execute(x, mesh)

    @staticmethod
    def backward(ctx, g):
        return ctx.plan.reverse().execute(g.contiguous(), ctx.mesh), None, None


def redistribute(x: torch.Tensor, src: Layout, dst: Layout, shape: Sequence[int] | None = None, *,
                 mesh: Mesh | None = None) -> torch.Tensor:
    """This rank's shard of the tensor (global ``shape``) in ``src`` -> its shard in ``dst``.

    Differentiable: the gradient is carried back by the reverse plan. ``shape`` may be left out
    when ``src`` divides evenly (the global shape is then the local shape times the shard counts).
    """
    if shape is None:
        shape = tuple(n * src.dim_shards(d) if d < len(src.spec) else n for d, n in enumerate(x.shape))
    plan = _plan(src, dst, shape, x.dtype, "redistribute")
    mesh = mesh if mesh is not None else src.mesh
    if not plan.steps:
        return x
    return _Redistribute.apply(x, plan, mesh)
