"""The engine at world 1 on CUDA, each result checked against the same run on the CPU.

Marked ``cuda`` and skipped where ``torch.cuda.is_available()`` is False (no device: the CPU machines
and CI). On a GPU machine: ``python3 -m pytest -m cuda tests/runtime/test_engine_cuda.py``.

Every CUDA test compares numbers, never only "it ran":

* **against the CPU** (the same engine, plan and batches on ``sl.Mesh({"data": 1}, device="cpu")``):
  fp32 losses within 1e-5 relative (the suite's fp32 bound; cuBLAS and MKL order sums differently,
  TF32 is off by default); bf16/fp16 within 2.5 of the low dtype's eps, the bound
  ``test_engine_precision.py`` uses between layouts;
* **against plain PyTorch on the same device** (``reference``: the engine's mixed-precision policy
  written out — fp32 masters, a compute copy in the low dtype, fp16's loss scale divided out of
  fp32 gradients, an overflow skips the step): on the CPU the engine at one rank is this reference
  bit for bit (``test_engine_precision.test_one_rank_is_the_reference_bit_for_bit``; re-checked here
  by ``test_cpu_engine_equals_the_reference_policy``), so on CUDA the bound is tight (a quarter eps in mixed precision,
  1e-6 in fp32);
* recompute: the same losses as without it, and less CUDA memory at the peak;
* checkpoints: the CUDA generator's state comes back on load (a dropout model continues with the
  losses of the uninterrupted run, exactly), and a CUDA checkpoint loads into a CPU engine;
* a meta-device model materialized straight onto the device holds the values of a normal CPU build
  (bit for bit) and trains like it.

``test_cpu_engine_equals_the_reference_policy`` (not marked ``cuda``) runs the same helpers on the CPU here, so the
CPU half of each comparison is tested on every machine.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import shardlib as sl
from shardlib.models import GPT, MLP, GPTConfig, regression_batch, token_batch

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")

STEPS = 4
BATCH = 8
GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
MLP_SIZES = (7, 13, 11, 5)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE = 2.0 ** 10          # an fp16 loss scale that does not overflow these models
FP32_RTOL = 1e-5           # the suite's fp32 bound on losses (max relative difference)


class DropMLP(nn.Module):
    """An MLP with dropout: its losses depend on the device's random-number generator."""

    def __init__(self, seed: int = 0, p: float = 0.3):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(16, 64)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(self.drop(torch.tanh(self.fc1(x)))), y)


def make_model(name: str, seed: int = 0) -> nn.Module:
    if name == "gpt":
        return GPT(GPT_CFG, seed=seed)
    if name == "mlp":
        return MLP(MLP_SIZES, seed=seed)
    if name == "drop":
        return DropMLP(seed)
    if name.startswith("gpt:"):        # gpt:d_model,seq,layers — a wider one for memory checks
        d, s, n = (int(v) for v in name[4:].split(","))
        return GPT(GPTConfig(vocab_size=256, seq_len=s, d_model=d, n_heads=4, n_layers=n), seed=seed)
    raise KeyError(name)


def make_batches(name: str, steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if name == "gpt":
        return [token_batch(GPT_CFG, batch, seed=100 + s) for s in range(steps)]
    if name == "mlp":
        return [regression_batch(MLP_SIZES, batch, seed=100 + s) for s in range(steps)]
    if name == "drop":
        return [regression_batch((16, 4), batch, seed=100 + s) for s in range(steps)]
    if name.startswith("gpt:"):
        d, s, n = (int(v) for v in name[4:].split(","))
        cfg = GPTConfig(vocab_size=256, seq_len=s, d_model=d, n_heads=4, n_layers=n)
        return [token_batch(cfg, batch, seed=100 + i) for i in range(steps)]
    raise KeyError(name)


def make_optimizer(kind: str):
    if kind == "adamw":   # eps 1e-6 damps Adam's blow-up of gradients that are round-off noise
        return lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-6)
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)
    raise KeyError(kind)


def build(device: str, model: str = "gpt", *, precision: str = "fp32", zero: int = 0, recompute: bool = False,
          loss_scale: float | None = None, optimizer: str = "adamw", meta: bool = False, seed: int = 0):
    """The engine for ``model`` on a world-1 mesh on ``device`` (built on the meta device if ``meta``)."""
    mesh = sl.Mesh({"data": 1}, device=device)
    if meta:
        with torch.device("meta"):
            m = make_model(model, seed)
    else:
        m = make_model(model, seed)
    plan = sl.plan(m, mesh, zero=zero, precision=precision, recompute=recompute)
    scale = loss_scale if loss_scale is not None else (SCALE if precision == "fp16" else None)
    return sl.parallelize(m, plan, optimizer=make_optimizer(optimizer), loss_scale=scale)


def train(device: str, model: str = "gpt", *, batches=None, steps: int = STEPS, **kw) -> dict:
    """Train with the engine at world 1 on ``device``: losses, skipped steps, the loss scale and
    the final full state (on the CPU)."""
    eng = build(device, model, **kw)
    batches = batches if batches is not None else make_batches(model, steps)
    losses, skipped = [], []
    for i, b in enumerate(batches):
        before = eng.scaler.skipped_steps if eng.scaler else 0
        losses.append(eng.step(b))
        if eng.scaler and eng.scaler.skipped_steps > before:
            skipped.append(i)
    state = {k: v.detach().to("cpu", copy=True) for k, v in eng.full_state_dict().items()}
    return {"losses": losses, "skipped": skipped, "loss_scale": eng.loss_scale, "state": state}


def reference(device: str, model: str = "gpt", *, precision: str = "fp32", optimizer: str = "adamw",
              scale: float = SCALE, batches=None, steps: int = STEPS) -> dict:
    """Plain PyTorch on ``device`` under the engine's precision policy (``tests/runtime/test_engine_data_parallel.py``'s
    ``reference_run``, on any device): fp32 masters, a compute copy in the low dtype, gradients
    upcast to fp32 (fp16: the loss scaled, the scale divided out, an overflow skips the step and
    halves the scale)."""
    batches = batches if batches is not None else make_batches(model, steps)
    master = make_model(model).to(device)
    cdt = DTYPES[precision]
    mixed = cdt != torch.float32
    compute = copy.deepcopy(master).to(cdt) if mixed else master
    pairs = list(zip(master.parameters(), compute.parameters()))
    params = list(master.parameters())
    opt = make_optimizer(optimizer)(params)
    fp16 = precision == "fp16"
    out = {"losses": [], "skipped": []}
    for step, batch in enumerate(batches):
        for _, q in pairs:
            q.grad = None
        mb = [t.to(device) for t in batch]
        mb = [t.to(cdt) if t.is_floating_point() else t for t in mb]
        loss = compute(*mb)
        out["losses"].append(float(loss.detach().float()))
        (loss.float() * (scale if fp16 else 1.0)).backward()
        if mixed:
            for p, q in pairs:
                p.grad = None if q.grad is None else q.grad.float() / (scale if fp16 else 1.0)
        if fp16 and not all(torch.isfinite(p.grad).all() for p in params if p.grad is not None):
            out["skipped"].append(step)
            scale /= 2
            continue
        opt.step()
        if mixed:
            with torch.no_grad():
                for p, q in pairs:
                    q.copy_(p)
    out["state"] = {k: v.detach().to("cpu", copy=True) for k, v in master.state_dict().items()}
    out["loss_scale"] = scale if fp16 else None
    return out


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def eps(precision: str) -> float:
    return torch.finfo(DTYPES[precision]).eps


def assert_losses(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), what
    assert all(math.isfinite(x) for x in got), f"{what}: non-finite losses {got}"
    err = max_rel(got, want)
    assert err <= rtol, f"{what}: max relative loss difference {err:.3g} > {rtol:.3g}\n  got  {got}\n  want {want}"


def assert_trained(result: dict, model: str, what: str) -> None:
    """The run moved the parameters (the update ran): some element by more than 1e-4."""
    init = make_model(model).state_dict()
    moved = max(float((result["state"][k] - v).abs().max()) for k, v in init.items())
    assert moved > 1e-4, f"{what}: the parameters moved by at most {moved:.3g} — did the update run?"


# ---------------------------------------------------------------------------------------------
# The CPU half, on every machine
# ---------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:parallelize. fp16 compute on this CPU:RuntimeWarning")
def test_cpu_engine_equals_the_reference_policy():
    """The helpers the CUDA tests use, on the CPU: the engine equals the reference policy bit for bit
    in fp32 and fp16 (as the suite's one-rank test says), and training moves the loss."""
    for prec in ("fp32", "fp16"):
        got = train("cpu", "mlp", precision=prec, optimizer="sgd")
        ref = reference("cpu", "mlp", precision=prec, optimizer="sgd")
        assert got["losses"] == ref["losses"], prec
        assert_trained(got, "mlp", prec)
        for k, v in ref["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=0, atol=1e-7)
    got = train("cpu", "gpt", steps=2)
    assert_losses(got["losses"], reference("cpu", "gpt", steps=2)["losses"], FP32_RTOL, "gpt fp32 cpu")


# ---------------------------------------------------------------------------------------------
# CUDA against CPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("zero", [0, 3])
def test_fp32_cuda_matches_cpu(zero):
    """AdamW: losses. (Adam's final weights are not compared elementwise: an element whose gradient
    is round-off noise — attention's key bias — moves by up to lr a step either way, so CPU and
    CUDA kernels part there without any bug; SGD's weights are compared below.)"""
    got = train("cuda", zero=zero)
    cpu = train("cpu", zero=zero)
    assert_trained(got, "gpt", "cuda")
    assert_losses(got["losses"], cpu["losses"], FP32_RTOL, f"fp32 zero={zero}: cuda vs cpu")
    ref = reference("cuda")
    assert_losses(got["losses"], ref["losses"], 1e-6, f"fp32 zero={zero}: engine vs plain PyTorch on cuda")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("zero", [0, 3])
def test_fp32_sgd_gpt_final_weights_cuda_match_cpu(zero):
    got, cpu = train("cuda", zero=zero, optimizer="sgd"), train("cpu", zero=zero, optimizer="sgd")
    assert_trained(got, "gpt", "cuda sgd")
    assert_losses(got["losses"], cpu["losses"], FP32_RTOL, f"gpt sgd fp32 zero={zero}: cuda vs cpu")
    for k, v in cpu["state"].items():      # SGD is linear in the gradient: round-off stays round-off
        torch.testing.assert_close(got["state"][k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.cuda
@cuda
def test_fp32_sgd_final_weights_cuda_match_cpu():
    got, cpu = train("cuda", "mlp", optimizer="sgd"), train("cpu", "mlp", optimizer="sgd")
    assert_losses(got["losses"], cpu["losses"], FP32_RTOL, "mlp sgd fp32: cuda vs cpu")
    for k, v in cpu["state"].items():      # SGD is linear in the gradient: round-off stays round-off
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("zero", [0, 3])
def test_mixed_precision_on_cuda_matches_the_policy_and_the_cpu(precision, zero):
    e = eps(precision)
    got = train("cuda", precision=precision, zero=zero)
    cpu = train("cpu", precision=precision, zero=zero)
    ref = reference("cuda", precision=precision)
    fp32 = train("cuda", zero=zero)
    assert got["skipped"] == ref["skipped"] == [], (got["skipped"], ref["skipped"])
    assert_trained(got, "gpt", precision)
    assert_losses(got["losses"], ref["losses"], 0.25 * e, f"{precision} zero={zero}: engine vs the policy on cuda")
    assert_losses(got["losses"], cpu["losses"], 2.5 * e, f"{precision} zero={zero}: cuda vs cpu")
    assert got["losses"] != fp32["losses"], f"{precision}: the same losses as fp32 — was it computed in fp32?"
    if precision == "fp16":
        assert got["loss_scale"] == cpu["loss_scale"] == SCALE


@pytest.mark.cuda
@cuda
def test_mixed_precision_compute_copy_is_on_cuda_in_the_low_dtype():
    eng = build("cuda", precision="bf16")
    seen = {(p.device.type, p.dtype) for p in eng.model.parameters()}
    assert seen == {("cuda", torch.bfloat16)}, seen


@pytest.mark.cuda
@cuda
def test_fp16_overflow_skips_that_step_on_cuda_as_on_cpu():
    batches = make_batches("mlp")
    x, y = batches[2]
    x = x.clone()
    x[-1, 0] = 1e5                   # inf in fp16: that step's gradients overflow
    batches[2] = (x, y)
    kw = dict(precision="fp16", optimizer="sgd", batches=batches)
    got, cpu = train("cuda", "mlp", **kw), train("cpu", "mlp", **kw)
    ref = reference("cuda", "mlp", precision="fp16", optimizer="sgd", batches=batches)
    assert got["skipped"] == cpu["skipped"] == ref["skipped"] == [2]
    assert got["loss_scale"] == cpu["loss_scale"] == SCALE / 2
    finite = [i for i in range(STEPS) if i != 2]
    assert_losses([got["losses"][i] for i in finite], [ref["losses"][i] for i in finite], 0.25 * eps("fp16"),
                  "fp16 overflow: engine vs the policy on cuda")
    for k, v in cpu["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=0, atol=2.5 * eps("fp16"), msg=lambda m: f"{k}: {m}")


# ---------------------------------------------------------------------------------------------
# Recompute
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_on_cuda_matches_no_recompute_and_the_cpu(precision):
    tol = 1e-6 if precision == "fp32" else 0.25 * eps(precision)
    got = train("cuda", precision=precision, recompute=True)
    plain = train("cuda", precision=precision)
    cpu = train("cpu", precision=precision, recompute=True)
    assert_losses(got["losses"], plain["losses"], tol, f"{precision}: recompute vs not, on cuda")
    assert_losses(got["losses"], cpu["losses"], FP32_RTOL if precision == "fp32" else 2.5 * eps(precision),
                  f"{precision}: recompute, cuda vs cpu")


def _peak_cuda_bytes(recompute: bool) -> int:
    model = "gpt:256,256,4"
    eng = build("cuda", model, precision="bf16", recompute=recompute)
    batches = make_batches(model, steps=2, batch=16)
    eng.step(batches[0])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    eng.step(batches[1])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del eng
    torch.cuda.empty_cache()
    return peak


@pytest.mark.cuda
@cuda
def test_recompute_lowers_the_cuda_peak():
    plain, rec = _peak_cuda_bytes(False), _peak_cuda_bytes(True)
    assert rec < 0.8 * plain, f"recompute's step peak {rec / 2**20:.1f} MiB is not below 0.8x {plain / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Checkpoints: the CUDA generator comes back
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@cuda
def test_checkpoint_round_trip_restores_the_cuda_rng(tmp_path):
    batches = make_batches("drop", steps=5)
    torch.cuda.manual_seed(7)
    a = build("cuda", "drop", optimizer="sgd")
    losses = [a.step(b) for b in batches[:2]]
    saved_rng = torch.cuda.get_rng_state().clone()
    a.save(tmp_path / "ckpt")
    at_save = {k: v.detach().cpu().clone() for k, v in a.full_state_dict().items()}
    assert torch.equal(torch.cuda.get_rng_state(), saved_rng), "save drew from the CUDA generator"
    losses += [a.step(b) for b in batches[2:]]

    torch.cuda.manual_seed(12345)                 # another stream: only the load can bring the saved one back
    torch.rand(1000, device="cuda")
    b = build("cuda", "drop", optimizer="sgd", seed=3)
    b.load(tmp_path / "ckpt")
    assert torch.equal(torch.cuda.get_rng_state(), saved_rng), "load did not restore the CUDA generator's state"
    resumed = [b.step(x) for x in batches[2:]]
    assert resumed == losses[2:], f"resumed {resumed} != uninterrupted {losses[2:]} (dropout masks differ?)"

    # without the generator's state the continuation differs: the check above can fail
    torch.cuda.manual_seed(12345)
    c = build("cuda", "drop", optimizer="sgd", seed=3)
    c.load(tmp_path / "ckpt")
    torch.cuda.manual_seed(999)
    assert [c.step(x) for x in batches[2:]] != losses[2:], "dropout did not depend on the CUDA generator"

    # the CUDA checkpoint loads into a CPU engine: the same values
    d = build("cpu", "drop", optimizer="sgd", seed=3)
    d.load(tmp_path / "ckpt")
    for k, v in d.full_state_dict().items():
        assert torch.equal(v.detach().cpu(), at_save[k]), k


# ---------------------------------------------------------------------------------------------
# Meta-device build, materialized straight onto the device
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("zero", [0, 3])
def test_meta_init_onto_cuda_holds_cpu_build_values_and_trains_alike(zero):
    torch.cuda.synchronize()
    eng = build("cuda", meta=True, zero=zero)
    want = make_model("gpt").state_dict()
    got = eng.full_state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k].detach().cpu(), v), f"{k}: not the values of a normal CPU build"
    masters = {s.master.device.type for s in eng.states if s.master is not None}
    assert masters == {"cuda"}, f"the fp32 masters are on {masters}, expected the device"
    if zero == 0:
        assert {p.device.type for p in eng.model.parameters()} == {"cuda"}
    batches = make_batches("gpt")
    losses = [eng.step(b) for b in batches]
    normal = train("cuda", zero=zero)
    # the same values on the same device: equal up to the non-determinism of CUDA's fp32 attention backward
    assert_losses(losses, normal["losses"], 1e-6, "meta-built vs CPU-built, both on cuda")
