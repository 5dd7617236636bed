"""A stack of NF4 experts ``[E, out, in]`` (``shardlib.quant.nf4_stack.NF4Stack``): each expert is torchao's
``to_nf4`` of that expert bit for bit, and the layout arithmetic cuts, packs and rebuilds it as it does the
other quantized types (what the expert axis and ZeRO-3 run on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardlib as sl
from shardlib.quant.layout import QuantSpec, cat_rows, pack, slice_weight, split_problems, views
from shardlib.quant.nf4_stack import INNER, NF4Stack

# (shape, block, scaler block): factors spanning whole rows (R = 16 rows, F = 1), three factors per 32 rows
# (R = 32, F = 3), and rows holding whole scaler blocks (R = 1, F = 2)
SHAPES = [((4, 64, 32), 16, 32), ((4, 32, 48), 16, 32), ((3, 8, 1024), 16, 32)]


def _to_nf4(w: torch.Tensor, block: int, scalers: int):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    return to_nf4(w, block, scalers)


@pytest.mark.parametrize("shape, block, scalers", SHAPES, ids=["F1", "F3", "R1"])
def test_each_expert_is_torchaos_nf4_of_it_and_runs_its_product(shape, block, scalers):
    torch.manual_seed(0)
    w = torch.randn(shape)
    stack = NF4Stack.from_float(w, block, scalers)
    floats = stack.dequantize()
    for e in range(shape[0]):
        want = _to_nf4(w[e], block, scalers)
        for got in (stack[e], stack[torch.tensor(e)]):
            assert type(got).__name__ == "NF4Tensor" and got.shape == want.shape
            for n in INNER:
                assert torch.equal(getattr(got, n).reshape(-1), getattr(want, n).reshape(-1)), (e, n)
        assert torch.equal(floats[e], want.get_original_weight())
    # the model's own product: torchao's NF4 linear on one expert, autograd to the input only
    p = nn.Parameter(stack, requires_grad=False)
    x = torch.randn(5, shape[2], requires_grad=True)
    F.linear(x, p[1]).sum().backward()
    torch.testing.assert_close(x.grad, floats[1].sum(0).expand(5, -1))
    # what transformers' grouped experts take: a transpose, on the dequantized stack
    assert torch.equal(p.transpose(-2, -1), floats.transpose(-2, -1))
    assert torch.equal(p[torch.tensor([2, 0])].dequantize(), floats[[2, 0]])


@pytest.mark.parametrize("shape, block, scalers", SHAPES, ids=["F1", "F3", "R1"])
def test_the_layout_cuts_experts_and_rows_packs_and_rebuilds_the_stack(shape, block, scalers):
    torch.manual_seed(1)
    stack = NF4Stack.from_float(torch.randn(shape), block, scalers)
    floats = stack.dequantize()
    spec = QuantSpec.of(stack)
    e, out_f, in_f = shape
    # every byte of the stack, counted: codes, scalers, factors, a mean per expert, one table
    held = sum(getattr(stack, n).numel() * getattr(stack, n).element_size() for n in INNER)
    assert spec.held_bytes() == held == e * out_f * in_f // 2 + e * out_f * in_f // block + \
        4 * e * out_f * in_f // (block * scalers) + 4 * e + 4 * 16
    # experts: halves equal the float halves, and rejoin into the whole
    lo, hi = (slice_weight(stack, (slice(a, b), slice(None), slice(None))) for a, b in ((0, 2), (2, e)))
    assert torch.equal(lo.dequantize(), floats[:2]) and torch.equal(hi.dequantize(), floats[2:])
    assert torch.equal(cat_rows([lo, hi]).dequantize(), floats)
    assert spec.held_bytes(tuple(lo.shape)) == QuantSpec.of(lo).held_bytes()
    # rows in whole factor groups (ZeRO's data axis on a local stack)
    rows = spec.group(1)
    assert out_f % rows == 0 and rows == {(4, 64, 32): 16, (4, 32, 48): 32, (3, 8, 1024): 1}[shape]
    top = slice_weight(stack, (slice(None), slice(0, rows), slice(None)))
    assert torch.equal(top.dequantize(), floats[:, :rows])
    # packed into one byte buffer and rebuilt as views of it (ZeRO-3's gather)
    buf = pack(stack)
    assert buf.numel() == spec.packed_bytes()
    assert torch.equal(views(stack, buf, shape).dequantize(), floats)
    # what materializing and copying run
    blank = torch.empty_like(stack)
    blank.copy_(stack)
    assert torch.equal(blank.dequantize(), floats)
    meta = NF4Stack.from_float(torch.empty(shape, device="meta"), block, scalers)
    assert QuantSpec.of(meta) == spec


def test_a_split_inside_a_factor_group_is_refused_with_the_degrees_that_work():
    stack = NF4Stack.from_float(torch.randn(4, 32, 48), 16, 32)        # factors span 32 rows
    said = " ".join(split_problems("w", QuantSpec.of(stack), [(1, 2, "data")]))
    assert "in groups of 32 along its dim 1" in said and "data=2 shards of 16 would cut a group" in said, said
    assert not split_problems("w", QuantSpec.of(stack), [(0, 4, "expert")])


def test_sl_quantize_takes_stacks_by_name_and_names_what_it_cannot_take():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 64, 32))
            self.down_proj = nn.Parameter(torch.randn(4, 32, 40))          # 40 in-features: not blocks of 16
            self.proj = nn.Linear(32, 32)

    model = Experts()
    with pytest.raises(sl.ShardingError) as e:
        sl.quantize(model, "nf4", parameters=["gate_up_proj", "down_proj", "nothing"], block_size=16,
                    scaler_block_size=32)
    said = str(e.value)
    assert "parameter down_proj [4, 32, 40] cannot be quantized as nf4 — got in-features 40 (expected a " \
           "multiple of block_size 16)" in said and "'nothing' matches no parameter" in said, said
    assert type(model.gate_up_proj) is nn.Parameter and not isinstance(model.gate_up_proj, NF4Stack)  # unchanged
    want = model.gate_up_proj.detach().clone()
    sl.quantize(model, "nf4", parameters=["gate_up_proj"], block_size=16, scaler_block_size=32)
    assert isinstance(model.gate_up_proj, NF4Stack) and not model.gate_up_proj.requires_grad
    assert type(model.proj.weight) is nn.Parameter          # parameters alone choose no Linear
    torch.testing.assert_close(model.gate_up_proj.dequantize(), want, atol=0.5, rtol=0)
    for fmt, kind in (("int4", "Int4Tensor"), ("int8", "Int8Tensor")):
        m = Experts()
        sl.quantize(m, fmt, parameters=["gate_up_proj"], group_size=16)
        assert type(m.gate_up_proj).__name__ == kind and m.gate_up_proj.shape == (4, 64, 32)
    meta = Experts().to("meta")              # marked: the layout its load will give it, no values
    sl.quantize(meta, "nf4", parameters=["gate_up_proj"], block_size=16, scaler_block_size=32)
    from shardlib.quant.api import PendingWeight
    assert isinstance(meta.gate_up_proj, PendingWeight) and meta.gate_up_proj.weight_name == "gate_up_proj"
    assert QuantSpec.of(meta.gate_up_proj.quantized_layout) == QuantSpec.of(model.gate_up_proj)
