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

This module plans; ``pricing.py`` prices each step for every rank, ``execute.py`` runs the steps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..algebra.layout import Layout, chunk_size
from ..algebra.mesh import AbstractMesh, Mesh
from ..algebra.spec import PartitionSpec
from ..errors import ShardingError, ShardingTypeError
from .core import format_bytes
from .execute import EXEC
from .pricing import step_bytes

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
                x = EXEC[s.op](x, s, self.shape, mesh)
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
    src.require_plain(api)
    dst.require_plain(api)
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
        out.append(Step(op, axes, s_lay, d_lay, d, e, step_bytes(op, axes, s_lay, d_lay, d, e, shape, itemsize)))
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
            total += step_bytes(op, axes, cur.layout(mesh), nxt.layout(mesh), d, e, shape, itemsize, rank)
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
