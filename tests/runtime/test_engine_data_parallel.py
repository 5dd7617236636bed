"""The data-parallel engine trains like one process (fp32): DP and ZeRO-1/2/3 at data = 1, 2, 4.

The reference is a plain PyTorch loop written here (``reference_run``), never the engine on one
rank: same initial weights (the model's seed), same global batches, the same optimizer and
scheduler; accumulation as a mean over micro-batches, clipping with
``torch.nn.utils.clip_grad_norm_``. For mixed precision the reference applies the policy the
engine claims: fp32 master parameters, a compute copy cast to the low dtype, floating inputs cast,
gradients upcast to fp32 (and, for fp16, a loss scale that skips steps whose gradients overflow).

The engine runs in a pool of gloo ranks (``world`` fixture); each worker call runs many
configurations and returns per-rank losses and the gathered final parameters, compared here.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

import shardlib as sl
from shardlib.models import GPT, MLP, GPTConfig, regression_batch, token_batch
from shardlib.testing import get_mesh

STEPS = 5
BATCH = 8
GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
# the tensor-parallel tests' GPT: a vocabulary and an MLP width that 2 and 4 do not divide
GPT_TP_CFG = GPTConfig(vocab_size=67, seq_len=8, d_model=32, n_heads=4, n_layers=2, mlp_width=90)
# the pipeline tests' GPT: 8 blocks (pipe 4 x 2 virtual stages), uneven tensor widths as above
GPT_PP_CFG = GPTConfig(vocab_size=67, seq_len=8, d_model=32, n_heads=4, n_layers=8, mlp_width=90)
# a vocabulary (251, prime) whose tables hold over half a block's parameters: under ZeRO-3 wte and
# head are units of their own (planner/units.py), head kept gathered from its forward to its backward
GPT_VOCAB_CFG = GPTConfig(vocab_size=251, seq_len=16, d_model=32, n_heads=4, n_layers=2)
MLP_SIZES = (7, 13, 11, 5)        # odd sizes: every shard uneven at data = 2 and 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_RTOL = 1e-5                  # the bound on losses (max relative difference)


# ---------------------------------------------------------------------------------------------
# Models, data, optimizers (picklable by name, so worker calls can name them)
# ---------------------------------------------------------------------------------------------

def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The model ``name`` with initial values drawn from ``seed``."""
    if name == "gpt":
        return GPT(GPT_CFG, seed=seed)
    if name == "gpt_tp":
        return GPT(GPT_TP_CFG, seed=seed)
    if name == "gpt_pp":
        return GPT(GPT_PP_CFG, seed=seed)
    if name == "gpt_vocab":
        return GPT(GPT_VOCAB_CFG, seed=seed)
    if name == "gpt_vocab_frozen":               # a frozen token table: its unit runs no backward
        m = GPT(GPT_VOCAB_CFG, seed=seed)
        m.wte.weight.requires_grad_(False)
        return m
    if name == "gpt_tied":                       # head.weight is wte.weight
        m = GPT(GPT_CFG, seed=seed)
        m.head.weight = m.wte.weight
        return m
    if name == "gpt_frozen":                     # position embeddings and a block's norm frozen
        m = GPT(GPT_CFG, seed=seed)
        m.wpe.weight.requires_grad_(False)
        for p in m.blocks[1].ln1.parameters():
            p.requires_grad_(False)
        return m
    if name == "mlp":
        return MLP(MLP_SIZES, seed=seed)
    if name == "mlp_unused":
        return UnusedMLP(seed)
    if name == "bn":
        return BatchNormMLP(seed)
    raise KeyError(name)


class UnusedMLP(MLP):
    """An MLP whose last layer (a unit of the stack) and one root parameter never reach the loss."""

    def __init__(self, seed: int = 0):
        super().__init__(MLP_SIZES + (3,), seed=seed)
        self.unused = torch.nn.Parameter(torch.randn(6, 5))

    def forward(self, x, y=None):
        for i, layer in enumerate(self.layers[:-1]):
            x = layer(x)
            if i < len(self.layers) - 2:
                x = torch.tanh(x)
        return torch.nn.functional.mse_loss(x, y)


class BatchNormMLP(torch.nn.Module):
    """``(Linear -> BatchNorm1d -> tanh)`` blocks, then a Linear; buffers: running statistics (fp32)
    and batch counts (int64). A frozen BatchNorm affine bias, too. Batches as the MLP's."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.BatchNorm1d(b))
                                          for a, b in itertools.pairwise(MLP_SIZES[:-1]))
        self.out = torch.nn.Linear(MLP_SIZES[-2], MLP_SIZES[-1])
        for block in self.blocks:                # non-trivial affine parameters, one of them frozen
            torch.nn.init.uniform_(block[1].weight, 0.5, 1.5)
            torch.nn.init.uniform_(block[1].bias, -0.5, 0.5)
        self.blocks[0][1].bias.requires_grad_(False)

    def forward(self, x, y=None):
        for block in self.blocks:
            x = torch.tanh(block(x))
        x = self.out(x)
        return x if y is None else torch.nn.functional.mse_loss(x, y)


def make_batches(model: str, steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if model == "gpt_tp":
        return [token_batch(GPT_TP_CFG, batch, seed=100 + s) for s in range(steps)]
    if model == "gpt_pp":
        return [token_batch(GPT_PP_CFG, batch, seed=100 + s) for s in range(steps)]
    if model.startswith("gpt_vocab"):
        return [token_batch(GPT_VOCAB_CFG, batch, seed=100 + s) for s in range(steps)]
    if model.startswith("gpt"):
        return [token_batch(GPT_CFG, batch, seed=100 + s) for s in range(steps)]
    return [regression_batch(MLP_SIZES, batch, seed=100 + s) for s in range(steps)]


def make_optimizer(kind: str):
    """A factory ``params -> Optimizer`` (the engine's contract)."""
    if kind == "adamw":   # eps 1e-6 (not 1e-8) damps Adam's blow-up of gradients that are round-off noise
        return lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-6)
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "sgd_plain":
        return lambda ps: torch.optim.SGD(ps, lr=0.1)
    if kind == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=1e-2)
    raise KeyError(kind)


def make_scheduler(kind: str | None):
    if kind is None:
        return None
    if kind == "step":
        return lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "onecycle":
        return lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
    if kind == "lambda":
        return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if kind == "plateau":
        return lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=1e-4)
    raise KeyError(kind)


# ---------------------------------------------------------------------------------------------
# The single-process reference
# ---------------------------------------------------------------------------------------------

def edit_params(model: torch.nn.Module) -> None:
    """An edit between steps (``edit_at``): halve every parameter but the first, set that one to 0.01."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i:
                p.mul_(0.5)
            else:
                p.fill_(0.01)


def reference_run(model: str, *, optimizer: str = "adamw", scheduler: str | None = None, precision: str = "fp32",
                  grad_accum: int = 1, clip: float | None = None, scale: float = 2.0 ** 16,
                  batches=None, steps: int = STEPS, edit_at: int | None = None) -> dict:
    """Train ``model`` in one process, plain PyTorch. Returns losses, final fp32 parameters,
    which steps were skipped (fp16 overflow) and the gradient norms before clipping. ``edit_at``:
    before that step, ``edit_params`` edits the fp32 parameters (the compute copy follows)."""
    batches = batches if batches is not None else make_batches(model, steps)
    master = make_model(model)
    cdt = DTYPES[precision]
    mixed = cdt != torch.float32
    compute = copy.deepcopy(master).to(cdt) if mixed else master
    pairs = list(zip(master.parameters(), compute.parameters()))      # tied weights appear once
    trainable = [p for p in master.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer)(trainable)
    sched = make_scheduler(scheduler)(opt) if scheduler else None
    fp16 = precision == "fp16"
    out = {"losses": [], "skipped": [], "norms": []}
    for step, batch in enumerate(batches):
        if step == edit_at:
            edit_params(master)
            if mixed:
                with torch.no_grad():
                    for p, q in pairs:
                        q.copy_(p)
        for _, q in pairs:
            q.grad = None
        total = torch.zeros(())
        rows = batch[0].shape[0] // grad_accum
        for i in range(grad_accum):
            mb = [t[i * rows:(i + 1) * rows] for t in batch]
            mb = [t.to(cdt) if t.is_floating_point() else t for t in mb]
            loss = compute(*mb)
            total += loss.detach().float()
            (loss.float() * ((scale if fp16 else 1.0) / grad_accum)).backward()
        out["losses"].append(float(total / grad_accum))
        if mixed:
            for p, q in pairs:
                if p.requires_grad:
                    p.grad = None if q.grad is None else q.grad.float() / (scale if fp16 else 1.0)
        if fp16 and not all(torch.isfinite(p.grad).all() for p in trainable if p.grad is not None):
            out["skipped"].append(step)
            scale /= 2
            out["norms"].append(float("nan"))
            continue
        norm = torch.nn.utils.clip_grad_norm_(trainable, clip if clip else float("inf"))
        out["norms"].append(float(norm))
        opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(out["losses"][-1])
        elif sched is not None:
            sched.step()
        if mixed:
            with torch.no_grad():
                for p, q in pairs:
                    q.copy_(p)
    out["params"] = {n: p.detach().clone() for n, p in master.named_parameters()}
    out["lr"] = opt.param_groups[0]["lr"]
    return out


# ---------------------------------------------------------------------------------------------
# The engine, in a worker (or in the test process for data = 1)
# ---------------------------------------------------------------------------------------------

def engine_run(cfg: dict, data: int) -> dict:
    """Train with the engine by ``cfg``; return this rank's losses and the gathered parameters."""
    mesh = get_mesh({"data": data})
    # "seed": "rank" builds each rank's model from another seed (the engine starts all from rank 0's)
    model = make_model(cfg["model"], seed=mesh.rank if cfg.get("seed") == "rank" else 0)
    kw = {k: cfg[k] for k in ("zero", "states", "precision", "grad_accum", "recompute", "reduce_dtype",
                              "reshard_after_forward", "bucket_mb", "units", "broadcast_buffers") if k in cfg}
    if "clip" in cfg:
        kw["clip_grad_norm"] = cfg["clip"]
    plan = sl.plan(model, mesh, optimizer=cfg.get("plan_optimizer", "adamw"), **kw)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer(cfg.get("optimizer", "adamw")),
                            lr_scheduler=make_scheduler(cfg.get("scheduler")), loss_scale=cfg.get("loss_scale"))
    batches = cfg.get("batches") or make_batches(cfg["model"], cfg.get("steps", STEPS))
    losses, skipped = [], []
    for step, batch in enumerate(batches):
        if step == cfg.get("edit_at"):
            with engine.gathered(writable=True) as m:
                edit_params(m)
        before = engine.scaler.skipped_steps if engine.scaler else 0
        if cfg.get("local"):
            rows = batch[0].shape[0] // data
            lo = engine.data_index * rows
            losses.append(engine.step(tuple(t[lo:lo + rows] for t in batch), local=True))
        else:
            losses.append(engine.step(batch))
        if engine.scaler and engine.scaler.skipped_steps > before:
            skipped.append(step)
    full = engine.full_state_dict()          # model.state_dict()'s keys: tied weights twice, buffers
    params = {name: full[name] for name, _ in model.named_parameters()}
    return {"losses": losses, "params": params, "lr": engine.optimizer.param_groups[0]["lr"],
            "skipped": skipped, "loss_scale": engine.loss_scale}


def engine_runs(cfgs: list[dict], data: int) -> list[dict]:
    return [engine_run(c, data) for c in cfgs]


def run_configs(world, cfgs: list[dict], data: int) -> list[list[dict]]:
    """``[config][rank] -> result``: every config on ``data`` ranks (in this process for 1)."""
    per_rank = [engine_runs(cfgs, 1)] if data == 1 else world(data, engine_runs, cfgs, data)
    return [[per_rank[r][i] for r in range(len(per_rank))] for i in range(len(cfgs))]


def ref_kwargs(cfg: dict) -> dict:
    kw = {k: cfg[k] for k in ("optimizer", "scheduler", "precision", "grad_accum", "clip", "batches", "steps",
                              "edit_at") if k in cfg}
    if "loss_scale" in cfg:
        kw["scale"] = cfg["loss_scale"]
    return kw


def max_rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


def param_tolerance(cfg: dict) -> dict:
    """fp32 tolerances on final parameters. SGD's update is linear in the gradient: round-off
    stays round-off. Adam divides by sqrt(v): an element whose gradient is round-off noise (the
    key bias of attention has a zero gradient in exact arithmetic) moves by up to ``lr`` per step
    whichever way the noise points, so elementwise only ``atol`` = 1% of ``lr x steps`` holds
    (measured: 5.5e-5 at data = 4)."""
    if cfg.get("optimizer", "adamw").startswith("sgd"):
        return {"rtol": 1e-5, "atol": 1e-6}
    return {"rtol": 1e-3, "atol": 1e-2 * 1e-2 * STEPS}


def check_parity(cfg: dict, results: list[dict], ref: dict, *, rtol: float = FP32_RTOL,
                 param_tol: dict | None = None) -> None:
    """Every rank returns the same losses, within ``rtol`` of the reference; gathered parameters
    match the reference's."""
    tol = param_tol or param_tolerance(cfg)
    first = results[0]["losses"]
    for r, res in enumerate(results):
        assert res["losses"] == first or all(math.isnan(a) and math.isnan(b) or a == b
                                             for a, b in zip(res["losses"], first)), \
            f"{cfg}: rank {r} returned other losses than rank 0"
        assert res.get("skipped", []) == ref["skipped"], f"{cfg}: rank {r} skipped {res['skipped']}, " \
                                                         f"the reference {ref['skipped']}"
    assert len(first) == len(ref["losses"])
    finite = [i for i, x in enumerate(ref["losses"]) if math.isfinite(x)]
    assert finite == [i for i, x in enumerate(first) if math.isfinite(x)], f"{cfg}: {first} vs {ref['losses']}"
    rel = max_rel([first[i] for i in finite], [ref["losses"][i] for i in finite])
    assert rel <= rtol, f"{cfg}: max relative loss difference {rel:.3g} > {rtol:g}\n{first}\n{ref['losses']}"
    for r, res in enumerate(results):
        assert res["params"].keys() == ref["params"].keys()
        for name, want in ref["params"].items():
            torch.testing.assert_close(res["params"][name], want, **tol,
                                       msg=lambda m, n=name, r=r: f"{cfg}: rank {r}, {n}: {m}")


# ---------------------------------------------------------------------------------------------
# Parity sweep: both models x zero 0-3 x {plain, accumulation, clipping, recompute} x data 1, 2, 4
# ---------------------------------------------------------------------------------------------

# SGD (with momentum) in most variants: Adam's update is nearly invariant to the gradient's scale,
# so a run with a wrong gradient scale (a missing 1/N, clipping by the wrong norm) would pass with
# Adam alone.
# bucket_mb=0.001 (1 KiB): many gradient buckets, so a bucket reduced twice or not at all shows.
VARIANTS = [
    {},
    {"grad_accum": 2, "optimizer": "sgd", "bucket_mb": 0.001},
    {"clip": 0.05, "optimizer": "sgd"},
    {"grad_accum": 2, "clip": 0.6, "recompute": True, "optimizer": "sgd", "bucket_mb": 0.001},
    {"grad_accum": 2, "recompute": True},
]


def sweep(models=("gpt", "mlp")) -> list[dict]:
    return [{"model": m, "zero": z, **v} for m in models for z in range(4) for v in VARIANTS]


_REFS: dict = {}


def reference_for(cfg: dict) -> dict:
    kw = ref_kwargs(cfg)
    key = (cfg["model"], repr(sorted((k, v) for k, v in kw.items() if k != "batches")))
    if "batches" in kw or key not in _REFS:
        ref = reference_run(cfg["model"], **kw)
        if "batches" in kw:
            return ref
        _REFS[key] = ref
    return _REFS[key]


def test_reference_clips_and_accumulates_for_real():
    """The sweep's clip threshold is below the gradient norm (so clipping changes the run), and
    accumulation over two micro-batches gives the same run as one batch (the mean of means)."""
    for model in ("gpt", "mlp"):
        plain = reference_for({"model": model, "optimizer": "sgd"})
        clipped = reference_for({"model": model, "clip": 0.05, "optimizer": "sgd"})
        assert min(plain["norms"]) > 0.05, plain["norms"]
        assert max_rel(plain["losses"][1:], clipped["losses"][1:]) > 1e-3
        plain = reference_for({"model": model})
        accum = reference_for({"model": model, "grad_accum": 2})
        assert max_rel(plain["losses"], accum["losses"]) < 1e-5
        # clip 0.6 clips some steps and not others (the branch where the norm is below the bound)
        norms = reference_for({"model": model, "grad_accum": 2, "clip": 0.6, "optimizer": "sgd"})["norms"]
        assert min(norms) < 0.6 < max(norms), norms
    # the plateau scheduler sees both an improving and a worsening loss
    losses = reference_for({"model": "mlp", "optimizer": "sgd", "scheduler": "plateau"})["losses"]
    assert any(b < a for a, b in zip(losses, losses[1:])) and any(b > a for a, b in zip(losses, losses[1:]))


@pytest.mark.parametrize("data", [1, 2, 4])
def test_fp32_sweep_trains_like_one_process(world, data):
    cfgs = sweep()
    for cfg, results in zip(cfgs, run_configs(world, cfgs, data)):
        check_parity(cfg, results, reference_for(cfg))


# ---------------------------------------------------------------------------------------------
# Model shapes and training set-ups beyond the sweep
# ---------------------------------------------------------------------------------------------

S = sl.StateLayouts
EXTRA = (
    # head.weight is wte.weight: one parameter, two owners (both in the root unit)
    [{"model": "gpt_tied", "zero": z, "optimizer": "sgd"} for z in range(4)]
    + [{"model": "gpt_tied", "zero": 3, "grad_accum": 2, "recompute": True}]
    # requires_grad=False: no gradient, no optimizer state, still gathered under ZeRO-3
    + [{"model": "gpt_frozen", "zero": z, "optimizer": "sgd"} for z in range(4)]
    # a unit never called and a root parameter never used: left out of the update, as in one
    # process (SGD with momentum and weight decay would move them if they got a zero gradient)
    + [{"model": "mlp_unused", "zero": z, "optimizer": "sgd", "grad_accum": 2} for z in range(4)]
    # each rank feeds its own rows
    + [{"model": "mlp", "zero": z, "local": True, "grad_accum": 2, "optimizer": "sgd"} for z in range(4)]
    # optimizers x schedulers (the scheduler steps after every update; plateau gets the loss)
    + [{"model": "mlp", "zero": 1, "optimizer": "sgd", "scheduler": "onecycle"},
       {"model": "gpt", "zero": 2, "optimizer": "adam", "scheduler": "step"},
       {"model": "mlp", "zero": 3, "optimizer": "sgd_plain", "scheduler": "lambda"},
       {"model": "mlp", "zero": 0, "optimizer": "sgd", "scheduler": "plateau"},
       {"model": "mlp", "zero": 2, "optimizer": "sgd", "scheduler": "plateau", "grad_accum": 2}]
    # layouts given directly, units and resharding chosen
    + [{"model": "mlp", "states": S(None, None, "data"), "optimizer": "sgd"},
       {"model": "gpt", "states": S(None, "data", "data", False), "optimizer": "sgd"},
       {"model": "gpt", "zero": 3, "reshard_after_forward": False, "optimizer": "sgd"},
       {"model": "gpt", "zero": 3, "units": ["blocks.1"], "optimizer": "sgd", "recompute": ["blocks.1"]}]
    # ZeRO-3's default units with the embeddings and the head as units of their own
    + [{"model": "gpt_vocab", "zero": 3},
       {"model": "gpt_vocab", "zero": 3, "grad_accum": 2, "recompute": True, "optimizer": "sgd"},
       {"model": "gpt_vocab", "zero": 3, "reshard_after_forward": False, "optimizer": "sgd"},
       {"model": "gpt_vocab_frozen", "zero": 3, "grad_accum": 2, "optimizer": "sgd"}]
)


@pytest.mark.parametrize("data", [2, 4])
def test_fp32_extra_models_and_setups_train_like_one_process(world, data):
    for cfg, results in zip(EXTRA, run_configs(world, EXTRA, data)):
        ref = reference_for(cfg)
        check_parity(cfg, results, ref)
        if "scheduler" in cfg:
            assert all(r["lr"] == pytest.approx(ref["lr"], rel=1e-12) for r in results), cfg
            assert ref["lr"] != make_optimizer(cfg["optimizer"])([torch.zeros(1)]).param_groups[0]["lr"]


def test_unused_parameters_at_one_rank_are_left_out_of_the_update(world):
    """At data = 1 the gradient buckets install no hooks (nothing to overlap): whether a parameter
    got a gradient is read after backward, and an unused one is still left out of the update."""
    cfgs = [c for c in EXTRA if c["model"] == "mlp_unused"]
    for cfg, results in zip(cfgs, run_configs(world, cfgs, 1)):
        check_parity(cfg, results, reference_for(cfg))


def test_unused_parameters_stay_as_they_were():
    """The reference leaves unused parameters alone; so the parity above checks the engine does."""
    ref = reference_for({"model": "mlp_unused", "optimizer": "sgd", "grad_accum": 2})
    init = make_model("mlp_unused")
    for name in ("unused", "layers.3.weight", "layers.3.bias"):
        assert torch.equal(ref["params"][name], dict(init.named_parameters())[name])
