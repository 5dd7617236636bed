"""A transformers causal LM pipelines with no code: the stack named by a table entry (or found),
``rules={"layers": "pipe"}``, batches the dicts ``model(**batch)`` takes, the model's own loss.

Tiny models of ``tests/hf_models.py`` (Llama, Qwen2, Mistral, GPT-2 untied, GPT-NeoX; 4 blocks) and a
Gemma-2 (logit soft-capping, per-layer sliding/full masks)
train 4 steps with AdamW on gloo ranks — pipe 2 under every schedule, pipe 2 x data 2 ZeRO-3
(both ``pipe_gather`` policies), pipe 2 x tensor 2 (``planner/hf_tp.tp_table``, ± vocab-parallel
head) and data 2 x tensor 2 x pipe 2 (Llama, Qwen2, GPT-2, GPT-NeoX), some with ``recompute`` — with
and without an ``attention_mask`` (odd rows end in padding, their labels -100). Each must give the
losses of the same model trained by a plain loop in one process on the whole batch
(``hf_models.train_alone``, within 1e-5 relative), the same on every rank, the final weights
equal, and one step's counted collectives and point-to-point messages equal to the plan's. With
micro-batches of one row, whose labelled tokens differ, the step's loss is still the whole batch's
token mean (the engine's ``num_items_in_batch``, runtime/batches.py; tests/runtime/test_token_mean.py has
more uneven cases). After every action of the schedule, a rank holds the blocks' arguments (masks,
rotary tables) only of the micro-batches with a forward still to run on it; a step given a tuple
or a dict without labels is refused on every rank before anything runs.

Plan-time refusals (no processes): a stack entry naming something that is not a list of blocks,
blocks needing tensors computed from parameters or returning more than the hidden state, tied
embeddings, two candidate stacks, a batch that is not a dict.
"""

from __future__ import annotations

import collections
import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import hf_models
import shardlib as sl
from shardlib.planner.hf_tp import tp_table
from shardlib.testing import get_mesh
from test_engine_data_parallel import max_rel
from test_tensor_parallel import train_counting

STEPS, BATCH, LR = 4, 8, 1e-2
STACKS = {"llama": "model.layers", "qwen2": "model.layers", "mistral": "model.layers", "gpt2": "transformer.h",
          "gpt_neox": "gpt_neox.layers", "gemma2": "model.layers"}
_REFS: dict = {}


def _build(family: str, meta: bool = False):
    """``hf_models.build(family, tie=False)``, or a tiny Gemma-2: logits soft-capped after the head,
    embeddings scaled inside the base model, sliding-window and full attention alternating by layer."""
    if family != "gemma2":
        return hf_models.build(family, tie=False, meta=meta)
    import transformers as tf

    cfg = tf.Gemma2Config(vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_hidden_layers=4, max_position_embeddings=hf_models.SEQ,
                          sliding_window=4, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, use_cache=False,
                          pad_token_id=None, attn_implementation="eager", tie_word_embeddings=False,
                          dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    return model.float().train()


def _batches(family: str, mask: bool) -> list[dict]:
    return [hf_models.batch("llama" if family == "gemma2" else family, BATCH, 300 + s, mask=mask)
            for s in range(STEPS)]


def reference(family: str, mask: bool) -> dict:
    """One process on the whole batch: ``model(**batch).loss``."""
    key = (family, mask)
    if key not in _REFS:
        model = _build(family)
        losses = hf_models.train_alone(model, _batches(family, mask), lr=LR)
        _REFS[key] = {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return _REFS[key]


def _watch_contexts(pipe) -> list[tuple]:
    """After each action ``pipe`` runs: ``(kind, stage, micro-batch, micro-batches whose block
    arguments it holds)``."""
    seen = []
    do = pipe._do

    def watched(a) -> None:
        do(a)
        seen.append((a.kind, a.stage, a.mb, sorted(pipe.ctx)))
    pipe._do = watched
    return seen


def _refusals(engine, batch: dict) -> list[str]:
    """What ``engine.step`` says to a tuple and to a dict without labels (raised before anything runs)."""
    out = []
    for bad in ((batch["input_ids"], batch["labels"]), {"input_ids": batch["input_ids"]}):
        try:
            engine.step(bad)
        except sl.ShardingTypeError as e:
            out.append(str(e))
    return out


def hf_run(cfg: dict, shape: dict) -> dict:
    mesh = get_mesh(shape)
    family = cfg["family"]
    model = _build(family)
    table = {**({STACKS[family]: ("layers",)} if cfg.get("declare") else {}),
             **(tp_table(model, vocab=cfg.get("vocab", False)) if shape.get("tensor", 1) > 1 else {})}
    if table:
        sl.shard(table)(model)
    batches = _batches(family, cfg.get("mask", False))
    kw = {k: cfg[k] for k in ("zero", "microbatches", "schedule", "virtual_stages", "pipe_gather", "recompute")
          if k in cfg}
    plan = sl.plan(model, mesh, rules={"layers": "pipe"}, batch=batches[0], sequence_parallel=cfg.get("sp", False),
                   **kw)
    engine = sl.parallelize(model, plan, optimizer=functools.partial(hf_models.adamw, lr=LR))
    held = _watch_contexts(engine.pipe)
    losses, counts = train_counting(engine, plan, batches)
    refused = _refusals(engine, batches[0]) if cfg.get("refuse") else []
    if cfg.get("save"):
        engine.save_pretrained(cfg["save"])
    full = engine.full_state_dict()
    names = [n for n, _ in _build(family, meta=True).named_parameters()]
    return {"losses": losses, "params": {n: full[n] for n in names}, "stack": plan.pipeline.stack,
            "source": plan.pipeline.source, "block_saved": plan.pipeline.block_saved, "held": held,
            "left": len(engine.pipe.ctx), "refused": refused, **counts}


def hf_runs(cfgs: list[dict], shape: dict) -> list[dict]:
    return [hf_run(c, shape) for c in cfgs]


def _check(world, cfgs: list[dict], shape: dict) -> list[list[dict]]:
    n = 1
    for v in shape.values():
        n *= v
    per_rank = world(n, hf_runs, cfgs, shape)
    for i, cfg in enumerate(cfgs):
        ref = reference(cfg["family"], cfg.get("mask", False))
        for r in range(n):
            res = per_rank[r][i]
            rel = max_rel(res["losses"], ref["losses"])
            assert rel <= 1e-5, f"{cfg} {shape} rank {r}: {res['losses']} vs {ref['losses']} ({rel:.3g})"
            assert res["losses"] == per_rank[0][i]["losses"], f"{cfg} {shape}: rank {r} differs from rank 0"
            for name, want in ref["params"].items():
                torch.testing.assert_close(res["params"][name], want, rtol=1e-3, atol=1e-2 * LR * STEPS,
                                           msg=lambda m, n=name: f"{cfg} {shape} rank {r}, {n}: {m}")
            assert res["counted"] == res["planned"], f"{cfg} {shape} rank {r}: ran {res['counted']}, " \
                                                     f"planned {res['planned']}"
            assert res["stack"] == STACKS[cfg["family"]] and "transformers adapter" in res["source"]
            assert res["block_saved"] and all(b > 0 for b in res["block_saved"])
            _check_contexts(res["held"], f"{cfg} {shape} rank {r}")
            assert res["left"] == 0, f"{cfg} {shape} rank {r}: {res['left']} contexts kept after the steps"
            if cfg.get("refuse"):
                tuple_msg, labels_msg = res["refused"]
                _has(tuple_msg, "step: the batch of", "is a tuple", "model(**batch)", "'labels'", "Give dicts")
                _has(labels_msg, "step: the batch of", "has no 'labels'", "['input_ids']", "Add it")
    return per_rank


def _check_contexts(held: list[tuple], where: str) -> None:
    """Each step (the same actions): after every action, the contexts held are those of the
    micro-batches whose forwards on this rank have begun and not all run."""
    per = len(held) // STEPS
    assert per * STEPS == len(held), where
    for k in range(STEPS):
        actions = held[k * per:(k + 1) * per]
        total = collections.Counter(mb for kind, _, mb, _ in actions if kind == "F")
        done: collections.Counter = collections.Counter()
        for kind, stage, mb, ctx in actions:
            done[mb] += kind == "F"
            want = sorted(i for i in done if 0 < done[i] < total[i])
            assert ctx == want, f"{where}, step {k}, after {kind} of stage {stage} micro-batch {mb}: holds " \
                                f"the contexts of {ctx}, expected {want}"


SCHEDULES = [{"schedule": "gpipe"}, {"schedule": "1f1b"}, {"schedule": "zb_h1"},
             {"schedule": "interleaved_1f1b", "virtual_stages": 2}]


def test_llama_pipe_every_schedule_masked_or_not_trains_like_one_process(world):
    """And with micro-batches of one row, whose labelled tokens differ (15 or 12): the step's loss
    is the mean over the whole batch's tokens, as one process computes it, not the mean of the
    micro-batch means."""
    cfgs = [{"family": "llama", "microbatches": 4, "mask": mask, "declare": mask, **s}
            for s in SCHEDULES for mask in (False, True)]
    cfgs.append({"family": "llama", "microbatches": 8, "mask": True, "schedule": "1f1b", "refuse": True})
    cfgs += [{"family": "llama", "microbatches": 2, "recompute": True},
             {"family": "llama", "microbatches": 4, "mask": True, "recompute": True, "schedule": "interleaved_1f1b",
              "virtual_stages": 2}]
    _check(world, cfgs, {"data": 1, "pipe": 2})


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2", "gpt_neox"])
def test_other_families_at_pipe2_train_like_one_process_every_schedule(world, family):
    cfgs = [{"family": family, "microbatches": 4, "mask": i % 2 == 1, **s} for i, s in enumerate(SCHEDULES)]
    _check(world, cfgs, {"data": 1, "pipe": 2})


def test_what_the_model_does_after_its_head_comes_with_it(world):
    """Gemma-2 soft-caps its logits and alternates sliding and full attention: the last stage runs
    the model's own forward after the stack, and each block gets its own layer's mask."""
    cfgs = [{"family": "gemma2", "microbatches": 4, "mask": True, "schedule": "1f1b"},
            {"family": "gemma2", "microbatches": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2}]
    _check(world, cfgs, {"data": 1, "pipe": 2})


def test_zero3_under_pipe_either_gather_policy_trains_like_one_process(world):
    cfgs = [{"family": f, "zero": 3, "microbatches": 2, "pipe_gather": g, "mask": g == "microbatch"}
            for f in ("llama", "qwen2", "gpt2", "gpt_neox") for g in ("step", "microbatch")]
    _check(world, cfgs, {"data": 2, "pipe": 2})


def test_pipe_by_tensor_trains_like_one_process(world):
    cfgs = [{"family": "llama", "microbatches": 2, "declare": True, "vocab": True},
            {"family": "llama", "microbatches": 2, "mask": True, "schedule": "zb_h1"},
            {"family": "qwen2", "microbatches": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2, "mask": True},
            {"family": "gpt2", "microbatches": 2, "mask": True, "vocab": True},
            {"family": "gpt_neox", "microbatches": 2, "schedule": "gpipe"},
            {"family": "llama", "microbatches": 2, "mask": True, "sp": True},
            {"family": "llama", "microbatches": 2, "mask": True, "recompute": True},
            {"family": "gpt2", "microbatches": 2, "recompute": True, "sp": True}]
    _check(world, cfgs, {"pipe": 2, "tensor": 2})


def test_data_by_tensor_by_pipe_trains_and_saves_like_one_process(world, tmp_path):
    """2x2x2 for four families; Llama (ZeRO-3) and GPT-2 (Conv1D, fused c_attn) also written back with
    save_pretrained: from_pretrained of the folder holds the trained weights, equal to one process's."""
    from transformers import AutoModelForCausalLM

    cfgs = [{"family": "llama", "zero": 3, "microbatches": 2, "mask": True, "save": str(tmp_path / "llama")},
            {"family": "llama", "zero": 3, "microbatches": 2, "pipe_gather": "microbatch", "declare": True},
            {"family": "qwen2", "zero": 3, "microbatches": 2, "mask": True, "vocab": True},
            {"family": "gpt2", "microbatches": 2, "mask": True, "save": str(tmp_path / "gpt2")},
            {"family": "gpt_neox", "zero": 3, "microbatches": 2, "recompute": True}]
    per_rank = _check(world, cfgs, {"data": 2, "tensor": 2, "pipe": 2})
    for i, cfg in enumerate(cfgs):
        if not cfg.get("save"):
            continue
        saved = dict(AutoModelForCausalLM.from_pretrained(cfg["save"], dtype=torch.float32).named_parameters())
        want = reference(cfg["family"], cfg.get("mask", False))["params"]
        assert saved.keys() == want.keys()
        for name, value in saved.items():
            torch.testing.assert_close(value.detach(), per_rank[0][i]["params"][name], rtol=0, atol=0)
            torch.testing.assert_close(value.detach(), want[name], rtol=1e-3, atol=1e-2 * LR * STEPS)


# ---- refused at plan time -------------------------------------------------------------------------

def _refused(model, **kw) -> str:
    with pytest.raises(sl.ShardingError) as info:
        sl.plan(model, sl.AbstractMesh({"data": 1, "pipe": 2}), rules={"layers": "pipe"}, **kw)
    return str(info.value)


def _has(msg: str, *parts: str) -> None:
    for p in parts:
        assert p in msg, f"{p!r} not in:\n{msg}"


def test_a_stack_entry_that_is_not_a_list_of_blocks_is_refused():
    model = hf_models.build("llama", layers=2)
    sl.shard({"model.norm": ("layers",)})(model)
    _has(_refused(model), "'model.norm'", "LlamaRMSNorm", "nn.ModuleList of blocks", "'model.layers'")


def test_tied_embeddings_stay_tied_or_are_refused_with_the_fix():
    batch = hf_models.batch("gpt2", 4, 0)
    plan = sl.plan(hf_models.build("gpt2", layers=2), sl.AbstractMesh({"data": 1, "pipe": 2}),
                   rules={"layers": "pipe"}, batch=batch)
    assert plan.pipeline.tied == ("transformer.wte.weight",)
    _has(_refused(hf_models.build("gpt2", layers=2), batch=batch, zero=3),
         "'lm_head.weight'", "'transformer.wte.weight'", "tied", "under ZeRO-3", "tie_word_embeddings=False")


def test_a_batch_that_is_not_a_dict_is_refused():
    ids = torch.zeros(4, 16, dtype=torch.long)
    _has(_refused(hf_models.build("llama", layers=2), batch=(ids, ids)), "is a tuple", "model(**batch)", "'labels'")


class _Block(nn.Module):
    def __init__(self, d: int, returns_tuple: bool = False):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.returns_tuple = returns_tuple

    def forward(self, x, gate=None):
        y = x + self.fc(x) * (1 if gate is None else gate)
        return (y, gate) if self.returns_tuple else y


class _FakeLM(nn.Module):
    """A causal LM the adapter does not know: its blocks get a gate computed from a parameter
    (``gated``), or return a tuple."""

    def __init__(self, gated: bool, returns_tuple: bool = False, d: int = 8, vocab: int = 11):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=d)
        self.emb = nn.Embedding(vocab, d)
        self.gate = nn.Linear(d, 1) if gated else None
        self.layers = nn.ModuleList(_Block(d, returns_tuple) for _ in range(4))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids=None, inputs_embeds=None, labels=None, attention_mask=None, use_cache=None):
        x = self.emb(input_ids) if inputs_embeds is None else inputs_embeds
        gate = torch.sigmoid(self.gate(x)) if self.gate is not None else None
        for layer in self.layers:
            x = layer(x, gate=gate)
            x = x[0] if isinstance(x, tuple) else x
        logits = self.head(x)
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_blocks_needing_other_tensors_are_refused_tuple_blocks_are_not():
    ids = torch.zeros(4, 6, dtype=torch.long)
    _has(_refused(_FakeLM(gated=True), batch={"input_ids": ids, "labels": ids}),
         "block 0 of 'layers' needs 'gate'", "computed from parameters", "only the hidden state crosses")
    # a block returning a tuple around the hidden state (GPT-J, BLOOM, MPT) is a block: the stages keep its
    # first item, the model's own loop sees the tuple it expects (trained against one process in test_transformers_families)
    plan = sl.plan(_FakeLM(gated=False, returns_tuple=True), sl.AbstractMesh({"data": 1, "pipe": 2}),
                   rules={"layers": "pipe"}, batch={"input_ids": ids, "labels": ids})
    assert plan.pipeline.block_tuple == 2
    assert sl.plan(_FakeLM(gated=False), sl.AbstractMesh({"data": 1, "pipe": 2}), rules={"layers": "pipe"},
                   batch={"input_ids": ids, "labels": ids}).pipeline.block_tuple == 0


def test_a_model_with_several_block_lists_and_no_stack_is_refused():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.b = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    _has(_refused(Two()), "several lists of identical blocks", "['a', 'b']", "sl.shard({'a': ('layers',)})(model)")


def test_a_stage_computes_its_block_arguments_once_per_batch_shape():
    """``context`` (every stage but the first, every micro-batch): the blocks' arguments depend on the batch's
    shape alone when it holds only input_ids and labels, so they are computed once per shape (the latest few
    kept) — not when it holds a mask, nor while a dropout draws (its draws would be skipped)."""
    from shardlib.planner.hf_stages import CausalLMStages
    model = hf_models.build("llama")
    stages = CausalLMStages(model, "model.layers")
    runs = []
    record = stages._record
    stages._record = lambda *a, **k: (runs.append(1), record(*a, **k))[1]
    plain = hf_models.batch("llama", 2, 0)
    first = stages.context(plain, torch.float32)
    again = stages.context(hf_models.batch("llama", 2, 1), torch.float32)     # other tokens, same shape
    assert again is first and len(runs) == 1
    masked = hf_models.batch("llama", 2, 0, mask=True)
    stages.context(masked, torch.float32)
    stages.context(masked, torch.float32)
    assert len(runs) == 3
    for rows in (1, 3, 4, 5, 6):                                       # other shapes: at most 4 kept
        stages.context(hf_models.batch("llama", rows, 0), torch.float32)
    assert len(runs) == 8 and len(stages._contexts) == 4
    assert stages.context(hf_models.batch("llama", 6, 2), torch.float32) is not None and len(runs) == 8
    model.extra = nn.Dropout(0.1)                                      # a dropout that draws in training
    drawing = CausalLMStages(model, "model.layers")
    drawing._record = lambda *a, **k: (runs.append(1), record.__func__(drawing, *a, **k))[1]
    drawing.context(plain, torch.float32)
    drawing.context(plain, torch.float32)
    assert len(runs) == 10
    model.eval()
    drawing.context(plain, torch.float32)
    drawing.context(plain, torch.float32)
    assert len(runs) == 11
