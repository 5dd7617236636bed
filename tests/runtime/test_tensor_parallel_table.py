"""A third-party model gets Megatron TP from a pattern table, with no edits to its code.

``transformers``' ``LlamaForCausalLM`` (tiny config: grouped-query attention 4/2 heads, an MLP
width of 90 that neither 2 nor 4 divides, untied vocab 96) is given ``tests/llama.py``'s
``LLAMA_TP`` table (q/k/v, gate/up column; o/down row) — and the vocab-parallel embedding and LM
head (``LLAMA_VOCAB_TP``) — and trained 4 steps at tensor 2 and data 2 x tensor 2 (ZeRO 0 and 3,
± sequence parallel). Compared with the same model trained by a plain loop in one process:
losses within 1e-5 relative, final weights equal; collectives counted equal the plan's.
"""

from __future__ import annotations

import pytest
import torch

import shardlib as sl
from hf_models import train_alone
from llama import LLAMA_TP, LLAMA_VOCAB_TP, llama_batch, tiny_config, tiny_llama
from shardlib.testing import get_mesh
from test_engine_data_parallel import max_rel
from test_tensor_parallel import train_counting

STEPS = 4
BATCH = 4
LR = 1e-2
PARAM_TOL = {"rtol": 1e-3, "atol": 1e-2 * LR * STEPS}    # AdamW's (test_engine_data_parallel.param_tolerance says why)


def _batches() -> list[dict]:
    cfg = tiny_config()
    return [llama_batch(cfg, BATCH, seed=200 + s) for s in range(STEPS)]


def _loss(model, batch) -> torch.Tensor:
    return model(**batch).loss


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-6)


def reference() -> dict:
    model = tiny_llama()
    losses = train_alone(model, _batches(), optimizer=_optimizer, loss=_loss)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def check_ranks(results: list[dict], ref: dict, where: str, *, rtol: float, atol: float) -> None:
    """Each rank's results (``losses``, ``params``, ``counted``, ``planned``) against one process's ``ref``:
    losses within 1e-5 relative, final parameters within ``rtol``/``atol``, counted collectives the planned."""
    for r, res in enumerate(results):
        at = f"{where} rank {r}"
        rel = max_rel(res["losses"], ref["losses"])
        assert rel <= 1e-5, f"{at}: {res['losses']} vs {ref['losses']} ({rel:.3g})"
        for name, want in ref["params"].items():
            torch.testing.assert_close(res["params"][name], want, rtol=rtol, atol=atol,
                                       msg=lambda m, k=name: f"{at}, {k}: {m}")
        assert res["counted"] == res["planned"], f"{at}: ran {res['counted']}, planned {res['planned']}"


def llama_run(cfg: dict, shape: dict) -> dict:
    mesh = get_mesh(shape)
    model = tiny_llama()
    table = {**LLAMA_TP, **(LLAMA_VOCAB_TP if cfg.get("vocab") else {})}
    sl.shard(table)(model)
    batches = _batches()
    plan = sl.plan(model, mesh, zero=cfg.get("zero", 0), sequence_parallel=cfg.get("sp", False), batch=batches[0],
                   recompute=cfg.get("recompute", False))
    engine = sl.parallelize(model, plan, optimizer=_optimizer, loss_fn=_loss)
    losses, counts = train_counting(engine, plan, batches)
    full = engine.full_state_dict()
    return {"losses": losses, "params": {n: full[n] for n, _ in model.named_parameters()}, **counts}


def llama_runs(cfgs: list[dict], shape: dict) -> list[dict]:
    return [llama_run(c, shape) for c in cfgs]


@pytest.mark.parametrize("shape", [{"data": 1, "tensor": 2}, {"data": 2, "tensor": 2}])
def test_llama_tensor_parallel_trains_like_one_process(world, shape):
    cfgs = [{"zero": 0}, {"zero": 0, "sp": True, "vocab": True}]
    if shape["data"] > 1:
        cfgs += [{"zero": 3, "vocab": True}, {"zero": 3, "sp": True}]
    n = shape["data"] * shape["tensor"]
    per_rank = world(n, llama_runs, cfgs, shape)
    ref = reference()
    for i, cfg in enumerate(cfgs):
        check_ranks([per_rank[r][i] for r in range(n)], ref, f"{cfg} {shape}", **PARAM_TOL)


def _export_llama(path: str) -> None:
    """Train the Llama on data 2 x tensor 2 (ZeRO-3, vocab-parallel head) and export it."""
    mesh = get_mesh({"data": 2, "tensor": 2})
    model = tiny_llama()
    sl.shard({**LLAMA_TP, **LLAMA_VOCAB_TP})(model)
    batches = _batches()
    plan = sl.plan(model, mesh, zero=3, batch=batches[0])
    engine = sl.parallelize(model, plan, optimizer=_optimizer, loss_fn=_loss)
    for b in batches[:2]:
        engine.step(b)
    engine.export(path)


def test_a_tensor_parallel_llama_exports_to_a_plain_transformers_model(world, tmp_path):
    """The safetensors file of a model trained with TP (and ZeRO-3) loads with strict=True into a
    fresh transformers LlamaForCausalLM, and gives the loss one process reaches after the same steps."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    path = str(tmp_path / "llama.safetensors")
    world(4, _export_llama, path)
    fresh = LlamaForCausalLM(tiny_config())
    fresh.load_state_dict(load_file(path), strict=True)
    ref = tiny_llama()
    batches = _batches()
    train_alone(ref, batches[:2], optimizer=_optimizer, loss=_loss)
    with torch.no_grad():
        want, got = float(_loss(ref, batches[2])), float(_loss(fresh.train(), batches[2]))
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
