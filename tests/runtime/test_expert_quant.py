"""Frozen quantized experts on the expert axis (issue 40, fine-tuning): QLoRA of a mixture of experts.

The routed experts' 3-D stacks ``[E, out, in]`` are quantized — int8 through torchao (``FqnToConfig`` on the
parameters' names: per-row scales) or the project's packed int4 (``quantize_int4_(parameters=...)``: groups
of 16 along in-features) — and frozen; PEFT LoRA adapts attention. Split over ``expert``, each rank holds
only its experts' packed bytes (1/ep of the stack's, planned = held), ZeRO-3 gathers move packed bytes
(counted = planned), and the losses and every parameter equal the same quantized PEFT model trained in one
process. Both the reference GPT (one ``F.linear`` per expert) and transformers' Mixtral (``grouped_mm``, its
default, and eager) run; what cannot run is refused at plan time by name.
"""

from __future__ import annotations

import math

import pytest
import torch

import shardlib as sl
from shardlib.models.gpt import GPT, token_batch
from shardlib.quant.layout import QuantSpec, is_quantized
from test_expert_parallel import (BATCH, CFG, STEPS, TENSOR, _hf_batch, _mixtral, _one_process, _opt, _planned,
                                  _stepped)

GROUP = 16
NF4_BLOCK, NF4_SCALERS = 16, 32
NF4_TABLE = 16 * 4          # torchao's 16-entry fp32 table, kept whole on every rank


def _base(kind: str, impl: str | None):
    if kind == "gpt":
        return GPT(CFG, seed=0)
    model = _mixtral()
    if impl is not None:
        model.set_experts_implementation(impl)
    return model


def _quantized(kind: str, quant: str, impl: str | None = None):
    """The base with its routed experts' stacks quantized and frozen, LoRA on attention (PEFT, seed 1)."""
    from peft import LoraConfig, get_peft_model
    model = _base(kind, impl)
    stacks = [n for n, p in model.named_parameters() if p.dim() == 3]
    if quant == "int8":
        from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig, quantize_
        quantize_(model, FqnToConfig({n: Int8WeightOnlyConfig() for n in stacks}), filter_fn=None)
    elif quant == "nf4":        # tiny experts: blocks of 16 (in-features 32 and 48), 32 scalers per factor
        sl.quantize(model, "nf4", parameters=stacks, block_size=NF4_BLOCK, scaler_block_size=NF4_SCALERS)
    else:
        from shardlib.quant import quantize_int4_
        quantize_int4_(model, group_size=GROUP, filter_fn=lambda m, n: False, parameters=stacks)
    for n in stacks:
        model.get_parameter(n).requires_grad_(False)
    torch.manual_seed(1)
    targets = ["qkv", "proj"] if kind == "gpt" else ["q_proj", "v_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False))


def _plain(t: torch.Tensor) -> torch.Tensor:
    from shardlib.quant import formats
    return formats.dequantize(t) if is_quantized(t) else t


def _train(shape: dict, kind: str, quant: str, zero: int, impl: str | None = None):
    batches = [token_batch(CFG, BATCH, s) for s in range(STEPS)] if kind == "gpt" else \
        [_hf_batch(s) for s in range(STEPS)]
    loss = (lambda m, b: m(*b)) if kind == "gpt" else (lambda m, b: m(**b).loss)
    want_losses, want = _one_process(_quantized(kind, quant, impl), batches, loss=loss)
    model = _quantized(kind, quant, impl)
    whole = {n: QuantSpec.of(p).packed_bytes() for n, p in model.named_parameters() if is_quantized(p)}
    mesh = sl.Mesh(shape)
    rules = {"experts": "expert", **(TENSOR if "tensor" in shape else {})}   # tensor: each expert's width split too
    plan = sl.plan(model, mesh, rules=rules, zero=zero, batch=batches[0])   # batch: the routing's
    engine = sl.parallelize(model, plan, optimizer=_opt, loss_fn=loss)
    held = {n: (type(p).__name__, tuple(p.shape), QuantSpec.of(p).packed_bytes(tuple(p.shape)))
            for n, p in model.named_parameters() if n in whole and zero < 3}    # (ZeRO-3: flat shards, below)
    losses, second = _stepped(engine, batches)
    got = engine.full_state_dict()
    return {"losses": losses, "want_losses": want_losses, "whole": whole, "held": held,
            "params": {k: (_plain(got[k]), _plain(want[k])) for k in want},
            "counted": dict(second), "planned": dict(_planned(plan, mesh.rank)),
            "memory": (engine.memory_held("device")["params"], plan.memory_per_rank(mesh.rank)["params"])}


@pytest.mark.parametrize("kind, quant, shape, zero, impl", [
    ("gpt", "int8", {"expert": 2}, 0, None), ("gpt", "int4", {"expert": 2}, 0, None),
    ("gpt", "int8", {"data": 2, "expert": 2}, 3, None), ("gpt", "int4", {"data": 2, "expert": 2}, 3, None),
    ("mixtral", "int4", {"data": 2, "expert": 2}, 1, None), ("mixtral", "int8", {"expert": 4}, 3, "eager"),
    ("gpt", "nf4", {"expert": 2}, 0, None), ("gpt", "nf4", {"data": 2, "expert": 2}, 3, None),
    ("mixtral", "nf4", {"data": 2, "expert": 2}, 1, "eager"), ("mixtral", "nf4", {"expert": 2}, 3, None)],
    ids=["gpt_int8_expert2", "gpt_int4_expert2", "gpt_int8_data2_expert2_zero3", "gpt_int4_data2_expert2_zero3",
         "mixtral_int4_grouped_mm_data2_expert2_zero1", "mixtral_int8_eager_expert4_zero3",
         "gpt_nf4_expert2", "gpt_nf4_data2_expert2_zero3", "mixtral_nf4_eager_data2_expert2_zero1",
         "mixtral_nf4_grouped_mm_expert2_zero3"])
def test_quantized_frozen_experts_train_lora_like_one_process_holding_their_packed_bytes(world, kind, quant,
                                                                                           shape, zero, impl):
    ep = shape["expert"]
    for r in world(math.prod(shape.values()), _train, shape, kind, quant, zero, impl):
        assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
        for k, (got, want) in r["params"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=k)
        assert r["whole"] and set(r["held"]) == (set(r["whole"]) if zero < 3 else set())
        for n, (kind_, held_shape, held_bytes) in r["held"].items():
            # at rest a rank holds its experts' packed stack: 1/ep of the whole (both models have 4 experts)
            assert kind_ == {"int8": "Int8Tensor", "int4": "Int4Tensor", "nf4": "NF4Stack"}[quant], (n, kind_)
            assert held_shape[0] == 4 // ep, (n, held_shape)
            if quant == "nf4":      # every rank keeps the table; five components, each aligned to 8 bytes
                assert held_bytes == pytest.approx((r["whole"][n] - NF4_TABLE) / ep + NF4_TABLE, abs=40), \
                    (n, held_bytes, r["whole"][n])
            else:
                assert held_bytes == pytest.approx(r["whole"][n] / ep, abs=8), (n, held_bytes, r["whole"][n])
        assert r["counted"] == r["planned"]            # ZeRO-3's gathers: the packed bytes
        held, planned = r["memory"]
        assert held == planned, (held, planned)


def _refusal(model, shape: dict, rules: dict) -> str:
    with pytest.raises(sl.ShardingError) as e:
        sl.plan(model, sl.AbstractMesh(shape), rules=rules)
    return str(e.value)


def test_quantized_experts_the_model_cannot_multiply_or_a_split_that_cuts_them_are_refused_by_name():
    # torchao's Int8Tensor has no transpose, which transformers' grouped experts take (in one process too)
    said = _refusal(_quantized("mixtral", "int8"), {"expert": 2}, {"experts": "expert"})
    assert "multiplies with experts_implementation='grouped_mm', which transposes it" in said, said
    assert "model.set_experts_implementation('eager')" in said and said.count("experts.gate_up_proj") == 2, said
    sl.plan(_quantized("mixtral", "int8", "eager"), sl.AbstractMesh({"expert": 2}), rules={"experts": "expert"})
    # each expert's gate|up split over tensor (a fused split of the packed stack): each part's chunk must hold whole
    # blocks — NF4's factors span 16 rows of gate_up here, and tensor 4 would give each part's chunk 8
    said = _refusal(_quantized("gpt", "nf4"), {"expert": 2, "tensor": 4}, {"experts": "expert", **TENSOR})
    assert "experts.gate_up_proj (each of its 2 fused parts) (4, 32, 32) is a NF4Stack quantized in groups of 16 " \
           "along its dim 1, and tensor=4 shards of 8 would cut a group" in said, said
    # without expert_mlp the stacks stay whole on tensor and split on expert
    rules = {k: v for k, v in TENSOR.items() if k != "expert_mlp"}
    plan = sl.plan(_quantized("gpt", "int4"), sl.AbstractMesh({"expert": 2, "tensor": 2}),
                   rules={"experts": "expert", **rules})
    assert str(plan.param("base_model.model.blocks.0.mlp.experts.down_proj").spec) == "P('expert', None, None)"


@pytest.mark.parametrize("quant, zero", [("int4", 0), ("nf4", 3), ("int8", 1)])
def test_quantized_experts_split_over_tensor_too_train_like_one_process(world, quant, zero):
    """Each expert's width split over tensor as well (``expert_mlp``: gate|up a fused column, down a row) on frozen
    quantized stacks: each rank holds its experts' slice of each part, cut on block boundaries (NF4's R-row factor
    groups, int4's groups along in-features), and trains LoRA exactly as one process, every collective the plan's
    and the bytes held the plan's."""
    for r in world(4, _train, {"expert": 2, "tensor": 2}, "gpt", quant, zero):
        assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
        for k, (got, want) in r["params"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=k)
        assert r["counted"] == r["planned"]
        held, planned = r["memory"]
        assert held == planned, (held, planned)
        for n, (_, shape, _) in r["held"].items():       # 2 of 4 experts, half of each one's width
            i = CFG.expert_width // 2
            assert shape == ((2, 2 * i, CFG.d_model) if n.endswith("gate_up_proj") else (2, CFG.d_model, i)), (n, shape)


def test_quantized_experts_are_planned_as_their_packed_bytes_split_over_expert():
    """The plan's parameter bytes per rank differ between int8 and int4 by the stacks' packed bytes over ep:
    each rank holds its experts' packed bytes, int8 a quarter of fp32 plus a scale per row, int4 an eighth plus
    a scale and zero point per group."""
    mesh = sl.AbstractMesh({"expert": 2})
    held = {q: sl.plan(_quantized("gpt", q), mesh, rules={"experts": "expert"}).memory_per_rank(0)["params"]
            for q in ("int8", "int4")}
    model = _quantized("gpt", "int8")
    floats = sum(4 * math.prod(p.shape) for n, p in model.named_parameters() if is_quantized(p))
    packed = {q: sum(QuantSpec.of(p).packed_bytes() for p in _quantized("gpt", q).parameters() if is_quantized(p))
              for q in ("int8", "int4")}
    # (tiny rows: 32 in-features share an fp32 scale in int8; 16 share a scale and a zero point in int4)
    assert floats / 4 < packed["int8"] < floats / 3 and floats / 8 < packed["int4"] < floats / 4, packed
    assert held["int8"] - held["int4"] == pytest.approx((packed["int8"] - packed["int4"]) / 2, abs=64), (held, packed)


# -- quantized while loading: a MoE no rank holds in float --------------------------------------------------

def _qlora(model, quant: str):
    """QLoRA of the reference GPT: attention and the routed experts' stacks quantized (marked, on the meta device),
    everything else frozen float, LoRA on attention (PEFT, seed 1: drawn on the CPU beside a marked weight)."""
    from peft import LoraConfig, get_peft_model
    for p in model.parameters():
        p.requires_grad_(False)
    sl.quantize(model, quant, modules=["qkv", "proj"], parameters=["*.experts.gate_up_proj", "*.experts.down_proj"],
                group_size=GROUP, block_size=NF4_BLOCK, scaler_block_size=NF4_SCALERS)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj"], lora_dropout=0.0,
                                            init_lora_weights=False))


def _loaded(folder: str, shape: dict, quant: str, zero: int):
    from shardlib.quant.api import PendingWeight
    batches = [token_batch(CFG, BATCH, s) for s in range(STEPS)]
    ref = _qlora(GPT(CFG, seed=0), quant)
    loaded = {k: _plain(v).clone() for k, v in ref.state_dict().items()}
    opt, want_losses = _opt([p for p in ref.parameters() if p.requires_grad]), []
    for b in batches:
        loss = ref(*b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(float(loss.detach()))
    want = {k: _plain(v) for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        base = GPT(CFG, seed=0)
    model = _qlora(base, quant)
    marked = sorted(n for n, p in model.named_parameters() if isinstance(p, PendingWeight) and p.dim() == 3)
    mesh = sl.Mesh(shape)
    rules = {**({"experts": "expert"} if "expert" in shape else {}), **(TENSOR if "tensor" in shape else {})}
    plan = sl.plan(model, mesh, rules=rules or None, zero=zero, batch=batches[0])
    engine = sl.parallelize(model, plan, optimizer=_opt, loss_fn=lambda m, b: m(*b), init=False)
    engine.load_pretrained(folder)
    first = engine.full_state_dict()
    losses = [engine.step(b) for b in batches]
    got = engine.full_state_dict()
    return {"marked": marked, "losses": losses, "want_losses": want_losses,
            "first": {k: (_plain(first[k]), v) for k, v in loaded.items()},
            "params": {k: (_plain(got[k]), v) for k, v in want.items()},
            "memory": (engine.memory_held("device")["params"], plan.memory_per_rank(mesh.rank)["params"])}


@pytest.mark.parametrize("quant, shape, zero", [("nf4", {"data": 2, "expert": 2}, 3), ("int4", {"expert": 2}, 0),
                                                ("nf4", {"expert": 2, "tensor": 2}, 0)],
                         ids=["nf4_data2_expert2_zero3", "int4_expert2", "nf4_expert2_tensor2"])
def test_a_marked_meta_moe_loads_a_float_folder_each_rank_quantizing_its_experts(world, tmp_path, quant, shape, zero):
    """QLoRA of a mixture of experts that no rank holds in float: built on the meta device, its stacks marked by
    ``sl.quantize(parameters=...)``, each rank reads only its experts' float rows from the folder, a few experts
    at a time, and quantizes each expert on its own — the codes bit for bit one process's, then training equal."""
    import os

    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in GPT(CFG, seed=0).state_dict().items()},
              os.path.join(tmp_path, "model.safetensors"))
    for r in world(math.prod(shape.values()), _loaded, str(tmp_path), shape, quant, zero):
        assert len(r["marked"]) == 2 * CFG.n_layers, r["marked"]
        for k, (got, want) in r["first"].items():                 # as loaded: base codes and adapters
            assert torch.equal(got, want), k
        assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
        for k, (got, want) in r["params"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=k)
        held, planned = r["memory"]
        assert held == planned, (held, planned)


def _mixtral_qlora(model, quant: str | None):
    """Mixtral (eager experts) frozen; attention and the experts' stacks quantized (marked on the meta device);
    LoRA on q/v (PEFT, seed 1). ``quant=None``: the float model, no adapters."""
    from peft import LoraConfig, get_peft_model
    model.set_experts_implementation("eager")
    if quant is None:
        return model
    for p in model.parameters():
        p.requires_grad_(False)
    sl.quantize(model, quant, modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                parameters=["*.experts.gate_up_proj", "*.experts.down_proj"], group_size=GROUP,
                block_size=NF4_BLOCK, scaler_block_size=NF4_SCALERS)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))


def _mixtral_folder(folder: str, shape: dict, quant: str | None, zero: int):
    from transformers import MixtralForCausalLM
    batches = [_hf_batch(s) for s in range(STEPS)]
    ref = _mixtral_qlora(MixtralForCausalLM.from_pretrained(folder), quant)
    loaded = {k: _plain(v).clone() for k, v in ref.state_dict().items()}
    opt, want_losses = _opt([p for p in ref.parameters() if p.requires_grad]), []
    for b in batches:
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(float(loss.detach()))
    with torch.device("meta"):
        base = MixtralForCausalLM(_mixtral().config)
    model = _mixtral_qlora(base, quant)       # (PEFT draws the adapters on the CPU, beside the marked weights)
    mesh = sl.Mesh(shape)
    plan = sl.plan(model, mesh, rules={"experts": "expert"}, zero=zero, batch=batches[0])
    engine = sl.parallelize(model, plan, optimizer=_opt, loss_fn=lambda m, b: m(**b).loss, init=False)
    engine.load_pretrained(folder)
    first = engine.full_state_dict()
    losses = [engine.step(b) for b in batches]
    got = engine.full_state_dict()
    return {"losses": losses, "want_losses": want_losses, "first": {k: (_plain(first[k]), v) for k, v in loaded.items()},
            "params": {k: (_plain(got[k]), _plain(v)) for k, v in ref.state_dict().items()}}


@pytest.mark.parametrize("quant", [None, "nf4"], ids=["float", "nf4"])
def test_a_transformers_moe_folder_of_per_expert_tensors_loads_into_split_fused_experts(world, tmp_path, quant):
    """What the hub holds: Mixtral's checkpoint keeps each expert's ``w1``/``w2``/``w3``; transformers fuses them on
    load (``MergeModulelist`` + ``Concatenate``: ``gate_up_proj [E, 2I, H]``). Each rank reads only its experts'
    tensors and joins them as transformers does — into float stacks (data 2 x expert 2, ZeRO-3, every tensor equal
    to ``from_pretrained``'s) or, marked on the meta device, into NF4 stacks quantized expert by expert (QLoRA of a
    MoE no rank holds in float: codes bit for bit one process's, training equal)."""
    _mixtral().save_pretrained(str(tmp_path))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in f.keys()     # the per-expert layout
    for r in world(4, _mixtral_folder, str(tmp_path), {"data": 2, "expert": 2}, quant, 3):
        for k, (got, want) in r["first"].items():
            assert torch.equal(got, want), k
        assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
        for k, (got, want) in r["params"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=k)


def _broken_load(folder: str) -> str:
    from transformers import MixtralForCausalLM
    with torch.device("meta"):
        model = MixtralForCausalLM(_mixtral().config)
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"expert": 2}), rules={"experts": "expert"}),
                            optimizer=_opt, init=False)
    with pytest.raises(sl.CheckpointError) as e:
        engine.load_pretrained(folder)
    return str(e.value)


def test_a_folder_missing_an_experts_tensor_is_refused_naming_the_conversion(world, tmp_path):
    from safetensors.torch import load_file, save_file
    _mixtral().save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for said in world(2, _broken_load, str(tmp_path)):
        assert "holds no tensor 'model.layers.1.mlp.experts.gate_up_proj'" in said, said
        assert "transformers builds it on load from ['.experts.*.w1.weight', '.experts.*.w3.weight']" in said, said
        assert "'model.layers.0.mlp.experts.gate_up_proj'" not in said, said       # the complete layer loads


def _save_then_load(ckpt: str, quant: str):
    """A QLoRA MoE engine at expert 4, loaded from a float folder, trains a step and saves; a fresh meta engine of
    the same model at data 2 x expert 2 ZeRO-3 loads the checkpoint (no folder): both full states, and the next
    step's loss on each."""
    import os

    from safetensors.torch import save_file
    batches = [token_batch(CFG, BATCH, s) for s in range(2)]

    def engine(shape: dict, zero: int):
        with torch.device("meta"):
            base = GPT(CFG, seed=0)
        model = _qlora(base, quant)
        plan = sl.plan(model, sl.Mesh(shape), rules={"experts": "expert"}, zero=zero, batch=batches[0])
        return sl.parallelize(model, plan, optimizer=_opt, loss_fn=lambda m, b: m(*b), init=False)

    folder = os.path.join(ckpt, "folder")
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in GPT(CFG, seed=0).state_dict().items()},
                  os.path.join(folder, "model.safetensors"))
    torch.distributed.barrier()
    first = engine({"expert": 4}, 0)
    first.load_pretrained(folder)
    first.step(batches[0])
    first.save(os.path.join(ckpt, "step1"))
    saved = {k: _plain(v) for k, v in first.full_state_dict().items()}
    loss_a = float(first.step(batches[1]))
    other = engine({"data": 2, "expert": 2}, 3)
    other.load(os.path.join(ckpt, "step1"))
    loaded = {k: _plain(v) for k, v in other.full_state_dict().items()}
    return {"saved": saved, "loaded": loaded, "loss_a": loss_a, "loss_b": float(other.step(batches[1]))}


def test_a_quantized_moe_checkpoint_moves_from_expert_4_to_data_2_x_expert_2(world, tmp_path):
    """The NF4 stacks' codes, scalers, factors and means (and the adapters and their moments) saved at expert 4
    load into data 2 x expert 2 under ZeRO-3: every tensor bit-equal, the next step's loss the same."""
    for r in world(4, _save_then_load, str(tmp_path), "nf4"):
        assert r["saved"].keys() == r["loaded"].keys()
        for k, v in r["saved"].items():
            assert torch.equal(v, r["loaded"][k]), k
        assert r["loss_a"] == r["loss_b"], (r["loss_a"], r["loss_b"])
