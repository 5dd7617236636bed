"""End-to-end runs of the examples (slow: each starts its own process world)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int = 300) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_redistribution_demo_checks_every_shard():
    out = _run("examples/demo.py")
    assert "every shard matches the global tensor" in out
    assert out.count("ok") >= 5 * 4          # 5 steps x 4 ranks, each checked against the global tensor
    assert "WRONG" not in out


@pytest.mark.slow
def test_training_run_learns_and_ranks_agree():
    out = _run("examples/train.py", "steps=12", "log_every=6", "zero=3", "mesh=dp2", "model.n_layers=2",
               "model.d_model=64", "batch=8")
    assert "the same on all 2 ranks" in out
    assert "model states held per rank" in out
    first, last = out.split("loss ")[-1].split(" over")[0].split(" -> ")
    assert float(last) < float(first)
