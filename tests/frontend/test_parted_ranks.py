"""Ranks that part ways are caught in the step where they part (issue 43; ``runtime/parted.py``): each rank's
collectives since the last step are fingerprinted and compared in the step's scalar all-reduce, which runs
anyway. DeepSpeed #7170's case — ZeRO-3 at data 2, rank 1 skipping a block in its third step — used to pair
mismatched gathers, let rank 1 finish every step on wrong parameters and fail 20 s later at the end of the run;
here the third step fails on rank 1 before its update, naming the step, and rank 0 fails with it, the launcher's
report setting both ranks' last collectives side by side. Runs under ``sl.launch``: a rank that raised exits,
and its peer's wait ends at once (a pool worker would stay alive, and its peer wait out the timeout)."""

from __future__ import annotations

import pytest
import torch

import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.traffic import FINGERPRINT_FLOATS, fingerprint_bits

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=3)


def _skip_a_block(zero: int, shape: dict, skip_step: int):
    mesh = sl.Mesh(shape, timeout=60)
    model = GPT(CFG, seed=0)
    rules = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"} if "tensor" in shape else None
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=zero, rules=rules),
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    blocks = dict(model.blocks._modules)
    losses = []
    for step in range(4):
        skip = mesh.rank == mesh.size - 1 and step == skip_step       # the last rank: block 1 skipped
        model.blocks._modules = {k: v for k, v in blocks.items() if not (skip and k == "1")}
        losses.append(engine.step(token_batch(CFG, 4, step)))
    return losses


@pytest.mark.parametrize("zero, shape", [(3, {"data": 2}), (0, {"tensor": 2})], ids=["zero3_unit", "tensor_branch"])
def test_a_rank_that_skips_a_block_fails_that_step_on_every_rank(zero, shape):
    with pytest.raises(sl.WorkerError) as info:
        sl.launch(_skip_a_block, 2, zero, shape, 2, timeout=120)
    msg = str(info.value)
    axes = tuple(shape)
    assert f"step 3: the ranks over {axes} took different paths" in msg, msg
    assert "Nothing of this step was applied, on any rank" in msg and "the plan's per step:" in msg, msg
    assert "flight recorder (each rank's last collectives, oldest first):" in msg, msg
    assert "returned its result" not in msg, msg              # no rank returned a result after it


def test_ranks_that_run_the_same_collectives_pass_the_check():
    """The check's arithmetic: equal hashes pass, one differing fails, at the group sizes the bits allow."""
    for n in (2, 8, 64, 1024):
        b = fingerprint_bits(n)
        assert b >= 1 and n * n * (1 << (2 * b)) < 1 << 24, (n, b)
        top = (1 << b) - 1
        same = torch.tensor([n * top, n * top * top, n * 1.0, n * 1.0], dtype=torch.float32)
        assert same.tolist() == [n * top, n * top * top, n, n]       # exact in fp32
        s1, q1 = (n - 1) * top, (n - 1) * top * top                   # one rank's hash 0 instead
        assert n * q1 != s1 * s1
    assert fingerprint_bits(2048) < 1 and FINGERPRINT_FLOATS == 4


def test_the_plan_counts_the_fingerprint_in_the_steps_scalars():
    model = GPT(CFG, seed=0)
    trainable = sum(1 for p in model.parameters())
    one = sl.plan(model, sl.AbstractMesh({"data": 1}))
    two = sl.plan(model, sl.AbstractMesh({"data": 2}))
    assert one.fingerprint_axes() == () and two.fingerprint_axes() == ("data",)
    assert two.scalars_per_step() - one.scalars_per_step() == FINGERPRINT_FLOATS
    assert one.scalars_per_step() == 1 + trainable
    piped = sl.plan(model, sl.AbstractMesh({"data": 2, "pipe": 2}), rules={"layers": "pipe"}, microbatches=2,
                    clip_grad_norm=1.0)                       # scalars over the whole mesh: stages differ, no check
    assert piped.fingerprint_axes() == ()
