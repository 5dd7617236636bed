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
from shardlib.planner.context import FORMULAS
from shardlib.runtime.context import gathered_order, zigzag_positions
from test_expert_parallel import _counted, _one_process, _opt, _planned

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, BATCH = 3, 8


def _stepped(engine, batches: list) -> tuple[list[float], dict, dict]:
    """Each batch a step: the losses, the second step's collectives (``_counted``) and the final state."""
    losses, second = [], {}
    for step, b in enumerate(batches):
        with sl.count_collectives() as counted:
            losses.append(engine.step(b))
        if step == 1:
            second = _counted(counted.records)
    return losses, second, engine.full_state_dict()


def _exact(r: dict, embed_atol: float = 1e-5, counted: bool = True) -> None:
    """A rank's result against one process's: every step's loss, every final parameter (a transformers token
    embedding within ``embed_atol``: ``test_a_transformers_llama_trains_unchanged_on_the_context_axis`` says
    why), and, with ``counted``, the second step's collectives equal to the plan's."""
    assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
    for k, (got, want) in r["params"].items():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=embed_atol if "embed_tokens" in k else 1e-5, msg=k)
    if counted:
        assert r["counted"] == r["planned"]


def _train_hf(build, batches: list, shape: dict, zero: int = 0, method: str = "allgather") -> dict:
    """A transformers model (``build()``) trained on ``batches`` on ``shape`` with the sequence over context, its
    own loss, beside the same model in one process: ``_exact``'s fields and its position modules."""
    want_losses, want = _one_process(build(), batches, loss=lambda m, b: m(**b).loss)
    model = build()
    mesh = sl.Mesh(shape)
    plan = sl.plan(model, mesh, rules={"seq": "context"}, zero=zero, batch=batches[0], context_attention=method)
    engine = sl.parallelize(model, plan, optimizer=_opt)
    losses, second, got = _stepped(engine, batches)
    return {"losses": losses, "want_losses": want_losses, "params": {k: (got[k], want[k]) for k in want},
            "counted": dict(second), "planned": dict(_planned(plan, mesh.rank)), "tables": plan.position_tables}


def _train(shape: dict, zero: int, recompute: str, clip: float | None, method: str = "allgather"):
    batches = [token_batch(CFG, BATCH, s) for s in range(STEPS)]
    want_losses, want = _one_process(GPT(CFG, seed=0), batches, clip=clip)
    model = GPT(CFG, seed=0)
    mesh = sl.Mesh(shape)
    plan = sl.plan(model, mesh, rules={"seq": "context"}, zero=zero, batch=batches[0], recompute=recompute,
                   clip_grad_norm=clip, context_attention=method)
    engine = sl.parallelize(model, plan, optimizer=_opt)
    losses, second, got = _stepped(engine, batches)
    # attention's planned moves forward (the counted ones equal the plan's, collective by collective)
    moved = sum(e.total for e in plan.comm_per_step(mesh.rank) if e.what == "activations" and e.phase == "forward")
    return {"losses": losses, "want_losses": want_losses, "params": {k: (got[k], want[k]) for k in want},
            "counted": dict(second), "planned": dict(_planned(plan, mesh.rank)), "moved": moved,
            "tables": plan.position_tables, "dp": plan.dp_axes, "rows": plan.row_axes, "method": plan.context_attention}


@pytest.mark.parametrize("method, shape, zero, recompute, clip", [
    ("allgather", {"context": 2}, 0, "none", None), ("allgather", {"context": 4}, 2, "selective", 1.0),
    ("allgather", {"data": 2, "context": 2}, 1, "none", 0.5), ("allgather", {"data": 2, "context": 2}, 3, "full", None),
    ("allgather", {"context": 2}, 3, "selective", None),
    ("ring", {"context": 2}, 0, "none", None), ("ring", {"context": 4}, 0, "none", 1.0),
    ("ring", {"data": 2, "context": 2}, 3, "full", None), ("ring", {"context": 2}, 1, "selective", None),
    ("ulysses", {"context": 2}, 0, "none", None), ("ulysses", {"context": 4}, 3, "full", None),
    ("ulysses", {"data": 2, "context": 2}, 2, "selective", 0.5)],
    ids=["allgather_context2", "allgather_context4_zero2_selective_clip", "allgather_data2_context2_zero1_clip",
         "allgather_data2_context2_zero3_full", "allgather_context2_zero3_selective", "ring_context2",
         "ring_context4_clip", "ring_data2_context2_zero3_full", "ring_context2_zero1_selective", "ulysses_context2",
         "ulysses_context4_zero3_full", "ulysses_data2_context2_zero2_selective_clip"])
def test_the_gpt_trains_on_the_context_axis_as_one_process_on_whole_sequences(world, method, shape, zero, recompute,
                                                                              clip):
    n, c = math.prod(shape.values()), shape["context"]
    for r in world(n, _train, shape, zero, recompute, clip, method):
        _exact(r)                                     # (counted = planned: the gathers of keys and values too)
        assert r["tables"] == ("wpe",) and r["dp"][-1] == "context" and "context" not in r["rows"]
        assert r["method"] == method
        # each method's formula per layer and sequence (all-gather 2·b·s·h_kv·(N-1)/N, ring 2·(N-1)·b·(s/N)·h_kv,
        # Ulysses 4·b·(s/N)·h·(N-1)/N), for the rows a rank holds: its forward moves
        rows = BATCH // shape.get("data", 1)
        formula = FORMULAS[method](CFG.seq_len, CFG.d_model, c, 4)
        assert r["moved"] == pytest.approx(CFG.n_layers * rows * formula), (r["moved"], formula)


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
    said = _refused(_Eager(), {"context": 2}, rules={"seq": "context"}, batch=batch)
    assert "computes no attention through torch.nn.functional.scaled_dot_product_attention" in said
    assert "attn_implementation='sdpa'" in said
    long = torch.zeros(4, 32, dtype=torch.long)           # wpe holds 16 positions
    said = _refused(gpt, {"context": 2}, rules={"seq": "context"}, batch=(long, long))
    assert "wpe is a learned position table of 16 positions, shorter than the 32-token sequence" in said, said
    from llama import tiny_llama
    padded = {**_llama_batch(0), "attention_mask": torch.ones(4, 16, dtype=torch.long)}
    said = _refused(tiny_llama(), {"pipe": 2, "context": 2}, rules={"seq": "context", "layers": "pipe"},
                    batch=padded)
    assert "under a pipe with a batch of documents or padding" in said, said
    said = _refused(_windowed("mistral"), {"context": 2}, rules={"seq": "context"}, batch=_llama_batch(0),
                    recompute="selective")
    assert "attends within a sliding window, and selective recompute replays attention" in said, said


def _llama_batch(step: int) -> dict:
    """Labels with ignored spans inside the sequence (one crosses a chunk edge at context 2 and 4): the loss is
    the mean over the global batch's counted tokens."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    labels = ids.clone()
    labels[0, 5:9], labels[2, 12:] = -100, -100
    return {"input_ids": ids, "labels": labels}


def _train_llama(shape: dict, zero: int, method: str = "allgather"):
    from llama import tiny_llama
    return _train_hf(tiny_llama, [_llama_batch(s) for s in range(STEPS)], shape, zero, method)


@pytest.mark.parametrize("method, shape, zero", [
    ("allgather", {"context": 2}, 0), ("allgather", {"data": 2, "context": 2}, 3), ("allgather", {"context": 4}, 1),
    ("ring", {"context": 4}, 1), ("ulysses", {"context": 2}, 0), ("ulysses", {"data": 2, "context": 2}, 3)],
    ids=["allgather_context2", "allgather_data2_context2_zero3", "allgather_context4_zero1", "ring_context4_zero1",
         "ulysses_context2", "ulysses_data2_context2_zero3"])
def test_a_transformers_llama_trains_unchanged_on_the_context_axis(world, method, shape, zero):
    """transformers' Llama with SDPA, its code untouched: the rotary module's positions are mapped to global
    ones, its loss gets the labels shifted over the whole sequence (``shift_labels``) and the global count of
    tokens, so the loss is one process's token mean. Every parameter equals one process's; the token
    embedding within 5e-5: after 3 AdamW steps (eps 1e-6) a token row whose gradient is round-off-small moves by
    lr x the round-off's ratio (with SGD every parameter is within 1e-5). Grouped keys and values (4 heads, 2
    key/value heads) travel ungrouped: the ring passes the 2 heads, Ulysses splits them over the axis."""
    for r in world(math.prod(shape.values()), _train_llama, shape, zero, method):
        _exact(r, embed_atol=5e-5)
        assert r["tables"] == ("model.rotary_emb",)


def test_the_planner_picks_the_method_by_its_moves_and_a_policy_forces_one():
    """Per layer a rank's moves: Ulysses moves ``4·(s/N)·h·(N-1)/N`` against the all-gather's ``2·s·h_kv·(N-1)/N``,
    so for a long sequence on 8 ranks it wins with as many key/value heads as query heads, and loses with 4
    key/value heads of 32 (grouped-query attention); with heads the axis does not divide it cannot run. The
    choice is the plan's (``plan.context_attention``, in ``explain``); ``context_attention=`` forces one."""
    from shardlib.planner.context import AttentionCall, choose_method, method_costs
    seq, n = 32768, 8

    def calls(heads: int, kv_heads: int):
        return tuple(AttentionCall(kv_heads * seq // n * 128, f"layers.{i}", heads * seq // n * 128, heads, kv_heads)
                     for i in range(32))
    assert choose_method(calls(32, 32), n, 2, None) == "ulysses"
    assert choose_method(calls(32, 4), n, 2, None) == "allgather"
    assert "ulysses" not in method_costs(calls(12, 12), n, 2) and choose_method(calls(12, 12), n, 2, None) != "ulysses"
    assert choose_method(calls(32, 32), n, 2, "ring") == "ring"
    gpt, batch = GPT(CFG, seed=0), token_batch(CFG, 4, 0)
    plan = sl.plan(gpt, sl.AbstractMesh({"context": 2}), rules={"seq": "context"}, batch=batch,
                   context_attention="ulysses")
    assert plan.context_attention == "ulysses" and "attention: ulysses in 2 call(s)" in plan.explain()
    with pytest.raises(sl.ShardingError, match="context_attention must be 'allgather', 'ring', 'ulysses' or None"):
        sl.plan(gpt, sl.AbstractMesh({"context": 2}), rules={"seq": "context"}, batch=batch, context_attention="tree")


def _lora_gpt():
    from peft import LoraConfig, get_peft_model
    model = GPT(CFG, seed=0)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj", "fc", "out"],
                                            lora_dropout=0.0, init_lora_weights=False))


def _composed(shape: dict, model: str, method: str, rules: dict, kw: dict):
    from dataclasses import replace
    cfg = replace(CFG, n_experts=4, top_k=2, expert_width=32, shared_experts=1, aux_loss=0.05) \
        if model == "moe" else CFG
    build = _lora_gpt if model == "lora" else (lambda: GPT(cfg, seed=0))
    batches = [token_batch(cfg, BATCH, s) for s in range(STEPS)]
    want_losses, want = _one_process(build(), batches, clip=kw.get("clip_grad_norm"))
    net = build()
    mesh = sl.Mesh(shape)
    plan = sl.plan(net, mesh, rules={"seq": "context", **rules}, batch=batches[0], context_attention=method, **kw)
    # (PEFT's wrapper takes the batch as keywords: its loss through loss_fn; the others their own forward)
    engine = sl.parallelize(net, plan, optimizer=_opt, loss_fn=(lambda m, b: m(*b)) if model == "lora" else None)
    losses, second, got = _stepped(engine, batches)
    return {"losses": losses, "want_losses": want_losses, "params": {k: (got[k], want[k]) for k in want},
            "counted": dict(second), "planned": dict(_planned(plan, mesh.rank))}


TP = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


@pytest.mark.parametrize("shape, model, method, rules, kw", [
    ({"context": 2, "tensor": 2}, "gpt", "allgather", TP, {}),
    ({"data": 2, "context": 2, "tensor": 2}, "gpt", "ulysses", TP, {"zero": 3, "sequence_parallel": True}),
    ({"pipe": 2, "context": 2}, "gpt", "allgather", {"layers": "pipe"}, {"microbatches": 2, "clip_grad_norm": 0.05}),
    ({"pipe": 2, "context": 2, "tensor": 2}, "gpt", "ring", {"layers": "pipe", **TP},
     {"microbatches": 2, "zero": 1, "sequence_parallel": True}),
    ({"expert": 2, "context": 2}, "moe", "ring", {"experts": "expert"}, {"zero": 1}),
    ({"data": 2, "context": 2}, "gpt", "allgather", {},
     {"zero": 2, "recompute": "selective", "offload": {"activations": "host", "optimizer": "host"}}),
    ({"data": 2, "context": 2}, "gpt", "ring", {}, {"zero": 3, "offload": {"params": "host", "optimizer": "host"}}),
    ({"data": 2, "context": 2}, "lora", "ring", {}, {"zero": 3})],
    ids=["tensor2", "data2_tensor2_sp_zero3_ulysses", "pipe2_clip", "pipe2_tensor2_sp_zero1_ring", "moe_expert2_zero1_ring",
         "activations_and_optimizer_on_host_selective", "params_on_host_zero3_ring", "lora_zero3_ring"])
def test_the_context_axis_composes_with_every_other_axis_and_policy(world, shape, model, method, rules, kw):
    """Beside tensor (± SP: attention's region gathers the sequence chunk back, the context method runs on
    the rank's heads), pipe (each stage's blocks attend over context; the stream is the chunk; clipping counts
    the replicated gradients once over data x context), expert (a mixture of experts routes each chunk's
    tokens; the routers' statistics are the whole batch's), offload of activations, optimizer and parameters,
    and PEFT LoRA: every loss and parameter equals one process's, every collective counted = planned."""
    for r in world(math.prod(shape.values()), _composed, shape, model, method, rules, kw):
        _exact(r)


@pytest.mark.parametrize("method", ["allgather", "ring", "ulysses"])
def test_the_activations_a_rank_holds_fall_as_one_over_the_context_degree(method):
    """``plan.peak_per_rank()["activations"]``: what a rank's chunk saves for backward, measured at plan time —
    one process's activations over the whole sequences divided by C (ring, Ulysses), plus the all-gather's
    whole keys and values (``2·(C-1)`` more local chunks per layer)."""
    cfg = GPTConfig(vocab_size=64, seq_len=256, d_model=32, n_heads=4, n_layers=2)
    batch = token_batch(cfg, 4, 0)
    whole = sl.activation_bytes(GPT(cfg, seed=0), batch)
    for c in (2, 4):
        plan = sl.plan(GPT(cfg, seed=0), sl.AbstractMesh({"context": c}), rules={"seq": "context"}, batch=batch,
                       context_attention=method)
        got = plan.peak_per_rank(0)["activations"]
        kv = 4 * 256 // c * 32 * 4                     # a layer's local keys (or values): rows x S/C x width, fp32
        extra = 2 * (c - 1) * kv * cfg.n_layers if method == "allgather" else 0
        assert got - extra == pytest.approx(whole / c, rel=0.02), (c, got, extra, whole)


def _documents_batch(step: int, kind: str) -> dict:
    """Padding (right on row 1, left on row 3; padded labels -100) and/or packed documents (``position_ids``
    restarting mid-row, across chunk edges)."""
    out = _llama_batch(step)
    labels = out["labels"]
    labels[0, 5:9], labels[2, 12:] = out["input_ids"][0, 5:9], out["input_ids"][2, 12:]     # (no spans here)
    if kind in ("padding", "both"):
        mask = torch.ones(4, 16, dtype=torch.long)
        mask[1, 11:], mask[3, :5] = 0, 0
        labels[mask == 0] = -100
        out["attention_mask"] = mask
    if kind in ("packed", "both"):
        pos = torch.cat([torch.arange(6), torch.arange(7), torch.arange(3)]).expand(4, 16).clone()
        pos[2] = torch.cat([torch.arange(9), torch.arange(7)])
        out["position_ids"] = pos
    return out


def _train_documents(shape: dict, zero: int, kind: str, method: str):
    from llama import tiny_llama
    return _train_hf(tiny_llama, [_documents_batch(s, kind) for s in range(STEPS)], shape, zero, method)


@pytest.mark.parametrize("kind, method, shape, zero", [
    ("padding", "allgather", {"context": 2}, 0), ("packed", "ring", {"data": 2, "context": 2}, 3),
    ("both", "ring", {"context": 4}, 0), ("both", "ulysses", {"context": 2}, 1)],
    ids=["padding_allgather", "packed_ring_data2_zero3", "both_ring_context4", "both_ulysses_zero1"])
def test_padding_and_packed_documents_mask_attention_over_the_whole_sequence(world, kind, method, shape, zero):
    """transformers decides the mask in one process — with an ``attention_mask``, causal over the non-padding
    keys (a left pad sees nothing: zeros); without one, ``position_ids`` restarting mark packed documents, each
    query seeing its own document's keys; the rotary positions are the batch's ``position_ids``. The engine
    takes both out of the model's inputs and gives them to the attention over whole sequences
    (``runtime/context.Documents``), each method masking chunk pairs: every loss and parameter equals one
    process's, counted = planned."""
    for r in world(math.prod(shape.values()), _train_documents, shape, zero, kind, method):
        _exact(r, embed_atol=5e-5)


class _Pooled(GPT):
    """The GPT with a sequence classifier's mean pooling over its tokens before the head."""

    def forward(self, idx, targets):
        x = self.pipeline_pre(idx)
        for block in self.blocks:
            x = block(x)
        pooled = self.ln_f(x).mean(dim=1)
        return nn.functional.cross_entropy(self.head(pooled), targets[:, 0])


def test_a_pooling_over_the_sequence_is_refused_naming_where():
    said = _refused(_Pooled(CFG, seed=0), {"context": 2}, rules={"seq": "context"}, batch=token_batch(CFG, 4, 0))
    assert "plan: _Pooled reduces activations over the sequence (a pooling over dim 1)" in said, said
    sl.plan(GPT(CFG, seed=0), sl.AbstractMesh({"context": 2}), rules={"seq": "context"},
            batch=token_batch(CFG, 4, 0))             # the GPT's loss is a mean over every token: not a pooling


def _windowed(kind: str, cache: bool = False):
    """A tiny transformers Mistral (every layer within a sliding window of 6) or Qwen2 (its second layer within
    one of 5), SDPA; ``cache``: the config's ``use_cache`` (transformers then makes a cache in training too)."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, attn_implementation="sdpa", use_cache=cache)
    if kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        return MistralForCausalLM(MistralConfig(sliding_window=6, **common))
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(sliding_window=5, use_sliding_window=True, max_window_layers=1, **common))


def _train_windowed(shape: dict, kind: str, method: str, docs: str, cache: bool):
    return _train_hf(lambda: _windowed(kind, cache), [_documents_batch(s, docs) for s in range(STEPS)], shape,
                     method=method)


@pytest.mark.parametrize("kind, method, shape, docs, cache", [
    ("mistral", "allgather", {"context": 2}, "none", False), ("qwen2", "ulysses", {"context": 2}, "none", False),
    ("mistral", "ring", {"data": 2, "context": 2}, "packed", False), ("qwen2", "ulysses", {"context": 4}, "both", False),
    ("mistral", "ring", {"context": 2}, "packed", True)],
    ids=["mistral_allgather", "qwen2_mixed_layers_ulysses", "mistral_packed_ring_data2", "qwen2_both_ulysses_context4",
         "mistral_packed_with_a_cache_ring"])
def test_sliding_windows_by_layer_over_the_whole_sequence(world, kind, method, shape, docs, cache):
    """A layer's sliding window (Mistral's every layer, Qwen2's sliding ones: the attention module's own) is
    applied over the whole sequence by global index, with documents and padding as transformers combines
    them; the model's own mask of its chunk (causal within the window) is recognized and replaced. A model whose
    config keeps a cache attends across packed documents in one process (transformers reads packing only
    without one): so here too. Every loss and parameter equals one process's, counted = planned."""
    for r in world(math.prod(shape.values()), _train_windowed, shape, kind, method, docs, cache):
        _exact(r, embed_atol=5e-5)


def _flattened(step: int) -> dict:
    """transformers' ``DataCollatorWithFlattening`` form: one row of packed documents with its ``position_ids`` and
    flash-attention's offsets (``cu_seq_lens_q/k``, ``max_length_q/k``), labels -100 at each document's start."""
    g = torch.Generator().manual_seed(step)
    lengths = (5, 7, 9, 11)
    ids = torch.randint(0, 96, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max(lengths), "max_length_k": max(lengths)}


def _train_flattened(shape: dict, method: str):
    from llama import tiny_llama
    return _train_hf(tiny_llama, [_flattened(s) for s in range(STEPS)], shape, method=method)


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_a_flattened_batch_of_packed_documents_trains_as_one_process(world, method):
    """One 32-token row of 4 packed documents as transformers' flattening collator gives it: the documents
    come from ``position_ids`` (an SDPA model never reads flash-attention's ``cu_seq_lens``, which describe
    the whole row and are dropped, not cut); at context 2 every loss and parameter equals one process's."""
    for r in world(2, _train_flattened, {"context": 2}, method):
        _exact(r, embed_atol=5e-5)


def _save_or_resume(shape: dict, folder: str, save: bool):
    """``save``: two steps on ``shape`` (ZeRO-1: the optimizer's states sharded over data x context), saved;
    else: loaded on ``shape`` and the third step taken, every parameter beside one process's."""
    model = GPT(CFG, seed=0)
    mesh = sl.Mesh(shape)
    rules = {"seq": "context"} if "context" in shape else None
    plan = sl.plan(model, mesh, rules=rules, zero=1, batch=token_batch(CFG, BATCH, 0))
    engine = sl.parallelize(model, plan, optimizer=_opt)
    if save:
        losses = [engine.step(token_batch(CFG, BATCH, s)) for s in range(2)]
        engine.save(folder)
        return {"losses": losses}
    engine.load(folder)
    losses = [engine.step(token_batch(CFG, BATCH, 2))]
    want_losses, want = _one_process(GPT(CFG, seed=0), [token_batch(CFG, BATCH, s) for s in range(3)])
    got = engine.full_state_dict()
    return {"losses": losses, "want_losses": want_losses[2:], "params": {k: (got[k], want[k]) for k in want}}


@pytest.mark.parametrize("to", [{"data": 2}, {"context": 4}], ids=["data2", "context4"])
def test_a_checkpoint_saved_on_data_x_context_resumes_on_another_layout(world, tmp_path, to):
    """The axis holds no state of its own: a checkpoint of data 2 x context 2 (ZeRO-1 over both) resumes on data 2
    and on context 4, and the step after equals one process's."""
    world(4, _save_or_resume, {"data": 2, "context": 2}, str(tmp_path), True)
    for r in world(math.prod(to.values()), _save_or_resume, to, str(tmp_path), False):
        _exact(r, counted=False)
