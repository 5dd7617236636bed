"""PEFT LoRA on every axis (issue 19, deliverables 1-2): a transformers Llama (GQA, uneven MLP) and the
reference GPT, wrapped by ``peft.get_peft_model`` (no wrapper of ours), train like the same PEFT model
in one process — at data 2 (ZeRO 0-3) and 4, tensor 2 (± SP), pipe 2, data 2 x tensor 2 (ZeRO-3) and
2 x 2 x 2: losses within 1e-5 relative, the same on every rank, the adapters equal, the base weights
untouched bit for bit, counted collectives equal to the plan's. Specs written against the base model
keep matching after wrapping; adapters follow their base's layout; frozen weights hold no gradient or
optimizer state, and ``memory_per_rank`` equals what the engine holds.
"""

from __future__ import annotations

import pytest
import torch

import peft_models as pm
import shardlib as sl
from test_engine_data_parallel import max_rel

LAYOUTS = {
    "data2": ({"data": 2}, [{"zero": z} for z in (0, 1, 2, 3)]),
    "data4": ({"data": 4}, [{"zero": 0}, {"zero": 3}]),
    "tensor2": ({"data": 1, "tensor": 2}, [{"sp": False}, {"sp": True}]),
    "pipe2": ({"data": 1, "pipe": 2}, [{"schedule": "1f1b"}, {"schedule": "gpipe", "zero": 3}]),
    "data2xtensor2": ({"data": 2, "tensor": 2}, [{"zero": 3}, {"zero": 3, "sp": True}]),
    "3d": ({"data": 2, "pipe": 2, "tensor": 2}, [{"zero": 3}]),
}
_REFS: dict = {}


def _reference(kind: str, quant: str | None = None) -> dict:
    if (kind, quant) not in _REFS:
        _REFS[(kind, quant)] = pm.reference(kind, quant)
    return _REFS[(kind, quant)]


def check(world, kind: str, layout: str, quant: str | None = None, *, rel: float = 1e-5) -> list[list[dict]]:
    """Every configuration of ``layout`` against the one-process reference (the module doc); ``rel``
    bounds the losses' relative difference (and, scaled, the adapters')."""
    shape, cfgs = LAYOUTS[layout]
    n = 1
    for v in shape.values():
        n *= v
    per_rank = world(n, pm.runs, kind, cfgs, shape, quant)
    ref = _reference(kind, quant)
    for i, cfg in enumerate(cfgs):
        for r in range(n):
            res, where = per_rank[r][i], f"{kind} {quant or 'fp32'} {shape} {cfg} rank {r}"
            got = max_rel(res["losses"], ref["losses"])
            assert got <= rel, f"{where}: losses {res['losses']} vs {ref['losses']} ({got:.3g})"
            assert res["losses"] == per_rank[0][i]["losses"], f"{where}: losses differ from rank 0's"
            assert res["adapters"].keys() == ref["adapters"].keys() and ref["adapters"], where
            for k, want in ref["adapters"].items():
                # Adam amplifies round-off in near-zero gradients: 1% of one step's size (as test_tensor_parallel_hf)
                torch.testing.assert_close(res["adapters"][k], want, rtol=1e-3 * rel / 1e-5,
                                           atol=1e-2 * pm.LR * pm.STEPS * rel / 1e-5,
                                           msg=lambda m, k=k: f"{where}, {k}: {m}")
            assert res["changed"] == [], f"{where}: base weights changed: {res['changed']}"
            assert res["counted"] == res["planned"], f"{where}: ran {res['counted']}, planned {res['planned']}"
            held, planned = res["held"], res["memory"]
            planned_gather, gathered = res["gathered"]
            if cfg.get("zero") == 3 and "pipe" not in shape:    # ZeRO-3's gathered units: planned = held
                assert gathered == planned_gather, f"{where}: gathered {gathered}, planned {planned_gather}"
            assert {k: held[k] for k in ("params", "grads", "optimizer")} == \
                {k: planned[k] for k in ("params", "grads", "optimizer")}, f"{where}: held {held}, planned {planned}"
    return per_rank


@pytest.mark.parametrize("layout", ["data2", "data4", "tensor2", "pipe2", "data2xtensor2", "3d"])
def test_llama_lora_trains_like_one_process(world, layout):
    check(world, "llama", layout)


@pytest.mark.parametrize("layout", ["data2", "tensor2", "pipe2", "data2xtensor2", "3d"])
def test_gpt_lora_trains_like_one_process(world, layout):
    check(world, "gpt", layout)


# ---------------------------------------------------------------------------------------------
# ZeRO-3's outer units on a transformers model: the token table and the head units of their own
# ---------------------------------------------------------------------------------------------

def _wide_llama(lora: bool):
    """The test Llama with a 512-token vocabulary, untied: its tables hold more than half a block."""
    import transformers as tf

    import hf_models
    cfg = hf_models.config("llama", layers=2, tie=False)
    cfg.vocab_size = 512
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, init_lora_weights=False))
    return model


def _wide_batches() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": (ids := torch.randint(0, 512, (4, 16), generator=g)), "labels": ids} for _ in range(3)]


def _wide_run(lora: bool) -> dict:
    from shardlib.testing import get_mesh
    model = _wide_llama(lora)
    plan = sl.plan(model, get_mesh({"data": 2}), zero=3, optimizer="sgd")
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                            loss_fn=lambda m, b: m(**b).loss)
    losses = []
    for b in _wide_batches():
        with sl.count_collectives() as counter:
            losses.append(engine.step(b))
    return {"losses": losses, "units": [(u.name, u.backward) for u in plan.units if ".layers." not in u.name],
            "events": list(engine.units.events) == list(plan.gather_schedule()),
            "bytes": (counter.bytes, plan.comm_bytes_per_step()),
            "held": (engine.memory_held()["total"], plan.memory_per_rank()["total"])}


def test_llama_outer_units_train_like_one_process(world):
    """Under ZeRO-3 at data 2, embed_tokens and lm_head are units of their own (planner/units.py); with
    LoRA the frozen table runs no backward, gathered for its forward only. Both train like one process,
    gather as planned, send and hold what the plan says."""
    for lora in (False, True):
        model = _wide_llama(lora)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        ref = []
        for b in _wide_batches():
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref.append(loss.item())
        prefix = "base_model.model." if lora else ""
        for r in world(2, _wide_run, lora):
            assert r["units"] == [("", True), (f"{prefix}model.embed_tokens", not lora), (f"{prefix}lm_head", True)], r
            assert max_rel(r["losses"], ref) <= 1e-5, (lora, r["losses"], ref)
            assert r["events"] and r["bytes"][0] == r["bytes"][1] and r["held"][0] == r["held"][1], (lora, r)
