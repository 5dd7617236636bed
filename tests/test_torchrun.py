"""Two torchrun "nodes" on loopback run the main job on one 2x2x2 mesh, as one machine does.

Each node is a ``torchrun --nnodes 2 --nproc-per-node 4`` launch of ``examples/train_gpt.py`` (static
rendezvous on 127.0.0.1); the program uses that world unchanged. Its losses must equal the
single-machine run's (the program spawning its 8 processes itself), and the whole-run claim — every
rank returned the same losses — is checked across the 8 ranks of both nodes (``summary.json``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["train=quick", "train.steps=4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_torchrun_nodes_train_like_one_machine(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    single = subprocess.run([sys.executable, "examples/train_gpt.py", *ARGS, f"hydra.run.dir={tmp_path / 'single'}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [subprocess.Popen([*torchrun, "--node-rank", str(n), "examples/train_gpt.py", *ARGS,
                               f"hydra.run.dir={tmp_path / f'node{n}'}"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["ranks_agree"] is True and "the same loss on all 8 ranks: yes" in outs[0]
    assert _losses(tmp_path / "node0") == _losses(tmp_path / "single")
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()      # global rank 0 writes, on node 0
