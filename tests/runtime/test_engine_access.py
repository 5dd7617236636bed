"""Touching parameters between steps, and the checkpoint form.

* ZeRO-3 between steps: reading a parameter raises a ``ShardingError`` that names it and the fix
  (it used to kill the process: full shape, 0 bytes of storage — so that case runs in a
  subprocess); ``model.state_dict()`` and ``torch.save`` of it raise pointing to
  ``engine.full_state_dict()`` (they used to write a file ``torch.load`` cannot read).
* ``engine.gathered()``: full fp32 parameters in the model inside; read-only by default (edits
  are dropped), ``writable=True`` writes edits to the masters and the compute copies — checked by
  training on after an edit and matching one process that made the same edit.
* ``engine.full_state_dict()`` at every stage, fp32 and bf16: the keys of a fresh model's
  ``state_dict`` (tied weights under both names, buffers), the same on every rank, loading with
  ``strict=True`` into a fresh single-process model that then computes what the engine's does.
* A warning, once, where bf16/fp16 compute lands on a CPU with no native support for it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from test_engine_data_parallel import (
    DTYPES,
    check_parity,
    edit_params,
    make_batches,
    make_model,
    make_optimizer,
    reference_for,
    run_configs,
)

import shardlib as sl
from shardlib.runtime import machine as engine_module
from shardlib.testing import get_mesh

# ---------------------------------------------------------------------------------------------
# ZeRO-3 at rest: a clear error, never a crash (in a subprocess: the old failure is SIGSEGV)
# ---------------------------------------------------------------------------------------------

_AT_REST = textwrap.dedent("""
    import io, torch, shardlib as sl
    from shardlib.models import MLP, regression_batch
    model = MLP((7, 13, 11, 5), seed=0)
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": 1}), zero=3),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    engine.step(regression_batch((7, 13, 11, 5), 8, seed=1))
    w = model.layers[1].weight
    print("SHAPE", tuple(w.shape), w.dtype, w.requires_grad, isinstance(w, torch.nn.Parameter))
    print("REPR", repr(w))
    for what, fn in [("sum", lambda: w.sum()), ("index", lambda: w[0, 0]), ("item", lambda: w.item()),
                     ("data", lambda: w.data.clone()), ("tolist", lambda: w.tolist()),
                     ("save param", lambda: torch.save(w, io.BytesIO())),
                     ("state_dict", lambda: torch.save(model.state_dict(), io.BytesIO())),
                     ("load_state_dict", lambda: model.load_state_dict(MLP((7, 13, 11, 5), seed=1).state_dict()))]:
        try:
            fn()
            print("NO ERROR", what)
        except sl.ShardingError as e:
            print("ERROR", what, "|", str(e).replace("\\n", " "))
    buf = io.BytesIO()
    torch.save(engine.full_state_dict(), buf)
    buf.seek(0)
    fresh = MLP((7, 13, 11, 5), seed=1)
    fresh.load_state_dict(torch.load(buf), strict=True)
    with engine.gathered():
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    print("RELOADED", same)
""")


def test_zero3_parameters_at_rest_raise_instead_of_crashing():
    proc = subprocess.run([sys.executable, "-c", _AT_REST], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert "SHAPE (11, 13) torch.float32 True True" in lines, proc.stdout
    assert any(ln.startswith("REPR ShardedParameter(layers.1.weight") for ln in lines), proc.stdout
    errors = {ln.split(" | ")[0][6:]: ln.split(" | ")[1] for ln in lines if ln.startswith("ERROR ")}
    assert set(errors) == {"sum", "index", "item", "data", "tolist", "save param", "state_dict", "load_state_dict"}, \
        proc.stdout
    for what, msg in errors.items():
        if what in ("state_dict", "load_state_dict"):
            assert msg.startswith(f"model.{what}(): under ZeRO-3") and "engine.gathered(" in msg, msg
        else:
            assert msg.startswith("layers.1.weight: a ZeRO-3 parameter is sharded over 'data'"), msg
            assert "engine.gathered()" in msg and "engine.full_state_dict()" in msg, msg
    assert "engine.full_state_dict()" in errors["state_dict"]
    assert "RELOADED True" in lines, proc.stdout


# ---------------------------------------------------------------------------------------------
# gathered(), state_dict and full_state_dict on real ranks
# ---------------------------------------------------------------------------------------------

def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


def _access(data: int, name: str, zero: int, precision: str) -> dict:
    mesh = get_mesh({"data": data})
    model = make_model(name, seed=mesh.rank)
    plan = sl.plan(model, mesh, zero=zero, precision=precision)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer("adamw"))
    batches = make_batches(name, 3)
    for batch in batches[:2]:
        engine.step(batch)
    out = {}
    with sl.count_collectives() as counted:
        full = engine.full_state_dict()
    out["full"] = full
    # the sharded parameters' values: one all-gather over data, an all-gather's bytes (each rank's
    # parts padded to the widest rank's), not an all-reduce of zero-filled full tensors
    sharded = [s for s in engine.states if s.plan.quant is None and engine.access.replicated(s) is None]
    widest = max((sum(hi - lo for lo, hi in (s.slot.piece(plan.flat.groups[s.slot.group].segments[s.slot.segment]
                                                              .bounds(r)) for s in sharded)) for r in range(data)),
                 default=0)
    out["gather_records"] = [(r.op, r.axes, r.bytes) for r in counted.records if r.axes == ("data",)]
    out["gather_expected"] = [("all_gather", ("data",), (data - 1) * widest * 4)] if sharded else []
    out["rank0_buffers_here"] = {n: b.clone() for n, b in model.named_buffers()}
    # at rest: model.state_dict() raises under ZeRO-3 only, and so does reading a parameter
    try:
        model.state_dict()
        out["state_dict"] = "ok"
    except sl.ShardingError as e:
        out["state_dict"] = str(e)
    first = next(iter(model.parameters()))
    try:
        float(first.detach().float().sum())
        out["read"] = "ok"
    except sl.ShardingError as e:
        out["read"] = str(e)
    # read-only: full fp32 values, as in full_state_dict; edits are dropped
    with engine.gathered() as m:
        inside = m.state_dict()
        out["inside_dtypes"] = {str(p.dtype) for p in m.parameters()}
        out["inside_equal"] = all(torch.equal(inside[k], full[k]) for k, _ in m.named_parameters())
        edit_params(m)
    after = engine.full_state_dict()
    out["unchanged"] = all(torch.equal(after[k], full[k]) for k in full)
    # a forward outside a step (evaluation) computes with the current parameters, frees what it gathers
    x = _cast(batches[2][0], plan.compute_dtype)
    with torch.no_grad():
        out["eval"] = model(x).float()
    out["held"], out["planned"] = engine.memory_held(), plan.memory_per_rank()
    # load another model's values: refused at rest under ZeRO-3, written through inside writable
    other = make_model(name, seed=7).state_dict()
    if zero == 3:
        try:
            model.load_state_dict(other)
            out["load_at_rest"] = "ok"
        except sl.ShardingError as e:
            out["load_at_rest"] = str(e)
    with engine.gathered(writable=True) as m:
        m.load_state_dict(other)
    loaded = engine.full_state_dict()
    # a frozen parameter under mixed precision is stored in the compute dtype only (no fp32 master)
    out["loaded"] = all(torch.equal(loaded[k], (other[k] if p.requires_grad else other[k].to(plan.compute_dtype)).float())
                        for k, p in model.named_parameters())
    # misuse: a step inside the block, a block inside the block
    out["step inside"] = out["nested"] = "ok"
    with engine.gathered():
        try:
            engine.step(batches[2])
        except sl.ShardingError as e:
            out["step inside"] = str(e)
        try:
            with engine.gathered():
                pass
        except sl.ShardingError as e:
            out["nested"] = str(e)
    out["loss_after"] = engine.step(batches[2])
    return out


ACCESS = [(name, zero, precision) for name in ("gpt_tied", "bn", "gpt_frozen") for zero in range(4)
          for precision in ("fp32", "bf16")]


def _access_all(data: int) -> list[dict]:
    return [_access(data, *cfg) for cfg in ACCESS]


@pytest.fixture(scope="module")
def access(world):
    return world(2, _access_all, 2)


def test_full_state_dict_is_a_fresh_models_state_dict_on_every_rank(access):
    for i, (name, zero, precision) in enumerate(ACCESS):
        where = f"{name} zero={zero} {precision}"
        fulls = [per_rank[i]["full"] for per_rank in access]
        fresh = make_model(name, seed=3)
        assert list(fulls[0]) == list(fresh.state_dict()), where        # keys, in order: tied, buffers
        for full in fulls[1:]:                                          # the same on every rank
            assert all(torch.equal(full[k], fulls[0][k]) for k in full), where
        fresh.load_state_dict(fulls[0], strict=True)
        for n, p in fresh.named_parameters():                           # fp32 values, the masters'
            assert fulls[0][n].dtype == torch.float32 and torch.equal(p, fulls[0][n]), f"{where} {n}"
        for n, b in access[0][i]["rank0_buffers_here"].items():         # buffers: rank 0's
            assert torch.equal(fulls[0][n], b), f"{where} {n}"
        # the fresh model computes what the engine's model computes outside a step
        x = make_batches(name, 3)[2][0]
        with torch.no_grad():
            want = fresh.to(DTYPES[precision])(_cast(x, DTYPES[precision])).float()
        for per_rank in access:
            torch.testing.assert_close(per_rank[i]["eval"], want, rtol=0, atol=0, msg=where)


def test_full_state_dict_sends_an_all_gathers_bytes(access):
    for cfg, per_rank in zip(ACCESS, zip(*access)):
        for res in per_rank:
            got = [g for g in res["gather_records"] if g[0] != "broadcast"]     # buffers: rank 0's, broadcast
            assert got == res["gather_expected"], (cfg, got, res["gather_expected"])


def test_model_state_dict_raises_under_zero3_and_is_full_inside_gathered(access):
    for per_rank in access:
        for (name, zero, precision), res in zip(ACCESS, per_rank):
            where = f"{name} zero={zero} {precision}"
            if zero == 3:
                assert "engine.full_state_dict()" in res["state_dict"], where
                assert "sharded over 'data'" in res["read"] and "engine.gathered()" in res["read"], where
                assert "engine.gathered(writable=True)" in res["load_at_rest"], where
            else:
                assert res["state_dict"] == res["read"] == "ok", where
            assert res["inside_dtypes"] == {"torch.float32"} and res["inside_equal"], where
            assert res["unchanged"], f"{where}: an edit inside gathered() (read-only) changed the parameters"
            assert res["loaded"], f"{where}: load_state_dict inside gathered(writable=True) was not written back"
            assert res["held"] == res["planned"], f"{where}: {res['held']} vs {res['planned']}"
            assert "step: called inside" in res["step inside"] and "already inside" in res["nested"], where


def test_steps_after_loading_agree_across_ranks(access):
    for i, cfg in enumerate(ACCESS):
        assert len({per_rank[i]["loss_after"] for per_rank in access}) == 1, cfg


# ---------------------------------------------------------------------------------------------
# gathered(writable=True): an edit between steps trains on like one process that made it
# ---------------------------------------------------------------------------------------------

EDITED = [{"model": m, "zero": z, "optimizer": "sgd", "edit_at": 2, **p} for m in ("mlp", "gpt_tied", "gpt_frozen")
          for z in range(4) for p in ({}, {"precision": "bf16"})]


def test_edits_inside_writable_gathered_reach_masters_and_compute_copies(world):
    init = {m: dict(make_model(m).named_parameters()) for m in ("mlp", "gpt_tied", "gpt_frozen")}
    for cfg, results in zip(EDITED, run_configs(world, EDITED, 2)):
        ref = reference_for(cfg)
        plain = reference_for({k: v for k, v in cfg.items() if k != "edit_at"})
        tol = {}
        if cfg.get("precision") == "bf16":     # the tolerances of test_engine_precision
            eps = torch.finfo(torch.bfloat16).eps
            moved = max(float((p - init[cfg["model"]][n].detach()).abs().max()) for n, p in ref["params"].items())
            tol = {"rtol": 2.5 * eps, "param_tol": {"rtol": 0.0, "atol": 2.5 * eps * moved}}
        check_parity(cfg, results, ref, **tol)
        # and the edit matters: a run that dropped it would not pass
        with pytest.raises(AssertionError):
            check_parity(cfg, results, plain, **tol)


# ---------------------------------------------------------------------------------------------
# Item 7: low precision on a CPU without native support warns, once
# ---------------------------------------------------------------------------------------------

def _build(precision: str) -> list[warnings.WarningMessage]:
    model = make_model("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sl.parallelize(model, sl.plan(model, sl.Mesh({"data": 1}), precision=precision),
                       optimizer=make_optimizer("sgd"))
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "precision='fp32'" in str(w.message)]


def test_low_precision_on_a_cpu_without_native_support_warns_once(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(engine_module, "_cpu_flags", lambda: {"fpu", "sse2", "avx", "avx2", "fma"})
    engine_module._warn_once.cache_clear()
    first = _build("bf16")
    assert len(first) == 1, first
    msg = str(first[0].message)
    assert "bf16" in msg and "avx2" in msg and "avx512_bf16" in msg and "fp32" in msg, msg
    assert _build("bf16") == []                            # once per process
    assert len(_build("fp16")) == 1                        # fp16 is another case, warned once too
    assert _build("fp32") == []
    # a CPU that has it: no warning
    monkeypatch.setattr(engine_module, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    engine_module._warn_once.cache_clear()
    assert _build("bf16") == []
    engine_module._warn_once.cache_clear()
