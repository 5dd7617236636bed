"""Checkpoints that change mesh: save the whole training state on one layout, resume on any other.

The matrix: 5 save layouts x 5 load layouts (2x2x2 ZeRO-3 + SP, data 4 ZeRO-1, tensor 2, interleaved
pipe 2 x data 2, one process) of a GPT whose vocabulary (67) and MLP width (90) give uneven shards.
Each save run trains 3 steps, saves, and trains 3 more (the uninterrupted trajectory); each load run
starts from a fresh model (another seed), loads, and trains the same 3 steps. Same layout: the
losses continue bit for bit (fp32). Another layout: within 1e-5 relative (fp32 round-off). AdamW with
a step LR schedule, so optimizer moments, step counts and the scheduler must all come back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import xxhash

import shardlib as sl
from shardlib.algebra.boxes import overlap, range_boxes
from shardlib.models import GPT, GPTConfig, token_batch
from shardlib.runtime.checkpoint.core import CheckpointError, latest, save_step
from shardlib.testing import get_mesh

CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=4, mlp_width=90)
TP = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
LAYOUTS = {
    "3d_zero3": ({"data": 2, "pipe": 2, "tensor": 2}, {"zero": 3, "microbatches": 2, "sequence_parallel": True}),
    "dp4_zero1": ({"data": 4}, {"zero": 1}),
    "tp2": ({"data": 1, "tensor": 2}, {}),
    "pp2_dp2_interleaved": ({"data": 2, "pipe": 2}, {"microbatches": 2, "schedule": "interleaved_1f1b",
                                                     "virtual_stages": 2, "zero": 2}),
    "single": ({"data": 1}, {}),
}
SAVE_AT, MORE = 3, 3


def size(shape: dict) -> int:
    return math.prod(shape.values())


def build(shape: dict, kw: dict, *, seed: int = 0, precision: str = "fp32", lr: float = 1e-2):
    mesh = get_mesh(shape)
    model = GPT(CFG, seed=seed)
    rules = {**(TP if shape.get("tensor", 1) > 1 else {}), **({"layers": "pipe"} if shape.get("pipe", 1) > 1 else {})}
    plan = sl.plan(model, mesh, rules=rules or None, batch=token_batch(CFG, 8, 0), precision=precision, **kw)
    return sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1),
                          lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))


def batch(i: int):
    return token_batch(CFG, 8, 100 + i)


def save_run(name: str, folder: str, precision: str = "fp32") -> list[float]:
    shape, kw = LAYOUTS[name]
    engine = build(shape, kw, precision=precision)
    losses = [engine.step(batch(i)) for i in range(SAVE_AT)]
    engine.save(folder, extra={"data_position": SAVE_AT})
    return losses + [engine.step(batch(i)) for i in range(SAVE_AT, SAVE_AT + MORE)]


def load_run(name: str, folder: str, precision: str = "fp32") -> list[float]:
    shape, kw = LAYOUTS[name]
    engine = build(shape, kw, seed=7, precision=precision)
    extra = engine.load(folder)
    start = extra["data_position"]
    assert start == SAVE_AT and engine.step_count == SAVE_AT and engine.samples_seen == 8 * SAVE_AT
    return [engine.step(batch(i)) for i in range(start, start + MORE)]


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, (shape, _) in LAYOUTS.items():
        folder = str(root / name)
        per_rank = world(size(shape), save_run, name, folder) if size(shape) > 1 else [save_run(name, folder)]
        assert all(r == per_rank[0] for r in per_rank)
        out[name] = (folder, per_rank[0])
    return out


@pytest.mark.parametrize("source", list(LAYOUTS))
def test_resume_on_every_layout_continues_the_saved_run(world, saved, source):
    folder, losses = saved[source]
    for target, (shape, _) in LAYOUTS.items():
        per_rank = world(size(shape), load_run, target, folder) if size(shape) > 1 else [load_run(target, folder)]
        assert all(r == per_rank[0] for r in per_rank), (source, target)
        got, want = per_rank[0], losses[SAVE_AT:]
        if target == source:
            assert got == want, (source, target, got, want)          # bit for bit
        else:
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
            assert rel <= 1e-5, (source, target, rel)


def test_mixed_precision_checkpoints_cross_precisions(world, tmp_path):
    """bf16 compute with fp32 masters: the masters are what is saved; resumed in bf16 on another
    layout it continues within bf16 round-off, and an fp32 engine can take the same masters."""
    folder = str(tmp_path / "bf16")
    losses = world(4, save_run, "dp4_zero1", folder, "bf16")[0]
    again = world(8, load_run, "3d_zero3", folder, "bf16")[0]
    eps = torch.finfo(torch.bfloat16).eps
    assert max(abs(a - b) / abs(b) for a, b in zip(again, losses[SAVE_AT:])) <= 4 * eps
    assert load_run("single", folder)[0] == pytest.approx(losses[SAVE_AT], rel=4 * eps)


# ---- bad input: clear errors, the previous checkpoint intact ---------------------------------------

def _errors(folder: str, other: str, data: int = 2) -> dict:
    """Load attempts that must fail, with what each raised."""
    out = {}
    engine = build({"data": data}, {"zero": 2})
    for label, path in (("missing", other + "/nope"), ("not a checkpoint", other), ("good", folder)):
        try:
            engine.load(path)
            out[label] = "ok"
        except CheckpointError as e:
            out[label] = str(e)
    return out


def test_bad_checkpoints_are_named(world, tmp_path):
    good = str(tmp_path / "good")
    save_run("single", good)
    (tmp_path / "plain").mkdir()
    out = world(2, _errors, good, str(tmp_path / "plain"))[0]
    assert out["good"] == "ok"
    assert "does not exist" in out["missing"]
    assert "is not a checkpoint — no manifest.json" in out["not a checkpoint"]
    # a truncated data file, then a corrupted one: named, before DCP reads anything
    data = sorted(Path(good).glob("*.distcp"))[0]
    raw = data.read_bytes()
    data.write_bytes(raw[: len(raw) // 2])
    out = world(2, _errors, good, str(tmp_path / "plain"))[0]
    assert f"{data.name} is corrupt" in out["good"] and "truncated or corrupt" in out["good"]
    data.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    assert f"{data.name} is corrupt" in world(2, _errors, good, str(tmp_path / "plain"))[0]["good"]
    data.write_bytes(raw)
    # the files' hashes are XXH3-128 of their bytes, computed here apart from the library
    mpath = Path(good) / "manifest.json"
    manifest = json.loads(mpath.read_text())
    assert manifest["hash"] == "xxh3_128"
    files = sorted(p for p in Path(good).iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == [p.name for p in files]
    assert all(manifest["files"][p.name] == xxhash.xxh3_128(p.read_bytes()).hexdigest() for p in files)
    # a checkpoint written before (no "hash": SHA-256 of every file) loads, and its corruption is named
    old = {k: v for k, v in manifest.items() if k != "hash"}
    old["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    mpath.write_text(json.dumps(old))
    data.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    mpath.write_text(json.dumps({**old, "hash": "md5"}))
    # at 4 ranks two of them hash none of the 2 files: each refuses all the same (none waits in a collective)
    refusals = world(4, _errors, good, str(tmp_path / "plain"), 4)
    assert len(manifest["files"]) < 4 and len({r["good"] for r in refusals}) == 1
    out = [refusals[0]["good"]]
    mpath.write_text(json.dumps(old))
    out += [world(2, _errors, good, str(tmp_path / "plain"))[0]["good"]]
    data.write_bytes(raw)
    out += [world(2, _errors, good, str(tmp_path / "plain"))[0]["good"]]
    assert "the manifest names hash 'md5' — this shardlib checks xxh3_128, sha256" in out[0]
    assert f"{data.name} is corrupt (its sha256 hash differs" in out[1]
    assert out[2] == "ok"
    mpath.unlink()
    assert "no manifest.json" in world(2, _errors, good, str(tmp_path / "plain"))[0]["good"]


OTHERS = {  # what differs from the saved model -> the words its refusal must hold
    "fewer layers": (dict(n_layers=3), "adamw", "holds parameter 'blocks.3.ln1.weight', which this model does not have"),
    "more layers": (dict(n_layers=5), "adamw", "has no parameter 'blocks.4.ln1.weight' (32,) — the checkpoint is of another model"),
    "wider MLP": (dict(mlp_width=96), "adamw", "parameter 'blocks.0.mlp.fc.weight' is (90, 32) in"),
    "another optimizer": ({}, "sgd", "was saved with optimizer AdamW, this engine uses SGD"),
}


def _other_model(folder: str, change: dict, opt: str) -> str:
    model = GPT(GPTConfig(**{**CFG.__dict__, **change}), seed=0)
    plan = sl.plan(model, get_mesh({"data": 2}), zero=1)
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if opt == "adamw" else (lambda ps: torch.optim.SGD(ps, lr=1e-2))
    engine = sl.parallelize(model, plan, optimizer=make)
    try:
        engine.load(folder)
    except CheckpointError as e:
        return str(e)
    return "ok"


def test_a_checkpoint_of_another_model_is_refused(world, tmp_path):
    folder = str(tmp_path / "four_layers")
    save_run("single", folder)
    for what, (change, opt, words) in OTHERS.items():
        msg = world(2, _other_model, folder, change, opt)[0]
        assert words in msg, (what, msg)


def _scale_and_rng(folder: str) -> dict:
    """fp16: the loss scale and its counters come back; each rank's RNG comes back as its own."""
    rank = torch.distributed.get_rank()
    engine = build({"data": 2}, {"zero": 1}, precision="fp16")
    for i in range(2):
        engine.step(batch(i))
    engine.scaler.scale, engine.scaler.good_steps, engine.scaler.skipped_steps = 1536.0, 7, 3
    torch.manual_seed(1000 + rank)
    engine.save(folder)
    rng = torch.get_rng_state()
    fresh = build({"data": 2}, {"zero": 1}, precision="fp16", seed=7)
    torch.manual_seed(5)
    fresh.load(folder)
    return {"scaler": (fresh.scaler.scale, fresh.scaler.good_steps, fresh.scaler.skipped_steps),
            "rng": torch.equal(torch.get_rng_state(), rng), "draw": torch.rand(1).item()}


def test_loss_scale_and_rng_come_back(world, tmp_path):
    got = world(2, _scale_and_rng, str(tmp_path / "fp16"))
    assert all(g["scaler"] == (1536.0, 7, 3) for g in got)
    assert all(g["rng"] for g in got)
    assert got[0]["draw"] != got[1]["draw"]          # each rank its own stream, not rank 0's


def test_metadata_that_asks_for_code_is_never_unpickled(tmp_path):
    """DCP pickles ``.metadata``; a tampered one (its hash put in the manifest too) that would run
    code when unpickled is refused by name, and the code does not run."""
    import pickle

    folder = tmp_path / "ck"
    save_run("single", str(folder))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = folder / ".metadata"
    meta.write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][".metadata"] = xxhash.xxh3_128(meta.read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    engine = build({"data": 1}, {})
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        engine.load(str(folder))
    assert not marker.exists()


def _failing_save(folder: str, kind: str) -> str:
    """Save once, then fail the second save as ``kind`` (the disk full, no permission) on rank 1."""
    import torch.distributed.checkpoint.filesystem as fs

    engine = build({"data": 2}, {"zero": 1})
    engine.step(batch(0))
    engine.save(folder, extra={"n": 1})
    engine.step(batch(1))
    original = fs.FileSystemWriter.write_data
    if engine.mesh.rank == 1:
        err = OSError(28, "No space left on device") if kind == "full" else PermissionError(13, "Permission denied")

        def write_data(self, plan, planner):
            raise err
        fs.FileSystemWriter.write_data = write_data
    try:
        engine.save(folder, extra={"n": 2})
        return "ok"
    except CheckpointError as e:
        return str(e)
    finally:
        fs.FileSystemWriter.write_data = original


@pytest.mark.parametrize("kind, words", [("full", "No space left on device"), ("permission", "Permission denied")])
def test_a_failed_save_keeps_the_previous_checkpoint(world, tmp_path, kind, words):
    folder = tmp_path / "ckpt"
    msgs = world(2, _failing_save, str(folder), kind)
    assert all("writing" in m and words in m and "previous checkpoint (if any) is untouched" in m for m in msgs), msgs
    assert json.loads((folder / "manifest.json").read_text())["extra"] == {"n": 1}
    assert not list(tmp_path.glob(".ckpt.tmp-*"))


def _killed_mid_save(folder: str, when: str) -> None:
    """A second save killed with SIGKILL: rank 1 while DCP writes, or rank 0 before it installs."""
    import torch.distributed.checkpoint.filesystem as fs

    from shardlib.runtime.checkpoint import core as ck
    engine = build({"data": 2}, {"zero": 3})
    engine.step(batch(0))
    save_step(engine, folder, 1, extra={"step": 1})
    engine.step(batch(1))
    if when == "writing" and engine.mesh.rank == 1:
        def write_data(self, plan, planner):
            os.kill(os.getpid(), signal.SIGKILL)
        fs.FileSystemWriter.write_data = write_data
    if when == "installing" and engine.mesh.rank == 0:
        ck.install = lambda tmp, path: os.kill(os.getpid(), signal.SIGKILL)
    save_step(engine, folder, 2, extra={"step": 2})


def _resume(folder: str) -> dict:
    engine = build({"data": 2}, {"zero": 3})
    return engine.load(folder)


@pytest.mark.parametrize("when", ["writing", "installing"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(world, tmp_path, when):
    """The save is killed on a world of its own (a rank dies); the resume runs on the warm pool."""
    from shardlib.testing import WorldPool

    folder = str(tmp_path / "run")
    pool = WorldPool(2, timeout=10)
    pool.start()
    try:
        with pytest.raises(Exception):
            pool.run(_killed_mid_save, folder, when)
    finally:
        pool.close()
    assert latest(folder).name == "step-000001"
    assert world(2, _resume, folder) == [{"step": 1}, {"step": 1}]


def test_a_save_stopped_between_its_two_renames_points_at_the_previous_checkpoint(tmp_path):
    """Replacing a checkpoint moves the old one aside, then the new one in: stopped between the two,
    only ``.<name>.old-*`` is there, whole — the error for the missing name says so."""
    ck = tmp_path / "ck"
    save_run("single", str(ck))
    os.rename(ck, tmp_path / ".ck.old-1a2b3c4d")
    engine = build({"data": 1}, {})
    with pytest.raises(CheckpointError, match=r"\.ck\.old-1a2b3c4d beside it is the previous checkpoint.*rename it to ck"):
        engine.load(str(ck))
    os.rename(tmp_path / ".ck.old-1a2b3c4d", ck)
    assert engine.load(str(ck))["data_position"] == SAVE_AT


# ---- export -------------------------------------------------------------------------------------

def _export(path: str) -> dict:
    engine = build(*LAYOUTS["3d_zero3"])
    engine.step(batch(0))
    engine.export(path)
    return engine.full_state_dict()


def test_export_loads_into_a_plain_model(world, tmp_path):
    from safetensors.torch import load_file

    path = str(tmp_path / "model.safetensors")
    full = world(8, _export, path)[0]
    plain = GPT(CFG, seed=3)
    plain.load_state_dict(load_file(path), strict=True)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0)


# ---- the box algebra --------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_range_boxes_tile_any_flat_range(shape):
    n = math.prod(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            mark = torch.zeros(shape, dtype=torch.long)
            flat = torch.arange(n).view(shape)
            seen = []
            for starts, sizes in range_boxes(shape, lo, hi):
                idx = tuple(slice(s, s + k) for s, k in zip(starts, sizes))
                mark[idx] += 1
                seen += flat[idx].reshape(-1).tolist()
            assert seen == list(range(lo, hi))          # in order, each element once
            assert int(mark.sum()) == hi - lo and int(mark.max()) <= 1
            assert len(range_boxes(shape, lo, hi)) <= 2 * len(shape) - 1


def test_overlap_of_two_boxes_is_their_intersection_or_none():
    assert overlap(((0, 0), (2, 4)), ((1, 2), (5, 5))) == ((1, 2), (1, 2))
    assert overlap(((0,), (3,)), ((3,), (2,))) is None
