"""The context axis (issue 41, first part): the sequence split over ``context`` (``rules={"seq": "context"}``),
zigzag chunks, attention by all-gathered keys and values (Llama 3's method), learned positions made global.

The reference GPT trains at context 2, context 4 and data 2 x context 2 — ZeRO 0 to 3, full and selective
recompute, clipping — exactly as one process trains it on the whole sequences: every step's loss and every
final parameter, each step's collectives counted = planned, and the keys' and values' bytes equal to the
all-gather formula ``2·b·s·h_kv·(N-1)/N`` per layer and sequence. What cannot run on chunks is refused at plan
time by name."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.context import kv_bytes_formula
from shardlib.runtime.context import gathered_order, zigzag_positions
from test_expert_parallel import _counted, _one_process, _opt, _planned

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, BATCH = 3, 8


def _train(shape: dict, zero: int, recompute: str, clip: float | None):
    batches = [token_batch(CFG, BATCH, s) for s in range(STEPS)]
    want_losses, want = _one_process(GPT(CFG, seed=0), batches, clip=clip)
    model = GPT(CFG, seed=0)
    mesh = sl.Mesh(shape)
    plan = sl.plan(model, mesh, rules={"seq": "context"}, zero=zero, batch=batches[0], recompute=recompute,
                   clip_grad_norm=clip)
    engine = sl.parallelize(model, plan, optimizer=_opt)
    losses = []
    for step, b in enumerate(batches):
        with sl.count_collectives() as counted:
            losses.append(engine.step(b))
        if step == 1:
            second = _counted(counted.records)
    got = engine.full_state_dict()
    # the planned keys' and values' gathers (the counted ones equal the plan's, collective by collective)
    gathered = sum(e.total for e in plan.comm_per_step(mesh.rank) if e.what == "activations" and e.op == "all_gather")
    return {"losses": losses, "want_losses": want_losses, "params": {k: (got[k], want[k]) for k in want},
            "counted": dict(second), "planned": dict(_planned(plan, mesh.rank)), "gathered": gathered,
            "tables": plan.position_tables, "dp": plan.dp_axes, "rows": plan.row_axes}


@pytest.mark.parametrize("shape, zero, recompute, clip", [
    ({"context": 2}, 0, "none", None), ({"context": 4}, 2, "selective", 1.0),
    ({"data": 2, "context": 2}, 1, "none", 0.5), ({"data": 2, "context": 2}, 3, "full", None),
    ({"context": 2}, 3, "selective", None)],
    ids=["context2", "context4_zero2_selective_clip", "data2_context2_zero1_clip", "data2_context2_zero3_full",
         "context2_zero3_selective"])
def test_the_gpt_trains_on_the_context_axis_as_one_process_on_whole_sequences(world, shape, zero, recompute, clip):
    n, c = math.prod(shape.values()), shape["context"]
    for r in world(n, _train, shape, zero, recompute, clip):
        assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
        for k, (got, want) in r["params"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=k)
        assert r["counted"] == r["planned"]           # (the gathers of keys and values among them)
        assert r["tables"] == ("wpe",) and r["dp"][-1] == "context" and "context" not in r["rows"]
        # Llama 3's all-gather: each layer's keys and values, per sequence a rank holds rows of (recomputed
        # blocks gather again in backward)
        rows = BATCH // shape.get("data", 1)
        again = 2 if recompute != "none" else 1
        formula = kv_bytes_formula(CFG.seq_len, CFG.d_model, c, 4)
        assert r["gathered"] == pytest.approx(again * CFG.n_layers * rows * formula), (r["gathered"], formula)


def test_zigzag_chunks_cover_the_sequence_once_and_balance_causal_work():
    seq, size = 32, 4
    held = [zigzag_positions(seq, size, c) for c in range(size)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    work = {int((h + 1).sum()) for h in held}        # keys a causal query attends to, summed per rank
    assert len(work) == 1, work
    assert held[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    order = gathered_order(seq, size)
    assert torch.equal(torch.cat(held)[order], torch.arange(seq))


class _Eager(nn.Module):
    """Attention written out (scores, a materialized causal mask, softmax): no SDPA call to intercept."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 64)

    def forward(self, idx, targets):
        q, k, v = self.qkv(self.emb(idx)).chunk(3, -1)
        s = q @ k.transpose(-1, -2) / 4
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        y = torch.softmax(s, -1) @ v
        return nn.functional.cross_entropy(self.head(y).flatten(0, 1), targets.flatten())


def _refused(model, shape: dict, **kw) -> str:
    with pytest.raises(sl.ShardingError) as e:
        sl.plan(model, sl.AbstractMesh(shape), **kw)
    return str(e.value)


def test_what_cannot_run_on_chunks_is_refused_at_plan_time_by_name():
    gpt, batch = GPT(CFG, seed=0), token_batch(CFG, 4, 0)
    ids = torch.zeros(4, 18, dtype=torch.long)
    said = _refused(gpt, {"context": 2}, rules={"seq": "context"}, batch=(ids, ids))
    assert "a sequence of 18 tokens does not split over context=2 — expected a multiple of 2 x 2 = 4" in said
    assert "Pad or cut the sequence to 16 or 20" in said, said
    said = _refused(gpt, {"context": 2}, batch=batch)
    assert "the context axis 'context' (size 2) splits nothing" in said and "rules={'seq': 'context'}" in said
    said = _refused(gpt, {"context": 2}, rules={"seq": "context"})
    assert "needs an example batch" in said
    said = _refused(gpt, {"context": 2, "tensor": 2}, rules={"seq": "context", "heads": "tensor"}, batch=batch)
    assert "context=2 beside tensor=2" in said
    said = _refused(_Eager(), {"context": 2}, rules={"seq": "context"}, batch=batch)
    assert "computes no attention through torch.nn.functional.scaled_dot_product_attention" in said
    assert "attn_implementation='sdpa'" in said
    long = torch.zeros(4, 32, dtype=torch.long)           # wpe holds 16 positions
    said = _refused(gpt, {"context": 2}, rules={"seq": "context"}, batch=(long, long))
    assert "wpe is a learned position table of 16 positions, shorter than the 32-token sequence" in said, said
    from llama import tiny_llama
    padded = {**_llama_batch(0), "attention_mask": torch.ones(4, 16, dtype=torch.long)}
    padded["attention_mask"][1, 12:] = 0
    said = _refused(tiny_llama(), {"context": 2}, rules={"seq": "context"}, batch=padded)
    assert "the batch pads its sequences (attention_mask has zeros)" in said and "Pack documents" in said


def _llama_batch(step: int) -> dict:
    """Labels with ignored spans inside the sequence (one crosses a chunk edge at context 2 and 4): the loss is
    the mean over the global batch's counted tokens."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    labels = ids.clone()
    labels[0, 5:9], labels[2, 12:] = -100, -100
    return {"input_ids": ids, "labels": labels}


def _train_llama(shape: dict, zero: int):
    from llama import tiny_llama
    batches = [_llama_batch(s) for s in range(STEPS)]
    want_losses, want = _one_process(tiny_llama(), batches, loss=lambda m, b: m(**b).loss)
    model = tiny_llama()
    mesh = sl.Mesh(shape)
    plan = sl.plan(model, mesh, rules={"seq": "context"}, zero=zero, batch=batches[0])
    engine = sl.parallelize(model, plan, optimizer=_opt)
    losses = []
    for step, b in enumerate(batches):
        with sl.count_collectives() as counted:
            losses.append(engine.step(b))
        if step == 1:
            second = _counted(counted.records)
    got = engine.full_state_dict()
    return {"losses": losses, "want_losses": want_losses, "params": {k: (got[k], want[k]) for k in want},
            "counted": dict(second), "planned": dict(_planned(plan, mesh.rank)), "tables": plan.position_tables}


@pytest.mark.parametrize("shape, zero", [({"context": 2}, 0), ({"data": 2, "context": 2}, 3), ({"context": 4}, 1)],
                         ids=["context2", "data2_context2_zero3", "context4_zero1"])
def test_a_transformers_llama_trains_unchanged_on_the_context_axis(world, shape, zero):
    """transformers' Llama with SDPA, its code untouched: the rotary module's positions are mapped to global
    ones, its loss gets the labels shifted over the whole sequence (``shift_labels``) and the global count of
    tokens, so the loss is one process's token mean. Every parameter equals one process's; the token
    embedding within 5e-5: after 3 AdamW steps (eps 1e-6) a token row whose gradient is round-off-small moves by
    lr x the round-off's ratio (with SGD every parameter is within 1e-5)."""
    for r in world(math.prod(shape.values()), _train_llama, shape, zero):
        assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
        for k, (got, want) in r["params"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5 if "embed_tokens" in k else 1e-5, msg=k)
        assert r["counted"] == r["planned"] and r["tables"] == ("model.rotary_emb",)
