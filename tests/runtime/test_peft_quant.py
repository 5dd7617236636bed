"""QLoRA on every axis (issue 19, deliverable 3): a Llama whose adapted projections are int8 (torchao
``Int8WeightOnlyConfig``: per-row scales) or packed int4 (``shardlib.quant.Int4Tensor``, groups of 16)
trains its LoRA adapters like the same quantized PEFT model in one process, on data 2 (ZeRO 0-3),
tensor 2 (± SP), pipe 2 (ZeRO-3), data 2 x tensor 2 ZeRO-3 and 2 x 2 x 2 ZeRO-3: losses within 1e-5, adapters equal, the quantized base
untouched, counted collectives = planned (ZeRO-3 gathers move the packed bytes), memory planned = held.
A tensor split keeps each row's scale with its values (per-row scales ride every in-feature slice)
and one that would cut an int4 group is refused at plan time.
"""

from __future__ import annotations

import pytest
import torch

import peft_models as pm
import shardlib as sl
from test_peft_training import LAYOUTS, check

LAYOUTS.update({
    "q_data2": ({"data": 2}, [{"zero": z} for z in (0, 1, 2, 3)]),
    "q_tensor2": ({"data": 1, "tensor": 2}, [{"sp": False}, {"sp": True}]),
    "q_pipe2": ({"data": 1, "pipe": 2}, [{"schedule": "1f1b", "zero": 3}]),
    "q_data2xtensor2": ({"data": 2, "tensor": 2}, [{"zero": 3}]),
    "q_3d": ({"data": 2, "pipe": 2, "tensor": 2}, [{"zero": 3}]),
    "q_bf16": ({"data": 2}, [{"zero": 0, "precision": "bf16"}, {"zero": 3, "precision": "bf16"}]),
})


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("layout", ["q_data2", "q_tensor2", "q_pipe2", "q_data2xtensor2", "q_3d"])
def test_quantized_base_trains_adapters_like_one_process(world, layout, quant):
    check(world, "llama", layout, quant)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_base_in_bf16_stays_within_bf16_of_one_process(world, quant):
    """Mixed precision: bf16 compute over an fp32-scaled quantized base (dequantized in the input's
    dtype), fp32 masters of the adapters — within bf16 round-off of the fp32 one-process run."""
    check(world, "llama", "q_bf16", quant, rel=1e-2)


def test_quantized_weights_are_held_and_gathered_as_packed_bytes():
    """The plan holds a quantized weight as its packed bytes: int8 about 1/4 of fp32, int4 about 1/8
    plus scales; ZeRO-3 gathers move those bytes, not floats."""
    mesh = sl.AbstractMesh({"data": 2})
    sizes = {}
    for quant in (None, "int8", "int4"):
        model = pm.lora("llama", quant)
        plan = sl.plan(model, mesh, zero=3)
        q = [p for p in plan.params if "q_proj.base_layer" in p.name][0]
        sizes[quant] = (q.stored(4) * 4, plan.memory_per_rank(0)["params"],
                        sum(e.total for e in plan.comm_per_step(0) if e.op == "all_gather"))
    w = 32 * 32 * 4
    assert sizes[None][0] == w
    assert w / 4 <= sizes["int8"][0] <= w / 4 + 32 * 5 + 8, sizes          # codes + a scale/zero per row
    assert w / 8 <= sizes["int4"][0] <= w / 8 + 32 * 2 * 5 + 8, sizes      # 2 codes a byte + per group
    for quant in ("int8", "int4"):      # (int4 leaves the 90-wide down_proj in float: not whole groups)
        assert sizes[quant][1] < sizes[None][1] and sizes[quant][2] < sizes[None][2], sizes


def test_split_cutting_a_group_is_refused():
    model = pm.lora("llama", "int4")
    from shardlib.planner.hf_tp import tp_table
    sl.shard(tp_table(model))(model)
    with pytest.raises(sl.ShardingError, match=r"groups of 16.*tensor=4 shards of 8 would cut a group.*\[1, 2\]"):
        sl.plan(model, sl.AbstractMesh({"tensor": 4}))


def test_quantized_weight_marked_trainable_is_refused():
    model = pm.lora("llama", "int8")
    w = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    w.requires_grad_(True)
    with pytest.raises(sl.ShardingError, match="quantized Int8Tensor marked trainable"):
        sl.plan(model, sl.AbstractMesh({"data": 2}))
    assert torch.is_tensor(w)
