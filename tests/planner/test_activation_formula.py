"""Activations per layer beside Korthikanti et al. 2022 (issue 43): a tensor axis without a pipe is estimated too
(each block measured on its shards as a pipeline's are: ``pipeline_report.stack_saved_bytes``), and ``explain()``
states a block's bytes as a multiple of ``s·b·h`` next to the paper's formula and the micro-batches in flight.

The reference GPT under sequence parallelism saves, per block and in 16-bit values (units of ``sbh/t`` bytes):
the two LayerNorms' inputs (2 + 2), the two all-gathered sequence-parallel inputs of the column-parallel
matmuls as this rank's chunk, gathered again in backward as Megatron does (2 + 2: ``comm/sp_saved.py``; before,
they were kept whole, 2t + 2t), attention's q, k, v (6) and its output (2), the MLP's GELU input and output
(8 + 8): 32, where Korthikanti's 34 also counts the dropout masks (2) this model has none of. Full recompute keeps
a block's input: 2. The test derives the bytes from that list, not from the code under test."""

from __future__ import annotations

import pytest
import torch

import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=512, seq_len=128, d_model=256, n_heads=8, n_layers=3)
TENSOR = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def _plan(shape: dict, recompute: str, rows: int = 2, **kw):
    with torch.device("meta"):
        model = GPT(CFG, seed=None)
    ids = torch.zeros(rows, CFG.seq_len, dtype=torch.long, device="meta")
    return sl.plan(model, sl.AbstractMesh(shape), rules={**TENSOR, **kw.pop("rules", {})}, sequence_parallel=True,
                   recompute=recompute, precision="bf16", batch=(ids, ids), **kw)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_a_tensor_axis_without_a_pipe_has_its_blocks_saved_bytes(t, recompute):
    plan = _plan({"tensor": t}, recompute)
    stack, blocks, stream = plan.stack_saved
    sbh_t = 2 * CFG.seq_len * CFG.d_model // t        # a micro-batch of 2 rows (one data rank, no accumulation)
    per = 32 if recompute == "selective" else 2
    assert stack == "blocks" and len(blocks) == CFG.n_layers
    # the stack's first block gets the whole sequence (SP slices it there): the rest are alike, and hold the list
    # above plus the LayerNorms' fp32 statistics (under 1%)
    assert len(set(blocks[1:])) == 1 and per * sbh_t <= blocks[1] <= 1.01 * per * sbh_t, (blocks, per * sbh_t)
    text = " ".join(line.strip() for line in plan.explain().splitlines())
    factor = {"selective": "34sbh/t (SP, selective recompute)", "full": "2sbh/t (full recompute, SP)"}[recompute]
    assert f"Korthikanti et al.'s {factor}" in text and "1 micro-batch in flight" in text, text
    assert f"= {blocks[0] * t / (sbh_t * t):.1f}·sbh/t (t={t})" in text, text


def test_the_dry_run_estimates_a_tensor_axis_without_a_pipe():
    from shardlib.cli.compose import check_overrides
    from shardlib.frontend.config.run_config import run_config
    from shardlib.frontend.dryrun import dry_run
    dr = dry_run(run_config(check_overrides(["mesh=tp2", "parallel=tp_sp"])))
    assert dr.memory["activations"] > 0 and not any("not estimated" in n for n in dr.notes), dr.notes


def test_a_pipeline_states_its_first_ranks_micro_batches_in_flight():
    plan = _plan({"tensor": 2, "pipe": 2}, "selective", rows=8, rules={"layers": "pipe"}, microbatches=4)
    text = " ".join(line.strip() for line in plan.explain().splitlines())
    # 1F1B on 2 pipe ranks, 4 micro-batches: rank 0 (the first of 3 blocks) holds 2 in flight
    assert "pipe rank 0's 1 block x 2 micro-batches in flight" in text, text
