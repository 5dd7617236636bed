"""Tensor parallel (Megatron TP and SP) from parameter specs trains like one process.

The reference GPT names its dims; ``rules={"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}``
turns on TP with no other change. Its vocabulary (67) and MLP width (90) are not divisible by 2
or 4 (uneven shards). Each configuration trains 5 steps on a ``{"data", "tensor"}`` mesh of gloo
ranks and is compared with ``test_engine_data_parallel.reference_run`` (plain PyTorch, one process): losses
within 1e-5 relative, the gathered final weights (``engine.full_state_dict()``) equal; with plain
SGD the weight change is the gradient, so equal weights after SGD steps mean equal gradients.
The collectives of a step are counted and compared with ``plan.comm_per_step()``.
"""

from __future__ import annotations

import collections

import pytest
import torch

import shardlib as sl
from shardlib.testing import get_mesh
from test_engine_data_parallel import check_parity, make_batches, make_model, make_optimizer, reference_for

RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def tp_run(cfg: dict, shape: dict) -> dict:
    """Train ``gpt_tp`` by ``cfg`` on a mesh of ``shape``; losses, full weights, counted vs planned."""
    mesh = get_mesh(shape)
    model = make_model("gpt_tp")
    batches = make_batches("gpt_tp", cfg.get("steps", 5))
    kw = {k: cfg[k] for k in ("zero", "precision", "grad_accum", "recompute") if k in cfg}
    if "clip" in cfg:
        kw["clip_grad_norm"] = cfg["clip"]
    plan = sl.plan(model, mesh, rules=RULES, sequence_parallel=cfg.get("sp", False), batch=batches[0], **kw)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer(cfg.get("optimizer", "adamw")),
                            loss_scale=cfg.get("loss_scale"))
    losses, counts = train_counting(engine, plan, batches)
    full = engine.full_state_dict()
    params = {name: full[name] for name, _ in make_model("gpt_tp").named_parameters()}
    return {"losses": losses, "params": params, **counts}


def train_counting(engine, plan, batches) -> tuple[list[float], dict]:
    """Step through ``batches``; the second step's collectives, counted, next to the plan's:
    ``{"counted": {(op, axes): bytes, (op, axes, "n"): count}, "planned": the same from the plan}``."""
    losses, counted, planned = [], collections.Counter(), collections.Counter()
    for i, batch in enumerate(batches):
        with sl.count_collectives() as c:
            losses.append(engine.step(batch))
        if i == 1:
            for r in c.records:
                counted[(r.op, r.axes)] += r.bytes
                counted[(r.op, r.axes, "n")] += 1
    for e in plan.comm_per_step(engine.mesh.rank):
        planned[(e.op, e.axes)] += e.total
        planned[(e.op, e.axes, "n")] += e.count
    return losses, {"counted": dict(counted), "planned": dict(planned)}


def tp_runs(cfgs: list[dict], shape: dict) -> list[dict]:
    return [tp_run(c, shape) for c in cfgs]


def check_world(world, runs, cfgs: list[dict], shape: dict, reference, *, counts: bool = True,
                **tolerance) -> list[list[dict]]:
    """Run ``runs(cfgs, shape)`` on every rank of a ``shape`` mesh; each configuration's results must
    match ``reference(cfg)`` (``check_parity``) and, with ``counts``, each rank's counted collectives
    one step's planned ones. Returns every rank's results."""
    n = 1
    for v in shape.values():
        n *= v
    per_rank = world(n, runs, cfgs, shape)
    for i, cfg in enumerate(cfgs):
        results = [per_rank[r][i] for r in range(n)]
        check_parity({**cfg, **shape}, results, reference(cfg), **tolerance)
        for r, res in enumerate(results if counts else []):
            assert res["counted"] == res["planned"], f"{cfg} {shape}: rank {r} ran {res['counted']}, " \
                                                     f"the plan says {res['planned']}"
    return per_rank


def _reference(cfg: dict) -> dict:
    return reference_for({"model": "gpt_tp", **{k: v for k, v in cfg.items()
                                                if k in ("optimizer", "grad_accum", "clip", "precision", "loss_scale")}})


def _check(world, cfgs: list[dict], shape: dict, **tolerance) -> None:
    check_world(world, tp_runs, cfgs, shape, _reference, **tolerance)


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_tensor_parallel_alone_trains_like_one_process(world, tensor):
    cfgs = [{"sp": False}, {"sp": True}, {"sp": False, "optimizer": "sgd_plain"},
            {"sp": True, "optimizer": "sgd_plain"}]
    _check(world, cfgs, {"data": 1, "tensor": tensor})


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_by_tensor_every_zero_stage_trains_like_one_process(world, zero):
    cfgs = [{"zero": zero, "sp": False}, {"zero": zero, "sp": True},
            {"zero": zero, "sp": True, "optimizer": "sgd_plain"}]
    _check(world, cfgs, {"data": 2, "tensor": 2})


def test_data_by_tensor_accum_clip_and_recompute_train_like_one_process(world):
    """Accumulation, clipping (the global norm counts each element once over both axes) and
    recompute, with and without SP."""
    cfgs = [{"zero": 2, "sp": True, "grad_accum": 2, "clip": 0.05, "optimizer": "sgd"},
            {"zero": 3, "sp": False, "clip": 0.05, "recompute": True, "optimizer": "sgd"},
            {"zero": 0, "sp": True, "recompute": True, "grad_accum": 2}]
    _check(world, cfgs, {"data": 2, "tensor": 2})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_data_by_tensor_mixed_precision_matches_one_process_policy(world, precision):
    """bf16/fp16 compute with fp32 masters (fp16: a dynamic loss scale, 2^10 so that neither run
    overflows), ZeRO-3 with SP: the losses of the same policy in one process, within 2.5 epsilon of
    the low dtype (``test_engine_precision``'s bound: the rounding of another order of sums; here
    also the vocab-parallel loss, computed in fp32 where one process rounds in the low dtype)."""
    eps = torch.finfo(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision])).eps
    cfg = {"zero": 3, "sp": True, "precision": precision}
    if precision == "fp16":
        cfg["loss_scale"] = 2.0 ** 10
    _check(world, [cfg], {"data": 2, "tensor": 2}, rtol=2.5 * eps, param_tol={"rtol": 1.0, "atol": 1.0})


def fused_vs_plain(steps: int) -> dict:
    """GPT at tensor 2: which column layers run fused (``comm/column_async.py``), and the losses and
    collectives of ``steps`` steps with them fused and, on a fresh copy, with none fused."""
    mesh = get_mesh({"data": 1, "tensor": 2})
    batches = make_batches("gpt_tp", steps)
    out = {}
    for mode in ("fused", "plain"):
        model = make_model("gpt_tp")
        plan = sl.plan(model, mesh, rules=RULES, batch=batches[0])
        engine = sl.parallelize(model, plan, optimizer=make_optimizer("adamw"))
        fusion = engine.tensor.boundaries._fusion
        out[f"{mode}_names"] = sorted(n for n, m in model.named_modules() if id(m) in fusion.eligible)
        if mode == "plain":
            fusion.eligible.clear()
        out[mode] = train_counting(engine, plan, batches)
    return out


def test_column_layers_alone_in_their_region_all_reduce_their_input_gradient_during_the_weight_gradient(world):
    """Megatron's async input-gradient all-reduce: GPT's qkv and fc (each alone in its attention or MLP)
    run fused; training is the unfused run's within round-off, with the same collectives and bytes."""
    res = world(2, fused_vs_plain, 3)[0]
    blocks = len(make_model("gpt_tp").blocks)
    assert res["fused_names"] == sorted([f"blocks.{i}.attn.qkv" for i in range(blocks)]
                                        + [f"blocks.{i}.mlp.fc" for i in range(blocks)])
    (fused, fused_counts), (plain, plain_counts) = res["fused"], res["plain"]
    assert max(abs(a - b) / abs(b) for a, b in zip(fused, plain)) <= 1e-6, (fused, plain)
    assert fused_counts == plain_counts and fused_counts["counted"] == fused_counts["planned"]


# ---- the plan: Megatron's collectives per block ---------------------------------------------

def _per_block(plan, unit: str) -> collections.Counter:
    c = collections.Counter()
    for e in plan.activation_entries(0):
        if e.where == unit and e.what == "activations":
            c[(e.phase, e.op)] += 1
    return c


def test_block_plans_megatrons_two_all_reduces_or_equal_volume_sp_pairs():
    """Per block: 2 all-reduces forward and 2 backward without SP; with SP each becomes an
    all-gather + reduce-scatter pair of the same total volume — plus, as Megatron, each region's input
    gathered again in backward for its columns' weight gradients (the chunk is what forward kept:
    comm/sp_saved.py)."""
    mesh = sl.AbstractMesh({"data": 2, "tensor": 2})
    model = make_model("gpt_tp")
    batch = make_batches("gpt_tp", 1)[0]
    plain = sl.plan(model, mesh, rules=RULES, batch=batch)
    assert _per_block(plain, "blocks.0") == {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2}
    sp = sl.plan(model, mesh, rules=RULES, batch=batch, sequence_parallel=True)
    assert _per_block(sp, "blocks.1") == {("forward", "all_gather"): 2, ("forward", "reduce_scatter"): 2,
                                          ("backward", "all_gather"): 4, ("backward", "reduce_scatter"): 2}
    vol = {p: sum(e.total for e in q.activation_entries(0) if e.where == "blocks.0" and e.what == "activations")
           for p, q in (("plain", plain), ("sp", sp))}
    regathers = sum(e.total for e in sp.activation_entries(0)
                    if e.where == "blocks.0" and e.phase == "forward" and e.op == "all_gather")
    assert vol["sp"] == vol["plain"] + regathers, vol
