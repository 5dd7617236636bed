"""``python -m shardlib.verify``: the parity matrix CI runs, and that it fails loudly on a drift.

The default matrix — single, dp4, zero3 (data 4), hsdp 2x2, tp2 x dp2, pp2 x dp2 (1F1B, m = 4), the
2x2x2 3D mesh with ZeRO-3 — trains 6 steps of the tiny GPT in each layout and compares every
loss with plain PyTorch in one process (fp32: within 1e-5 relative; every rank the same). The
matrix and the drift check run the command's own ``main`` on the suite's warm worker pools; the
command as a process (``python -m shardlib.verify``) on bad input, which it refuses before any
process starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _verify(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlib.verify", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _pool_losses(run, steps):
    from shardlib.cli.verify import rank_losses
    from shardlib.testing import get_mesh

    return rank_losses(run, steps, get_mesh(run.mesh.shape))


@pytest.mark.slow
def test_the_default_matrix_trains_like_one_process(world, capsys):
    """The command's own code (``verify.main``) over the default matrix, each case on the suite's warm
    worker pools instead of a fresh world (the command itself runs as a process in the tests below)."""
    from shardlib.cli import verify

    def run_case(run, steps):
        return world(run.mesh.size, _pool_losses, run, steps) if run.mesh.size > 1 else [_pool_losses(run, steps)]

    code = verify.main([], run_case=run_case)
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    rows = [line for line in out.out.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert [r.split("|")[1].strip() for r in rows] == ["single", "dp4", "zero3", "hsdp", "tp2_dp2", "pp2_dp2", "3d_zero3"]
    for r in rows:
        cells = [c.strip() for c in r.split("|")]
        assert cells[7:9] == ["True", "ok"], r
        assert float(cells[6]) <= 1e-5, r
    assert "all 7 layouts train like one process" in out.out


def test_a_drifting_case_fails_loudly(world, capsys):
    """A case that trains something else (another learning rate) is caught against the reference."""
    from shardlib.cli import verify

    code = verify.main(["--cases", "single", "--case", "other_lr:mesh=dp2,parallel=dp,train.lr=0.01", "train.steps=3"],
                       run_case=lambda run, steps: world(run.mesh.size, _pool_losses, run, steps)
                       if run.mesh.size > 1 else [_pool_losses(run, steps)])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    assert "| other_lr |" in out.out and "DRIFT" in out.out
    assert "1 of 2 cases drifted or failed: other_lr" in out.err


def test_bad_matrix_input_is_refused_before_any_process(capsys):
    """The command as a process once; the other bad inputs through the same ``main`` in this process
    (a refusal is ``main``'s return value and its stderr; a process adds only its start-up)."""
    from shardlib.cli import verify

    proc = _verify("--cases", "dp5")
    assert proc.returncode == 2 and "--cases: dp5 — expected some of single, dp4" in proc.stderr
    assert verify.main(["mesh=dp4"]) == 2
    assert "the layout (mesh=, parallel=) is each case's" in capsys.readouterr().err
    assert verify.main(["--case", "x:mesh=dp4,parallel=tp"]) == 2
    assert "parallel=tp maps heads, mlp, vocab to the axis 'tensor'" in capsys.readouterr().err
