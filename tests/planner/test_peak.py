"""The planned peak per rank (``Plan.peak_per_rank``, ``planner/peak.py``) from first principles,
and the engine's tracked transients against it on real ranks. No RSS, no timing.

GPT (d = 32, 2 blocks, vocab 64, seq 16): the root unit holds ``wte`` (64x32), ``wpe`` (16x32),
``ln_f`` (2x32) and ``head`` (64x32); a block ``12d² + 13d`` parameters. fp32 AdamW: per trainable
element 4 bytes of parameter, 4 of gradient, 8 of optimizer state (no separate master).
"""

from __future__ import annotations

import pytest
import torch

import shardlib as sl
from shardlib.models import GPT, GPTConfig, token_batch
from shardlib.planner.peak import activation_bytes
from shardlib.testing import get_mesh

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
D, V, S = 32, 64, 16
ROOT = V * D + S * D + 2 * D + V * D          # wte, wpe, ln_f, head
BLOCK = 12 * D * D + 13 * D
PSI = ROOT + 2 * BLOCK


def plan(zero: int, n: int = 2, cfg: GPTConfig = CFG, **kw):
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    return sl.plan(model, sl.AbstractMesh({"data": n}), zero=zero, **kw)


def test_parameter_count_is_the_hand_count():
    assert sum(p.numel for p in plan(0).params) == PSI


def test_update_moment_is_states_plus_adam_temporaries():
    """Per-tensor Adam holds two fp32 temporaries the size of the tensor it updates (sqrt of the
    second moment, then its quotient): 2 x the largest master piece x 4 bytes. The multi-tensor
    step holds one per master at once: all master bytes."""
    dp = plan(0)
    buffers = dp.memory_per_rank()["buffers"]
    largest = 4 * D * D                                    # mlp.fc / mlp.out weights, whole under DP
    assert dp.peak_per_rank(foreach=False)["update"] == 16 * PSI + buffers + 2 * largest * 4
    assert dp.peak_per_rank(foreach=True)["update"] == 16 * PSI + buffers + PSI * 4
    # ZeRO-3 at N = 2: a block laid flat is ln1 (2d), qkv (3d² + 3d), proj (d² + d), ln2 (2d),
    # fc (4d² + 4d), out (4d² + d); rank 0 holds its first BLOCK / 2 = 6352 elements: qkv's
    # weight (3072) is its largest piece, fc's weight (offset 4352) is cut at 2000. Rank 1 holds
    # out's weight whole (4096). The root (wte, wpe, ln_f, head; 2336 each) gives 2048 at most.
    # ZeRO-3 also holds its persistent collective buffers from the first step on (runtime/
    # comm_buffers.py): the largest unit's all-gather output and reduce-scatter input, a block's
    assert BLOCK // 2 == 6352 and ROOT // 2 == 2336
    for r, piece in ((0, 3 * D * D), (1, 4 * D * D)):
        pk = plan(3).peak_per_rank(r)
        assert pk["comm_buffers"] == 4 * BLOCK + 4 * BLOCK
        assert pk["update"] == 16 * PSI // 2 + 2 * piece * 4 + pk["comm_buffers"]
    assert dp.peak_per_rank()["comm_buffers"] == 0


def test_backward_peak_of_dp_and_zero3_equals_the_hand_count():
    act = 1000
    # DP, fp32: gradients are views of the bucket buffers; a fresh gradient (the largest
    # parameter, 4 bytes an element) lives until it is copied into its view
    dp = plan(0)
    assert dp.peak_per_rank(activation_bytes=act)["backward"] == (
        16 * PSI + dp.memory_per_rank()["buffers"] + act + 4 * D * D * 4)
    # ZeRO-3, N = 2: the root's gradients as tensors (4 x ROOT) through backward, plus the one
    # persistent reduce-scatter input, the largest unit's (max(BLOCK, ROOT) = BLOCK; reduced in
    # place: no separate output), with one fresh gradient on its way in (the largest parameter: 4d²)
    z3 = plan(3)
    grads = 4 * ROOT + 4 * (max(BLOCK, ROOT) + 4 * D * D)
    gathered = z3.transient_per_rank()["gathered"]
    assert z3.peak_per_rank(activation_bytes=act)["backward"] == 16 * PSI // 2 + act + gathered + grads
    # the gathered peak by hand: the root (R) and a block being unpacked from the persistent
    # all-gather buffer, sized for the largest unit (2U)
    assert gathered == 4 * (ROOT + 2 * BLOCK)
    assert z3.transient_per_rank()["buffer"] == 4 * max(BLOCK, ROOT)


def test_zero3_buffers_are_a_blocks_when_the_root_is_larger():
    """Vocab 1024: the root (wte, head: 2 x 1024 x 32, wpe, ln_f) outweighs a block. The persistent
    buffers are a block's; the root, gathered and reduced once a step, gets buffers of its own in
    the idle buffers' place (freed for it, allocated again by the next block): its gather holds
    R + R at its wait, its reduce R (kept gradients) + R (its input). Between steps the gather
    buffer is held (the blocks' backward used it last), the reduce buffer not (the root's was last).
    The units named: by default wte and head would be units of their own (the next test)."""
    cfg = GPTConfig(vocab_size=1024, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    root = 2 * 1024 * D + S * D + 2 * D
    assert root > BLOCK
    z3 = plan(3, 2, cfg, units=["blocks.0", "blocks.1"])
    tr = z3.transient_per_rank()
    assert tr == {"gathered": 4 * max(2 * root, root + 2 * BLOCK), "buffer": 4 * BLOCK}
    pk = z3.peak_per_rank(activation_bytes=0)
    assert pk["comm_buffers"] == 4 * BLOCK
    fresh = 1024 * D                                      # the largest parameter: wte / head
    assert pk["backward"] == pk["states"] + tr["gathered"] + 4 * root + 4 * max(BLOCK + fresh, root)


def test_zero3_outer_units_take_the_root_out_of_the_peak():
    """Vocab 1024 by default: wte and head (E = 1024 x 32 each, over half a block) are units of their
    own, the root keeps wpe and ln_f (R). The buffers are the largest unit's, E, and both are held
    between steps. Gathered at most: the root, the gather buffer and one table unpacked from it (at
    the head's wait in forward, wte's in backward; the blocks are freed by then): R + 2E. The plan
    naming the blocks as units holds both tables in the root through the step instead."""
    cfg = GPTConfig(vocab_size=1024, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    e, r = 1024 * D, S * D + 2 * D
    z3 = plan(3, 2, cfg)
    assert [(u.name, u.reshard_after_forward) for u in z3.units] == \
        [("", False), ("wte", True), ("blocks.0", True), ("blocks.1", True), ("head", False)]
    tr = z3.transient_per_rank()
    assert tr == {"gathered": 4 * (r + 2 * e), "buffer": 4 * e}
    assert z3.peak_per_rank(activation_bytes=0)["comm_buffers"] == 2 * 4 * e
    named = plan(3, 2, cfg, units=["blocks.0", "blocks.1"])
    assert tr["gathered"] < named.transient_per_rank()["gathered"]
    assert z3.peak_per_rank(activation_bytes=0)["peak"] < named.peak_per_rank(activation_bytes=0)["peak"]
    assert z3.gather_schedule()[-4:] == ("G(wte)", "W(wte)", "F(wte)", "F(<root>)")
    assert "F(head)" not in z3.gather_schedule()[:z3.gather_schedule().index("W(head)")]


def test_peak_is_the_largest_moment_and_explain_states_it():
    z3 = plan(3)
    pk = z3.peak_per_rank(activation_bytes=500)
    assert pk["peak"] == max(pk[m] for m in ("build", "backward", "update", "publish"))
    assert pk["peak"] == pk["states"] + pk["transient"] + pk["activations"]
    line = [ln for ln in z3.explain().splitlines() if ln.strip().startswith("peak")]
    assert len(line) == 1 and sl.format_bytes(z3.peak_per_rank()["peak"]) in line[0]


def test_planned_peak_orders_zero3_below_zero2_below_dp_when_states_dominate():
    """8 blocks of d = 256 (6.3M parameters) and a 1 x 8 token batch: the states (16Ψ bytes under
    DP) dwarf the activations and any one unit, so sharding more holds less at the peak."""
    cfg = GPTConfig(vocab_size=256, seq_len=8, d_model=256, n_heads=4, n_layers=8)
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    act = activation_bytes(model, token_batch(cfg, 1, 0))
    peaks = [plan(z, 2, cfg).peak_per_rank(activation_bytes=act)["peak"] for z in (0, 1, 2, 3)]
    assert peaks[3] < peaks[2] < peaks[1] < peaks[0], peaks


def test_bad_activation_bytes_is_refused():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(sl.ShardingError if not isinstance(bad, str) else Exception):
            plan(0).peak_per_rank(activation_bytes=bad)


def _tracked(cfg_name: str) -> dict:
    mesh = get_mesh({"data": 2})
    model = GPT(CFG, seed=0)
    kw = {"recompute": True} if cfg_name == "recompute" else {}
    p = sl.plan(model, mesh, zero=3, **kw)
    engine = sl.parallelize(model, p, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    for s in range(2):
        engine.step(token_batch(CFG, 4, s))
    pk = p.peak_per_rank()
    return {"tracked": engine.peak_transient_bytes, "planned_backward": pk["backward"] - pk["states"],
            "gathered": p.transient_per_rank()["gathered"]}


@pytest.mark.parametrize("cfg_name", ["plain", "recompute"])
def test_engine_transients_stay_within_the_plan(world, cfg_name):
    """ZeRO-3 on 2 ranks: the bytes the runtime tracks (gathered units and buffers; gradients on
    their way to a reduce-scatter; both at once) never exceed the plan's backward transient, and
    the gradients' share reaches at least one block's reduce-scatter input (the tracking is live).
    Before the runtime bounded its reduce-scatters in flight, every unit's input lived to the end
    of backward: the whole model's gradients, above the plan."""
    for r in world(2, _tracked, cfg_name):
        t = r["tracked"]
        assert t["gathered"] == r["gathered"]
        assert t["both"] <= r["planned_backward"], r
        assert t["grads"] <= r["planned_backward"] - r["gathered"], r
        assert t["grads"] >= 4 * BLOCK, r
        assert t["grads"] < 4 * (ROOT + 2 * BLOCK), r      # never every unit's input at once


def test_a_plan_of_a_meta_built_model_states_the_build_of_one_unit():
    """Built on the meta device, ZeRO-3 materializes one unit at a time (runtime/materialize.py):
    the plan knows (``Plan.meta_build``) and its build moment holds the largest unit's fp32
    elements where a normally built model holds all of them."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=6)
    mesh = sl.AbstractMesh({"data": 4})
    normal = sl.plan(GPT(cfg, seed=0), mesh, zero=3)
    with torch.device("meta"):
        meta_model = GPT(cfg, seed=None)
    meta = sl.plan(meta_model, mesh, zero=3)
    assert meta.meta_build and not normal.meta_build
    built = normal.peak_per_rank()["build"] - meta.peak_per_rank()["build"]
    units = [sum(normal.param(n).numel for n in u.params) for u in normal.units]
    assert built == 4 * (normal.num_params - max(units))
    assert meta.peak_per_rank() == normal.peak_per_rank(meta_build=True)
