"""Planning PEFT models (issue 19, deliverable 1 and bad input), one process, no collectives: specs set on
the base model before PEFT wraps it carry over, table patterns written against the base model's names
keep matching (``base_model.model.`` and ``.base_layer.`` are transparent), adapters follow their base,
and what cannot be laid out is refused by name before any process starts."""

from __future__ import annotations

import pytest
import torch

import hf_models
import peft_models as pm
import shardlib as sl
from shardlib import P
from shardlib.planner.hf_tp import tp_table

MESH = sl.AbstractMesh({"data": 2, "tensor": 2})


def _specs(plan) -> dict:
    return {p.name: p.spec for p in plan.params}


def _wrap(model, **kw):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                            **{"target_modules": pm.TARGETS["llama"], **kw}))


@pytest.mark.parametrize("where", ["base before wrapping", "peft model after wrapping"])
def test_base_specs_carry_over_and_adapters_follow(where):
    base = hf_models.build("llama", layers=2)
    if where == "base before wrapping":
        sl.shard(tp_table(base, vocab=True))(base)
        model = _wrap(base)
    else:
        model = _wrap(base)
        sl.shard(tp_table(model, vocab=True))(model)
    s = _specs(sl.plan(model, MESH, zero=3))
    layer = "base_model.model.model.layers.1"
    assert s[f"{layer}.self_attn.q_proj.base_layer.weight"] == P("tensor", None)
    assert s[f"{layer}.self_attn.q_proj.lora_A.default.weight"] == P()
    assert s[f"{layer}.self_attn.q_proj.lora_B.default.weight"] == P("tensor", None)
    assert s[f"{layer}.mlp.down_proj.base_layer.weight"] == P(None, "tensor")
    assert s[f"{layer}.mlp.down_proj.lora_A.default.weight"] == P(None, "tensor")
    assert s[f"{layer}.mlp.down_proj.lora_B.default.weight"] == P()
    assert s["base_model.model.model.embed_tokens.weight"] == P("tensor", None)
    assert s["base_model.model.model.norm.weight"] == P()


def test_peft_names_of_a_table_match_too():
    """A pattern written against the wrapped names (``.base_layer.``) matches as well."""
    model = _wrap(hf_models.build("llama", layers=2))
    sl.shard({"*.q_proj.base_layer.weight": P("tensor", None), "*.o_proj.weight": P(None, "tensor")})(model)
    s = _specs(sl.plan(model, MESH))
    assert s["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == P("tensor", None)
    assert s["base_model.model.model.layers.0.self_attn.o_proj.base_layer.weight"] == P(None, "tensor")
    assert s["base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight"] == P(None, "tensor")


def test_frozen_parameters_hold_no_training_state():
    model = _wrap(hf_models.build("llama", layers=2))
    plan = sl.plan(model, sl.AbstractMesh({"data": 2}), zero=1)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.num_trainable == trainable < plan.num_params
    mem = plan.memory_per_rank(0)
    assert mem["grads"] == trainable * 4                      # ZeRO-1: full local gradients of the adapters only
    assert mem["optimizer"] == (trainable // 2) * 8            # Adam's 2 states of this rank's half, no master (fp32)
    assert "frozen" in plan.explain() and "lora_B" in plan.explain()


def test_lora_on_a_module_the_tensor_axis_cannot_follow_is_refused():
    """LoRA on the vocab-split embedding: PEFT's embedding adapter cannot follow a vocab split."""
    base = hf_models.build("llama", layers=2)
    sl.shard(tp_table(base, vocab=True))(base)
    model = _wrap(base, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(sl.ShardingError, match=r"adapter .*embed_tokens.*Embedding.*cannot follow that split"):
        sl.plan(model, MESH)


def test_dora_on_a_split_base_is_refused():
    base = hf_models.build("llama", layers=2)
    sl.shard(tp_table(base))(base)
    model = _wrap(base, use_dora=True)
    with pytest.raises(sl.ShardingError, match=r"DoRA \(use_dora=True\) on a base split"):
        sl.plan(model, MESH)
    sl.plan(model, sl.AbstractMesh({"data": 2, "tensor": 1}))      # nothing split: DoRA plans


def test_a_peft_method_other_than_lora_is_refused_by_name():
    from peft import IA3Config, get_peft_model
    model = get_peft_model(hf_models.build("llama", layers=2),
                           IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(sl.ShardingError, match=r"is IA3 \(IA3Config\) — expected LoRA"):
        sl.plan(model, sl.AbstractMesh({"data": 2}))


@pytest.mark.parametrize("quant", [None, "int8"])
def test_load_pretrained_into_a_built_peft_or_quantized_engine_loads_the_base(tmp_path, quant):
    """A transformers folder holds the base model's names and floats: loaded into a PEFT model's engine
    (its base quantized in place or not), the base becomes the folder's, quantized in the base's own
    format, and the adapters stay as drawn."""
    hf_models.build("llama", seed=7, layers=2).save_pretrained(tmp_path)
    model = pm.lora("llama", quant)
    drawn = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": 1})), optimizer=pm.adamw)
    engine.load_pretrained(tmp_path)
    got = engine.full_state_dict()
    ref = hf_models.build("llama", seed=7, layers=2)
    if quant == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        quantize_(ref, Int8WeightOnlyConfig(), filter_fn=pm._adapted("llama"))
    for name, value in ref.state_dict().items():
        adapted = name.rpartition(".")[0].rpartition(".")[2] in pm.TARGETS["llama"]
        mine = got["base_model.model." + (name.replace(".weight", ".base_layer.weight") if adapted else name)]
        if hasattr(value, "dequantize"):
            value, mine = value.dequantize(), mine.dequantize()
        torch.testing.assert_close(mine, value, rtol=0, atol=0, msg=name)
    for name, value in drawn.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("zero", [0, 3])
def test_init_false_keeps_quantized_codes(zero):
    """``init=False`` lays a quantized weight out from its own codes (a load overwrites them), never as
    float zeros."""
    model = pm.lora("llama", "int4")
    want = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.dequantize().clone()
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": 1}), zero=zero), optimizer=pm.adamw, init=False)
    state = engine.full_state_dict()
    got = state["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert torch.equal(got, want)
