"""Redistribution plans as data: which collectives, how many bytes (no processes).

Expected byte counts here are computed by hand from the ring model in the comments, not by
the code under test.
"""

import pytest
import torch

import shardlib as sl
from shardlib import P

M = sl.AbstractMesh({"data": 2, "tensor": 2})
M3 = sl.AbstractMesh({"data": 2, "pipe": 2, "tensor": 2})


def L(spec, mesh=M, **kw):
    return sl.Layout(mesh, spec, **kw)


def test_gather_prints_compactly_with_bytes():
    # 786432 f32 = 3 MiB; each data shard is 1.5 MiB; an all-gather over 2 sends one shard
    plan = sl.plan_redistribute(L(P("data")), L(P()), (786432,), torch.float32)
    assert str(plan) == "S(0)R -> RR: all_gather(data) 1.5 MiB"
    assert plan.bytes == 1.5 * 2**20
    assert plan.bytes_by_rank == (1.5 * 2**20,) * 4


def test_partial_to_sharded_is_one_reduce_scatter():
    plan = sl.plan_redistribute(L(P(), partial="tensor"), L(P("tensor")), (8, 4))
    assert plan.ops == ("reduce_scatter",)
    assert plan.bytes == 1 * 4 * 4 * 4   # (k-1) * output shard (4x4 f32)


def test_partial_to_replicated_is_one_all_reduce():
    plan = sl.plan_redistribute(L(P("data"), partial="tensor"), L(P("data")), (8, 3))
    assert plan.ops == ("all_reduce",)
    assert plan.bytes == 2 * 1 * 6 * 4   # 2(k-1) ceil(n/k): local 4x3=12 f32, k=2 -> 2*6 elements


def test_two_partial_axes_reduce_in_one_collective():
    plan = sl.plan_redistribute(L(P(), partial=("data", "tensor")), L(P()), (8,))
    assert plan.ops == ("all_reduce",) and plan.steps[0].axes == ("data", "tensor")
    assert plan.bytes == 2 * 3 * 2 * 4   # k=4: 2*(4-1)*ceil(8/4) f32


def test_replicated_to_sharded_is_a_free_slice():
    plan = sl.plan_redistribute(L(P()), L(P("data", "tensor")), (8, 8))
    assert plan.ops == ("slice", "slice") and plan.bytes == 0
    plan = sl.plan_redistribute(L(P()), L(P(("data", "tensor"))), (8, 8))
    assert plan.ops == ("slice",) and plan.steps[0].axes == ("data", "tensor")


def test_move_between_dims_is_one_all_to_all():
    plan = sl.plan_redistribute(L(P("tensor")), L(P(None, "tensor")), (8, 6))
    assert plan.ops == ("all_to_all",)
    assert plan.bytes == 1 * 4 * 3 * 4   # (k-1) * chunk: rows 8/2=4 x cols 6/2=3


def test_gather_of_a_multi_axis_dim_is_one_collective():
    plan = sl.plan_redistribute(L(P(("data", "tensor"))), L(P()), (8,))
    assert plan.ops == ("all_gather",) and plan.steps[0].axes == ("data", "tensor")
    assert plan.bytes == 3 * 2 * 4      # (4-1) shards of 2 f32


def test_uneven_non_nesting_chunks_send_exactly_what_is_missing():
    # 5 over data x tensor: chunks [0:2] [2:4] [4:5] [5:5] on ranks 0..3.
    # 5 over data: [0:3] on ranks 0,1 and [3:5] on ranks 2,3.
    # rank 0 sends [0:2] to rank 1; rank 1 sends [2:3] to rank 0 and [3:4] to ranks 2 and 3;
    # rank 2 sends [4:5] to rank 3; rank 3 holds nothing.
    plan = sl.plan_redistribute(L(P(("data", "tensor"))), L(P("data")), (5,))
    assert plan.ops == ("exchange",)
    assert plan.bytes_by_rank == (8, 12, 4, 0)


def test_swap_prefers_the_cheaper_exchange():
    # P(data, tensor) -> P(tensor, data) on 8x4: rank (d,t) holds rows 4d.., cols 2t..; it must
    # hold rows 4t.., cols 2d... Ranks 0 and 3 keep their block; ranks 1 and 2 swap 8 f32.
    plan = sl.plan_redistribute(L(P("data", "tensor")), L(P("tensor", "data")), (8, 4))
    assert plan.bytes_by_rank == (0, 32, 32, 0)


def test_memory_kind_copies_where_the_data_is_smallest():
    down = sl.plan_redistribute(L(P()), L(P("data"), memory="cpu"), (8,))
    assert down.ops == ("slice", "copy") and down.steps[-1].bytes == 4 * 4
    up = sl.plan_redistribute(L(P("data"), memory="cpu"), L(P()), (8,))
    assert up.ops == ("copy", "all_gather")
    assert up.bytes == 4 * 4              # copies are not network bytes
    assert "copy(cpu->device)" in str(up)


def test_size_one_axes_split_nothing():
    m = sl.AbstractMesh({"data": 2, "pipe": 1, "tensor": 1})
    plan = sl.plan_redistribute(L(P(("pipe", "data")), m), L(P("data"), m), (6,))
    assert plan.steps == ()
    assert str(plan).endswith("no-op")


def test_reverse_carries_gradients_back():
    plan = sl.plan_redistribute(L(P(), partial="tensor"), L(P("tensor")), (8,))
    assert plan.reverse().ops == ("all_gather",)       # cotangent of a partial sum is replicated


def test_every_pair_on_a_3d_mesh_plans_and_ends_at_the_destination():
    from layouts import all_layouts

    lays = all_layouts(M3, 2)
    assert len(lays) == 92
    for a in lays[::7]:
        for b in lays:
            plan = sl.plan_redistribute(a, b, (5, 6))
            assert plan.steps == () and a.equivalent(b) or plan.steps[-1].dst.equivalent(b)
            assert "all_reduce" not in plan.ops or set(a.partial) - set(b.partial)


def test_planning_a_huge_mesh_needs_no_processes():
    big = sl.AbstractMesh({"data": 100, "tensor": 100})
    plan = sl.plan_redistribute(L(P(("data", "tensor")), big), L(P("data"), big), (10**6, 8))
    assert plan.ops == ("all_gather",) and plan.bytes == 99 * 100 * 8 * 4


def test_other_meshes_too_long_specs_and_bad_keywords_are_refused():
    with pytest.raises(sl.ShardingError, match="different meshes"):
        sl.plan_redistribute(L(P()), L(P(), M3), (4,))
    with pytest.raises(sl.SpecError, match="rank 1"):
        sl.plan_redistribute(L(P("data", "tensor")), L(P()), (4,))
    with pytest.raises(TypeError):
        sl.plan_redistribute(L(P()), L(P()), (4,), dtype="float32")
