"""The data-parallel planner as data (no processes): layouts, memory, traffic, gather schedule.

Expected numbers are computed by hand here from the ZeRO paper and the ring model, not by the
code under test. The test GPT (vocab 64, seq 16, d_model 32, 2 blocks) has
Ψ = 30,080 parameters: the root unit (wte 64x32, wpe 16x32, ln_f 2x32, head 64x32) holds 4,672 and
each block 12,704 (ln1 64, qkv 32x96+96, proj 32x32+32, ln2 64, fc 32x128+128, out 128x32+32).
Every dim 0 divides by 2, 4 and 8. The MLP (7 -> 13 -> 11 -> 5) has Ψ = 104 + 154 + 60 = 318.
"""

from __future__ import annotations

import pytest
import torch

import shardlib as sl
from shardlib import P
from shardlib.models import GPT, MLP, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
PSI, ROOT, BLOCK = 30080, 4672, 12704
MLP_PSI = 318
S = sl.StateLayouts


def gpt():
    return GPT(CFG, seed=0)


def mesh(n: int) -> sl.AbstractMesh:
    return sl.AbstractMesh({"data": n})


def test_gpt_and_mlp_sizes_are_what_the_hand_counts_say():
    assert sum(p.numel() for p in gpt().parameters()) == PSI == ROOT + 2 * BLOCK
    assert sum(p.numel() for p in MLP().parameters()) == MLP_PSI


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------

def test_zero_stages_name_the_state_layouts():
    assert S.zero(0) == S(None, None, None, True)
    assert S.zero(1) == S(None, "data", "data", True)
    assert S.zero(2) == S(None, "data", "data", False)
    assert S.zero(3) == S("data", "data", "data", False)
    assert [S.zero(k).stage for k in range(4)] == [0, 1, 2, 3]
    assert S(None, None, "data").stage is None            # all-reduce, then a sharded update


@pytest.mark.parametrize("zero", range(4))
def test_zero_k_is_the_same_plan_as_its_layouts(zero):
    a = sl.plan(gpt(), mesh(4), zero=zero)
    b = sl.plan(gpt(), mesh(4), states=S.zero(zero))
    assert a == b and a.zero == zero


def test_per_parameter_layouts_follow_the_stage():
    p = sl.plan(gpt(), mesh(2), zero=2).param("blocks.0.attn.qkv.weight")
    assert (p.rest.spec, p.compute.spec, p.grad.spec, p.optim.spec) == (P(), P(), P("data"), P("data"))
    p = sl.plan(gpt(), mesh(2), zero=3).param("wte.weight")
    assert (p.rest.spec, p.compute.spec, p.unit) == (P("data"), P(), "")
    assert sl.plan(gpt(), mesh(2)).batch.spec == P("data")


def test_units_and_buckets_hold_tied_once_and_frozen_never():
    model = gpt()
    model.head.weight = model.wte.weight                   # tied: one parameter, two owners
    model.wpe.weight.requires_grad_(False)
    plan = sl.plan(model, mesh(2), zero=0, recompute=True, bucket_mb=0.01)
    names = [p.name for p in plan.params]
    assert "head.weight" not in names and names.count("wte.weight") == 1
    assert [u.name for u in plan.units] == ["", "blocks.0", "blocks.1"]
    assert [u.recompute for u in plan.units] == [False, True, True]
    frozen = plan.param("wpe.weight")
    assert not frozen.trainable and frozen.bucket is None
    buckets = plan.buckets()
    assert len(buckets) > 2
    assert sorted(p.name for b in buckets for p in b) == sorted(p.name for p in plan.params if p.trainable)
    assert names[-1] in [p.name for p in buckets[0]]        # backward order: the last parameters first
    for b in buckets:                                        # 10 KiB buckets (a parameter may exceed one)
        assert len(b) == 1 or sum(p.numel * 4 for p in b) <= 0.01 * 2**20
    assert [u.name for u in sl.plan(gpt(), mesh(2), zero=3, units=["blocks.1"]).units] == ["", "blocks.1"]


def test_zero3_makes_large_outer_layers_units_of_their_own():
    """Vocab 251, d 32: wte and head (8,032 parameters each) hold over half a block's 12,704, wpe
    (512) does not. Under ZeRO-3 on the data axis they are units of their own, in the model's order,
    the head kept gathered from its forward to its backward; not under ZeRO-0..2, a tensor or pipe
    axis, when tied (two owners), when the units are named, or for the small vocabulary (64 x 32).
    Recompute replays the blocks only."""
    cfg = GPTConfig(vocab_size=251, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    blocks = ["blocks.0", "blocks.1"]

    def units(model, shape=None, **kw):
        return [u.name for u in sl.plan(model, sl.AbstractMesh(shape or {"data": 2}), **kw).units if u.name]

    wide = GPT(cfg, seed=0)
    plan = sl.plan(wide, mesh(2), zero=3, recompute=True)
    assert [(u.name, u.reshard_after_forward, u.recompute) for u in plan.units] == [
        ("", False, False), ("wte", True, False), ("blocks.0", True, True), ("blocks.1", True, True),
        ("head", False, False)]
    assert plan.param("wte.weight").unit == "wte" and plan.param("wpe.weight").unit == ""
    assert units(wide, zero=3, reshard_after_forward=False) == ["wte", *blocks, "head"]
    assert units(wide, zero=3, recompute=["wte"]) == ["wte", *blocks, "head"]
    for z in range(3):
        assert units(wide, zero=z) == blocks, z
    assert units(wide, zero=3, units=blocks) == blocks
    assert units(wide, {"data": 2, "tensor": 2}, zero=3, rules={"vocab": "tensor"}) == blocks
    assert units(wide, {"data": 2, "pipe": 2}, zero=3, rules={"layers": "pipe"}, microbatches=2) == blocks
    tied = GPT(cfg, seed=0)
    tied.head.weight = tied.wte.weight
    assert units(tied, zero=3) == blocks
    assert units(gpt(), zero=3) == blocks
    # a frozen token table runs no backward: gathered once a step, for its forward
    assert all(u.backward for u in plan.units)
    wide.wte.weight.requires_grad_(False)
    frozen = sl.plan(wide, mesh(2), zero=3)
    assert [u.name for u in frozen.units if not u.backward] == ["wte"]
    gathers = [(e.phase, e.count) for e in frozen.comm_per_step() if e.where == "wte" and e.op == "all_gather"]
    assert gathers == [("forward", 1)], gathers
    assert frozen.gather_schedule().count("W(wte)") == 1 and plan.gather_schedule().count("W(wte)") == 2


# ---------------------------------------------------------------------------------------------
# Memory: the ZeRO-paper terms
# ---------------------------------------------------------------------------------------------

def paper(zero: int, n: int, mixed: bool, k: int) -> float:
    """Model-state bytes per rank (ZeRO paper, Ψ parameters, K bytes per parameter of optimizer
    state and master copy); fp32: 4-byte parameters and gradients, no separate master."""
    two = 2 if mixed else 4
    return {0: (two + two + k) * PSI, 1: 2 * two * PSI + k * PSI / n, 2: two * PSI + (two + k) * PSI / n,
            3: (two + two + k) * PSI / n}[zero]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("zero", range(4))
def test_memory_per_rank_is_the_zero_paper_terms(n, zero):
    for precision, k in (("bf16", 12), ("fp16", 12), ("fp32", 8)):
        plan = sl.plan(gpt(), mesh(n), zero=zero, precision=precision)
        for rank in (0, n - 1):
            assert plan.memory_per_rank(rank)["total"] == paper(zero, n, precision != "fp32", k)
        assert plan.zero_formula()["total"] == paper(zero, n, precision != "fp32", k)
    sgd = sl.plan(gpt(), mesh(n), zero=zero, optimizer="sgd")     # K = 0: no state
    assert sgd.memory_per_rank()["optimizer"] == 0


def test_zero2_bf16_memory_per_state_and_at_the_update_by_hand():
    plan = sl.plan(gpt(), mesh(4), zero=2, precision="bf16")
    assert plan.memory_per_rank() == {"params": 2 * PSI, "grads": 2 * PSI // 4, "optimizer": 12 * PSI // 4,
                                      "total": 2 * PSI + 14 * PSI // 4, "buffers": 0}
    # during the update the optimizer also reads fp32 copies of this rank's gradient rows
    assert plan.memory_per_rank(at="update")["grads"] == 2 * PSI // 4 + 4 * PSI // 4


def test_memory_at_the_update_fp32_zero1_counts_the_reduced_rows():
    plan = sl.plan(gpt(), mesh(4), zero=1)
    rest, update = plan.memory_per_rank(), plan.memory_per_rank(at="update")
    assert update["grads"] - rest["grads"] == 4 * PSI // 4
    zero3 = sl.plan(gpt(), mesh(4), zero=3)                # fp32: the optimizer reads the kept shards
    assert zero3.memory_per_rank(at="update") == zero3.memory_per_rank()
    with pytest.raises(sl.ShardingError, match="at="):
        plan.memory_per_rank(at="peak")


@pytest.mark.parametrize("n", [3, 4, 8])
def test_uneven_shards_add_up_over_ranks(n):
    """The MLP's layers laid flat (104, 154, 60 elements: the flat groups ZeRO splits) do not all
    divide by n: ranks hold different amounts (trailing ones less), but every element is on
    exactly one rank."""
    for zero in (1, 2, 3):
        plan = sl.plan(MLP(), mesh(n), zero=zero)
        per_rank = [plan.memory_per_rank(r) for r in range(n)]
        assert sum(m["optimizer"] for m in per_rank) == 8 * MLP_PSI
        if zero >= 2:
            assert sum(m["grads"] for m in per_rank) == 4 * MLP_PSI
        if zero == 3:
            assert sum(m["params"] for m in per_rank) == 4 * MLP_PSI
        assert per_rank[0]["total"] > per_rank[-1]["total"]


def test_frozen_parameters_have_no_gradients_or_optimizer_state():
    model = gpt()
    model.wte.weight.requires_grad_(False)                  # 2,048 parameters frozen
    trainable = PSI - 2048
    for zero in range(4):
        plan = sl.plan(model, mesh(2), zero=zero)
        assert plan.num_trainable == trainable
        mem = plan.memory_per_rank()
        assert mem["optimizer"] == 8 * trainable // (1 if zero == 0 else 2)
        assert {k: v for k, v in mem.items() if k != "buffers"} == {k: int(v) for k, v in plan.zero_formula().items()}


# ---------------------------------------------------------------------------------------------
# Communication: the ring minimum
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8])
def test_traffic_is_the_ring_minimum_for_even_shards(n):
    for precision, c in (("fp32", 4), ("bf16", 2)):
        for zero in range(4):
            plan = sl.plan(gpt(), mesh(n), zero=zero, precision=precision)
            moved = plan.comm_bytes_per_step("params") + plan.comm_bytes_per_step("grads")
            if zero < 3:        # DP: all-reduce (2 transfers); ZeRO-1/2: reduce-scatter + all-gather
                want = 2 * PSI * (n - 1) // n * c
            else:               # 3 per unit (gather, gather again in backward, reduce-scatter); root: 2
                want = (3 * PSI - ROOT) * (n - 1) // n * c
            assert moved == plan.ring_minimum() == want, (precision, zero)


def test_zero3_without_a_root_unit_is_exactly_three_psi():
    mlp = MLP((8, 16, 12, 4))                               # every dim 0 divides by 2 and 4
    psi = 8 * 16 + 16 + 16 * 12 + 12 + 12 * 4 + 4
    for n in (2, 4):
        plan = sl.plan(mlp, mesh(n), zero=3)
        assert all(u.name for u in plan.units)
        assert plan.ring_minimum() == 3 * psi * (n - 1) // n * 4
        assert plan.comm_bytes_per_step("params") + plan.comm_bytes_per_step("grads") == plan.ring_minimum()
        kept = sl.plan(mlp, mesh(n), zero=3, reshard_after_forward=False)
        assert kept.ring_minimum() == 2 * psi * (n - 1) // n * 4


def test_uneven_shards_move_at_most_the_padding_more():
    for n in (2, 4):
        for zero in range(4):
            plan = sl.plan(MLP(), mesh(n), zero=zero)
            moved = plan.comm_bytes_per_step("params") + plan.comm_bytes_per_step("grads")
            # padding: < 1 row (<= 13 elements) per parameter per collective, 6 parameters
            assert plan.ring_minimum() <= moved <= plan.ring_minimum() + 3 * 6 * 13 * 4 * (n - 1)


def test_comm_entries_by_hand_for_the_mlp():
    """N = 2, fp32. DP: the step's scalars (the loss + one used-flag per parameter: 7 floats, and the 4 of the
    ranks' collectives' fingerprint: 11) ride the one bucket's all-reduce: 318 + 11 = 329 floats = 2·1·165·4
    bytes, of which 2·1·159·4 are the gradients' share. ZeRO-2: a reduce-scatter, and the scalars in an
    all-reduce of their own: 11 floats = 2·1·6·4 bytes."""
    plan = sl.plan(MLP(), mesh(2), zero=0)
    assert plan.scalars_ride_gradients
    assert [(e.phase, e.op, e.bytes, e.count, e.riders) for e in plan.comm_per_step()] == [
        ("backward", "all_reduce", 1320, 1, 1320 - 1272)]
    assert plan.comm_bytes_per_step("grads") == 1272 and plan.comm_bytes_per_step("scalars") == 48
    assert plan.scalars_per_step() == 7 + 4
    assert plan.memory_per_rank()["buffers"] == 11 * 4
    plan = sl.plan(MLP(), mesh(2), zero=2)
    assert not plan.scalars_ride_gradients
    assert [(e.op, e.bytes) for e in plan.comm_per_step() if e.what == "scalars"] == [("all_reduce", 48)]
    # ZeRO-2 + fp16 + clipping: the scalars also carry the overflow count and the squared norm
    assert sl.plan(MLP(), mesh(2), zero=2, precision="fp16", clip_grad_norm=1.0).scalars_per_step() == 9 + 4
    # ZeRO-3 with 2 micro-steps: per unit, per micro-step: gather, gather again, reduce-scatter
    plan = sl.plan(MLP(), mesh(2), zero=3, grad_accum=2)
    layer0 = [e for e in plan.comm_per_step() if e.where == "layers.0"]
    # layers.0: weight 13x7 and bias 13 laid flat = 104 floats, 52 a rank
    assert [(e.op, e.bytes, e.count) for e in layer0] == [
        ("all_gather", 52 * 4, 2), ("all_gather", 52 * 4, 2), ("reduce_scatter", 52 * 4, 2)]


def test_accumulation_does_not_add_traffic_before_zero3():
    for zero in range(3):
        one = sl.plan(gpt(), mesh(4), zero=zero).comm_bytes_per_step()
        assert sl.plan(gpt(), mesh(4), zero=zero, grad_accum=4).comm_bytes_per_step() == one
    one = sl.plan(gpt(), mesh(4), zero=3).comm_bytes_per_step("params")
    assert sl.plan(gpt(), mesh(4), zero=3, grad_accum=4).comm_bytes_per_step("params") == 4 * one


def test_frozen_parameters_move_no_gradients():
    model = gpt()
    model.wte.weight.requires_grad_(False)
    trainable = PSI - 2048
    assert sl.plan(model, mesh(2), zero=0).ring_minimum() == 2 * trainable // 2 * 4
    assert sl.plan(model, mesh(2), zero=2).ring_minimum() == 2 * trainable // 2 * 4
    # ZeRO-3 still gathers the frozen embedding (root: forward only) but reduces no gradient for it
    assert sl.plan(model, mesh(2), zero=3).ring_minimum() == (3 * PSI - ROOT - 2048) // 2 * 4


def test_a_world_of_one_communicates_nothing():
    for zero in range(4):
        plan = sl.plan(gpt(), mesh(1), zero=zero)
        assert plan.comm_per_step() == [] and plan.ring_minimum() == 0


# ---------------------------------------------------------------------------------------------
# ZeRO-3: gather schedule and transient bytes
# ---------------------------------------------------------------------------------------------

def test_gather_schedule_prefetches_one_unit_ahead():
    plan = sl.plan(gpt(), mesh(2), zero=3)
    assert " ".join(plan.gather_schedule()) == (
        "G(<root>) W(<root>) G(blocks.0) "
        "W(blocks.0) G(blocks.1) F(blocks.0) W(blocks.1) F(blocks.1) "          # forward
        "G(blocks.1) W(blocks.1) F(blocks.1) G(blocks.0) W(blocks.0) F(blocks.0) "   # backward
        "F(<root>)")
    kept = sl.plan(gpt(), mesh(2), zero=3, reshard_after_forward=False)
    assert " ".join(kept.gather_schedule()) == (
        "G(<root>) W(<root>) G(blocks.0) W(blocks.0) G(blocks.1) W(blocks.1) F(blocks.1) F(blocks.0) F(<root>)")
    assert sl.plan(gpt(), mesh(2), zero=2).gather_schedule() == ()


def test_transient_bytes_by_hand():
    """The peak is while a block is unpacked: the root (R), the block's parameters (U) and the
    gather buffer (the persistent one, the largest unit's: U, even shards); the next block is
    prefetched after that wait: R + 2U."""
    for n in (2, 4):
        plan = sl.plan(gpt(), mesh(n), zero=3)
        assert plan.transient_per_rank() == {"gathered": (ROOT + 2 * BLOCK) * 4, "buffer": BLOCK * 4}
    bf16 = sl.plan(gpt(), mesh(2), zero=3, precision="bf16")
    assert bf16.transient_per_rank() == {"gathered": (ROOT + 2 * BLOCK) * 2, "buffer": BLOCK * 2}
    assert sl.plan(gpt(), mesh(2), zero=2).transient_per_rank() == {"gathered": 0, "buffer": 0}


def test_transient_bytes_count_padded_buffers():
    """MLP at N = 4: a buffer holds 4 chunks of ceil(T/4) of the unit laid flat. layers.0:
    13x7 + 13 = 104 -> 4 x 26 = 104; layers.1: 11x13 + 11 = 154 -> 4 x 39 = 156 (2 padding);
    layers.2: 5x11 + 5 = 60 -> 4 x 15 = 60. The persistent gather buffer is the largest, 156;
    the peak is while layers.1 is unpacked: its parameters and the buffer, 154 + 156 = 310
    floats (a neighbour is prefetched only after the wait, in forward; in backward once
    layers.1 is freed). While layers.0 is unpacked the idle part of the buffer counts too:
    104 + 156 = 260, where a buffer of layers.0's own size held 208."""
    plan = sl.plan(MLP(), mesh(4), zero=3)
    assert plan.transient_per_rank() == {"gathered": 310 * 4, "buffer": 156 * 4}


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------

def test_explain_summarizes_units_and_full_lists_every_parameter():
    plan = sl.plan(gpt(), mesh(4), zero=3, precision="bf16", recompute=True)
    text = plan.explain()
    for words in ("ZeRO-3", "N=4", "bf16 compute", "blocks.0..1 (2 units x 12 params)*", "ZeRO formula",
                  "ring minimum", "gathered", "W(blocks.1) F(blocks.1)", "all_gather(data)", "reduce_scatter(data)",
                  "blocks.*.attn.qkv.weight"):
        assert words in text, words
    full = plan.explain(full=True)                         # one by one: every unit and parameter
    for words in ("blocks.0(12)*", "blocks.1(12)*", "blocks.1.attn.qkv.weight", "[blocks.1]"):
        assert words in full, words
    assert "data parallel" in sl.plan(gpt(), mesh(2)).explain()
    assert "custom" in sl.plan(gpt(), mesh(2), states=S(None, None, "data")).explain()
    assert "none (one rank)" in sl.plan(gpt(), mesh(1)).explain()


def test_planning_a_large_mesh_needs_no_processes():
    big = sl.AbstractMesh({"data": 1024})
    plan = sl.plan(gpt(), big, zero=3)
    assert sum(plan.memory_per_rank(r)["params"] for r in range(1024)) == 4 * PSI


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero", [-1, 4, 7])
def test_zero_out_of_range_is_refused_listing_the_stages(zero):
    with pytest.raises(sl.ShardingError, match=rf"zero={zero} is out of range — expected 0 \(data parallel\)"):
        sl.plan(gpt(), mesh(2), zero=zero)


@pytest.mark.parametrize("zero", [True, 1.0, "1"])
def test_zero_of_the_wrong_kind_is_a_type_error(zero):
    with pytest.raises(sl.ShardingTypeError, match="zero must be an int"):
        sl.plan(gpt(), mesh(2), zero=zero)


def test_plan_reports_every_problem_at_once():
    with pytest.raises(sl.ShardingError) as info:
        sl.plan(gpt(), sl.AbstractMesh({"data": 2, "extra": 2}), precision="fp8", grad_accum=0,
                clip_grad_norm=-1.0, bucket_mb=0, optimizer="lion")
    msg = str(info.value)
    assert "6 problems" in msg
    for words in ("'extra': 2", "fp8", "grad_accum", "clip_grad_norm", "bucket_mb", "lion"):
        assert words in msg, words


def test_plan_reports_every_problem_at_once_zero_and_states_included():
    with pytest.raises(sl.ShardingError) as info:
        sl.plan(gpt(), mesh(2), zero=7, precision="fp8", grad_accum=0)
    msg = str(info.value)
    assert "3 problems" in msg and len(info.value.problems) == 3
    for words in ("zero=7 is out of range", "precision 'fp8'", "grad_accum"):
        assert words in msg, words
    # the state layouts (2 problems), the reduction dtype, units, recompute and optimizer too
    with pytest.raises(sl.ShardingError) as info:
        sl.plan(gpt(), mesh(2), zero=1, states=S("data", None, None, False), reduce_dtype="fp8",
                units=["blocks.9"], recompute=["wte"], optimizer="lion")
    msg = str(info.value)
    assert "7 problems" in msg
    for words in ("zero is given twice", "need gradients and optimizer state sharded", "keep_local_grads=False",
                  "reduce_dtype 'fp8'", "units ['blocks.9'] are not submodules", "recompute names ['wte']",
                  "optimizer 'lion'"):
        assert words in msg, words


def test_wrong_kinds_alone_are_a_type_error_and_otherwise_listed_with_the_rest():
    with pytest.raises(sl.ShardingTypeError) as info:
        sl.plan(gpt(), mesh(2), zero="1", optimizer=[8], recompute="blocks.0", units="blocks.0")
    msg = str(info.value)
    assert "4 problems" in msg
    for words in ("zero must be an int", "optimizer must be a name", "recompute must be 'none', 'selective', 'full' (True, False) or a list",
                  "units must be a list"):
        assert words in msg, words
    with pytest.raises(sl.ShardingError) as info:           # a value problem among them: a ShardingError
        sl.plan(gpt(), mesh(2), zero="1", precision="fp8")
    assert "2 problems" in str(info.value) and "zero must be an int" in str(info.value)


def test_units_and_recompute_may_be_any_iterable():
    plan = sl.plan(gpt(), mesh(2), zero=3, units=(f"blocks.{i}" for i in range(2)),
                   recompute=(u for u in ["blocks.1"]))
    assert [(u.name, u.recompute) for u in plan.units] == [("", False), ("blocks.0", False), ("blocks.1", True)]


@pytest.mark.parametrize("kwargs, words", [
    ({"zero": 1, "states": S.zero(1)}, "zero is given twice"),
    ({"data_axis": "dp"}, "no 'dp' axis"),
    ({"grad_accum": True}, "grad_accum"),
    ({"units": ["blocks.9"]}, "not submodules"),
    ({"recompute": ["wte"]}, "not units"),
    ({"reduce_dtype": "fp8"}, "reduce_dtype"),
    ({"states": S("data", None, None, False)}, "need gradients and optimizer state sharded"),
    ({"states": S(None, "data", None)}, "optimizer state sharded the same way"),
    ({"states": S(None, None, None, False)}, "keep_local_grads=False"),
    ({"states": S("data", "data", "data", True)}, "keep_local_grads=True"),
    ({"states": S(None, "pipe", "pipe", True)}, "not an axis of the mesh"),
    ({"optimizer": -4}, "optimizer must be"),
])
def test_plan_errors_name_the_fix(kwargs, words):
    with pytest.raises(sl.ShardingError, match=words):
        sl.plan(gpt(), mesh(2), **kwargs)


def test_a_non_module_model_or_non_mesh_is_a_type_error():
    with pytest.raises(sl.ShardingTypeError, match="nn.Module"):
        sl.plan("gpt", mesh(2))
    with pytest.raises(sl.ShardingTypeError, match="Mesh"):
        sl.plan(gpt(), {"data": 2})


def test_a_model_without_parameters_is_refused():
    with pytest.raises(sl.ShardingError, match="has no parameters"):
        sl.plan(torch.nn.Sequential(torch.nn.ReLU()), mesh(2))
