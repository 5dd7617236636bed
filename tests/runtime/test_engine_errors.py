"""Bad input to the engine: clear errors, raised on every rank before any collective runs; a
non-finite loss stops the run with a message naming the step."""

from __future__ import annotations

import pytest
import torch
from test_engine_data_parallel import make_batches, make_model, make_optimizer

import shardlib as sl
from shardlib.testing import get_mesh


def _attempt(fn) -> tuple[str, str, int]:
    """Run ``fn``; the error's type and message (or 'ok'), and how many collectives ran — besides the
    set-up broadcast of rank 0's model (``Plan.comm_setup``), which every engine's construction runs
    on every rank alike before it builds the states that the optimizer checks need."""
    with sl.count_collectives() as counter:
        try:
            fn()
            what = ("ok", "")
        except Exception as e:  # noqa: BLE001 — the test inspects the type
            what = (type(e).__name__, str(e))
    return what + (counter.count() - counter.count(tag="setup"),)


def _engine(mesh, zero=0, model="mlp", **kw):
    m = make_model(model)
    return sl.parallelize(m, sl.plan(m, mesh, zero=zero, **kw), optimizer=make_optimizer("adamw"))


def _bad_inputs(data: int) -> dict[str, tuple[str, str, int]]:
    mesh = get_mesh({"data": data})
    out = {}
    x, y = make_batches("mlp", 1, 8)[0]
    out["batch 7"] = _attempt(lambda: _engine(mesh).step((x[:7], y[:7])))
    out["batch 6, accum 2"] = _attempt(lambda: _engine(mesh, grad_accum=2).step((x[:6], y[:6])))
    out["batch 2, accum 4"] = _attempt(lambda: _engine(mesh, 3, grad_accum=4).step((x[:2], y[:2])))
    out["local batch 3, accum 2"] = _attempt(lambda: _engine(mesh, 2, grad_accum=2).step((x[:3], y[:3]), local=True))
    out["dims disagree"] = _attempt(lambda: _engine(mesh).step((x, y[:6])))
    out["no tensors"] = _attempt(lambda: _engine(mesh).step(("a", 1)))
    out["loss not scalar"] = _attempt(lambda: sl.parallelize(
        m := make_model("mlp"), sl.plan(m, mesh), optimizer=make_optimizer("sgd"),
        loss_fn=lambda model, b: (model(b[0]) - b[1]) ** 2).step((x, y)))
    for zero in range(4):
        def unsharded(zero=zero):
            m = make_model("mlp")
            sl.parallelize(m, sl.plan(m, mesh, zero=zero), optimizer=lambda ps: torch.optim.AdamW(m.parameters()))
        out[f"optimizer on the model's parameters, zero={zero}"] = _attempt(unsharded)
    m = make_model("mlp")
    out["optimizer instance"] = _attempt(lambda: sl.parallelize(m, sl.plan(m, mesh, zero=1),
                                                                optimizer=torch.optim.AdamW(m.parameters())))
    out["fp16 with LBFGS"] = _attempt(lambda: sl.parallelize(
        m2 := make_model("mlp"), sl.plan(m2, mesh, precision="fp16"), optimizer=lambda ps: torch.optim.LBFGS(ps)))
    out["factory returns no optimizer"] = _attempt(lambda: sl.parallelize(
        m3 := make_model("mlp"), sl.plan(m3, mesh), optimizer=lambda ps: ps))
    out["loss_scale without fp16"] = _attempt(lambda: sl.parallelize(
        m4 := make_model("mlp"), sl.plan(m4, mesh, precision="bf16"), optimizer=make_optimizer("sgd"), loss_scale=8.0))
    out["everything frozen"] = _attempt(lambda: sl.parallelize(
        m5 := make_model("mlp").requires_grad_(False), sl.plan(m5, mesh), optimizer=make_optimizer("sgd")))
    out["plan of another model"] = _attempt(lambda: sl.parallelize(
        make_model("gpt"), sl.plan(make_model("mlp"), mesh), optimizer=make_optimizer("sgd")))
    pmesh = get_mesh({"pipe": 2} if data == 2 else {"data": data // 2, "pipe": 2})   # no data axis at data 2
    out["loss_fn under a pipe"] = _attempt(lambda: sl.parallelize(
        m6 := make_model("gpt"), sl.plan(m6, pmesh, rules={"layers": "pipe"}), optimizer=make_optimizer("sgd"),
        loss_fn=lambda model, b: model(*b)))
    out["no parameters"] = _attempt(lambda: sl.plan(torch.nn.ReLU(), mesh))
    out["zero=4"] = _attempt(lambda: sl.plan(make_model("mlp"), mesh, zero=4))
    return out


# name -> (error type, words the message must hold)
EXPECTED = {
    "batch 7": ("ShardingError", ["batch of 7", "multiple of {n}", "Use a batch of", "data degree"]),
    "batch 6, accum 2": ("ShardingError", ["batch of 6", "multiple of {2n}", "grad_accum"]),
    "batch 2, accum 4": ("ShardingError", ["batch of 2", "multiple of {4n}", "Use a batch of {4n}, or"]),
    "local batch 3, accum 2": ("ShardingError", ["local batch of 3", "multiple of 2", "Use a batch of 2 or 4"]),
    "dims disagree": ("ShardingError", ["dim 0", "(8, 7)", "(6, 5)"]),
    "no tensors": ("ShardingTypeError", ["no tensors"]),
    "loss not scalar": ("ShardingTypeError", ["scalar", "loss_fn"]),
    "optimizer on the model's parameters, zero=0": ("ok", []),     # fp32 DP: the masters are the parameters
    "optimizer on the model's parameters, zero=1": ("ShardingError", ["unsharded", "ZeRO-1", "factory"]),
    "optimizer on the model's parameters, zero=2": ("ShardingError", ["unsharded", "ZeRO-2", "factory"]),
    "optimizer on the model's parameters, zero=3": ("ShardingError", ["ZeRO-3", "factory"]),
    "optimizer instance": ("ShardingTypeError", ["AdamW", "factory", "lambda params"]),
    "fp16 with LBFGS": ("ShardingError", ["fp16", "LBFGS", "skip", "AdamW"]),
    "factory returns no optimizer": ("ShardingTypeError", ["torch.optim.Optimizer"]),
    "loss_scale without fp16": ("ShardingError", ["loss_scale", "bf16", "fp16"]),
    "everything frozen": ("ShardingError", ["no trainable parameters", "requires_grad"]),
    "plan of another model": ("ShardingError", ["parameters differ"]),
    "loss_fn under a pipe": ("ShardingError", ["loss_fn", "pipeline stages", "Drop loss_fn"]),
    "no parameters": ("ShardingError", ["ReLU", "no parameters"]),
    "zero=4": ("ShardingError", ["zero=4", "out of range"]),
}


@pytest.mark.parametrize("data", [2, 4])
def test_bad_input_is_caught_on_every_rank_before_any_collective(world, data):
    per_rank = world(data, _bad_inputs, data)
    assert all(r.keys() == EXPECTED.keys() for r in per_rank)
    for name, (kind, words) in EXPECTED.items():
        for r, results in enumerate(per_rank):
            got_kind, msg, collectives = results[name]
            assert got_kind == kind, f"{name}, rank {r}: {got_kind}: {msg}"
            assert collectives == 0, f"{name}, rank {r}: {collectives} collectives ran before the error"
            for w in words:
                w = w.format(n=data, **{"2n": 2 * data, "4n": 4 * data})
                assert w in msg, f"{name}, rank {r}: {w!r} not in {msg!r}"


def test_errors_are_value_and_type_errors():
    assert issubclass(sl.ShardingError, ValueError) and issubclass(sl.ShardingTypeError, TypeError)
    assert issubclass(sl.NonFiniteLossError, FloatingPointError)


# ---------------------------------------------------------------------------------------------
# Non-finite loss
# ---------------------------------------------------------------------------------------------

def _nan_run(data: int, zero: int, precision: str, clip: float | None, poison: str) -> dict:
    """Steps 1-2 are clean; step 3 has a NaN (or inf) in the last rank's rows only."""
    mesh = get_mesh({"data": data})
    model = make_model("mlp")
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=zero, precision=precision, clip_grad_norm=clip),
                            optimizer=make_optimizer("sgd"))
    batches = make_batches("mlp", 3)
    x = batches[2][0].clone()
    x[-1, 0] = float("nan") if poison == "nan" else float("inf")
    batches[2] = (x, batches[2][1])
    engine.step(batches[0])
    engine.step(batches[1])
    before = engine.full_state_dict()
    try:
        engine.step(batches[2])
        return {"error": None}
    except sl.NonFiniteLossError as e:
        after = engine.full_state_dict()
        return {"error": str(e), "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


@pytest.mark.parametrize("zero", [0, 3])
def test_nan_loss_stops_naming_the_step(world, zero):
    for precision in ("fp32", "bf16"):
        for r, res in enumerate(world(2, _nan_run, 2, zero, precision, None, "nan")):
            assert res["error"] is not None, f"rank {r}: no error"
            assert "step 3" in res["error"] and "nan" in res["error"] and precision in res["error"], res["error"]
            assert res["unchanged"], f"rank {r}: parameters changed"


def test_nonfinite_gradient_norm_stops_when_clipping(world):
    """An inf input saturates tanh: the loss stays finite but the gradients are NaN. With
    clipping the norm is computed anyway, so the run stops there too."""
    for r, res in enumerate(world(2, _nan_run, 2, 2, "fp32", 1.0, "inf")):
        assert res["error"] is not None and "step 3" in res["error"] and "gradient norm" in res["error"], res
        assert res["unchanged"]


def test_world_of_one_stops_on_a_nan_loss_naming_the_step(world):
    res = _nan_run(1, 1, "fp32", None, "nan")
    assert "step 3" in res["error"] and res["unchanged"]


class _ReadsTheTable(torch.nn.Module):
    """Ties its output to the token table by reading ``wte.weight`` (not sharing the Parameter): under
    ZeRO-3's default units wte is a unit of its own (planner/units.py), freed after its forward."""

    def __init__(self):
        super().__init__()
        from test_engine_data_parallel import GPT_VOCAB_CFG
        from shardlib.models import GPT
        self.gpt = GPT(GPT_VOCAB_CFG, seed=0)
        self.gpt.head.weight.requires_grad_(False)

    def forward(self, idx, targets):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = block(x)
        logits = torch.nn.functional.linear(g.ln_f(x), g.wte.weight) + 0 * g.head(x[:, :1]).sum()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_reading_a_freed_unit_outside_its_forward_names_the_parameter_and_the_fix():
    mesh = get_mesh({"data": 1})
    batch = make_batches("gpt_vocab", 1, 2)[0]
    model = _ReadsTheTable()
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=3), optimizer=make_optimizer("sgd"))
    with pytest.raises(sl.ShardingError) as err:
        engine.step(batch)
    said = str(err.value)
    assert "gpt.wte.weight (unit 'gpt.wte')" in said and "outside its module's forward" in said, said
    assert "units=[...]" in said and "storage of size 0" in said, said
    # with the blocks named as the units, wte stays in the root, whole through the step
    model = _ReadsTheTable()
    blocks = ["gpt.blocks.0", "gpt.blocks.1"]
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=3, units=blocks), optimizer=make_optimizer("sgd"))
    assert torch.isfinite(torch.tensor(engine.step(batch)))
