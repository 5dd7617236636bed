"""HSDP as a layout: a mesh with two data axes, ``replica x data``, trains like one process.

The batch splits over both axes; ZeRO shards the training states over ``data`` only and they are
replicated over ``replica`` (FSDP2's HSDP, ZeRO++'s hpZ): each rank's gradient shard is summed
over the replicas by one all-reduce per bucket or unit. Each configuration trains 5 steps; losses
must equal plain PyTorch in one process (``test_engine_data_parallel.reference_run``) within 1e-5 relative, the
gathered weights too; one step's collectives counted equal ``plan.comm_per_step(rank)`` and the
model states a rank holds equal ``plan.memory_per_rank()`` — the ``data``-sharded amounts, the
same as ZeRO on ``data`` alone.
"""

from __future__ import annotations

import pytest

import shardlib as sl
from shardlib.testing import get_mesh
from test_engine_data_parallel import make_batches, make_model, make_optimizer, reference_for
from test_tensor_parallel import check_world, train_counting

TP = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def hsdp_run(cfg: dict, shape: dict) -> dict:
    mesh = get_mesh(shape)
    model = make_model(cfg["model"])
    batches = make_batches(cfg["model"], 5)
    kw = {k: cfg[k] for k in ("zero", "grad_accum", "recompute", "microbatches") if k in cfg}
    if "clip" in cfg:
        kw["clip_grad_norm"] = cfg["clip"]
    rules = {**(TP if shape.get("tensor", 1) > 1 else {}), **({"layers": "pipe"} if shape.get("pipe", 1) > 1 else {})}
    opt = cfg.get("optimizer", "sgd")
    plan = sl.plan(model, mesh, rules=rules or None, batch=batches[0] if rules else None,
                   optimizer={"adamw": "adamw", "sgd": "sgd_momentum"}[opt], **kw)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer(opt))
    losses, counts = train_counting(engine, plan, batches)
    full = engine.full_state_dict()
    return {"losses": losses, "params": {n: full[n] for n, _ in make_model(cfg["model"]).named_parameters()},
            "held": engine.memory_held()["total"], "planned_held": plan.memory_per_rank()["total"],
            "dp": (engine.data_size, engine.data_index), **counts}


def hsdp_runs(cfgs: list[dict], shape: dict) -> list[dict]:
    return [hsdp_run(c, shape) for c in cfgs]


def _reference(cfg: dict) -> dict:
    return reference_for({k: v for k, v in cfg.items() if k in ("model", "optimizer", "grad_accum", "clip")}
                         | {"optimizer": cfg.get("optimizer", "sgd")})


def _check(world, cfgs: list[dict], shape: dict) -> list[list[dict]]:
    """Parity and counted = planned collectives (``check_world``), and each rank holds what was planned."""
    per_rank = check_world(world, hsdp_runs, cfgs, shape, _reference)
    for i, cfg in enumerate(cfgs):
        for r, ranks in enumerate(per_rank):
            assert ranks[i]["held"] == ranks[i]["planned_held"], (cfg, r, ranks[i]["held"], ranks[i]["planned_held"])
    return per_rank


def test_hsdp_every_zero_stage_trains_like_one_process(world):
    """replica 2 x data 2: DP (one all-reduce over both axes), ZeRO-1/2/3 (sharded over data, the
    shard all-reduced over replica); accumulation, clipping, an uneven MLP, ZeRO-3's outer units."""
    cfgs = [{"model": "gpt", "zero": z} for z in range(4)]
    cfgs += [{"model": "gpt", "zero": 3, "grad_accum": 2, "clip": 0.05, "recompute": True},
             {"model": "mlp", "zero": 2, "clip": 0.05, "optimizer": "adamw"},
             # the token table and the head as units of their own, the table trained or frozen
             {"model": "gpt_vocab", "zero": 3}, {"model": "gpt_vocab_frozen", "zero": 3, "grad_accum": 2}]
    per_rank = _check(world, cfgs, {"replica": 2, "data": 2})
    # the batch splits over both axes, replica major: rank r takes chunk r
    assert [per_rank[r][0]["dp"] for r in range(4)] == [(4, r) for r in range(4)]


def test_hsdp_states_are_the_data_sharded_amounts():
    """Per rank, HSDP holds what ZeRO on ``data`` alone holds; the batch is split over both axes;
    the replicas add one all-reduce of each rank's gradient shard: 2(R-1)/R of it, per step."""
    model = make_model("gpt")
    hsdp = sl.AbstractMesh({"replica": 2, "data": 2})
    flat = sl.AbstractMesh({"data": 2})
    for z in range(1, 4):
        a, b = sl.plan(model, hsdp, zero=z), sl.plan(model, flat, zero=z)
        assert a.replica_axis == "replica" and a.dp_size == 4 and a.dp_axes == ("replica", "data")
        assert a.memory_per_rank() == b.memory_per_rank()
        extra = [e for e in a.comm_per_step() if e.axes == ("replica",)]
        assert extra and all(e.op == "all_reduce" and e.what == "grads" for e in extra)
        assert sum(e.total for e in extra) == a.comm_bytes_per_step() - b.comm_bytes_per_step() \
            - (a.comm_bytes_per_step("scalars") - b.comm_bytes_per_step("scalars"))
    assert sl.plan(model, hsdp, zero=0).batch.spec == sl.P(("replica", "data"))
    with pytest.raises(sl.ShardingError, match="replica_axis='replicas' is not an axis"):
        sl.plan(model, hsdp, zero=3, replica_axis="replicas")
    with pytest.raises(sl.ShardingError, match="replica_axis="):
        sl.plan(model, sl.AbstractMesh({"copies": 2, "data": 2}), zero=3)   # an unused axis names the fix


def test_hsdp_with_tensor_or_pipe_trains_like_one_process(world):
    """A fourth dimension on the same mesh: replica x data x tensor and replica x data x pipe."""
    _check(world, [{"model": "gpt_tp", "zero": 3, "clip": 0.05}], {"replica": 2, "data": 2, "tensor": 2})
    _check(world, [{"model": "gpt_pp", "zero": 1, "microbatches": 2}], {"replica": 2, "data": 2, "pipe": 2})
