"""The process world a cluster launcher started, read as ``torchrun`` would give it.

``torch.distributed``'s ``env://`` rendezvous reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (and the runtime ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``), which ``torchrun`` sets and
other launchers do not. ``adopt_launcher_env`` fills them, where they are missing, from the launcher's
own variables:

================  =====================  =======================  ===============================
launcher          rank / world size      local rank / size        rendezvous host
================  =====================  =======================  ===============================
``srun`` (SLURM)  ``SLURM_PROCID`` /     ``SLURM_LOCALID`` / the  the first host of
                  ``SLURM_STEP_NUM_TASKS``  first count of        ``SLURM_STEP_NODELIST``
                                         ``SLURM_STEP_TASKS_PER_NODE``
Open MPI          ``OMPI_COMM_WORLD_RANK`` ``..._LOCAL_RANK`` /     ``MASTER_ADDR`` exported by the
(``mpirun``)      / ``..._SIZE``         ``..._LOCAL_SIZE``       user (``mpirun -x MASTER_ADDR``);
                                                                  on one node, ``127.0.0.1``
MPICH / Intel     ``PMI_RANK`` /         ``MPI_LOCALRANKID`` /    the same
MPI (Hydra)       ``PMI_SIZE``           ``MPI_LOCALNRANKS``
================  =====================  =======================  ===============================

The port, when ``MASTER_PORT`` is not exported: under SLURM derived from the job id (every rank of
a job computes the same one; ``20000 + job id mod 20000``), under MPI ``29500`` (torchrun's default).
Variables already set are never changed, so ``torchrun`` inside an allocation wins. A SLURM batch
script's own shell is not a launcher (it has no job step of tasks): start the program with ``srun``.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

from ..errors import MeshError

DEFAULT_PORT = 29500
LAUNCHERS = {
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE"),
}


def detect(env: MutableMapping[str, str] | None = None) -> str | None:
    """Which launcher started this process (``"slurm"``, ``"openmpi"``, ``"mpich"``), or None."""
    env = os.environ if env is None else env
    for name, (rank, size) in LAUNCHERS.items():
        if rank in env and size in env:
            return name
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[003-008,010],gpu1`` -> ``node003``."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None or not head.group(1):
        raise MeshError(f"Mesh: cannot read the SLURM node list {nodelist!r} — expected hosts such as "
                        "'node[01-04]' or 'a,b'. Export MASTER_ADDR (the first host) yourself.")
    prefix, ranges = head.group(1), head.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def adopt_launcher_env(env: MutableMapping[str, str] | None = None, *, rendezvous: bool = True) -> str | None:
    """Fill the ``env://`` variables from the launcher's (module doc) where they are missing; return
    the launcher's name, or None where there is none (or ``torchrun`` already set them all).
    ``rendezvous=False`` (the ``mpi`` backend, which needs no host): no ``MASTER_ADDR`` is required."""
    env = os.environ if env is None else env
    name = detect(env)
    if name is None or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    if name == "slurm":
        rank, size, local = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"], env.get("SLURM_LOCALID", "0")
        per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", ""))
        local_size = per_node.group(0) if per_node else None
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        host = first_host(nodelist) if nodelist else None
        job = env.get("SLURM_JOB_ID", "")
        port = str(20000 + int(job) % 20000) if job.isdigit() else str(DEFAULT_PORT)
    else:
        prefix = "OMPI_COMM_WORLD_" if name == "openmpi" else None
        if prefix:
            rank, size = env[prefix + "RANK"], env[prefix + "SIZE"]
            local, local_size = env.get(prefix + "LOCAL_RANK", "0"), env.get(prefix + "LOCAL_SIZE")
        else:
            rank, size = env["PMI_RANK"], env["PMI_SIZE"]
            local, local_size = env.get("MPI_LOCALRANKID", "0"), env.get("MPI_LOCALNRANKS")
        one_node = local_size is not None and local_size == size
        host = "127.0.0.1" if one_node else None
        port = str(DEFAULT_PORT)
    if "MASTER_ADDR" not in env and host is None and rendezvous:
        raise MeshError(f"Mesh: started by {name} over several nodes, but MASTER_ADDR is not set — expected the "
                        "rendezvous host, the first rank's node. Export it before the launch "
                        + ("(mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...)." if name == "openmpi" else
                           "(mpiexec -genv MASTER_ADDR $(hostname) ...)." if name == "mpich" else
                           "(export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1))."))
    values = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local, "MASTER_ADDR": host, "MASTER_PORT": port}
    if local_size is not None:
        values["LOCAL_WORLD_SIZE"] = local_size
    for key, value in values.items():
        if key not in env and value is not None:
            env[key] = str(value)
    return name
