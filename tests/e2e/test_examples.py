"""End-to-end runs of the examples (slow: each starts its own process world).

A fresh world costs every rank its imports and its plan, so each run here is checked many ways:
the main job runs once, as two torchrun nodes, for its outputs and for the two-node claims; the
run stopped with Ctrl-C is resumed twice, and the resume on another mesh is also the run whose rank
is killed. The uninterrupted references are the job's own ``Trainer`` on the suite's warm pools
(``world``), not fresh worlds.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardlib as sl

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 300, code: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == code, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_redistribution_demo_checks_every_shard():
    out = _run("examples/demo.py").stdout
    assert "every shard matches the global tensor" in out
    assert out.count("ok") >= 5 * 4          # 5 steps x 4 ranks, each checked against the global tensor
    assert "WRONG" not in out


def _example(name: str):
    """Import an example script as a module (its ``main`` is guarded: nothing runs)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAIN = ["train=quick", "train.steps=6"]


def _compose(overrides: list[str]):
    from shardlib.cli.compose import check_overrides
    from shardlib.frontend.config.run_config import run_config

    return run_config(check_overrides(overrides))


def _pool_steps(run) -> list[dict]:
    """The job's steps on a warm pool rank: its ``Trainer`` on ``run``, each step's loss and learning rate
    (what ``rank_main`` writes to ``metrics.jsonl``; the job is nothing but this loop around it)."""
    from shardlib.frontend.run import Trainer
    from shardlib.testing import get_mesh

    trainer = Trainer(run, get_mesh(run.mesh.shape))
    rows = [trainer.step(i, record=False) for i in range(run.train.steps)]
    return [{"step": r["step"], "loss": r["loss"], "lr": r["lr"]} for r in rows]


def _one_machine(world, overrides: list[str]) -> list[dict]:
    """The uninterrupted job of ``overrides`` on one machine's world (a warm pool of its mesh's size);
    every rank's steps must agree."""
    run = _compose(overrides)
    per_rank = world(run.mesh.size, _pool_steps, run)
    assert all(r == per_rank[0] for r in per_rank), per_rank
    return per_rank[0]


def _pool_expert_steps(run) -> list[dict]:
    from shardlib.frontend.run import Trainer
    from shardlib.testing import get_mesh

    trainer = Trainer(run, get_mesh(run.mesh.shape))
    return [trainer.step(i, record=False) for i in range(run.train.steps)]


def test_main_job_on_expert_x_tensor_records_and_draws_each_experts_load(world, tmp_path):
    """The MoE job on expert 2 x tensor 2 (``mesh=ep2_tp2 parallel=ep_tp``): every rank the same losses and the
    same tokens per expert — the whole batch's, each token once per chosen expert — and ``experts.png`` drawn
    from them with the imbalance (the most loaded expert over the mean)."""
    from shardlib.frontend.plots.report import plot_expert_load
    run = _compose(["model=moe_tiny", "mesh=ep2_tp2", "parallel=ep_tp", *MAIN])
    per_rank = world(run.mesh.size, _pool_expert_steps, run)
    rows = per_rank[0]
    for other in per_rank[1:]:
        assert [(r["loss"], r["tokens_per_expert"]) for r in other] == [(r["loss"], r["tokens_per_expert"]) for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"]
    m = run.model
    for r in rows:
        assert len(r["tokens_per_expert"]) == m.n_layers
        for counts in r["tokens_per_expert"].values():
            assert len(counts) == m.n_experts and sum(counts) == run.train.batch * run.seq * m.top_k
        worst = max(max(c) * len(c) / sum(c) for c in r["tokens_per_expert"].values())
        assert r["expert_imbalance"] == pytest.approx(worst)
    plot_expert_load(rows, tmp_path / "experts.png", title="ep2_tp2")
    assert (tmp_path / "experts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_on_data_x_context_trains_as_on_data_alone(world):
    """The long-sequence job (``model=tiny_long mesh=dp2_cp2 parallel=cp train=long``: each 128-token sequence
    split over context 2, ring attention forced) against the same job on data 2 alone: every step's loss
    within fp32 round-off."""
    job = ["model=tiny_long", "train=long", "train.steps=3", "train.seq=128", "train.batch=4"]
    cp = _one_machine(world, [*job, "mesh=dp2_cp2", "parallel=cp", "parallel.context_attention=ring"])
    dp = _one_machine(world, [*job, "mesh=dp2", "parallel=zero1"])
    assert [r["loss"] for r in cp] == pytest.approx([r["loss"] for r in dp], rel=1e-5)
    from shardlib.frontend.config.checking import ConfigError
    with pytest.raises(ConfigError, match=r"has context=2, but parallel=zero1 maps no logical dim to 'context'.*"
                                          r"parallel=cp"):
        _compose([*job, "mesh=cp2", "parallel=zero1"])
    with pytest.raises(ConfigError, match=r"train.seq: 130 tokens do not split over context=2 .* train.seq=128 or 132"):
        _compose([*job, "mesh=cp2", "parallel=cp", "train.seq=130"])


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """The README's first command, shortened (a 2x2x2 mesh, 8 processes, 6 steps), run once for every
    check of the main job: as two ``torchrun --nnodes 2 --nproc-per-node 4`` launches on loopback
    (static rendezvous). Node 0's output, and the run directory each node was given."""
    import socket

    tmp = tmp_path_factory.mktemp("main")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    logs = [(tmp / f"node{n}.out", tmp / f"node{n}.err") for n in (0, 1)]
    nodes = []
    for n, (out, err) in enumerate(logs):
        with open(out, "w") as fo, open(err, "w") as fe:    # files, not pipes: neither node can block on its output
            nodes.append(subprocess.Popen([*torchrun, "--node-rank", str(n), "examples/train_gpt.py", *MAIN,
                                           f"hydra.run.dir={tmp / f'node{n}'}"], cwd=ROOT, env=env, stdout=fo,
                                          stderr=fe, text=True))
    try:
        for p in nodes:
            p.wait(timeout=600)
    finally:
        for p in nodes:
            p.kill()
    texts = [(out.read_text(), err.read_text()) for out, err in logs]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] + e[-3000:] for o, e in texts)
    return subprocess.CompletedProcess(nodes[0].args, 0, *texts[0]), tmp / "node0", tmp / "node1"


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_main_job_trains_3d_and_writes_its_metrics_and_pictures(main_run):
    """The loss falls; the run directory holds one metrics object per step, the plan and the three pictures."""
    proc, out_dir, _ = main_run
    out = proc.stdout
    assert "pipeline: 'pipe' (p=2)" in out and "the same loss on all 8 ranks: yes" in out, out[-2000:]
    rows = _metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"]
    # not a terminal (captured): plain progress lines, no bar and its carriage returns
    assert "\r" not in out + proc.stderr and "it/s" not in proc.stderr and "step/s" not in proc.stderr
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ") and "ETA" in line] == \
        [f"{i}/6" for i in range(1, 7)]
    for r in rows:
        assert set(r) == {"step", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "bytes_per_axis", "peak_rss"}
        assert len(r["peak_rss"]) == 8 and r["grad_norm"] > 0
        assert {"data", "pipe", "tensor"} <= set(r["bytes_per_axis"])
    for name in ("loss.png", "memory.png", "timeline.png", "plan.txt", "summary.json"):
        assert (out_dir / name).stat().st_size > 0, name
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["ranks_agree"] and summary["last_loss"] == rows[-1]["loss"]
    # model states: what each rank holds is what the plan says
    for planned, held in zip(summary["memory"]["planned"], summary["memory"]["measured"]):
        assert [planned[k] for k in ("params", "grads", "optimizer")] == [held[k] for k in ("params", "grads", "optimizer")]


@pytest.mark.slow
def test_two_torchrun_nodes_train_like_one_machine(main_run, world):
    """Two ``torchrun --nnodes 2 --nproc-per-node 4`` launches on loopback (static rendezvous) run the
    same program on one 2x2x2 world, unchanged: the losses of the same job on one machine's 8 ranks
    (the suite's warm pool), bit for bit, and the whole-run claim (every rank the same losses) checked
    across the 8 ranks of both nodes."""
    proc, node0, node1 = main_run
    summary = json.loads((node0 / "summary.json").read_text())
    assert summary["ranks_agree"] is True and "the same loss on all 8 ranks: yes" in proc.stdout
    assert [m["loss"] for m in _metrics(node0)] == [m["loss"] for m in _one_machine(world, MAIN)]
    assert not (node1 / "metrics.jsonl").exists()      # global rank 0 writes, on node 0


# ---- a bad configuration: one message, exit code 2, before any process starts --------------------------

@pytest.mark.parametrize("args, expected", [
    (["mesh=nope"], ["mesh=nope: no such mesh preset — expected one of"]),
    (["train.stpes=5"], ["train.stpes: no such config key", "Did you mean train.steps?"]),
    (["mesh=dp4", "parallel=tp"], ["parallel.rules: parallel=tp maps heads, mlp, vocab to the axis 'tensor', but "
                                   "mesh=dp4 has axes ('data',)"]),
    (["mesh=dp4", "parallel=hsdp"], ["parallel.replica_axis: parallel=hsdp replicates over 'replica'"]),
    (["mesh=tp4", "parallel=tp", "model.n_heads=2", "model.d_model=64"],
     ["model.n_heads with the mesh's tensor axis: plan (mesh=tp4, parallel=tp, model=tiny): Attention",
      "has 2 attention heads, which tensor=4 ranks cannot split whole", "(the same in 4 blocks: 0..3)"]),
    (["mesh=pp4", "parallel=pp_1f1b", "model.n_layers=3"],
     ["model.n_layers with the mesh's pipe axis: plan (mesh=pp4, parallel=pp_1f1b, model=tiny):",
      "3 blocks, fewer than the 4 stages"]),
    (["data=file", "data.path=/nonexistent/text.txt"], ["data.path: /nonexistent/text.txt does not exist"]),
    (["train.precision=fp8", "train.batch=15"], ["train.precision: got 'fp8'", "train.batch: 15 sequences"]),
])
def test_main_job_config_errors_name_the_key(args, expected):
    got = "\n".join(_example("train_gpt").problems_of(args))
    for want in expected:
        assert want in got, got


def test_main_job_config_errors_stop_it_before_any_rank_starts():
    proc = _run("examples/train_gpt.py", "mesh=dp4", "parallel=tp", "train.precision=fp8", code=2)
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "train_gpt.py: 2 problems in the configuration:"
    assert lines[1].startswith("  - train.precision: got 'fp8'") and lines[2].startswith("  - parallel.rules: parallel=tp")


def test_a_corrupt_dataset_is_named(tmp_path):
    bad = tmp_path / "corrupt.txt"
    bad.write_bytes(b"some text\n" * 50 + bytes(range(128, 256)) * 4)
    got = _example("train_gpt").problems_of(["data=file", f"data.path={bad}"])
    assert len(got) == 1 and f"data.path: {bad} is not UTF-8 text" in got[0] and "corrupt" in got[0]


def test_a_mesh_that_is_not_the_torchrun_world_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    got = _example("train_gpt").problems_of([])
    assert len(got) == 1 and "mesh=2x2x2 has 8 ranks" in got[0] and "torchrun started 4" in got[0]


def test_checkpoint_settings_are_checked_before_any_rank_starts(tmp_path):
    """A resume path that is no checkpoint, a checkpoint of another model, a folder that cannot be
    written: each named by its key, in this process."""
    from shardlib.models import GPT, GPTConfig

    problems_of = _example("train_gpt").problems_of
    got = problems_of([f"checkpoint.resume={tmp_path / 'nope'}"])
    assert len(got) == 1 and got[0].startswith(f"checkpoint.resume: {tmp_path / 'nope'} does not exist"), got
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=2), seed=0)   # tiny has 4
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": 1})),
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    engine.save(tmp_path / "two_layers")
    got = problems_of([f"checkpoint.resume={tmp_path / 'two_layers'}"])
    assert got and all(g.startswith("checkpoint.resume: ") for g in got), got
    assert any("has no parameter 'blocks.3.ln1.weight'" in g for g in got), got
    got = problems_of(["checkpoint.every=5", f"checkpoint.dir={tmp_path / 'two_layers' / 'manifest.json' / 'ck'}"])
    assert len(got) == 1 and got[0].startswith("checkpoint.dir: ") and "cannot be written" in got[0], got
    assert problems_of(["checkpoint.every=5", f"checkpoint.dir={tmp_path / 'new' / 'ck'}",
                        "checkpoint.resume=auto"]) == []      # nothing saved yet: starts at step 0


def test_demo_config_errors_are_caught_before_any_rank_starts():
    proc = _run("examples/demo.py", "steps=[{from:[bogus,null],to:[null,null]},{from:[data],to:[data,data]}]", code=2)
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "demo.py: 2 problems in the configuration:"
    assert lines[1].startswith("  - steps[0]: Layout: dim 0 of P('bogus', None): unknown mesh axis 'bogus'")
    assert lines[2].startswith("  - steps[1]: P: axis 'data' is used twice")


# ---- Ctrl-C, then resume: the same loss curve ------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(stat.parent.name))
    return out


def _ranks(pid: int) -> list[int]:
    """The ranks of the launch in process ``pid``: forked by its fork server (``sl.launch``'s default), or
    spawned by it (``SHARDLIB_START_METHOD=spawn``)."""
    def cmdline(p):
        try:
            return (Path("/proc") / str(p) / "cmdline").read_bytes()
        except OSError:
            return b""
    kids = _children(pid)
    servers = [k for k in kids if b"multiprocessing.forkserver" in cmdline(k)]
    return sorted([r for s in servers for r in _children(s)] + [k for k in kids if b"spawn_main" in cmdline(k)])


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


COMMON = ["mesh=dp2", "parallel=zero2", "train=quick", "train.lr=1e-3", "train.lr_schedule=constant",
          "train.log_every=1"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A long run (``COMMON``, checkpoints every 2 steps) stopped with Ctrl-C once it has saved step 4 (a
    constant learning rate, so the run's length does not change its steps). Where it stopped depends on
    the machine's speed: ``saved`` is the step of the checkpoint it left."""
    import signal
    import time

    root = tmp_path_factory.mktemp("ctrl_c")
    ck, tmp = root / "ck", root / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    first = subprocess.Popen([sys.executable, "examples/train_gpt.py", *COMMON, "train.steps=100000",
                              "checkpoint.every=2", f"checkpoint.dir={ck}", f"hydra.run.dir={root / 'first'}"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             # Ctrl-C as at a terminal, even where this suite runs as a background job (whose
                             # children a shell starts with SIGINT ignored)
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not ((ck / "latest").exists() and (ck / "latest").read_text().strip() >= "step-000004"):
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint at step 4 before the run ended"
        time.sleep(0.05)
    ranks = _ranks(first.pid)
    assert len(ranks) == 2, ranks                      # COMMON's mesh: dp2
    first.send_signal(signal.SIGINT)                   # Ctrl-C
    first.wait(timeout=300)

    def leftovers():       # the launcher's, multiprocessing's and the save's temporary files (torch's caches may stay)
        return list(tmp.glob("shardlib-launch-*")) + list(tmp.glob("pymp-*")) + list(ck.glob(".*.tmp-*"))
    deadline = time.monotonic() + 30
    while (any(_alive(p) for p in ranks) or leftovers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    saved = int((ck / "latest").read_text().strip().split("-")[1])
    return {"root": root, "ck": ck, "ranks": ranks, "alive": [p for p in ranks if _alive(p)],
            "leftovers": leftovers(), "saved": saved, "end": f"train.steps={saved + 4}"}


@pytest.fixture(scope="module")
def uninterrupted(interrupted, world):
    """The reference: the same job uninterrupted to the same end (saved + 4 steps) on one machine's 2 ranks."""
    return _one_machine(world, [*COMMON, interrupted["end"]])


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_and_leaves_no_temp_files(interrupted):
    assert interrupted["ranks"] and interrupted["alive"] == [] and interrupted["leftovers"] == []


@pytest.fixture(scope="module")
def moved_then_killed(interrupted):
    """The checkpoint resumed on another mesh and layout (data 2 x tensor 2, TP), run on (a constant learning
    rate: its length does not change its steps) until it has logged 4 steps; then one of its 4 ranks is
    killed with SIGKILL. The run's metrics, its exit code and stderr, and its ranks."""
    import signal
    import time

    root, ck, saved = interrupted["root"], interrupted["ck"], interrupted["saved"]
    out = root / "other"
    log = root / "other.log"
    with open(log, "w") as f:
        job = subprocess.Popen([sys.executable, "examples/train_gpt.py",
                                *[c for c in COMMON if not c.startswith(("mesh=", "parallel="))], "train.steps=100000",
                                "mesh=dp2_tp2", "parallel=tp", f"checkpoint.resume={ck / f'step-{saved:06d}'}",
                                f"hydra.run.dir={out}"], cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               stdout=f, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 4):      # 4 whole lines written
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        ranks = _ranks(job.pid)
        assert len(ranks) == 4, ranks
        os.kill(ranks[-1], signal.SIGKILL)             # the last started: not rank 0, which writes the metrics
        err = job.communicate(timeout=120)[1]
    finally:
        job.kill()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().split("\n")[:4]]
    return {"metrics": rows, "code": job.returncode, "err": err, "alive": [p for p in ranks if _alive(p)],
            "stdout": log.read_text()}


@pytest.mark.slow
def test_resume_on_another_mesh_follows_the_same_loss_curve(interrupted, uninterrupted, moved_then_killed):
    """The same checkpoint on another mesh and layout (data 2 x tensor 2, TP): within fp32 round-off."""
    saved = interrupted["saved"]
    moved = moved_then_killed["metrics"]
    assert f"resumed from {interrupted['ck'] / f'step-{saved:06d}'}" in moved_then_killed["stdout"]
    assert [m["step"] for m in moved] == list(range(saved + 1, saved + 5))
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(moved, uninterrupted[saved:], strict=True))
    assert rel <= 1e-5, rel


@pytest.mark.slow
def test_resume_with_the_optimizer_on_the_host_is_bit_for_bit(interrupted, uninterrupted, moved_then_killed):
    """Resumed on the same mesh with the optimizer's states on the host (parallel=zero_offload: ZeRO-2, the
    same arithmetic): the uninterrupted run's losses and learning rates, bit for bit; each memory kind shown."""
    ck, saved = interrupted["ck"], interrupted["saved"]
    root = interrupted["root"]
    again = _run("examples/train_gpt.py", *[c for c in COMMON if c != "parallel=zero2"], "parallel=zero_offload",
                 interrupted["end"], "checkpoint.every=2", f"checkpoint.dir={ck}", "checkpoint.resume=auto",
                 f"hydra.run.dir={root / 'again'}")
    assert f"resumed from {ck / f'step-{saved:06d}'}" in again.stdout
    assert "model states by memory kind on rank 0 (optimizer -> host): device" in again.stdout, again.stdout[-2000:]
    resumed, reference = _metrics(root / "again"), uninterrupted
    assert [m["step"] for m in resumed] == list(range(saved + 1, saved + 5))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in reference[saved:]]     # bit for bit
    assert [m["lr"] for m in resumed] == [m["lr"] for m in reference[saved:]]


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_job_with_the_launchers_line(moved_then_killed):
    """A rank killed with SIGKILL mid-run (the resumed run on data 2 x tensor 2 above): the job exits 1
    with the launcher's one line on stderr — no traceback of the launching process, no Hydra advice —
    and no rank is left running."""
    err = moved_then_killed["err"]
    assert moved_then_killed["code"] == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"train_gpt\.py: rank [0-3] of 4 failed: rank [0-3] was killed by SIGKILL "
                                            r"before returning a result.*", lines[0]), err
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err
    assert moved_then_killed["alive"] == []
