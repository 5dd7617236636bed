"""The exact token mean of a transformers causal LM (``runtime/batches.py``): with padding and
``-100`` labels spread unevenly over the rows, micro-batches hold unequal counts of labelled tokens,
and every layout must still give one process's ``model(**batch).loss`` on the whole batch — the
engine hands each micro-batch ``num_items_in_batch`` = the global count over ``data · m``.

A tiny Llama trains 4 steps with AdamW on gloo ranks: data 2 x grad_accum 2 (global batches, and
local batches whose count one all-reduce sums), data 2 x grad_accum 2 ZeRO-3, pipe 2 (1F1B, 4
micro-batches of 2 rows) and data 2 x tensor 2 with a vocab-parallel head (its cross-entropy
summed); losses within 1e-5 relative of one process, the same on every rank, collectives counted
as planned (a local step: plus the count's one all-reduce over ``data``). A model given ``loss_fn``
or a batch without labels is not touched.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_models
import shardlib as sl
from shardlib.planner.hf_tp import tp_table
from shardlib.runtime.batches import counts_tokens
from shardlib.testing import get_mesh
from test_engine_data_parallel import max_rel
from test_tensor_parallel import train_counting

STEPS, BATCH, LR = 4, 8, 1e-2
PAD = [0, 3, 9, 1, 14, 0, 5, 11]         # padding at the end of each row: unequal counts everywhere


def _batches() -> list[dict]:
    out = []
    for s in range(STEPS):
        b = hf_models.batch("llama", BATCH, 500 + s)
        mask = torch.ones_like(b["input_ids"])
        for r, k in enumerate(PAD):
            if k:
                mask[r, -k:] = 0
        labels = b["input_ids"].masked_fill(mask == 0, -100)
        labels[(s + 2) % BATCH, :6] = -100      # a prompt whose tokens are not trained on
        out.append({"input_ids": b["input_ids"], "attention_mask": mask, "labels": labels})
    return out


def reference() -> list[float]:
    """One process, the whole batch: ``model(**batch).loss``."""
    return hf_models.train_alone(hf_models.build("llama"), _batches(), lr=LR)


def token_run(cfg: dict) -> dict:
    shape = cfg["shape"]
    mesh = get_mesh(shape)
    model = hf_models.build("llama")
    if shape.get("tensor", 1) > 1:
        sl.shard(tp_table(model, vocab=True))(model)
    batches = _batches()
    kw = {k: cfg[k] for k in ("zero", "microbatches", "schedule", "grad_accum") if k in cfg}
    rules = {"layers": "pipe"} if "pipe" in shape else None
    plan = sl.plan(model, mesh, rules=rules, batch=batches[0], **kw)
    engine = sl.parallelize(model, plan, optimizer=functools.partial(hf_models.adamw, lr=LR))
    if not cfg.get("local"):
        losses, counts = train_counting(engine, plan, batches)
        return {"losses": losses, **counts}
    rows = BATCH // engine.data_size
    local = [{k: v[engine.data_index * rows:(engine.data_index + 1) * rows] for k, v in b.items()} for b in batches]
    losses = []
    for i, b in enumerate(local):
        with sl.count_collectives() as c:
            losses.append(engine.step(b, local=True))
        if i == 1:
            counted = [(r.op, r.axes) for r in c.records]
    planned = [(e.op, e.axes) for e in plan.comm_per_step(mesh.rank) for _ in range(e.count)]
    return {"losses": losses, "counted": sorted(counted, key=repr), "planned": sorted(planned, key=repr)}


def token_runs(cfgs: list[dict]) -> list[dict]:
    return [token_run(c) for c in cfgs]


def _check(world, n: int, cfgs: list[dict]) -> None:
    ref = reference()
    per_rank = world(n, token_runs, cfgs)
    for i, cfg in enumerate(cfgs):
        for r in range(n):
            res = per_rank[r][i]
            rel = max_rel(res["losses"], ref)
            assert rel <= 1e-5, f"{cfg} rank {r}: {res['losses']} vs one process {ref} ({rel:.3g})"
            assert res["losses"] == per_rank[0][i]["losses"], f"{cfg}: rank {r} differs from rank 0"
            if cfg.get("local"):     # the count's all-reduce over data, besides the plan's
                want = sorted([*res["planned"], ("all_reduce", ("data",))], key=repr)
                assert res["counted"] == want, f"{cfg} rank {r}: ran {res['counted']}, expected {want}"
            else:
                assert res["counted"] == res["planned"], f"{cfg} rank {r}: ran {res['counted']}, " \
                                                         f"planned {res['planned']}"


def test_unequal_token_counts_on_two_ranks_give_the_one_process_loss(world):
    data2 = {"shape": {"data": 2}, "grad_accum": 2}
    _check(world, 2, [data2, {**data2, "local": True}, {**data2, "zero": 3},
                      {"shape": {"data": 1, "pipe": 2}, "microbatches": 4, "schedule": "1f1b"}])


def test_unequal_token_counts_with_a_vocab_parallel_head_match_one_process(world):
    _check(world, 4, [{"shape": {"data": 2, "tensor": 2}, "zero": 3, "grad_accum": 2}])


def test_the_one_process_count_is_the_shifted_labels():
    """``(labels[:, 1:] != -100).sum()`` is what ``ForCausalLMLoss`` divides by: summed over one-row
    micro-batches with that divisor, the losses add up to the whole batch's."""
    model = hf_models.build("llama", layers=2)
    batch = _batches()[0]
    n = (batch["labels"][:, 1:] != -100).sum().float()
    parts = [model(**{k: v[i:i + 1] for k, v in batch.items()}, num_items_in_batch=n).loss for i in range(BATCH)]
    torch.testing.assert_close(sum(parts), model(**batch).loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", ["loss_fn", "no labels", "tuple", "not transformers"])
def test_counts_tokens_only_for_hf_models_given_labelled_dicts_no_loss_fn(case):
    model = hf_models.build("llama", layers=2)
    batch = _batches()[0]
    if case == "loss_fn":
        assert not counts_tokens(model, lambda m, b: m(**b).loss, batch)
    elif case == "no labels":
        assert not counts_tokens(model, None, {"input_ids": batch["input_ids"]})
    elif case == "tuple":
        assert not counts_tokens(model, None, (batch["input_ids"], batch["labels"]))
    else:
        assert not counts_tokens(torch.nn.Linear(2, 2), None, batch)
    assert counts_tokens(model, None, batch) and counts_tokens(hf_models.build("gpt2", layers=2), None, batch)
