"""Tensor parallel beyond ``nn.Linear``: transformers models of four more families, unchanged, split by
``shardlib.planner.hf_tp.tp_table`` (issue 18, deliverable 2).

- GPT-2: ``Conv1D`` projections, the fused ``c_attn`` (``P(None, Fused(3, "tensor"))``, bias
  ``P(Fused(3, "tensor"))``), tied embeddings (kept replicated);
- Qwen2: q/k/v biases following their column weights, vocab-parallel embedding and head;
- GPT-NeoX: the per-head interleaved ``query_key_value`` as a plain column;
- Phi-3: fused ``qkv_proj`` (``Fused(3)``) and ``gate_up_proj`` (``Fused(2)``).

Each trains 4 steps at tensor 2 and at data 2 x tensor 2 with ZeRO-3 (and Phi-3's MLP, uneven, at tensor 3): losses within 1e-5 relative of
one process, the same on every rank, final weights equal (``full_state_dict``), counted collectives
equal to the plan's. A checkpoint of fused parameters saved at tensor 2 loads at data 2 (ZeRO-3)
and at data 2 x tensor 2 with the same values.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_models
import shardlib as sl
from shardlib.planner.hf_tp import tp_table
from shardlib.testing import get_mesh
from test_engine_data_parallel import max_rel
from test_tensor_parallel import train_counting

STEPS, BATCH, LR, LAYERS = 4, 4, 1e-2, 2


def _batches(family: str) -> list[dict]:
    return [hf_models.batch(family, BATCH, 300 + s, mask=family == "qwen2") for s in range(STEPS)]


def _loss(model, batch) -> torch.Tensor:
    return model(**batch).loss


def reference(family: str) -> dict:
    model = hf_models.build(family, layers=LAYERS)
    losses = hf_models.train_alone(model, _batches(family), lr=LR)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _engine(family: str, cfg: dict, shape: dict):
    mesh = get_mesh(shape)
    model = hf_models.build(family, layers=LAYERS)
    table = tp_table(model, vocab=cfg.get("vocab", False))
    if cfg.get("mlp_only"):
        table = {k: v for k, v in table.items() if "proj" in k and "qkv" not in k and "o_proj" not in k}
    sl.shard(table)(model)
    plan = sl.plan(model, mesh, zero=cfg.get("zero", 0), sequence_parallel=cfg.get("sp", False),
                   batch=_batches(family)[0])
    return sl.parallelize(model, plan, optimizer=functools.partial(hf_models.adamw, lr=LR), loss_fn=_loss), plan


def hf_run(family: str, cfg: dict, shape: dict) -> dict:
    engine, plan = _engine(family, cfg, shape)
    losses, counts = train_counting(engine, plan, _batches(family))
    return {"losses": losses, "state": engine.full_state_dict(), **counts}


def _local_shapes(shape: dict) -> dict:
    engine, _ = _engine("phi3", {"mlp_only": True}, shape)
    return {s.name: tuple(s.plan.shape) for s in engine.states}


def hf_runs(cases: list[tuple[str, dict]], shape: dict) -> list[dict]:
    return [hf_run(f, c, shape) for f, c in cases]


CASES = {
    "tensor2": [("gpt2", {}), ("gpt2", {"sp": True}), ("qwen2", {"vocab": True}), ("gpt_neox", {"vocab": True}),
                ("phi3", {"vocab": True})],
    "data2xtensor2": [("gpt2", {"zero": 3}), ("qwen2", {"zero": 3, "vocab": True}), ("gpt_neox", {"zero": 3}),
                      ("phi3", {"zero": 3, "vocab": True})],
}
SHAPES = {"tensor2": {"data": 1, "tensor": 2}, "data2xtensor2": {"data": 2, "tensor": 2},
          "tensor3": {"data": 1, "tensor": 3}}
# uneven: Phi-3's gate|up blocks of 64 over 3 ranks are chunks of 22, 22 and 20 (its 4 heads stay whole)
CASES["tensor3"] = [("phi3", {"mlp_only": True})]


@pytest.mark.parametrize("mesh", list(CASES))
def test_transformers_families_train_like_one_process(world, mesh):
    shape, cases = SHAPES[mesh], CASES[mesh]
    n = shape["data"] * shape["tensor"]
    if mesh == "tensor3":
        engine_shapes = world(n, _local_shapes, shape)
        assert [s["model.layers.0.mlp.gate_up_proj.weight"] for s in engine_shapes] == [(44, 32), (44, 32), (40, 32)]
    per_rank = world(n, hf_runs, cases, shape)
    refs = {f: reference(f) for f in {f for f, _ in cases}}
    for i, (family, cfg) in enumerate(cases):
        ref = refs[family]
        for r in range(n):
            res = per_rank[r][i]
            where = f"{family} {cfg} {shape} rank {r}"
            rel = max_rel(res["losses"], ref["losses"])
            assert rel <= 1e-5, f"{where}: {res['losses']} vs {ref['losses']} ({rel:.3g})"
            assert res["losses"] == per_rank[0][i]["losses"], f"{where}: losses differ from rank 0's"
            assert res["state"].keys() == ref["state"].keys(), where
            for k, want in ref["state"].items():
                torch.testing.assert_close(res["state"][k], want, rtol=1e-3, atol=1e-2 * LR * STEPS,
                                           msg=lambda m, k=k: f"{where}, {k}: {m}")
            assert res["counted"] == res["planned"], f"{where}: ran {res['counted']}, planned {res['planned']}"


# ---- a checkpoint of fused parameters across meshes -------------------------------------------

def _save_and_reload(path: str) -> dict:
    """Train GPT-2 two steps at tensor 2 and save; load into data 2 (ZeRO-3, no tensor split)."""
    engine, _ = _engine("gpt2", {}, {"data": 1, "tensor": 2})
    batches = _batches("gpt2")
    for b in batches[:2]:
        engine.step(b)
    engine.save(path)
    saved = engine.full_state_dict()
    nxt = engine.step(batches[2])
    other, _ = _engine("gpt2", {"zero": 3}, {"data": 2, "tensor": 1})
    other.load(path)
    return {"saved": saved, "loaded": other.full_state_dict(), "next": nxt, "next_loaded": other.step(batches[2])}


def _load_at(path: str, cfg: dict, shape: dict) -> dict:
    engine, _ = _engine("gpt2", cfg, shape)
    engine.load(path)
    return {"loaded": engine.full_state_dict(), "next_loaded": engine.step(_batches("gpt2")[2])}


def test_fused_parameters_checkpoint_across_meshes(world, tmp_path):
    path = str(tmp_path / "ckpt")
    first = world(2, _save_and_reload, path)
    later = world(4, _load_at, path, {"zero": 3}, {"data": 2, "tensor": 2})
    saved, want = first[0]["saved"], first[0]["next"]
    for res in [*first, *later]:
        for k, v in saved.items():
            torch.testing.assert_close(res["loaded"][k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        assert abs(res["next_loaded"] - want) <= 1e-5 * abs(want), (res["next_loaded"], want)
