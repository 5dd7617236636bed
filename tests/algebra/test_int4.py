"""The project's packed int4 frozen weight (``shardlib.quant.Int4Tensor``), in one process.

Quantization keeps every value within half a step of its group's scale; two codes share a byte; the
tensor stands in for a frozen ``nn.Linear`` weight (``F.linear`` equals the dequantized weight's, the
input gets its gradient, the weight none); slicing the packed bytes by ``component_blocks`` equals
slicing the floats; a PEFT LoRA on a ``quantize_int4_``'d tiny Llama trains, leaves the packed base
bytes untouched, saves its adapter and loads it back. Bad group sizes and selections are named.
"""

from __future__ import annotations

import copy

import hf_models
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardlib.errors import ShardingError, ShardingTypeError
from shardlib.quant import Int4Tensor, quantize_int4_

# init_lora_weights=False leaves lora_A and lora_B both random (PEFT's "gaussian" still zeroes lora_B), so every
# adapter has a gradient from the first step and changes the logits that the save/load round trip compares
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"], lora_dropout=0.0, init_lora_weights=False)


def _weight(out: int = 12, cols: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g, dtype=torch.float32)
    w[0, :16] = 0.0            # a group part zero, and one all-positive row: both edges of the code range
    w[1] = w[1].abs() + 0.5
    return w.to(dtype)


def _inner(w: Int4Tensor) -> list[torch.Tensor]:
    return [getattr(w, n).clone() for n in w.__tensor_flatten__()[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32])
def test_round_trip_within_half_a_step(group, dtype):
    w = _weight(dtype=dtype)
    q = Int4Tensor.from_float(w, group)
    assert q.shape == w.shape and q.dtype == dtype and q.group_size == group
    assert q.qdata.dtype == torch.uint8 and q.zero_point.dtype == torch.uint8 and q.scale.dtype == dtype
    assert int(q.unpack().max()) <= 15 and int(q.zero_point.max()) <= 15
    err = (w.float() - q.dequantize(torch.float32)).abs()
    bound = q.scale.float().repeat_interleave(group, dim=1) / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())
    assert torch.equal(q.dequantize()[0, :16], torch.zeros(16, dtype=dtype))  # 0 is exactly representable
    assert torch.equal(Int4Tensor.from_float(w, group).qdata, q.qdata)        # deterministic


def test_two_values_per_byte_and_bytes_held():
    out, cols, group = 12, 64, 32
    q = Int4Tensor.from_float(_weight(out, cols), group)
    assert q.qdata.shape == (out, cols // 2) and q.qdata.nbytes == out * cols // 2
    codes = q.unpack()
    assert torch.equal(q.qdata & 0xF, codes[:, 0::2]) and torch.equal(q.qdata >> 4, codes[:, 1::2])
    groups = out * cols // group
    assert q.packed_nbytes() == out * cols // 2 + groups * (4 + 1)
    assert q.component_blocks() == {"qdata": (1, 2), "scale": (1, group), "zero_point": (1, group)}


def test_flatten_unflatten_rebuilds_whole_and_shards():
    q = Int4Tensor.from_float(_weight(), 32)
    names, meta = q.__tensor_flatten__()
    assert names == ["qdata", "scale", "zero_point"]
    assert meta == {"group_size": 32, "shape": (12, 64), "dtype": torch.float32}
    inner = {n: getattr(q, n) for n in names}
    same = Int4Tensor.__tensor_unflatten__(inner, meta, q.shape, None)
    assert torch.equal(same.dequantize(), q.dequantize())
    half = {n: t[:, t.shape[1] // 2:] for n, t in inner.items()}       # a shard along in-features
    shard = Int4Tensor.__tensor_unflatten__(half, meta, None, None)
    assert shard.shape == (12, 32) and torch.equal(shard.dequantize(), q.dequantize()[:, 32:])


def test_frozen_linear_equals_dequantized_float_in_output_and_grads():
    w = _weight()
    q = Int4Tensor.from_float(w, 32)
    p = nn.Parameter(q, requires_grad=False)
    assert isinstance(p, Int4Tensor) and isinstance(p, nn.Parameter) and not p.requires_grad
    assert p.shape == (12, 64) and p.dtype == torch.float32 and p.device.type == "cpu"
    g = torch.Generator().manual_seed(1)
    for shape in ((5, 64), (2, 3, 64)):
        x = torch.randn(*shape, generator=g).requires_grad_(True)
        b = torch.randn(12, generator=g).requires_grad_(True)
        x_ref, b_ref = x.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            y = F.linear(x, p, b)
        assert all(s.numel() != 12 * 64 for s in saved)     # backward dequantizes again: no float copy kept
        y_ref = F.linear(x_ref, q.dequantize(), b_ref)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        torch.testing.assert_close(x @ p.dequantize().T + b, y)
        (y * y).sum().backward()
        (y_ref * y_ref).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
        torch.testing.assert_close(b.grad, b_ref.grad)
        assert p.grad is None
    with pytest.raises(ShardingError, match="cannot be trained"):
        F.linear(x, nn.Parameter(q))                                    # requires_grad=True: refused


def test_detach_clone_copy_and_state_dict_keep_int4_values():
    m = quantize_int4_(nn.Sequential(nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 4)), 32)
    w = m[0].weight
    assert type(w) is Int4Tensor and type(m[2].weight) is nn.Parameter     # 12 in-features: left float
    for t in (w.detach(), w.clone(), w.to("cpu"), w.requires_grad_(False)):
        assert type(t) is Int4Tensor and torch.equal(t.dequantize(), w.dequantize())
    assert w.clone().qdata.data_ptr() != w.qdata.data_ptr()
    assert w.to(torch.float32) is w
    other = copy.deepcopy(m)
    assert type(other[0].weight) is Int4Tensor and other[0].weight.qdata.data_ptr() != w.qdata.data_ptr()
    m2 = quantize_int4_(nn.Sequential(nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 4)), 32)
    m2.load_state_dict(m.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_inner(m2[0].weight), _inner(w)))
    with torch.device("meta"):
        on_meta = quantize_int4_(nn.Sequential(nn.Linear(64, 12)), 32)
    assert on_meta[0].weight.qdata.is_meta and on_meta[0].weight.packed_nbytes() == w.packed_nbytes()
    on_meta.to_empty(device="cpu").load_state_dict(m[:1].state_dict())           # meta -> empty -> loaded
    assert all(torch.equal(a, b) for a, b in zip(_inner(on_meta[0].weight), _inner(w)))
    half = m.to(torch.bfloat16)[0].weight
    assert half.dtype == torch.bfloat16 and half.scale.dtype == torch.bfloat16 and torch.equal(half.qdata, w.qdata)


def test_slices_by_component_blocks_equal_slices_of_floats():
    q = Int4Tensor.from_float(_weight(12, 96), 32)
    full = q.dequantize()
    for rows, cols in ((slice(3, 9), slice(None)), (slice(None), slice(32, 96)), (slice(4, 8), slice(0, 64))):
        part = q.slice(rows, cols)
        assert torch.equal(part.dequantize(), full[rows, cols])
        blocks = part.component_blocks()
        for name, (br, bc) in blocks.items():                               # the runtime's rule
            r0, r1, _ = rows.indices(12)
            c0, c1, _ = cols.indices(96)
            assert torch.equal(getattr(part, name), getattr(q, name)[r0 // br:r1 // br, c0 // bc:c1 // bc])
    assert torch.equal(q[2:7].dequantize(), full[2:7]) and torch.equal(q[:, 64:].dequantize(), full[:, 64:])
    assert torch.equal(Int4Tensor.from_float(_weight(12, 96)[5:9], 32).qdata, q[5:9].qdata)  # rows quantize alone
    for dim in (0, 1):
        for got, want in ((q.chunk(3, dim), full.chunk(3, dim)),
                          (torch.split(q, [32, 64], 1), full.split([32, 64], 1))):
            assert len(got) == len(want) and all(torch.equal(a.dequantize(), b) for a, b in zip(got, want))
    with pytest.raises(ShardingError, match="group_size 32"):
        q.slice(cols=slice(16, 96))
    with pytest.raises(ShardingError, match=r"got \[0:16\]"):
        q.chunk(6, dim=1)


def test_unsupported_ops_name_the_op_and_the_way_out():
    q = Int4Tensor.from_float(_weight(), 32)
    with pytest.raises(NotImplementedError, match=r"aten\.add.*dequantize\(\)"):
        q + 1
    with pytest.raises(ShardingTypeError, match="float dtype"):
        q.to(torch.int8)
    with pytest.raises(ShardingTypeError, match="same shape, group size"):
        q.detach().copy_(torch.zeros(12, 64))
    assert "group_size=32" in repr(q)


def test_bad_group_sizes_and_selections_are_refused_naming_each():
    with pytest.raises(ShardingError, match="even"):
        Int4Tensor.from_float(_weight(), 15)
    with pytest.raises(ShardingError, match="got 64 in-features; expected a multiple of 48"):
        Int4Tensor.from_float(_weight(), 48)
    with pytest.raises(ShardingTypeError, match="group_size must be an int"):
        quantize_int4_(nn.Linear(64, 4), 32.0)
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 4), nn.Linear(90, 4))
    with pytest.raises(ShardingError) as err:
        quantize_int4_(model, 32, filter_fn=lambda m, fqn: True)
    text = str(err.value)
    assert "2 problems" in text and "1 cannot be quantized" in text and "in_features 8" in text
    assert "2 cannot be quantized" in text and "in_features 90" in text and "group_size 32" in text
    assert all(type(p) is nn.Parameter for p in model.parameters())         # nothing changed on error
    tied = nn.Sequential(nn.Embedding(10, 32), nn.Linear(32, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert type(quantize_int4_(tied, 32)[1].weight) is nn.Parameter         # default: tied weights stay float
    with pytest.raises(ShardingError, match="tied"):
        quantize_int4_(tied, 32, filter_fn=lambda m, fqn: fqn == "1")


def test_a_stack_of_experts_is_each_experts_weight_quantized_and_selected_packed():
    """A fused experts' stack ``[E, out, in]``: expert ``e`` of it is ``from_float`` of expert ``e``'s weight;
    ``w[e]`` (select) and ``w[tensor(e)]`` (index, transformers' eager loop) and ``w[a:b]`` stay packed; the
    grouped product transformers runs (``grouped_mm(x, w.transpose(-2, -1))``) equals the float stack's."""
    stack = torch.stack([_weight(12, 64, seed=e) for e in range(3)])
    q = Int4Tensor.from_float(stack, 32)
    assert q.shape == stack.shape and q.qdata.shape == (3, 12, 32) and q.scale.shape == (3, 12, 2)
    for e in range(3):
        one = Int4Tensor.from_float(stack[e], 32)
        for picked in (q[e], q[torch.tensor(e)]):
            assert type(picked) is Int4Tensor and picked.shape == (12, 64)
            assert all(torch.equal(a, b) for a, b in zip(_inner(picked), _inner(one)))
    assert type(q[1:3]) is Int4Tensor and torch.equal(q[1:3].dequantize(), q.dequantize()[1:3])
    x = torch.randn(5, 64, requires_grad=True)
    y = F.linear(x, q[torch.tensor(2)])
    y.sum().backward()
    torch.testing.assert_close(y, x @ q.dequantize()[2].T)
    torch.testing.assert_close(x.grad, q.dequantize()[2].sum(0).expand(5, 64))
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)           # rows 0-1 to expert 0, none to 1, 2-4 to 2
    got = torch._grouped_mm(x.detach(), q.transpose(-2, -1), offs=offs)
    torch.testing.assert_close(got, torch._grouped_mm(x.detach(), q.dequantize().transpose(-2, -1), offs=offs))
    with pytest.raises(NotImplementedError, match="select along the packed in-features"):
        q.select(2, 0)


def test_quantize_int4_takes_named_stacks_and_names_each_it_cannot_take():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 64))
            self.down_proj = nn.Parameter(torch.randn(4, 64, 8))
            self.bias = nn.Parameter(torch.randn(64))
    model = nn.Sequential(Experts(), nn.Linear(64, 64))
    floats = model[0].gate_up_proj.detach().clone()
    with pytest.raises(ShardingError) as err:
        quantize_int4_(model, 32, parameters=["0.gate_up_proj", "0.down_proj", "0.bias", "0.up_proj"])
    text = str(err.value)
    assert "0.down_proj [4, 64, 8] cannot be quantized — got last dim 8 (expected a multiple of group_size 32)" in text
    assert "0.bias [64] cannot be quantized" in text and "'0.up_proj' is not in the model" in text, text
    assert all(type(p) is nn.Parameter for p in model.parameters())         # nothing changed on error
    with pytest.raises(ShardingTypeError, match="a list of parameter names"):
        quantize_int4_(model, 32, parameters="0.gate_up_proj")
    quantize_int4_(model, 32, filter_fn=lambda m, fqn: False, parameters=["0.gate_up_proj"])
    w = model[0].gate_up_proj
    assert type(w) is Int4Tensor and not w.requires_grad and any(p is w for p in model.parameters())
    assert torch.equal(w.dequantize(), Int4Tensor.from_float(floats, 32).dequantize())
    assert type(model[1].weight) is type(model[0].down_proj) is nn.Parameter


def test_peft_lora_on_int4_llama_trains_saves_and_loads(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = quantize_int4_(hf_models.build("llama", layers=2), 32)
    quantized = {n: p for n, p in model.named_parameters() if isinstance(p, Int4Tensor)}
    assert "model.layers.0.self_attn.q_proj.weight" in quantized and "lm_head.weight" in quantized
    assert "model.layers.0.mlp.down_proj.weight" not in quantized            # MLP 90 in-features: float
    before = {n: _inner(p) for n, p in quantized.items()}
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(**LORA))
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear" and type(q_proj.base_layer.weight) is Int4Tensor
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and not any(isinstance(p, Int4Tensor) for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    batch = hf_models.batch("llama", 4, seed=0)
    losses = []
    for _ in range(4):
        loss = peft_model(**batch).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    after = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
             for n, p in peft_model.named_parameters() if isinstance(p, Int4Tensor)}
    assert after.keys() == before.keys()
    assert all(torch.equal(a, b) for n in before for a, b in zip(_inner(after[n]), before[n]))
    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(**batch).logits
    peft_model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists() and (tmp_path / "adapter_config.json").exists()
    base = quantize_int4_(hf_models.build("llama", layers=2), 32).eval()
    loaded = PeftModel.from_pretrained(base, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, logits, rtol=0, atol=0)
