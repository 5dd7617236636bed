"""Redistribution on real process groups: every pair of layouts, uneven shapes, partial sources.

Each rank builds the same global tensor, takes its shard in the source layout, runs the plan,
and compares with its shard of the same global tensor in the destination layout (for a partial
destination: the sum over the partial axes). Bytes counted while running must equal the plan's.

The big sweeps are cut into chunks of pairs (``pairs[offset::stride]``), one test each, so no test
runs for minutes on a busy machine; together the chunks cover the same pairs as one sweep.

The 92 layouts of a 2-D tensor on a 2x2x2 mesh make 8,464 pairs; at 8 (or 4) ranks on 2 cores a
pair costs ~20 ms of synchronization, so the world-8 and world-4 sweeps each run a third of them:
``pairs[i::3]`` with ``i`` = 0 at world 8 and 1 at world 4. 3 is prime to 92, so every layout is
a source and a destination ~31 times in each, and the two sweeps run different pairs (2/3 of
all pairs between them, on two meshes).
"""

import pytest
import torch
from layouts import all_layouts, local_input

import shardlib as sl
from shardlib import P
from shardlib.testing import get_mesh, progress


def _check_pairs(mesh_shape, shape, stride=1, offset=0, partial=True):
    """Run every (or every ``stride``-th) pair; return a list of failures (empty = all good).
    A partial destination is summed over its partial axes at the end, all pairs with the same axes in
    one ``psum`` (every rank holds the same pairs in the same order), not one collective per pair."""
    mesh = get_mesh(mesh_shape)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    lays = all_layouts(mesh, len(shape), partial=partial)
    pairs = [(a, b) for a in lays for b in lays][offset::stride]
    failures = []
    summed: dict[tuple, list] = {}          # partial axes -> [(pair, plan, local result, wanted)]
    for a, b in pairs:
        progress()
        plan = sl.plan_redistribute(a, b, shape)
        x = local_input(full, a, mesh.rank)
        with sl.count_collectives() as counter:
            y = plan.execute(x)
        want = full[b.local_slices(shape, mesh.rank)]
        if b.partial:
            summed.setdefault(tuple(b.partial), []).append(((a, b), plan, y, want))
        elif y.shape != want.shape or not torch.allclose(y, want, rtol=1e-5, atol=1e-6):
            failures.append(f"{a} -> {b}: wrong values ({plan})")
        if counter.bytes != plan.bytes_for(mesh.rank):
            failures.append(f"{a} -> {b}: counted {counter.bytes} B, planned {plan.bytes_for(mesh.rank)} B")
        if sum(1 for r in counter.records if r.op != "copy_d2h") != sum(
                1 for s in plan.steps if s.op not in ("slice", "make_partial", "copy")):
            failures.append(f"{a} -> {b}: {counter.count()} collectives for plan {plan}")
    for axes, rows in summed.items():
        total = sl.psum(torch.cat([y.reshape(-1) for _, _, y, _ in rows]), axes, mesh=mesh)
        for ((a, b), plan, y, want), part in zip(rows, total.split([y.numel() for _, _, y, _ in rows])):
            if y.shape != want.shape or not torch.allclose(part.view(y.shape), want, rtol=1e-5, atol=1e-6):
                failures.append(f"{a} -> {b}: wrong values ({plan})")
    return len(pairs), failures


def _assert_ok(results):
    n = results[0][0]
    failures = sorted({f for _, fs in results for f in fs})
    assert n > 0
    assert failures == [], f"{len(failures)} of {n} pairs failed:\n" + "\n".join(failures[:20])


def test_every_pair_on_2_ranks_ends_at_the_destination_shard(world):
    _assert_ok(world(2, _check_pairs, {"data": 2}, (5, 3)))
    _assert_ok(world(2, _check_pairs, {"data": 2, "tensor": 1}, (3,)))


def _chunk(part, parts, stride=1, offset=0):
    """``(stride, offset)`` of chunk ``part`` of ``parts`` of the pairs ``[offset::stride]``."""
    return stride * parts, offset + stride * part


def test_chunks_cover_the_sweep_exactly_once():
    pairs = list(range(1000))
    for parts, stride, offset in [(8, 1, 0), (4, 1, 0), (2, 5, 1)]:
        chunks = [pairs[o::s] for s, o in (_chunk(p, parts, stride, offset) for p in range(parts))]
        assert sorted(x for c in chunks for x in c) == pairs[offset::stride]


@pytest.mark.parametrize("part", range(2))
def test_pairs_on_4_ranks_with_a_size_one_axis_end_at_the_destination(world, part):
    _assert_ok(world(4, _check_pairs, {"data": 2, "pipe": 1, "tensor": 2}, (5, 6), *_chunk(part, 2, 3, 1)))


@pytest.mark.parametrize("part", range(3))
def test_uneven_pairs_on_8_ranks_end_at_the_destination_shard(world, part):
    _assert_ok(world(8, _check_pairs, {"data": 2, "pipe": 2, "tensor": 2}, (5, 6), *_chunk(part, 3, 3, 0)))


def test_thirds_see_every_layout_as_source_and_destination():
    n = 92
    for offset in (0, 1):
        pairs = [(a, b) for a in range(n) for b in range(n)][offset::3]
        assert {a for a, _ in pairs} == set(range(n)) and {b for _, b in pairs} == set(range(n))


@pytest.mark.parametrize("part", range(2))
def test_even_pairs_on_8_ranks_end_at_the_destination_shard(world, part):
    _assert_ok(world(8, _check_pairs, {"data": 2, "pipe": 2, "tensor": 2}, (8, 4), *_chunk(part, 2, 5, 1)))


def test_3d_tensor_pairs_on_8_ranks_end_at_the_destination_shard(world):
    _assert_ok(world(8, _check_pairs, {"data": 2, "pipe": 2, "tensor": 2}, (3, 4, 5), 97, 3, False))


def test_uneven_dims_over_a_4_way_axis_end_at_the_destination_shard(world):
    _assert_ok(world(4, _check_pairs, {"data": 4}, (7, 2)))


def _grad_pairs(mesh_shape, shape, stride):
    mesh = get_mesh(mesh_shape)
    g = torch.Generator().manual_seed(3)
    full, weight = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    lays = all_layouts(mesh, len(shape))
    failures = []
    for a, b in [(a, b) for a in lays for b in lays][::stride]:
        x = local_input(full, a, mesh.rank).requires_grad_(True)
        y = sl.redistribute(x, a, b, shape)
        # the global value is unchanged, so d(sum(W * Y))/dX = W: each rank's gradient is its
        # shard of W in the source layout (a partial source's share gets the whole cotangent)
        (y * weight[b.local_slices(shape, mesh.rank)]).sum().backward()
        if not torch.allclose(x.grad, weight[a.local_slices(shape, mesh.rank)], rtol=1e-5, atol=1e-6):
            failures.append(f"{a} -> {b}")
    return len(lays) ** 2 // stride, failures


def test_redistribute_gradient_is_the_cotangent_in_the_source_layout(world):
    _assert_ok(world(4, _grad_pairs, {"data": 2, "tensor": 2}, (5, 3), 3))


def _bad_local_shape():
    mesh = get_mesh({"data": 2})
    src, dst = sl.Layout(mesh, P("data")), sl.Layout(mesh, P())
    try:
        sl.plan_redistribute(src, dst, (6,)).execute(torch.zeros(6))
    except sl.ShardingError as e:
        return str(e)
    return None


def test_wrong_local_shape_is_caught_before_any_collective(world):
    msgs = world(2, _bad_local_shape)
    assert all(m and "expected (3,)" in m and "global shape" in m for m in msgs)
