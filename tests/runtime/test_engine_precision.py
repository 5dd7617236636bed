"""Mixed precision (bf16, fp16) against a single process under the same autocast policy.

The policy (``reference_run``): fp32 master parameters, a compute copy cast to bf16/fp16, floating
inputs cast, gradients upcast to fp32 for the update; fp16 multiplies the loss by a dynamic scale
and skips a step whose gradients overflow. With one rank the engine reproduces this reference
bit for bit (checked below), so what remains at N > 1 is low-precision rounding of a different
order of operations: each rank's gradient is rounded to the low dtype on its own rows, and the
reduction sums in the low dtype.

Tolerances, in units of the low dtype's machine epsilon (bf16 2^-7, fp16 2^-10), from runs of
the GPT and the MLP at N = 2 and 4, every ZeRO stage, AdamW and SGD:

* losses, max relative difference: measured 9.3e-3 (bf16, 1.2 eps), 9.4e-4 (fp16, 0.96 eps);
  bound 2.5 eps (1.95e-2, 2.44e-3);
* final parameters (SGD runs, where the update is linear in the gradient), max absolute
  difference relative to how far the reference moved them (max |θ_ref − θ_0|): measured 0.72%
  (bf16) and 0.07% (fp16); bound 2.5 eps (1.95%, 0.24%). A wrong gradient scale (a missing 1/N,
  a scale not divided out) moves parameters by 100% or more. AdamW's final parameters are not
  compared: Adam normalizes each element's gradient, so an element whose gradient is rounding
  noise moves by up to lr either way (the same run against the fp32 reference differs by 70%).

These bounds are about as wide as the gap between the bf16 and the fp32 reference themselves,
so they cannot tell the policy from plain fp32 training; the one-rank test does (bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_data_parallel import DTYPES, check_parity, make_batches, make_model, reference_for, reference_run, run_configs

SCALE = 2.0 ** 10          # an initial fp16 loss scale that does not overflow these models


def _eps(precision: str) -> float:
    return torch.finfo(DTYPES[precision]).eps


def _check_mixed(cfg: dict, results: list[dict], ref: dict) -> None:
    eps = _eps(cfg["precision"])
    sgd = cfg.get("optimizer", "adamw").startswith("sgd")
    init = dict(make_model(cfg["model"]).named_parameters())
    moved = max(float((p - init[n].detach()).abs().max()) for n, p in ref["params"].items())
    check_parity(cfg, results, ref, rtol=2.5 * eps,
                 param_tol={"rtol": 0.0, "atol": 2.5 * eps * moved} if sgd else {"rtol": 1.0, "atol": 1.0})


def _configs(data: int) -> list[dict]:
    out = []
    for prec in ("bf16", "fp16"):
        extra = {"precision": prec, **({"loss_scale": SCALE} if prec == "fp16" else {})}
        for model in ("gpt", "mlp"):
            for zero in range(4):
                out.append({"model": model, "zero": zero, "optimizer": "sgd", **extra})
                if data == 2:
                    out.append({"model": model, "zero": zero, **extra})
                    out.append({"model": model, "zero": zero, "optimizer": "sgd", "grad_accum": 2, "clip": 0.05,
                                "recompute": True, **extra})
    # gradients reduced in another dtype than the compute dtype
    out += [{"model": "mlp", "zero": z, "optimizer": "sgd", "precision": "bf16", "reduce_dtype": "fp32"}
            for z in range(4)]
    return out


@pytest.mark.parametrize("data", [2, 4])
def test_mixed_precision_matches_the_same_policy(world, data):
    cfgs = _configs(data)
    for cfg, results in zip(cfgs, run_configs(world, cfgs, data)):
        ref = reference_for({k: v for k, v in cfg.items() if k != "reduce_dtype"})
        assert ref["skipped"] == [], cfg
        _check_mixed(cfg, results, ref)


def test_one_rank_is_the_reference_bit_for_bit():
    """The policy is the same, not just close: with one rank nothing is reordered."""
    cfgs = [{"model": m, "zero": z, "optimizer": "sgd", "precision": p,
             **({"loss_scale": SCALE} if p == "fp16" else {})}
            for m in ("gpt", "mlp") for z in (0, 3) for p in ("bf16", "fp16")]
    for cfg, results in zip(cfgs, run_configs(None, cfgs, 1)):
        ref = reference_for(cfg)
        assert results[0]["losses"] == ref["losses"], cfg
        for name, want in ref["params"].items():
            torch.testing.assert_close(results[0]["params"][name], want, rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# fp16: a forced overflow skips exactly that step, on every rank
# ---------------------------------------------------------------------------------------------

def _overflow_batches(data: int, step: int = 2):
    """MLP batches where step ``step`` holds 1e5 (inf in fp16) in the last row only: it reaches
    the last rank alone, whose gradients become NaN; the other ranks' stay finite."""
    batches = make_batches("mlp")
    x, y = batches[step]
    x = x.clone()
    x[-1, 0] = 1e5
    batches[step] = (x, y)
    return batches


@pytest.mark.parametrize("data", [2, 4])
def test_fp16_overflow_skips_that_step_on_every_rank(world, data):
    batches = _overflow_batches(data)
    cfgs = [{"model": "mlp", "zero": z, "optimizer": opt, "precision": "fp16", "loss_scale": SCALE,
             "batches": batches, **kw}
            for z in range(4) for opt, kw in (("sgd", {}), ("adamw", {"grad_accum": 2, "clip": 0.05}))]
    ref = reference_run("mlp", optimizer="sgd", precision="fp16", scale=SCALE, batches=batches)
    assert ref["skipped"] == [2]
    for cfg, results in zip(cfgs, run_configs(world, cfgs, data)):
        for r, res in enumerate(results):
            assert res["skipped"] == [2], f"{cfg}: rank {r} skipped {res['skipped']}"
            assert res["loss_scale"] == SCALE / 2, f"{cfg}: rank {r}"
        _check_mixed(cfg, results, reference_run("mlp", **{k: cfg[k] for k in ("optimizer", "precision", "batches")},
                                                 grad_accum=cfg.get("grad_accum", 1), clip=cfg.get("clip"),
                                                 scale=SCALE))
