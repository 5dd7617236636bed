"""Cluster launchers: ``srun`` (SLURM), ``mpirun`` (Open MPI) and ``mpiexec`` (MPICH) start the same
program as ``torchrun`` does — the world read from their own variables (``algebra/world_env.py``).

The variables are what each launcher sets for its tasks (no ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``):
a pure test reads them, and one world of 2 processes per launcher runs ``test_launch_local.py``'s torchrun
program unchanged under them (``sl.Mesh`` and ``sl.launch`` join the world the launcher started, as
the main job does).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import shardlib as sl
from shardlib.algebra.world_env import adopt_launcher_env, detect, first_host
from shardlib.errors import MeshError
from test_launch_local import _TORCHRUN_SCRIPT

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _slurm(rank: int, n: int, job: int, nodes: str = "localhost") -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(n), "SLURM_LOCALID": str(rank),
            "SLURM_STEP_TASKS_PER_NODE": f"{n}", "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_ID": str(job),
            "SLURM_NTASKS": str(n)}


def _openmpi(rank: int, n: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(n),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)}


def _mpich(rank: int, n: int) -> dict[str, str]:
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(n), "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": str(n)}


def test_each_launchers_variables_read_as_torchruns():
    env = _slurm(5, 8, 1234567, "gpu[003-004,010]")
    env["SLURM_STEP_TASKS_PER_NODE"] = "4(x2)"
    assert adopt_launcher_env(env) == "slurm"
    assert {k: env[k] for k in TORCHRUN} == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5",
                                              "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu003",
                                              "MASTER_PORT": str(20000 + 1234567 % 20000)}
    env = _openmpi(1, 2)
    assert adopt_launcher_env(env) == "openmpi"
    assert {k: env[k] for k in TORCHRUN} == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": "29500"}
    env = {**_mpich(3, 4), "MASTER_ADDR": "head", "MASTER_PORT": "4000"}
    env["MPI_LOCALNRANKS"], env["MPI_LOCALRANKID"] = "2", "1"
    assert adopt_launcher_env(env) == "mpich"
    assert {k: env[k] for k in TORCHRUN} == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "4000"}
    # torchrun's own variables win; no launcher, nothing to do
    env = {**_slurm(0, 2, 7), "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    assert adopt_launcher_env(env) is None and env["RANK"] == "1"
    assert adopt_launcher_env({}) is None and detect({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}) is None
    assert [first_host(x) for x in ("node[01-04]", "a,b", "solo", "rack1-n[7,9]")] == ["node01", "a", "solo", "rack1-n7"]


def test_missing_rendezvous_and_missing_mpi_name_the_fix():
    env = _openmpi(0, 4)
    env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2"          # two nodes: the first rank's host is not known
    with pytest.raises(MeshError, match=r"openmpi over several nodes, but MASTER_ADDR is not set .*\(mpirun -x "):
        adopt_launcher_env(env)
    assert adopt_launcher_env(env, rendezvous=False) == "openmpi" and "MASTER_ADDR" not in env
    import torch.distributed as dist
    if not dist.is_mpi_available():                  # the PyPI wheels: no MPI backend
        with pytest.raises(MeshError, match=r"backend 'mpi' is not available — this torch was built without MPI"):
            sl.Mesh({"data": 1}, backend="mpi")


def _free_port(lo: int = 20000, hi: int = 40000) -> int:
    for port in range(lo + os.getpid() % 1000, hi, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


@pytest.mark.parametrize("launcher", ["slurm", "openmpi", "mpich"])
def test_the_torchrun_program_runs_unchanged_under_the_launcher(tmp_path, launcher):
    script = tmp_path / "prog.py"
    script.write_text(_TORCHRUN_SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    base["OMP_NUM_THREADS"] = "1"
    port = _free_port()
    procs = []
    for rank in range(2):
        if launcher == "slurm":       # the port from the job id, as every rank of the job derives it
            env = {**base, **_slurm(rank, 2, port - 20000)}
        else:                         # mpirun -x MASTER_PORT=...: the host is the one node's
            env = {**base, **(_openmpi(rank, 2) if launcher == "openmpi" else _mpich(rank, 2)),
                   "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, d in enumerate(reports):
        assert d["rank"] == r and d["out"] == [{"rank": r, "sum": 21.0, "pid": d["pid"]}] and d["left_world"]
