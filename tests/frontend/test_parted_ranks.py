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


def _skip_a_block(zero: int, shape: dict, skip_step: int, check_replicas: bool = False):
    mesh = sl.Mesh(shape, timeout=60)
    model = GPT(CFG, seed=0)
    rules = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"} if "tensor" in shape else None
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=zero, rules=rules),
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), check_replicas=check_replicas)
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


def test_a_data_parallel_rank_that_skips_a_block_runs_the_same_buckets_and_keeps_the_replicas_equal():
    """Under DP (ZeRO-0) a block one rank skips leaves its parameters without a gradient there: their bucket
    is reduced all the same at the end of backward, that rank adding zeros (DDP's find_unused_parameters) —
    the ranks' collectives do not part, so the check passes, and every replica's parameters stay bit-equal
    after each step (check_replicas) — nothing is missing."""
    losses = sl.launch(_skip_a_block, 2, 0, {"data": 2}, 2, True, timeout=120)
    assert len(losses) == 2 and all(len(r) == 4 for r in losses) and losses[0] == losses[1], losses


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


def _parted_schedule(schedules: tuple[str, str], microbatches: tuple[int, int]):
    mesh = sl.Mesh({"pipe": 2}, timeout=60)
    model = GPT(CFG, seed=0)
    r = mesh.rank                   # a rank-dependent config: each pipe rank its own schedule / micro-batches
    plan = sl.plan(model, mesh, rules={"layers": "pipe"}, schedule=schedules[r], microbatches=microbatches[r],
                   batch=token_batch(CFG, 4, 0))
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    return [engine.step(token_batch(CFG, 4, step)) for step in range(2)]


@pytest.mark.parametrize("schedules, microbatches, differs", [
    (("1f1b", "1f1b"), (2, 4), ("pipeline", "training")), (("1f1b", "gpipe"), (2, 2), ("pipeline",))],
    ids=["microbatches", "schedule"])
def test_pipe_ranks_that_planned_different_schedules_fail_at_set_up_on_every_rank(schedules, microbatches, differs):
    """A pipeline schedule mismatch: pipe ranks that built their plans from different configs (another
    micro-batch count, another schedule) fail in parallelize, before any set-up collective pairs wrongly —
    every rank, naming the fields that differ and which ranks hold which, no rank returning a result."""
    with pytest.raises(sl.WorkerError) as info:
        sl.launch(_parted_schedule, 2, schedules, microbatches, timeout=120)
    msg = str(info.value)
    assert "parallelize: the ranks built different plans" in msg, msg
    for field in differs:
        assert f"{field} differs: rank 0 vs rank 1 — rank " in msg, msg
    assert "parameters differs" not in msg and "Nothing was set up" in msg, msg
    assert "returned its result" not in msg, msg
