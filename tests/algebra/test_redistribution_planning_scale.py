"""Planning a redistribution on a large mesh costs the same as on a small one (no processes).

``plan_redistribute(R -> S(data))`` on 2,048 devices took 7.5 s because the fallback exchange
(quadratic in ranks) was always computed. A structured plan (slice, all-gather, reduce-scatter,
all-reduce, all-to-all) is now found without it, so its work does not grow with the mesh. Work is
counted in Python steps (``work.steps``: deterministic, unlike time); timings are in
``benchmarks/bench_planning.py``. Bytes are checked against the ring formulas computed here.
"""

from __future__ import annotations

import pytest

import shardlib as sl
from shardlib import P
from shardlib.comm import redistribute as redis
from work import steps

ROWS, COLS, F32 = 5, 64, 4        # rows per rank (+3, uneven) and columns of the redistributed tensor


def _plan(n: int, src: P, partial: tuple, dst: P):
    mesh = sl.AbstractMesh({"data": n})
    a, b = sl.Layout(mesh, src, partial=partial), sl.Layout(mesh, dst)
    shape = (ROWS * n + 3, COLS * n) if dst == P(None, "data") else (ROWS * n + 3, COLS)
    redis._plan_cached.cache_clear()
    box = {}
    work = steps(lambda: box.setdefault("plan", sl.plan_redistribute(a, b, shape)))
    return box["plan"], work, shape


def _ring(n: int, shape: tuple[int, int], src: P, partial: tuple, dst: P) -> tuple[tuple[str, ...], int]:
    """The expected ops and the most bytes a rank sends, from the ring model: a dim-0 shard is
    ``ceil(rows/n)`` rows (the collective moves padded shards)."""
    rows, cols = shape
    shard = -(-rows // n) * cols * F32
    if partial:
        full = rows * cols
        if dst == P():
            return ("all_reduce",), min(2 * (n - 1) * -(-full // n), 2 * full) * F32
        return ("reduce_scatter",), (n - 1) * shard
    if src == P():
        return ("slice",), 0
    if dst == P():
        return ("all_gather",), (n - 1) * shard
    # S(0) -> S(1): rank i keeps its block of columns and sends the other n-1 blocks of its rows
    return ("all_to_all",), -(-rows // n) * (cols - cols // n) * F32


CASES = [(P(), (), P("data")), (P("data"), (), P()), (P(), ("data",), P("data")), (P(), ("data",), P()),
         (P("data"), (), P(None, "data"))]


@pytest.mark.parametrize("src, partial, dst", CASES, ids=["R->S", "S->R", "P->S", "P->R", "S0->S1"])
def test_structured_plans_cost_the_same_on_10240_devices_as_on_1024(src, partial, dst):
    small, work_small, _ = _plan(1024, src, partial, dst)
    large, work_large, shape = _plan(10240, src, partial, dst)
    assert small.ops == large.ops
    # constant in ranks (per-rank byte arrays are numpy: one step each); a loop over ranks would be
    # 10x, the old always-computed exchange 100x
    assert work_large <= 1.5 * work_small, (work_small, work_large)
    ops, most = _ring(10240, shape, src, partial, dst)
    assert large.ops == ops, str(large)
    assert large.bytes == most, (str(large), large.bytes, most)
    assert min(large.bytes_by_rank) >= 0


def test_the_exchange_fallback_is_still_right_where_no_structured_plan_exists():
    """An uneven, non-nested change of sharding (the case the exchange exists for: 7 rows in blocks
    of 2 on 6 ranks -> blocks of 3 on 3 data ranks, replicated over tensor): each row a rank holds
    is sent to every destination holder other than itself."""
    mesh = sl.AbstractMesh({"data": 3, "tensor": 2})
    shape = (7, 4)
    src, dst = sl.Layout(mesh, P(("data", "tensor"))), sl.Layout(mesh, P("data"))
    plan = sl.plan_redistribute(src, dst, shape)
    assert "exchange" in plan.ops, str(plan)
    def rows_of(layout, r):
        d0 = layout.local_slices(shape, r)[0]
        return range(d0.start, d0.stop)

    holders = [set(rows_of(dst, r)) for r in range(mesh.size)]
    for r in range(mesh.size):
        rows = rows_of(src, r)
        sent = sum(1 for x in rows for q in range(mesh.size) if q != r and x in holders[q]) * shape[1] * F32
        assert plan.bytes_for(r) == sent, (r, plan.bytes_for(r), sent)
