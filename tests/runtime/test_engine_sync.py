"""Replicas stay one model, as under ``DistributedDataParallel``.

* Set-up: ranks that build the model from different seeds (each rank ``r`` from seed ``r``) train
  exactly what one process trains from rank 0's seed — trainable and frozen parameters, at every
  ZeRO stage. The broadcast is the plan's one set-up collective (``Plan.comm_setup``), counted.
* Buffers (a BatchNorm model, different seeds per rank): the engine against real
  ``DistributedDataParallel`` in the same world, step by step — every rank's running statistics
  and batch counts, the loss, the final parameters. ``broadcast_buffers=True`` (the default) is
  DDP's default (rank 0's buffers before the forward; with accumulation, DDP under ``no_sync``
  broadcasts before the first micro-batch only); ``broadcast_buffers=False`` is DDP's
  ``forward_sync_buffers=False`` (rank 0's buffers at set-up only, then each rank its own).
  What a step sends is what ``Plan.comm_per_step`` says.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from test_engine_data_parallel import check_parity, make_batches, make_model, make_optimizer, reference_for, run_configs

import shardlib as sl
from shardlib.comm.core import broadcast_bytes
from shardlib.testing import get_mesh

# ---------------------------------------------------------------------------------------------
# Item 2: every rank starts from rank 0's model
# ---------------------------------------------------------------------------------------------

SEEDED = ([{"model": m, "zero": z, "seed": "rank", "optimizer": "sgd"} for m in ("mlp", "gpt_frozen")
           for z in range(4)]
          + [{"model": "gpt_tied", "zero": z, "seed": "rank", "grad_accum": 2} for z in (1, 3)])


def test_the_seeds_differ_for_real():
    """Seed 1 gives other values than seed 0 in every parameter, frozen ones included (else the
    tests below could pass without a broadcast)."""
    for name in ("mlp", "gpt_frozen"):
        a, b = make_model(name, seed=0), make_model(name, seed=1)
        differ = {n for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()) if not torch.equal(p, q)}
        # zero-initialized biases and unit norm weights are the same under any seed; all the rest differ
        same = {n for n, p in a.named_parameters() if n not in differ}
        assert all(n.endswith("bias") or ".ln" in n or n.startswith("ln_f") for n in same), same
        assert "wpe.weight" in differ or name == "mlp"


@pytest.mark.parametrize("data", [2, 4])
def test_ranks_built_from_other_seeds_train_rank_0s_model(world, data):
    for cfg, results in zip(SEEDED, run_configs(world, SEEDED, data)):
        check_parity(cfg, results, reference_for({k: v for k, v in cfg.items() if k != "seed"}))


def _setup_collectives(data: int) -> list[dict]:
    mesh = get_mesh({"data": data})
    out = []
    for name, zero in (("mlp", 0), ("gpt_frozen", 3), ("bn", 2)):
        model = make_model(name, seed=mesh.rank)
        plan = sl.plan(model, mesh, zero=zero)
        with sl.count_collectives() as counter:
            sl.parallelize(model, plan, optimizer=make_optimizer("sgd"))
        planned = Counter()
        for e in plan.comm_setup():
            planned[(e.op, e.phase)] += e.count
        out.append({"counted": counter.by_op(), "tags": {r.tag for r in counter.records},
                    "planned": [(e.op, e.what, e.count, e.total) for e in plan.comm_setup()],
                    "numel": sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()),
                    "dtypes": len({t.dtype for t in [*model.parameters(), *model.buffers()]})})
    return out


def test_setup_broadcast_is_planned_and_counted(world):
    """One fused broadcast per dtype (the BatchNorm model: fp32 and its int64 batch counts), all
    parameters and buffers, as ``plan.comm_setup()`` prices it — and, before it, the plans' agreement check:
    nothing else at set-up."""
    for per_model in world(2, _setup_collectives, 2):
        for res in per_model:
            # first the plans' agreement (one all-gather of a CRC per field), then the model
            ops = [e[0] for e in res["planned"]]
            assert ops == ["all_gather"] + ["broadcast"] * res["dtypes"] and res["tags"] == {"setup"}, res
            assert res["counted"] == {"all_gather": (1, res["planned"][0][3]),
                                      "broadcast": (res["dtypes"], sum(e[3] for e in res["planned"][1:]))}, res
        mlp = per_model[0]                 # fp32 only: every element once, half an all-reduce's bytes
        assert mlp["planned"][1:] == [("broadcast", "model", 1, broadcast_bytes(mlp["numel"], 2, 4))]
        assert broadcast_bytes(mlp["numel"], 2, 4) == 4 * mlp["numel"] // 2


# ---------------------------------------------------------------------------------------------
# Item 3: buffers as DDP's
# ---------------------------------------------------------------------------------------------

BN_STEPS = 4


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


NEW_DDP = "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters


def _bn_ddp(data: int, broadcast: bool, grad_accum: int) -> dict:
    """DDP on the BatchNorm model (rank r built from seed r), SGD, micro-batches under no_sync."""
    rank = dist.get_rank()
    model = make_model("bn", seed=rank)
    # forward_sync_buffers (torch 2.13) is what broadcast_buffers means before it
    sync = {"forward_sync_buffers": broadcast} if NEW_DDP else {"broadcast_buffers": broadcast}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **sync)
    opt = make_optimizer("sgd")(list(ddp.parameters()))
    out = {"losses": [], "buffers": []}
    for x, y in make_batches("bn", BN_STEPS):
        rows = x.shape[0] // data
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        per = rows // grad_accum
        total = torch.zeros(())
        for i in range(grad_accum):
            sync = i == grad_accum - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = ddp(x[i * per:(i + 1) * per], y[i * per:(i + 1) * per])
                (loss / grad_accum).backward()
            total += loss.detach()
        dist.all_reduce(total)
        out["losses"].append(float(total / (data * grad_accum)))
        opt.step()
        opt.zero_grad()
        out["buffers"].append(_buffers(model))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _bn_engine(data: int, broadcast: bool, grad_accum: int, zero: int) -> dict:
    mesh = get_mesh({"data": data})
    model = make_model("bn", seed=mesh.rank)
    plan = sl.plan(model, mesh, zero=zero, grad_accum=grad_accum, broadcast_buffers=broadcast)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer("sgd"))
    out = {"losses": [], "buffers": [], "counted": [], "planned": Counter()}
    for e in plan.comm_per_step():
        out["planned"][e.op] += e.count
    for batch in make_batches("bn", BN_STEPS):
        with sl.count_collectives() as counter:
            out["losses"].append(engine.step(batch))
        out["counted"].append(Counter({op: n for op, (n, _) in counter.by_op().items()}))
        out["bytes"] = (counter.bytes, plan.comm_bytes_per_step())
        out["buffers"].append(_buffers(model))
    full = engine.full_state_dict()
    out["params"] = {n: full[n] for n, _ in model.named_parameters()}
    out["full_buffers"] = {n: full[n] for n in out["buffers"][-1]}
    return out


def _bn_both(data: int, broadcast: bool, grad_accum: int) -> dict:
    return {"ddp": _bn_ddp(data, broadcast, grad_accum),
            "engine": [_bn_engine(data, broadcast, grad_accum, z) for z in range(4)]}


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_buffers_follow_ddp(world, broadcast, grad_accum):
    data = 2
    per_rank = world(data, _bn_both, data, broadcast, grad_accum)
    for r, res in enumerate(per_rank):
        ddp = res["ddp"]
        for zero, eng in enumerate(res["engine"]):
            where = f"rank {r}, zero={zero}, broadcast_buffers={broadcast}, grad_accum={grad_accum}"
            torch.testing.assert_close(eng["losses"], ddp["losses"], rtol=1e-5, atol=0, msg=where)
            for step, (got, want) in enumerate(zip(eng["buffers"], ddp["buffers"])):
                assert got.keys() == want.keys()
                for n in want:
                    torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6,
                                               msg=f"{where}, step {step}, {n}")
            for n, want in ddp["params"].items():
                torch.testing.assert_close(eng["params"][n], want, rtol=1e-5, atol=1e-6, msg=f"{where}, {n}")
            # full_state_dict holds rank 0's buffers on every rank
            for n, want in per_rank[0]["ddp"]["buffers"][-1].items():
                torch.testing.assert_close(eng["full_buffers"][n], want, rtol=1e-5, atol=1e-6, msg=f"{where}, {n}")
            for counted in eng["counted"]:
                assert counted == eng["planned"], f"{where}: ran {counted}, planned {eng['planned']}"
            assert eng["bytes"][0] == eng["bytes"][1], where
            assert eng["planned"]["broadcast"] == (2 if broadcast else 0), where   # fp32 stats, int64 counts
    # the ranks' running statistics do differ between broadcasts (else nothing above is tested)
    last = [res["ddp"]["buffers"][-1]["blocks.0.1.running_mean"] for res in per_rank]
    assert not torch.allclose(last[0], last[1])
