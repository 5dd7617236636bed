"""Checkpoints in DCP's standard layout: torch's own tools read an engine's checkpoint by name, an
FSDP2 checkpoint loads into an engine and an engine's into FSDP2.

A GPT with uneven shards (vocabulary 67, MLP 90) trained 2 steps with AdamW on one side, saved,
loaded on the other side (a fresh model of another seed), and both train the same 2 more steps: the
losses agree within fp32 round-off (1e-5 relative) — parameters, Adam's moments and step counts
came across. FSDP2's checkpoints both as torchtitan writes them (model keys at the top, the
optimizer flattened under ``optimizer``) and as DCP's tutorial does (``{"model": ..., "optim": ...}``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardlib as sl
from shardlib.models import GPT, GPTConfig, token_batch
from shardlib.runtime.checkpoint.core import CheckpointError
from shardlib.testing import get_mesh

CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=2, mlp_width=90)
TP = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
LAYOUTS = {"zero3": ({"data": 2}, {"zero": 3}), "zero1": ({"data": 2}, {"zero": 1}),
           "tp2_sp": ({"data": 1, "tensor": 2}, {"sequence_parallel": True})}
ADAMW = dict(lr=1e-2, weight_decay=0.1)


def batch(i: int):
    return token_batch(CFG, 8, 200 + i)


def engine_of(layout: str, seed: int):
    shape, kw = LAYOUTS[layout]
    model = GPT(CFG, seed=seed)
    plan = sl.plan(model, get_mesh(shape), rules=TP if "tensor" in shape else None, batch=batch(0), **kw)
    return sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, **ADAMW))


def fsdp_of(seed: int):
    from torch.distributed.fsdp import fully_shard

    model = GPT(CFG, seed=seed)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def fsdp_step(model, opt, b) -> float:
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = b[0].shape[0] // n
    loss = model(*(t[rank * rows:(rank + 1) * rows] for t in b))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    dist.all_reduce(out)
    return float(out) / n


def _options(flat: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def engine_then_fsdp(layout: str, folder: str) -> dict:
    """An engine trains 2 steps and saves; FSDP2 loads it (torchtitan's keys) and trains on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    engine = engine_of(layout, seed=0)
    first = [engine.step(batch(i)) for i in range(2)]
    engine.save(folder)
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    ref = [engine.step(batch(i)) for i in (2, 3)]
    model, opt = fsdp_of(seed=5)
    fsdp_step(model, opt, batch(9))               # (any state: it is overwritten)
    msd, osd = get_state_dict(model, opt, options=_options(True))
    state = {**msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict={k: state[k] for k in msd}, optim_state_dict=state["optimizer"],
                   options=_options(True))
    got = [fsdp_step(model, opt, batch(i)) for i in (2, 3)]
    return {"first": first, "ref": ref, "got": got, "full": full if dist.get_rank() == 0 else None}


def fsdp_then_engine(layout: str, folder: str, style: str) -> dict:
    """FSDP2 trains 2 steps and saves (``style``: torchtitan's keys or DCP's tutorial's); an engine
    loads it and trains on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = fsdp_of(seed=0)
    first = [fsdp_step(model, opt, batch(i)) for i in range(2)]
    msd, osd = get_state_dict(model, opt, options=_options(style == "torchtitan"))
    dcp.save({**msd, "optimizer": osd} if style == "torchtitan" else {"model": msd, "optim": osd},
             checkpoint_id=folder)
    ref = [fsdp_step(model, opt, batch(i)) for i in (2, 3)]
    engine = engine_of(layout, seed=5)
    extra = engine.load(folder)
    steps = engine.step_count
    got = [engine.step(batch(i)) for i in (2, 3)]
    return {"first": first, "ref": ref, "got": got, "extra": extra, "steps": steps}


def another_model_refused(folder: str) -> str:
    """An FSDP2 checkpoint of a wider model loaded into an engine: refused, naming the tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from torch.distributed.fsdp import fully_shard

    wide = GPT(GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=2, mlp_width=64), seed=0)
    fully_shard(wide)
    dcp.save(get_model_state_dict(wide), checkpoint_id=folder)
    engine = engine_of("zero3", seed=0)
    try:
        engine.load(folder)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def engine_saves(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    out = {}
    for layout in ("zero3", "tp2_sp"):
        folder = str(root / layout)
        out[layout] = (folder, world(2, engine_then_fsdp, layout, folder))
    return out


@pytest.mark.parametrize("layout", ["zero3", "tp2_sp"])
def test_an_engine_checkpoint_loads_into_fsdp2(engine_saves, layout):
    _, per_rank = engine_saves[layout]
    r = per_rank[0]
    assert all(p["ref"] == r["ref"] and p["got"] == r["got"] for p in per_rank)
    assert _close(r["got"], r["ref"]), (r["got"], r["ref"])


def test_dcp_to_torch_save_gives_the_state_dict_by_name(engine_saves, tmp_path):
    """torch's converter on an engine's checkpoint (ZeRO-3, and tensor 2 with SP): every key of the
    model's ``state_dict`` with its full value (the engine's ``full_state_dict``), Adam's moments by
    parameter name, equal between the two layouts."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    names = set(GPT(CFG, seed=0).state_dict())
    conv = {}
    for layout, (folder, per_rank) in engine_saves.items():
        dcp_to_torch_save(folder, tmp_path / f"{layout}.pt")
        sd = torch.load(tmp_path / f"{layout}.pt", weights_only=False)
        assert names <= set(sd), sorted(names - set(sd))
        full = per_rank[0]["full"]
        for k in names:
            assert torch.equal(sd[k], full[k]), k
        moments = {k for k in sd["optimizer"] if k.startswith("state.")}
        params = {k for k, _ in GPT(CFG, seed=0).named_parameters()}
        assert moments == {f"state.{p}.{m}" for p in params for m in ("exp_avg", "exp_avg_sq", "step")}
        assert all(sd["optimizer"][f"param_groups.{p}.lr"] == ADAMW["lr"] for p in params)
        conv[layout] = sd
    a, b = conv["zero3"], conv["tp2_sp"]
    for k, v in a["optimizer"].items():
        if isinstance(v, torch.Tensor):
            rel = float((v - b["optimizer"][k]).norm() / v.norm().clamp_min(1e-30))
            assert rel <= 1e-4, (k, rel)                # fp32 round-off of two layouts, through two Adam steps


@pytest.mark.parametrize("layout,style", [("tp2_sp", "torchtitan"), ("zero1", "tutorial"), ("zero3", "torchtitan")])
def test_an_fsdp2_checkpoint_loads_into_an_engine(world, tmp_path, layout, style):
    per_rank = world(2, fsdp_then_engine, layout, str(tmp_path / "fsdp"), style)
    r = per_rank[0]
    assert all(p["got"] == r["got"] for p in per_rank)
    assert r["extra"] == {} and r["steps"] == 2          # the step count from Adam's
    assert _close(r["got"], r["ref"]), (r["got"], r["ref"])


def test_a_foreign_checkpoint_of_another_model_is_refused(world, tmp_path):
    msg = world(2, another_model_refused, str(tmp_path / "wide"))[0]
    assert "blocks.0.mlp" in msg and "(64, 32)" in msg and "(90, 32)" in msg, msg
