"""Start a local process world (``sl.launch``), or join the one ``torchrun`` started.

``launch(fn, nprocs)`` spawns ``nprocs`` processes on this machine, sets the ``env://``
rendezvous variables, initializes ``torch.distributed`` (gloo on CPU, nccl on CUDA), runs
``fn(*args, **kwargs)`` on every rank and returns the per-rank results.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` already set) the same call runs ``fn`` once, in this
process, on the world torchrun made, and returns ``[result]``: one program serves both.

gloo sometimes aborts at interpreter exit after all work is done. A rank therefore writes its
result *before* a final barrier, then leaves with ``os._exit``; the parent decides success from
the results, so an abort after the barrier neither loses a result nor fails the run.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from .errors import ShardingTypeError


class WorkerError(RuntimeError):
    """A rank raised (or died). ``rank`` is the first failing rank; ``remote_traceback`` its stack."""

    def __init__(self, message: str, *, rank: int, remote_traceback: str = "", exc: BaseException | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exc = exc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_world(backend: str | None = None, timeout: float | datetime.timedelta | None = None,
               threads: int | None = None) -> None:
    """Initialize ``torch.distributed`` from the environment (idempotent)."""
    import torch
    import torch.distributed as dist

    from .mesh import _auto_backend, default_timeout

    if threads:
        torch.set_num_threads(threads)
    if dist.is_initialized():
        return
    backend = backend or _auto_backend()
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout or default_timeout())


def set_rank_env(rank: int, nprocs: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))


def finish_rank(ok: bool) -> None:
    """Leave the world cleanly: barrier, destroy the process group, ``os._exit`` (no atexit)."""
    import torch.distributed as dist

    try:
        if ok and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # a peer already failed; the result is written, leave anyway
        pass
    finally:
        os._exit(0 if ok else 1)


def _write(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    try:
        data = pickle.dumps(payload)
    except Exception as e:  # unpicklable result or exception
        data = pickle.dumps({"ok": False, "time": time.time(),
                             "error": f"could not pickle the rank's {'result' if payload.get('ok') else 'error'}: {e!r}",
                             "traceback": payload.get("traceback", "")})
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _worker(local_rank: int, fn: Callable, args: tuple, kwargs: dict, nprocs: int, port: int,
            result_dir: str, backend: str | None, timeout: float | None, threads: int) -> None:
    set_rank_env(local_rank, nprocs, port)
    path = os.path.join(result_dir, f"rank{local_rank}.pkl")
    ok = False
    try:
        init_world(backend, timeout, threads)
        result = fn(*args, **kwargs)
        _write(path, {"ok": True, "result": result})
        ok = True
    except BaseException as e:  # noqa: BLE001 — report everything, including KeyboardInterrupt
        _write(path, {"ok": False, "time": time.time(), "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc(), "exc": e})
    finish_rank(ok)


def launch(fn: Callable, nprocs: int, *args: Any, backend: str | None = None,
           timeout: float | None = None, run_timeout: float | None = None,
           threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return ``[result_of_rank_0, ...]``.

    ``fn`` must be importable (a module-level function). ``timeout`` bounds each collective
    (seconds; default ``SHARDLIB_TIMEOUT`` or 300), ``run_timeout`` the whole run. ``threads``
    is torch's intra-op thread count per rank (default: the machine's cores / ``nprocs``).
    If any rank raises, the others are stopped and ``WorkerError`` carries the first traceback.
    """
    if under_torchrun():
        init_world(backend, timeout, threads)
        return [fn(*args, **kwargs)]
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ShardingTypeError(f"launch: nprocs must be a positive int — got {nprocs!r}.")
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    result_dir = tempfile.mkdtemp(prefix="shardlib-launch-")
    try:
        ctx = mp.start_processes(_worker, args=(fn, args, kwargs, nprocs, free_port(), result_dir, backend,
                                                timeout, threads),
                                 nprocs=nprocs, join=False, start_method="spawn")
        return collect(ctx.processes, result_dir, nprocs, run_timeout)
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)


def collect(processes: list, result_dir: str, nprocs: int, run_timeout: float | None,
            grace: float = 10.0) -> list[Any]:
    """Wait for every rank's result file; stop the rest once one fails or dies."""
    deadline = time.monotonic() + run_timeout if run_timeout else None
    results: dict[int, dict] = {}
    failed_at: float | None = None
    while True:
        for r in range(nprocs):
            if r in results:
                continue
            path = os.path.join(result_dir, f"rank{r}.pkl")
            if os.path.exists(path):
                results[r] = _read(path, r)
            elif processes[r].exitcode is not None:
                # died without writing (a crash or os._exit in user code); re-check the file once,
                # since it may have been written just before exit
                if os.path.exists(path):
                    continue
                results[r] = {"ok": False, "time": time.time(),
                              "error": f"rank {r} died with exit code {processes[r].exitcode} before "
                                       "returning a result", "traceback": ""}
        errors = {r: v for r, v in results.items() if not v["ok"]}
        if len(results) == nprocs and not errors:
            _reap(processes, grace)
            return [results[r]["result"] for r in range(nprocs)]
        now = time.monotonic()
        if errors and failed_at is None:
            failed_at = now
        timed_out = deadline is not None and now > deadline
        if (errors and (len(results) == nprocs or now - failed_at > grace)) or timed_out:
            _reap(processes, 0.5)
            if not errors:
                missing = [r for r in range(nprocs) if r not in results]
                raise WorkerError(f"launch: ranks {missing} did not finish within {run_timeout} s", rank=missing[0])
            first = min(errors, key=lambda r: errors[r]["time"])
            e = errors[first]
            others = sorted(set(errors) - {first})
            msg = f"rank {first} failed: {e['error']}"
            if others:
                msg += f" (ranks {others} failed after it)"
            if e["traceback"]:
                msg += "\n--- traceback of rank %d ---\n%s" % (first, e["traceback"])
            raise WorkerError(msg, rank=first, remote_traceback=e["traceback"], exc=e.get("exc"))
        time.sleep(0.02)


def _read(path: str, rank: int) -> dict:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception as e:  # e.g. an exception type that cannot be rebuilt here
        return {"ok": False, "time": time.time(), "traceback": "",
                "error": f"rank {rank}'s result could not be read back: {e!r}"}


def _reap(processes: list, grace: float) -> None:
    end = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)
