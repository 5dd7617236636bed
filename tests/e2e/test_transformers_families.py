"""The family matrix (issue 38): transformers causal LMs of every family in ``hf_families`` split over the
tensor axis by their own plans (``sl.hf_dims``: the config's ``base_model_tp_plan``, or the project's
table), no table written — ``rules`` alone decide the axes.

Each family trains 3 AdamW steps and is checked against the same model in one process:
- losses within 1e-5 relative, the same on every rank;
- **every final parameter** (``full_state_dict``) equal to one process's;
- every replicated copy **bit-equal** across its axis (``shardlib.verify.replica_mismatches``): a per-head
  norm whose partial gradient went unreduced (Qwen3, Gemma-3, EXAONE-4) drifts here while the losses agree.

MoE families split their attention and dense MLPs, and each expert's width (``expert_mlp``: gate|up a column,
down a row, as Megatron's tensor-parallel experts; the rule is in ``RULES``). Bad input is refused before any collective: an
axis that splits nothing, a plan kind shardlib does not lower, an activation meeting split values unreduced.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import hf_families as hf
import shardlib as sl
from shardlib.planner.hf_dims import unsupported
from shardlib.testing import get_mesh
from shardlib.verify import replica_mismatches
from test_tensor_parallel import train_counting

RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor", "expert_mlp": "tensor"}   # MoE: experts split too
STEPS, LR = 3, 1e-2


def _batches(family: str) -> list[dict]:
    return [hf.batch(family, 4, 300 + s) for s in range(STEPS)]


def _loss(model, batch):
    return model(**batch).loss


def _run(family: str, shape: dict, zero: int, lora: bool = False) -> dict:
    model = hf.build(family)
    if lora:
        model = _lora(model)
    piped = shape.get("pipe", 1) > 1
    rules = {**(RULES if shape.get("tensor", 1) > 1 else {}), **({"layers": "pipe"} if piped else {})}
    plan = sl.plan(model, get_mesh(shape), rules=rules, zero=zero, batch=_batches(family)[0],
                   **({"microbatches": 2} if piped else {}))
    engine = sl.parallelize(model, plan, optimizer=functools.partial(hf.adamw, lr=LR),
                            loss_fn=None if piped else _loss)
    losses, counts = train_counting(engine, plan, _batches(family))
    tp = plan.tensor
    return {"losses": losses, "state": engine.full_state_dict(), "replicas": replica_mismatches(engine),
            "partial": tp.partial_modules if tp else (), "sites": len(tp.sites) if tp else None,
            "attention": any("attn" in x.module or "attention" in x.module for x in tp.sites) if tp else None,
            "tied": plan.pipeline.tied if plan.pipeline else (), **counts}


def _zero(zero: int | dict, family: str) -> int:
    return zero[family] if isinstance(zero, dict) else zero


def _runs(families: list[str], shape: dict, zero: int | dict, lora: bool = False) -> dict:
    """Each family trained on a ``shape`` mesh at ZeRO ``zero`` (one stage for all, or one per family)."""
    return {f: _run(f, shape, _zero(zero, f), lora) for f in families}


def _lora(model):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))


@functools.cache
def _reference(family: str, lora: bool = False) -> tuple[list[float], dict]:
    model = hf.build(family)
    if lora:
        model = _lora(model)
    losses = hf.train_alone(model, _batches(family), lr=LR)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(family: str, per_rank: list[dict], where: str, lora: bool = False) -> None:
    want_losses, want_state = _reference(family, lora)
    for r, res in enumerate(per_rank):
        at = f"{family} {where} rank {r}"
        assert res["sites"] is None or res["sites"] > 0, f"{at}: nothing split over tensor"
        assert res["counted"] == res["planned"], f"{at}: ran {res['counted']}, the plan says {res['planned']}"
        rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], want_losses))
        assert rel <= 1e-5, f"{at}: losses {res['losses']} vs one process {want_losses} ({rel:.3g})"
        assert res["losses"] == per_rank[0]["losses"], f"{at}: losses differ from rank 0's"
        assert res["replicas"] == [], f"{at}: {res['replicas']}"
        assert res["state"].keys() == want_state.keys(), at
        for k, want in want_state.items():
            torch.testing.assert_close(res["state"][k], want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=k: f"{at}, {k}: {m}")


def _train_and_check(world, families: list[str], shape: dict, zero: int | dict, lora: bool = False) -> list[dict]:
    """``families`` trained on every rank of a ``shape`` mesh (``_runs``), each checked against one process
    (``_check``). Returns every rank's results."""
    n = math.prod(shape.values())
    per_rank = world(n, _runs, families, shape, zero, lora)
    axes = " x ".join(f"{a} {k}" for a, k in shape.items() if k > 1)
    for f in families:
        where = f"{'LoRA, ' if lora else ''}{axes}, ZeRO-{_zero(zero, f)}"
        _check(f, [per_rank[r][f] for r in range(n)], where, lora)
    return per_rank


CHUNKS = [hf.FAMILIES[i::4] for i in range(4)]
# multi-query GPT-BigCode (one K and one V head), grouped-query Phi-3's fused q|k|v of unequal blocks, and
# DeepSeek-V3's MLA, which its own plan keeps replicated: attention replicated, the MLPs and experts split
ATTENTION_REPLICATED = {"gpt_bigcode", "phi3", "deepseek_v3"}


@pytest.mark.parametrize("chunk", range(len(CHUNKS)))
def test_every_family_at_tensor_2_trains_like_one_process(world, chunk):
    families = list(CHUNKS[chunk])
    per_rank = _train_and_check(world, families, {"data": 1, "tensor": 2}, 0)
    # attention split in every dense family but ATTENTION_REPLICATED's
    for f in families:
        assert per_rank[0][f]["attention"] == (f not in ATTENTION_REPLICATED), f
    # the per-head norms' partial gradients were found, and only where they are
    for f in families:
        partial = per_rank[0][f]["partial"]
        if f in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4"):
            assert partial and all(m.endswith(("q_norm", "k_norm")) for m in partial), (f, partial)
        else:
            assert partial == (), (f, partial)


@pytest.mark.parametrize("chunk", range(len(CHUNKS)))
def test_every_family_at_data_2_x_tensor_2_zero3_trains_like_one_process(world, chunk):
    _train_and_check(world, list(CHUNKS[chunk]), {"data": 2, "tensor": 2}, 3)


PIPE_CHUNKS = [hf.FAMILIES[i::4] for i in range(4)]


@pytest.mark.parametrize("chunk", range(len(PIPE_CHUNKS)))
def test_every_family_at_pipe_2_trains_like_one_process(world, chunk):
    """1F1B over 2 micro-batches, the model's own loss: tied embeddings held by both stages and summed
    (bit-equal copies), blocks returning tuples, MoE blocks (probed on zeros), DeepSeek-V3's dense first block."""
    families = list(PIPE_CHUNKS[chunk])
    per_rank = _train_and_check(world, families, {"data": 1, "pipe": 2}, 0)
    for f in families:
        tied = per_rank[0][f]["tied"]
        assert bool(tied) == (f in hf.TIED), (f, tied)


def _run_pipe(family: str, p: int, zero: int, schedule: str) -> dict:
    model = hf.build(family, layers=4)
    batches = [hf.batch(family, 8, 300 + s) for s in range(STEPS)]
    plan = sl.plan(model, get_mesh({"data": 1, "pipe": p}), rules={"layers": "pipe"}, zero=zero, microbatches=4,
                   schedule=schedule, batch=batches[0],
                   **({"virtual_stages": 2} if schedule == "interleaved_1f1b" else {}))
    engine = sl.parallelize(model, plan, optimizer=functools.partial(hf.adamw, lr=LR))
    losses, counts = train_counting(engine, plan, batches)
    return {"losses": losses, "state": engine.full_state_dict(), "replicas": replica_mismatches(engine),
            "tied": plan.pipeline.tied, **counts}


@pytest.mark.parametrize("family,p,zero,schedule", [("gpt2", 4, 0, "1f1b"), ("smollm3", 4, 2, "zb_h1"),
                                                    ("gemma", 2, 1, "interleaved_1f1b")])
def test_tied_tables_train_like_one_process_on_every_pipe_and_schedule(world, family, p, zero, schedule):
    """The stages between the first and the last add zeros to the tied weight's sum (pipe 4); the first and
    last virtual stage of an interleaved schedule sit on the two ends of the pipe axis."""
    per_rank = world(p, _run_pipe, family, p, zero, schedule)
    model = hf.build(family, layers=4)
    want = hf.train_alone(model, [hf.batch(family, 8, 300 + s) for s in range(STEPS)], lr=LR)
    for r, res in enumerate(per_rank):
        at = f"{family} pipe {p} {schedule} ZeRO-{zero} rank {r}"
        assert res["tied"], at
        assert max(abs(a - b) / abs(b) for a, b in zip(res["losses"], want)) <= 1e-5, (at, res["losses"], want)
        assert res["replicas"] == [], (at, res["replicas"])
        assert res["counted"] == res["planned"], (at, res["counted"], res["planned"])
        for k, v in model.state_dict().items():
            torch.testing.assert_close(res["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{at}, {k}: {m}")


CUBE_CHUNKS = [hf.FAMILIES[i::2] for i in range(2)]


@pytest.mark.parametrize("chunk", range(len(CUBE_CHUNKS)))
def test_every_family_at_2x2x2_trains_like_one_process(world, chunk):
    """data 2 x pipe 2 x tensor 2: ZeRO-3 where the family's embeddings are untied, ZeRO-1 where they are tied
    across the pipe's first and last stage (ZeRO-3 refuses those)."""
    families = list(CUBE_CHUNKS[chunk])
    _train_and_check(world, families, {"data": 2, "pipe": 2, "tensor": 2},
                     {f: 1 if f in hf.TIED else 3 for f in families})


LORA = ["qwen3", "gptj", "gpt2", "opt"]


def test_lora_at_tensor_2_trains_like_one_process(world):
    _train_and_check(world, LORA, {"data": 1, "tensor": 2}, 0, lora=True)


# ---- configurations with per-head q/k norms -----------------------------------------------------------

VARIANTS = {"stablelm": ("qk_layernorm", True), "cohere": ("use_qk_norm", True), "phi": ("qk_layernorm", True)}


def _variant(family: str):
    from transformers import AutoModelForCausalLM
    cfg = hf.config(family)
    setattr(cfg, *VARIANTS[family])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def _variant_runs(families: list[str]) -> dict:
    out = {}
    for f in families:
        model = _variant(f)
        plan = sl.plan(model, get_mesh({"data": 1, "tensor": 2}), rules=RULES, batch=_batches(f)[0])
        engine = sl.parallelize(model, plan, optimizer=functools.partial(hf.adamw, lr=LR), loss_fn=_loss)
        losses = [engine.step(b) for b in _batches(f)]
        out[f] = {"losses": losses, "state": engine.full_state_dict(), "replicas": replica_mismatches(engine),
                  "attention": any("attn" in x.module for x in plan.tensor.sites),
                  "partial": plan.tensor.partial_modules}
    return out


def test_per_head_qk_norm_variants_at_tensor_2_train_like_one_process(world):
    """StableLM's per-head q/k LayerNorm list and Cohere's (heads, head_dim) q/k norms keep their attention
    replicated (exact, not silently wrong: a rank would take the first heads' norms); Phi's shared q/k
    LayerNorms inside split attention get their partial gradients summed."""
    families = list(VARIANTS)
    per_rank = world(2, _variant_runs, families)
    for f in families:
        model = _variant(f)
        want = hf.train_alone(model, _batches(f), lr=LR)
        for r in range(2):
            res = per_rank[r][f]
            assert max(abs(a - b) / abs(b) for a, b in zip(res["losses"], want)) <= 1e-5, (f, res["losses"], want)
            assert res["replicas"] == [], (f, res["replicas"])
            for k, v in model.state_dict().items():
                torch.testing.assert_close(res["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{f}, {k}: {m}")
        assert per_rank[0][f]["attention"] == (f == "phi"), f
        if f == "phi":
            assert any(m.endswith(("q_layernorm", "k_layernorm")) for m in per_rank[0][f]["partial"])


# ---- the drift the replica check exists for ------------------------------------------------------

def _drifting(shape: dict) -> dict:
    """Qwen3 at tensor 2 with the partial-gradient derivation switched off: what every version before it did."""
    import shardlib.planner.varying as varying
    saved = varying.partial_modules
    varying.partial_modules = lambda *a: ()
    try:
        res = _run("qwen3", shape, 0)
        model = hf.build("qwen3")
        plan = sl.plan(model, get_mesh(shape), rules=RULES, batch=_batches("qwen3")[0])
    finally:
        varying.partial_modules = saved
    engine = sl.parallelize(model, plan, optimizer=functools.partial(hf.adamw, lr=LR), loss_fn=_loss,
                            check_replicas=True)
    try:
        engine.step(_batches("qwen3")[0])
        raised = None
    except sl.ShardingError as e:
        raised = str(e)
    return {**res, "raised": raised}


def test_replica_check_names_the_drifting_norm(world):
    per_rank = world(2, _drifting, {"data": 1, "tensor": 2})
    want_losses, _ = _reference("qwen3")
    for res in per_rank:
        # the losses agree closely while the norms' copies drift: only the parameters show it
        assert max(abs(a - b) / abs(b) for a, b in zip(res["losses"], want_losses)) < 1e-3
        assert res["replicas"] and res["replicas"][0].startswith("model.layers.0.self_attn.q_norm.weight"), res
        assert "('tensor',)" in res["replicas"][0]
        assert res["raised"] is not None and "q_norm.weight" in res["raised"], res["raised"]


# ---- plan-time refusals (no processes) -----------------------------------------------------------

def test_moe_experts_are_named_from_the_models_plan_and_split_over_tensor_or_refused_where_mislaid():
    """MoE experts' fused 3-D weights get the logical dims ``experts`` and ``expert_mlp`` from the model's plan;
    ``expert_mlp`` over tensor splits each expert's width (an ``experts`` site); a table splitting the experts
    against that (down's out-features) is refused by name."""
    model = hf.build("qwen3_moe", meta=True)
    dims = sl.hf_dims(model)
    assert dims["model.layers.*.mlp.experts.gate_up_proj"] == ("experts", sl.Fused(2, "expert_mlp"), "embed")
    assert dims["model.layers.*.mlp.experts.down_proj"] == ("experts", "embed", "expert_mlp")
    plan = sl.plan(model, sl.AbstractMesh({"tensor": 2}), rules=RULES)
    assert plan.tensor.site("model.layers.0.mlp.experts").kind == "experts"
    assert plan.param("model.layers.0.mlp.experts.gate_up_proj").spec == sl.P(None, sl.Fused(2, "tensor"), None)
    mislaid = sl.shard({"*.experts.gate_up_proj": sl.P(None, sl.Fused(2, "tensor"), None),
                        "*.experts.down_proj": sl.P(None, "tensor", None)})(hf.build("qwen3_moe", meta=True))
    with pytest.raises(sl.ShardingError, match="experts.down_proj") as e:
        sl.plan(mislaid, sl.AbstractMesh({"tensor": 2}), rules=RULES)
    assert "only as columns" in str(e.value) and "a row (down's in-features)" in str(e.value)


_P, _F = sl.P, sl.Fused
# a user's table splitting a packed projection against the layout its forward reads, or an attention holding
# per-head parameters: refused at plan time, naming the module, the layout and the spec it needs
_MISLAID = {
    "gpt2": ({"*.attn.c_attn.weight": _P(None, "tensor"), "*.attn.c_attn.bias": _P("tensor"),
              "*.attn.c_proj.weight": _P("tensor", None)}, "expected P(None, Fused(3, 'tensor'))"),
    "bloom": ({"*.query_key_value.weight": _P(_F(3, "tensor"), None), "*.query_key_value.bias": _P(_F(3, "tensor")),
               "*.self_attention.dense.weight": _P(None, "tensor")}, "interleaved per head"),
    "codegen": ({"*.attn.qkv_proj.weight": _P("tensor", None), "*.attn.out_proj.weight": _P(None, "tensor")},
                "expected P(Fused(12, 'tensor'), None)"),
    "phi3": ({"*.self_attn.qkv_proj.weight": _P("tensor", None), "*.self_attn.o_proj.weight": _P(None, "tensor")},
             "4 query and 2 KV heads: its blocks differ in width"),
    "stablelm": ({"*.self_attn.q_proj.weight": _P("tensor", None), "*.self_attn.k_proj.weight": _P("tensor", None),
                  "*.self_attn.v_proj.weight": _P("tensor", None), "*.self_attn.o_proj.weight": _P(None, "tensor")},
                 "'model.layers.0.self_attn.q_layernorm' holds 4 modules, one per head"),
    "cohere": ({"*.self_attn.q_proj.weight": _P("tensor", None), "*.self_attn.k_proj.weight": _P("tensor", None),
                "*.self_attn.v_proj.weight": _P("tensor", None), "*.self_attn.o_proj.weight": _P(None, "tensor")},
               "'model.layers.0.self_attn.q_norm' holds weight (4, 8), a row per head"),
}


@pytest.mark.parametrize("family", list(_MISLAID))
def test_a_table_against_the_forwards_layout_is_refused(family):
    table, why = _MISLAID[family]
    model = _variant(family) if family in ("stablelm", "cohere") else hf.build(family)
    sl.shard(table)(model)
    with pytest.raises(sl.ShardingError) as e:
        sl.plan(model, sl.AbstractMesh({"tensor": 2}), batch=_batches(family)[0])
    assert why in str(e.value), str(e.value)
    # the model's own dims (no table) plan: the packed blocks declared, per-head norms' attention replicated
    plain = _variant(family) if family in ("stablelm", "cohere") else hf.build(family)
    sl.plan(plain, sl.AbstractMesh({"tensor": 2}), rules=RULES, batch=_batches(family)[0])


def test_codegen_heads_per_chunk_must_split_whole():
    """CodeGen's 4 fixed chunks hold 2 heads each here: tensor 4 would cut a head."""
    with pytest.raises(sl.ShardingError, match="8 heads in 4 blocks") as e:
        sl.plan(hf.build("codegen", meta=True), sl.AbstractMesh({"tensor": 4}), rules=RULES)
    assert "divisible by 16" in str(e.value)


def test_a_plan_kind_shardlib_does_not_lower_is_refused_by_entry():
    model = hf.build("llama", meta=True)
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan,
                                       "layers.*.input_layernorm": "sequence_parallel"}
    assert unsupported(model) and "sequence_parallel" in unsupported(model)[0]
    with pytest.raises(sl.ShardingError, match="'sequence_parallel'") as e:
        sl.plan(model, sl.AbstractMesh({"tensor": 2}), rules=RULES)
    assert "model.layers.*.input_layernorm" in str(e.value) and "sl.shard" in str(e.value)
    sl.plan(model, sl.AbstractMesh({"data": 2}))      # no tensor axis: nothing to lower


def test_tied_weights_across_stages_refused_under_zero3():
    gpt2 = hf.build("gpt2", meta=True)
    batch = _batches("gpt2")[0]
    with pytest.raises(sl.ShardingError, match="under ZeRO-3"):
        sl.plan(gpt2, sl.AbstractMesh({"data": 2, "pipe": 2}), rules={"layers": "pipe"}, zero=3, batch=batch)
    plan = sl.plan(gpt2, sl.AbstractMesh({"data": 2, "pipe": 2}), rules={"layers": "pipe"}, zero=2, batch=batch)
    assert plan.pipeline.tied == ("transformer.wte.weight",)
    tied = [e for e in plan.comm_per_step(0) if e.what == "tied-grads"]
    assert len(tied) == 1 and tied[0].axes == ("pipe",), tied


def test_an_axis_that_splits_nothing_is_an_error():
    mesh = sl.AbstractMesh({"data": 2, "tensor": 2})
    with pytest.raises(sl.ShardingError, match="splits nothing") as e:
        sl.plan(hf.build("llama", meta=True), mesh)          # no rules: the model's dims map to nothing
    assert "'heads': 'tensor'" in str(e.value)
    with pytest.raises(sl.ShardingError, match="'tensor' has size 2 but the plan splits nothing"):
        sl.plan(nn.Sequential(nn.Linear(4, 4)), mesh)
    sl.plan(hf.build("llama", meta=True), sl.AbstractMesh({"data": 2, "tensor": 1}))    # size 1: fine


class _SharedKey(nn.Module):
    """An attention-like module whose shared value (a replicated projection's output, as DeepSeek-V3's rope
    key) meets the column-split per-head values without passing a column layer; with ``two``, the sum of two
    projections' outputs (no single module output to put the f on)."""

    def __init__(self, two: bool = False):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.q = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 1)
        self.other = nn.Linear(8, 1) if two else None
        self.o = nn.Linear(8, 8)

    def forward(self, x):
        h = self.pre(x)
        shared = self.shared(h) if self.other is None else self.shared(h) + self.other(h)
        return self.o(self.q(h) * shared)


_SHARED_TABLE = {"q.weight": sl.P("tensor", None), "q.bias": sl.P("tensor"), "o.weight": sl.P(None, "tensor")}


def test_a_shared_value_gets_its_f_derived_or_is_refused():
    """One module's output meeting split values gets f on that output (DeepSeek-V3 MLA's rope key, trained
    exactly in test_deepseek_mla_under_a_hand_table_derives_f_and_trains_exactly); a value with no single
    such output is refused by name."""
    model = sl.shard(_SHARED_TABLE)(_SharedKey())
    plan = sl.plan(model, sl.AbstractMesh({"tensor": 2}), batch=torch.zeros(2, 3, 8))
    assert plan.tensor.output_f == ("shared",)
    assert [e.what for e in plan.activation_entries(0) if e.phase == "backward"].count("activations") >= 2
    two = sl.shard(_SHARED_TABLE)(_SharedKey(two=True))
    with pytest.raises(sl.ShardingError, match="without having passed a column layer") as e:
        sl.plan(two, sl.AbstractMesh({"tensor": 2}), batch=torch.zeros(2, 3, 8))
    assert "<root> (mul)" in str(e.value)


_MLA = {"*.self_attn.q_b_proj.weight": sl.P("tensor", None), "*.self_attn.kv_b_proj.weight": sl.P("tensor", None),
        "*.self_attn.o_proj.weight": sl.P(None, "tensor")}


def _mla_run(shape: dict) -> dict:
    model = sl.shard(_MLA)(hf.build("deepseek_v3"))
    plan = sl.plan(model, get_mesh(shape), batch=_batches("deepseek_v3")[0])
    engine = sl.parallelize(model, plan, optimizer=functools.partial(hf.adamw, lr=LR), loss_fn=_loss)
    losses, counts = train_counting(engine, plan, _batches("deepseek_v3"))
    tp = plan.tensor
    return {"losses": losses, "state": engine.full_state_dict(), "replicas": replica_mismatches(engine),
            "sites": len(tp.sites), "derived": (tp.output_f, tp.no_f, tp.partial_modules), **counts}


def test_deepseek_mla_under_a_hand_table_derives_f_and_trains_exactly(world):
    """MLA split by hand (q_b_proj, kv_b_proj columns, o_proj row): the rope key shared by every head reaches the
    split attention from kv_a_proj_with_mqa's output, which gets the derived f; kv_b_proj then reads an already
    varying value (no f of its own) and kv_a_layernorm's gradient is partial (summed). Exact, replicas equal."""
    per_rank = world(2, _mla_run, {"data": 1, "tensor": 2})
    _check("deepseek_v3", per_rank, "MLA by hand, tensor 2")
    out_f, no_f, partial = per_rank[0]["derived"]
    assert out_f == ("model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.1.self_attn.kv_a_proj_with_mqa")
    assert no_f == ("model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj")
    assert partial == ("model.layers.0.self_attn.kv_a_layernorm", "model.layers.1.self_attn.kv_a_layernorm")


# ---- the table itself ------------------------------------------------------------------------------

def test_hf_dims_reads_the_models_own_plans():
    llama = hf.build("llama", meta=True)
    dims = sl.hf_dims(llama)
    assert dims["model.layers.*.self_attn.q_proj.weight"] == ("heads", "embed")
    assert dims["model.layers.*.self_attn.o_proj.weight"] == ("embed", "heads")
    assert dims["model.layers.*.mlp.down_proj.weight"] == ("embed", "mlp")
    assert dims["model.embed_tokens.weight"] == dims["lm_head.weight"] == ("vocab", "embed")
    assert dims["model.layers"] == ("layers",)
    src = sl.hf_dims(llama, sources=True)
    assert src["model.layers.*.self_attn.q_proj.weight"][1] == "config.base_model_tp_plan"
    assert src["model.layers"][1] == "config.base_model_pp_plan"
    # GPT-2 has no config plan: the project's table, its fused q|k|v declared as blocks
    gpt2 = sl.hf_dims(hf.build("gpt2", meta=True), sources=True)
    assert gpt2["transformer.h.*.attn.c_attn.weight"] == (("embed", sl.Fused(3, "heads")),
                                                          "the project's table (hf_dims.BUILTIN)")
    assert "transformer.wte.weight" not in gpt2          # tied: stays replicated
    # Qwen3's per-head norms are not split: their gradients are derived partial, not declared
    assert not any("norm" in k for k in sl.hf_dims(hf.build("qwen3", meta=True)))


def test_a_user_table_wins_over_the_models_plans():
    model = hf.build("llama", meta=True)
    sl.shard({"*.mlp.up_proj.weight": sl.P("tensor", None), "*.mlp.gate_proj.weight": sl.P("tensor", None),
              "*.mlp.down_proj.weight": sl.P(None, "tensor")})(model)
    plan = sl.plan(model, sl.AbstractMesh({"tensor": 2}), rules=RULES)
    split = {p.name for p in plan.params if p.spec != sl.P()}
    assert split and all(".mlp." in n for n in split), split


def test_alibi_and_whole_width_norms_are_planned_per_head():
    """BLOOM's and MPT's ALiBi biases are sliced to each rank's heads; OLMo-2's q/k norms over the whole q/k
    width are split with them, their statistics summed over tensor (forward and backward)."""
    for f, arg in (("bloom", "alibi"), ("mpt", "position_bias")):
        plan = sl.plan(hf.build(f), sl.AbstractMesh({"tensor": 2}), rules=RULES, batch=_batches(f)[0])
        assert {h.arg for h in plan.tensor.head_args} == {arg}, f
        assert len(plan.tensor.head_args) == 2, f            # one per block's attention
    plan = sl.plan(hf.build("olmo2"), sl.AbstractMesh({"tensor": 2}), rules=RULES, batch=_batches("olmo2")[0])
    norms = [x for x in plan.tensor.sites if x.kind == "norm"]
    assert sorted(x.module.rpartition(".")[2] for x in norms) == ["k_norm", "k_norm", "q_norm", "q_norm"]
    per_block = [e for e in plan.activation_entries(0) if e.where == "model.layers.0"]
    stats = [e for e in per_block if e.bytes == 2 * 4 * 16 * 4 // 2]     # (4 rows x 16 tokens) fp32 sums, ring 2
    assert len(stats) == 4, per_block          # q and k: forward all-reduce and backward all-reduce each
    assert "dims from the model's own plans" in plan.explain()


def test_explain_names_the_partial_gradients():
    model = hf.build("qwen3")
    plan = sl.plan(model, sl.AbstractMesh({"tensor": 2}), rules=RULES, batch=_batches("qwen3")[0])
    text = plan.explain()
    assert "partial gradients" in text and "q_norm" in text
    sp = sl.plan(hf.build("qwen3"), sl.AbstractMesh({"tensor": 2}), rules=RULES, sequence_parallel=True,
                 batch=_batches("qwen3")[0])
    assert sp.tensor.partial_modules == ()      # under SP every unit's norms already enter through f


# ---- a tied table on the pipe is one tensor in what is written ---------------------------------------

def _save_tied(path: str) -> dict:
    model = hf.build("gpt2")
    plan = sl.plan(model, get_mesh({"data": 1, "pipe": 2}), rules={"layers": "pipe"}, microbatches=2,
                   batch=_batches("gpt2")[0])
    engine = sl.parallelize(model, plan, optimizer=functools.partial(hf.adamw, lr=LR))
    for b in _batches("gpt2")[:2]:
        engine.step(b)
    engine.save_pretrained(path)
    return engine.full_state_dict()


def test_tied_table_on_the_pipe_saves_as_one_tensor(world, tmp_path):
    from transformers import AutoModelForCausalLM
    full = world(2, _save_tied, str(tmp_path))[0]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
