"""What the engine moves and holds is what the plan says, on real ranks.

* Collectives counted while stepping equal ``plan.comm_per_step()`` op by op (count and bytes):
  no extra collective runs. Parameter and gradient bytes equal the ring minimum where the flat
  groups ZeRO splits divide by N (GPT at N = 4), and exceed it by less than one element per rank
  and collective where they do not (the padding of ceil chunks: MLP, and GPT at N = 3).
* With accumulation, DP and ZeRO-1/2 communicate nothing before the last micro-step.
* Model-state storage held by a rank equals ``plan.memory_per_rank()`` between steps and
  ``plan.memory_per_rank(at="update")`` inside ``optimizer.step`` (the step's peak for model
  states) — at N = 3 too, where every flat segment is uneven and some pieces are empty; for the
  GPT at N = 4 (every unit and bucket divides by N) both plan and storage equal the ZeRO-paper
  terms, and at N = 3 they are within one element per segment of them.
* ZeRO-3: the units are gathered, waited for and freed in the order of
  ``plan.gather_schedule()``, and the peak of gathered parameters plus gather buffers equals
  ``plan.transient_per_rank()``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from test_engine_data_parallel import make_batches, make_model, make_optimizer

import shardlib as sl
from shardlib.testing import get_mesh


def _plan_by_op(plan) -> dict[str, tuple[int, int]]:
    n, b = Counter(), Counter()
    for e in plan.comm_per_step():
        n[e.op] += e.count
        b[e.op] += e.total
    return {op: (n[op], b[op]) for op in n}


def _accounting(cfgs: list[dict], data: int) -> list[dict]:
    mesh = get_mesh({"data": data})
    out = []
    for cfg in cfgs:
        model = make_model(cfg["model"])
        kw = {k: v for k, v in cfg.items() if k not in ("model", "optimizer")}
        opt = cfg.get("optimizer", "adamw")
        plan = sl.plan(model, mesh, optimizer={"adamw": "adamw", "sgd": "sgd_momentum"}[opt], **kw)
        engine = sl.parallelize(model, plan, optimizer=make_optimizer(opt))
        at_update = []
        engine.optimizer.register_step_pre_hook(lambda *_: at_update.append(engine.memory_held()))
        steps = []
        for batch in make_batches(cfg["model"], 2, 2 * data * cfg.get("grad_accum", 1)):
            with sl.count_collectives() as counter:
                engine.step(batch)
            steps.append({"by_op": counter.by_op(), "bytes": counter.bytes, "held": engine.memory_held()})
        out.append({
            "steps": steps, "at_update": at_update[-1], "planned_by_op": _plan_by_op(plan),
            "planned_bytes": plan.comm_bytes_per_step(),
            "planned_pg": plan.comm_bytes_per_step("params") + plan.comm_bytes_per_step("grads"),
            "ring_minimum": plan.ring_minimum(), "rest": plan.memory_per_rank(),
            "update": plan.memory_per_rank(at="update"),
            "formula": plan.zero_formula(),
            "events": list(engine.units.events) if engine.units else [], "schedule": list(plan.gather_schedule()),
            "peak": engine.peak_gathered_bytes, "transient": plan.transient_per_rank()["gathered"],
        })
    return out


CONFIGS = ([{"model": m, "zero": z, "precision": p} for m in ("gpt", "mlp") for z in range(4) for p in ("fp32", "bf16")]
           + [{"model": m, "zero": z, "grad_accum": 2, "clip_grad_norm": 1.0, "precision": "fp16"}
              for m in ("gpt", "mlp") for z in range(4)]
           + [{"model": "gpt_frozen", "zero": z, "optimizer": "sgd"} for z in range(4)]
           + [{"model": "gpt_tied", "zero": 3, "recompute": True},
              {"model": "gpt", "zero": 3, "reshard_after_forward": False, "precision": "bf16"},
              {"model": "mlp", "zero": 1, "reduce_dtype": "bf16"},
              {"model": "mlp", "zero": 2, "precision": "bf16", "reduce_dtype": "fp32"},
              {"model": "gpt", "states": sl.StateLayouts(None, None, "data"), "precision": "bf16"},
              {"model": "gpt", "zero": 2, "bucket_mb": 0.02},
              # wte and head units of their own (planner/units.py), the head kept from forward to backward
              {"model": "gpt_vocab", "zero": 3},
              {"model": "gpt_vocab", "zero": 3, "grad_accum": 2, "precision": "bf16"},
              # a frozen token table: gathered for its forward only
              {"model": "gpt_vocab_frozen", "zero": 3},
              {"model": "gpt_vocab_frozen", "zero": 3, "reshard_after_forward": False, "optimizer": "sgd"}])


@pytest.fixture(scope="module", params=[3, 4])
def accounting(request, world):
    data = request.param
    return data, world(data, _accounting, CONFIGS, data)


def _each(accounting):
    data, per_rank = accounting
    for r, results in enumerate(per_rank):
        for cfg, res in zip(CONFIGS, results):
            yield data, r, cfg, res


def _each_step(accounting):
    """Every step of every configuration on every rank, with what the plan says and where it ran."""
    for data, r, cfg, res in _each(accounting):
        for s in res["steps"]:
            yield s, res, f"N={data} rank {r} {cfg}"


def test_counted_collectives_equal_the_plan(accounting):
    for s, res, at in _each_step(accounting):
        assert s["by_op"] == res["planned_by_op"], at
        assert s["bytes"] == res["planned_bytes"], at


def test_parameter_and_gradient_traffic_is_the_ring_minimum(accounting):
    """Even flat groups (GPT, N = 4): exactly the minimum. Uneven: above it by the padding, less
    than one element (<= 4 bytes) per rank and per collective, plus the ring's rounding."""
    for data, r, cfg, res in _each(accounting):
        ring, planned = res["ring_minimum"], res["planned_pg"]
        if cfg["model"].startswith("gpt") and "bucket_mb" not in cfg and data == 4:
            assert planned == ring, f"N={data} {cfg}: {planned} B planned vs ring minimum {ring} B"
        else:
            # an all-reduce is a reduce-scatter and an all-gather: its padding counts twice
            collectives = sum(n * (2 if op == "all_reduce" else 1) for op, (n, _) in res["planned_by_op"].items())
            assert ring <= planned < ring + collectives * (data - 1) * 4 + 4, f"N={data} {cfg}: {planned} vs {ring}"


def test_held_storage_equals_the_plan_at_rest_and_at_the_update(accounting):
    for s, res, at in _each_step(accounting):
        assert s["held"] == res["rest"], f"{at}: held {s['held']} vs plan {res['rest']}"
    for data, r, cfg, res in _each(accounting):
        assert res["at_update"] == res["update"], f"N={data} rank {r} {cfg}"


def test_gpt_model_states_are_the_zero_paper_terms(accounting):
    """Ψ = GPT parameters (root unit 4,672, blocks 12,704; buckets end at units, so under ZeRO-1/2
    they split the units' parameters further, 4 groups with the defaults). At N = 4 every group
    divides: exactly the paper's terms. At N = 3 none does: each rank holds ceil(T/3) or fewer
    elements of each group's T — less than one element per group above T/3 (the last rank up to
    N - 1 below), each element carrying ``per_element`` bytes of sharded state. K = 12 (AdamW,
    mixed) or 8 (fp32)."""
    for data, r, cfg, res in _each(accounting):
        if cfg["model"] != "gpt" or "states" in cfg or cfg.get("precision") not in ("fp32", "bf16"):
            continue
        psi, n, z = 30080, data, cfg["zero"]
        if cfg["precision"] == "bf16":
            k = 12
            want = {0: (2 + 2 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
                    3: (2 + 2 + k) * psi / n}[z]
            per_element = {0: 0, 1: k, 2: 2 + k, 3: 2 + 2 + k}[z]
        else:
            k = 8
            want = {0: (4 + 4 + k) * psi, 1: 8 * psi + k * psi / n, 2: 4 * psi + (4 + k) * psi / n,
                    3: (4 + 4 + k) * psi / n}[z]
            per_element = {0: 0, 1: k, 2: 4 + k, 3: 4 + 4 + k}[z]
        assert res["formula"]["total"] == pytest.approx(want, rel=1e-12), f"N={data} {cfg}"
        assert res["steps"][-1]["held"]["total"] == res["rest"]["total"]
        if data == 4:
            assert res["rest"]["total"] == want, f"N={data} {cfg}"
        else:
            excess = res["rest"]["total"] - want
            assert -(data - 1) * 4 * per_element < excess < 4 * per_element or excess == per_element == 0, \
                f"N={data} rank {r} {cfg}: {res['rest']} vs {want}"


def test_zero3_gathers_in_the_planned_order_and_peak(accounting):
    seen = 0
    for data, r, cfg, res in _each(accounting):
        if not res["schedule"]:
            assert res["peak"] == res["transient"] == 0
            continue
        seen += 1
        assert res["events"] == res["schedule"], f"N={data} rank {r} {cfg}"
        assert res["peak"] == res["transient"], f"N={data} rank {r} {cfg}: {res['peak']} vs {res['transient']}"
    assert seen >= 6


# ---------------------------------------------------------------------------------------------
# Accumulation: nothing moves before the last micro-step (DP, ZeRO-1/2)
# ---------------------------------------------------------------------------------------------

def _comm_per_micro_step(data: int) -> list:
    mesh = get_mesh({"data": data})
    out = []
    for zero in range(4):
        model = make_model("gpt")
        plan = sl.plan(model, mesh, zero=zero, grad_accum=4, clip_grad_norm=1.0)
        seen: list[int] = []

        def loss_fn(m, batch, seen=seen):
            seen.append(len(counter.records))          # collectives issued before this micro-step
            return m(*batch)

        engine = sl.parallelize(model, plan, optimizer=make_optimizer("adamw"), loss_fn=loss_fn)
        with sl.count_collectives() as counter:
            engine.step(make_batches("gpt", 1, 16)[0])
        out.append((zero, seen, len(counter.records)))
    return out


def test_accumulation_communicates_only_on_the_last_micro_step(world):
    for zero, seen, total in world(2, _comm_per_micro_step, 2)[1]:
        if zero < 3:
            assert seen == [0, 0, 0, 0], (zero, seen)
            assert total > 0
        else:                                          # ZeRO-3 gathers and reduces every micro-step
            assert seen[0] == 0 and seen[1] > 0 and seen[1:] == sorted(seen[1:])
