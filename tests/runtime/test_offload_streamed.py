"""The host update streamed into the next forward (issue 42, deliverable 4; ``runtime/offload/streamed.py``):
under ZeRO-3 with the optimizer on the host, ``engine.step`` returns while the update runs unit by unit on a
thread, and the next forward's gather of a unit waits for that unit only.

* It overlaps: the last unit's update is held back until the next forward has reached the first block —
  which it can only do if that forward waits for its own units, not for the whole update (otherwise the
  update times out and the test fails) — and the step still finishes with every value right.
* It changes nothing: every loss and every final parameter equals the run whose update is whole before the
  step returns (``offload.stream_update = False``), bit for bit, with clipping, a learning-rate schedule,
  gradient accumulation, bf16 and LoRA's frozen weights; and equals one process within fp32 round-off.
* Counted as planned: each step's host-to-device copies are the plan's.
"""

from __future__ import annotations

import threading

import pytest
import torch

import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=4, mlp_width=90)
STEPS, ROWS, LR = 4, 4, 1e-2


def _opt(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _engine(stream: bool, clip: float | None = 0.5, precision: str = "fp32", accum: int = 1):
    mesh = sl.Mesh({"data": 2})
    plan = sl.plan(GPT(CFG, seed=0), mesh, zero=3, offload={"optimizer": "host"}, clip_grad_norm=clip,
                   precision=precision, grad_accum=accum)
    engine = sl.parallelize(GPT(CFG, seed=0), plan, optimizer=_opt, lr_scheduler=_schedule)
    engine.offload.stream_update = stream
    return engine, plan


def _run(stream: bool, **kw) -> dict:
    engine, plan = _engine(stream, **kw)
    batches = [token_batch(CFG, ROWS, seed=100 + s) for s in range(STEPS)]
    losses, in_flight, copies = [], [], []
    for b in batches:
        losses.append(engine.step(b))
        in_flight.append(engine.offload.in_flight)
        copies.append({op: sum(v for (o, _), v in engine.copies.totals().items() if o == op) for op in ("d2h", "h2d")})
    planned = plan.copy_bytes_per_step(engine.mesh.rank)
    return {"losses": losses, "in_flight": in_flight, "copies": copies, "planned": planned,
            "params": engine.full_state_dict(), "lr": engine.optimizer.param_groups[0]["lr"]}


def _same_as_whole(kw: dict) -> dict:
    return {"streamed": _run(True, **kw), "whole": _run(False, **kw)}


@pytest.mark.parametrize("kw", [{}, {"precision": "bf16", "accum": 2, "clip": None}], ids=["fp32-clip", "bf16-accum2"])
def test_the_streamed_update_is_the_whole_update_bit_for_bit(world, kw):
    for r, res in enumerate(world(2, _same_as_whole, kw)):
        s, w = res["streamed"], res["whole"]
        assert all(s["in_flight"]) and not any(w["in_flight"]), (r, s["in_flight"], w["in_flight"])
        assert s["losses"] == w["losses"], (r, s["losses"], w["losses"])
        bad = [k for k in w["params"] if not torch.equal(s["params"][k], w["params"][k])]
        assert bad == [], f"rank {r}: parameters differ from the whole update's: {bad[:4]}"
        assert s["lr"] == w["lr"] == pytest.approx(LR / (1 + STEPS))
        for step in s["copies"]:                    # each step's copies (d2h grads, h2d params) are the plan's
            assert step == {op: s["planned"][op] for op in ("d2h", "h2d")}, (step, s["planned"])


def _one_process() -> tuple[list[float], dict]:
    model = GPT(CFG, seed=0)
    opt = _opt(model.parameters())
    sched = _schedule(opt)
    losses = []
    for s in range(STEPS):
        loss = model(*token_batch(CFG, ROWS, seed=100 + s))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_streamed_update_trains_like_one_process(world):
    losses, want = _one_process()
    for res in world(2, _run, True):
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(res["params"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def _overlaps() -> dict:
    """Step once; hold the last unit's update of the second step until the third step's forward reaches the
    first block (a pre-hook releases it), then finish: what the third forward saw, and the parameters."""
    engine, _ = _engine(True)
    runner, off = engine.units, engine.offload
    batches = [token_batch(CFG, ROWS, seed=100 + s) for s in range(3)]
    engine.step(batches[0])
    off.wait()                                    # (its update finished before the second one is slowed)
    last = runner.all[-1]
    held_back = {id(s) for s in last.states}
    release, seen = threading.Event(), {}
    publish = off.publish_one

    def slow(s):
        if id(s) in held_back and not seen.get("held"):
            seen["held"] = True
            seen["released"] = release.wait(timeout=60)
        publish(s)

    off.publish_one = slow
    engine.step(batches[1])                       # returns with the update in flight, the last unit held back
    seen["returned_in_flight"] = off.in_flight

    def first_block(module, args):
        if "first_block" not in seen:
            seen["first_block"] = True
            seen["last_ready_then"] = off.streamed._events[id(last)].is_set()
            release.set()

    handle = runner.units[0].module.register_forward_pre_hook(first_block)
    loss = engine.step(batches[2])
    handle.remove()
    off.publish_one = publish
    return {**seen, "loss": loss, "params": engine.full_state_dict()}


def test_the_next_forward_waits_only_for_its_own_unit(world):
    per_rank, whole = world(2, _overlaps), world(2, _three_steps_whole)
    for r, (res, w) in enumerate(zip(per_rank, whole)):
        assert res["returned_in_flight"], r
        assert res["first_block"] and res["last_ready_then"] is False, (r, res)
        assert res["released"] is True, f"rank {r}: the forward waited for the whole update (it never released it)"
        # and the run is the whole update's: the third loss and every parameter after it
        assert res["loss"] == w["loss"], (r, res["loss"], w["loss"])
        bad = [k for k, v in w["params"].items() if not torch.equal(res["params"][k], v)]
        assert bad == [], (r, bad[:4])


def _three_steps_whole() -> dict:
    engine, _ = _engine(False)
    loss = None
    for s in range(3):
        loss = engine.step(token_batch(CFG, ROWS, seed=100 + s))
    return {"loss": loss, "params": engine.full_state_dict()}

