"""``sl.quantize`` (issue 42, deliverable 1): the format of a model's frozen weights, on a real model (in
place: torchao's ``Int8Tensor`` and ``NF4Tensor``, the project's ``Int4Tensor``) or on the meta device (a
mark the planner counts in packed bytes, the same as the real weights'); bad input named before anything
changes."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import qlora_models as qm
import shardlib as sl
from shardlib.quant import formats
from shardlib.quant.api import PendingWeight, pending_weights

logging.getLogger("torchao").setLevel(logging.ERROR)
PROJ = "model.layers.0.self_attn.q_proj"


def _llama(meta: bool = False, **over):
    from transformers import LlamaForCausalLM
    cfg = qm.config(**over)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
def test_a_real_model_is_quantized_in_place_as_the_library_quantizes(fmt):
    model = _llama()
    w = model.get_submodule(PROJ).weight.detach().clone()
    sl.quantize(model, fmt, **qm.OPTIONS[fmt])
    q = model.get_submodule(PROJ).weight
    assert formats.is_quantized(q) and not q.requires_grad
    if fmt == "nf4":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        want = to_nf4(w, 64, 64).get_original_weight()
    elif fmt == "int4":
        from shardlib.quant import Int4Tensor
        want = Int4Tensor.from_float(w, 16).dequantize()
    else:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        quantize_(lin, Int8WeightOnlyConfig())
        want = lin.weight.dequantize()
    assert torch.equal(formats.dequantize(q), want)
    # QLoRA's targets: the blocks' linear layers, not the embeddings or the head
    assert not formats.is_quantized(model.lm_head.weight) and not formats.is_quantized(model.model.embed_tokens.weight)
    assert sum(formats.is_quantized(p) for p in model.parameters()) == 2 * 7


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
def test_a_meta_model_is_marked_and_planned_as_the_real_one(fmt):
    meta, real = _llama(meta=True), _llama()
    sl.quantize(meta, fmt, **qm.OPTIONS[fmt])
    sl.quantize(real, fmt, **qm.OPTIONS[fmt])
    marked = pending_weights(meta)
    assert len(marked) == 14 and all(not p.requires_grad for p in marked.values())
    # no memory: a wrapper with no storage of its own, holding only the meta layout of its codes
    assert all(all(t.is_meta for t in formats.components(p.quantized_layout).values()) for p in marked.values())
    mesh = sl.AbstractMesh({"data": 2, "tensor": 2})
    for model in (meta, real):
        sl.shard(sl.tp_table(model))(model)
    plans = [sl.plan(m, mesh, zero=3) for m in (meta, real)]
    q = [{p.name: p.quant for p in plan.params if p.quant is not None} for plan in plans]
    assert q[0] == q[1] and len(q[0]) == 14
    assert plans[0].memory_per_rank(0) == plans[1].memory_per_rank(0)
    held = plans[0].memory_per_rank(0)["params"]
    plain = _llama(meta=True)
    sl.shard(sl.tp_table(plain))(plain)
    floats = sl.plan(plain, mesh, zero=3).memory_per_rank(0)["params"]
    assert held < floats / 2, (held, floats)            # packed bytes, not fp32


def test_a_marked_weight_has_no_values_to_compute_with():
    model = _llama(meta=True)
    sl.quantize(model, "nf4", **qm.OPTIONS["nf4"])
    w = model.get_submodule(PROJ).weight
    assert isinstance(w, PendingWeight) and w.device.type == "cpu"
    with pytest.raises(sl.ShardingError, match=r"no values yet.*load_pretrained"):
        F.linear(torch.randn(2, 128), w)


def test_peft_draws_the_adapters_of_a_marked_meta_model_as_one_process():
    meta = qm.wrap(_llama(meta=True), "nf4")
    real = qm.wrap(_llama(), "nf4")
    a, b = dict(meta.named_parameters()), dict(real.named_parameters())
    lora = [k for k in a if "lora_" in k]
    assert len(lora) == 28 and all(a[k].device.type == "cpu" and torch.equal(a[k], b[k]) for k in lora)


def test_bad_input_is_named_and_changes_nothing():
    model = _llama()
    before = {k: type(v) for k, v in model.named_parameters()}
    with pytest.raises(sl.ShardingError, match=r"unknown format 'fp4'.*\['int8', 'int4', 'nf4'\]"):
        sl.quantize(model, "fp4")
    with pytest.raises(sl.ShardingTypeError, match="group_size must be an even positive int"):
        sl.quantize(model, "int4", group_size=3)
    # one entry matches nothing, another cannot take NF4's blocks of 64: both named at once
    with pytest.raises(sl.ShardingError) as e:
        sl.quantize(model, "nf4", modules=["q_proj", "no_such_proj"], block_size=256)
    msg = str(e.value)
    assert "'no_such_proj' matches no nn.Linear" in msg and "in-features 128 (expected a multiple of block_size 256)" \
        in msg, msg
    assert {k: type(v) for k, v in model.named_parameters()} == before
    # a trainable weight of a PEFT model: an adapter
    peft_model = qm.wrap(_llama(), None)
    with pytest.raises(sl.ShardingError, match=r"lora_A.*trainable.*before peft.get_peft_model"):
        sl.quantize(peft_model, "int8", modules=["*.q_proj.lora_A.default"])


def test_an_nf4_split_that_would_cut_a_block_is_refused_with_the_degrees_that_work():
    model = _llama(meta=True, hidden_size=64, intermediate_size=128)     # o_proj: 64 in-features, one block
    sl.quantize(model, "nf4", scaler_block_size=16)
    sl.shard(sl.tp_table(model))(model)
    with pytest.raises(sl.ShardingError, match=r"o_proj.weight \(64, 64\) is a NF4Tensor.*tensor=2 shards of 32 "
                                               r"would cut a group.*among \[1\]"):
        sl.plan(model, sl.AbstractMesh({"data": 1, "tensor": 2}))


def _bnb(path, **quant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    return AutoModelForCausalLM.from_pretrained(
        path, device_map="cpu", dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(**{"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                                  "bnb_4bit_use_double_quant": True,
                                                  "bnb_4bit_compute_dtype": torch.float32, **quant})).train()


def test_a_bitsandbytes_4bit_model_plans_as_its_packed_codes_with_bitsandbytes_own_product(tmp_path):
    """A model loaded with bitsandbytes 4-bit (``BitsAndBytesConfig``, NF4 double-quantized, on the CPU) is laid
    out by ``sl.plan``: each ``Params4bit`` becomes a ``Bnb4Tensor`` of the weight's shape (bitsandbytes' codes,
    its block scales as its product computes them), whose float weight, slices and product are bitsandbytes'
    bit for bit; the plan counts its packed bytes; a tensor split that would cut a block of 64 is refused with
    the degrees that keep blocks whole."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from peft import LoraConfig, get_peft_model

    from shardlib.planner.hf_tp import tp_table
    from shardlib.quant.bnb4 import Bnb4Tensor

    qm.write_folder(tmp_path)
    ref = _bnb(tmp_path)
    model = get_peft_model(_bnb(tmp_path), LoraConfig(r=4, target_modules="all-linear"))
    sl.shard(tp_table(model))(model)
    plan = sl.plan(model, sl.AbstractMesh({"data": 2, "tensor": 2}), zero=3)
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        mine = model.base_model.model.model.layers[1].get_submodule(name).base_layer
        theirs = ref.model.layers[1].get_submodule(name)
        w, pw = mine.weight, theirs.weight
        assert isinstance(w, Bnb4Tensor) and tuple(w.shape) == (theirs.out_features, theirs.in_features)
        full = bnbf.dequantize_4bit(pw.data, pw.quant_state)
        assert torch.equal(w.dequantize(), full), name
        assert torch.equal(w[:, 64:].dequantize(), full[:, 64:]) and torch.equal(w[8:40].dequantize(), full[8:40])
        xi = torch.randn(3, theirs.in_features)
        assert torch.equal(mine(xi), theirs(xi)), name          # Linear4bit's own forward: gemm_4bit
        assert torch.equal(mine(xi), bnb.matmul_4bit(xi, pw, quant_state=pw.quant_state)), name
        spec = plan.param(f"base_model.model.model.layers.1.{name}.base_layer.weight").quant
        assert spec.kind == "Bnb4Tensor" and spec.held_bytes() == \
            w.qdata.nbytes + w.absmax.nbytes == theirs.out_features * theirs.in_features * (1 / 2 + 4 / 64), name
    text = plan.explain()
    assert "14 quantized (bnb4)" in text, text
    with pytest.raises(sl.ShardingError, match=r"o_proj.base_layer.weight \(128, 128\) is a Bnb4Tensor .* tensor=4 "
                                               r"shards of 32 would cut a group.*among \[1, 2\]"):
        sl.plan(model, sl.AbstractMesh({"data": 1, "tensor": 4}))


def test_a_bitsandbytes_model_that_cannot_be_laid_out_is_named_and_left_as_it_was(tmp_path):
    """bitsandbytes' 8-bit ``Int8Params``, and 4-bit codes over rows that do not hold whole blocks of 64
    (hidden 96): one problem per reason, naming the weights and the fix; the model keeps its weights."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM

    path = tmp_path / "odd"
    torch.manual_seed(0)
    LlamaForCausalLM(qm.config(hidden_size=96, num_attention_heads=3, num_key_value_heads=1)).save_pretrained(path)
    model = _bnb(path)
    before = {n: type(p).__name__ for n, p in model.named_parameters()}
    with pytest.raises(sl.ShardingError, match=r"q_proj.weight, .* and \d+ more: bitsandbytes 4-bit weights whose "
                                               r"quant storage cannot be sharded: in-features 96 that do not hold "
                                               r"whole blocks of 64"):
        sl.plan(model, sl.AbstractMesh({"data": 2}))
    assert {n: type(p).__name__ for n, p in model.named_parameters()} == before and "Params4bit" in before.values()
    eight = AutoModelForCausalLM.from_pretrained(qm.write_folder(tmp_path / "llama"), device_map="cpu",
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(sl.ShardingError, match=r"and 12 more: bitsandbytes Int8Params .*sl.quantize\(model, 'int8'\)"):
        sl.plan(eight, sl.AbstractMesh({"data": 2}))


