"""Start a local process world (``sl.launch``), or join the one ``torchrun`` started.

``launch(fn, nprocs)`` spawns ``nprocs`` processes on this machine, sets the ``env://``
rendezvous variables, initializes ``torch.distributed`` (gloo on CPU, nccl on CUDA), runs
``fn(*args, **kwargs)`` on every rank and returns the per-rank results.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` already set), or where the program already called
``torch.distributed.init_process_group``, the same call runs ``fn`` once, in this process, on that
world, and returns ``[result]``: one program serves both.

gloo sometimes aborts at interpreter exit after all work is done (``terminate called without an
active exception``, SIGABRT). A spawned rank therefore writes its result *before* a final barrier,
then leaves with ``os._exit``; the parent decides success from the results, so an abort after the
result is written neither loses it nor fails the run. Under ``torchrun`` a world that ``launch``
itself initialized is left the same way (barrier, ``destroy_process_group``) once ``fn`` returns,
which is what keeps the abort away there (0 of 14 runs, against 3 of 8 without).

When a rank hangs, its peers fail at the collective timeout; the report names the rank(s) that
never reached that collective, not the peers that waited (``frontend/launch/diagnose.py``). Nothing outlives a
launcher, even one killed with ``kill -9`` (``frontend/launch/reaper.py``).

**Starting ranks.** Where the platform has it (Linux), ranks are forked from multiprocessing's fork
server, which imports torch (its distributed parts, dynamo) and shardlib once (``PRELOAD``); a spawned
rank spends 3-4 CPU-seconds on those imports before its first collective, a forked one ~0.02 (8 ranks:
~28 CPU-seconds less per launch). Like a spawned one, a rank imports the main script as ``__mp_main__``
and sees the launcher's working directory, ``sys.path`` (multiprocessing's preparation) and environment
(``parent_state``, applied first) as of the call. The fork server only imports: it never opens a
process group or sets the allocator. The kernel still kills every rank when the launcher dies: the
server leaves when the launcher's end of its pipe closes (however the launcher exits), and each rank
asks to die with its parent, the server. ``SHARDLIB_START_METHOD=spawn`` spawns every rank instead.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ...allocator import set_mmap_threshold
from ...comm import progress
from ...errors import ShardingError, ShardingTypeError
from ...validate import positive_int
from . import diagnose
from .outcomes import UNGUARDED, collect, fault_path, progress_path, result_path, write
from .reaper import Reaper, die_with_parent

_LAUNCH_DIR_ENV = "SHARDLIB_LAUNCH_DIR"   # set for the ranks while they start: where to say they were misused
# imported once by the fork server; torch's own parts only (importing transformers or peft starts native
# threads, and a fork copies none of them)
PRELOAD = ("torch", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "torch.distributed",
           "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed.tensor.parallel", "shardlib")


def start_method() -> str:
    """``forkserver`` (preloading ``PRELOAD``) where the platform has it, else ``spawn``;
    ``SHARDLIB_START_METHOD=spawn`` forces a spawn."""
    import multiprocessing

    wanted = os.environ.get("SHARDLIB_START_METHOD", "forkserver")
    if wanted not in ("forkserver", "spawn"):
        raise ShardingError(f"launch: SHARDLIB_START_METHOD={wanted!r} — expected 'forkserver' or 'spawn'.")
    if wanted == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(list(PRELOAD))     # read when the server starts (once a process)
    return "forkserver"


def parent_state() -> dict:
    """What a rank takes from the process that starts it: the environment, working directory and
    ``sys.path`` now (a forked rank starts from the fork server's, frozen when the server started)."""
    return {"cwd": os.getcwd(), "env": dict(os.environ), "path": list(sys.path)}


def adopt_parent_state(parent: dict) -> None:
    os.chdir(parent["cwd"])
    os.environ.clear()
    os.environ.update(parent["env"])
    sys.path[:] = parent["path"]


class _StdStreams:
    """The launcher's stdout and stderr as they are when ranks start, handed to each rank (a forked rank
    would otherwise write where the launcher's pointed when the fork server started — before a
    redirection, or into an earlier capture)."""

    def __reduce__(self):
        from multiprocessing import reduction

        fds = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
                fds.append(reduction.DupFd(fd))
            except OSError:     # closed in the launcher: the rank keeps its own
                fds.append(None)
        return (_StdFds, tuple(fds))


class _StdFds:
    def __init__(self, out, err):
        self.fds = [None if d is None else d.detach() for d in (out, err)]

    def adopt(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            if fd is not None and fd != target:
                os.dup2(fd, target)
                os.close(fd)


def world_store():
    """The rendezvous store of a world this process starts, hosted here (``store.port`` goes to the ranks).

    The OS picks its port as the store binds it. A port chosen first (bind to port 0, close) and bound
    later by rank 0 can be taken in between by any other process — a gloo connection's ephemeral port, a
    second test worker's world — and rank 0 then fails with EADDRINUSE. The ranks join it as clients,
    as torchrun's ranks join their agent's store (``set_rank_env``). Keep it referenced until the ranks
    have left."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def under_torchrun() -> bool:
    """A world some launcher started: ``torchrun``, or ``srun`` / ``mpirun`` read as torchrun's
    variables (``algebra/world_env.py``)."""
    from ...algebra.world_env import adopt_launcher_env
    adopt_launcher_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_world(backend: str | None = None, timeout: float | datetime.timedelta | None = None,
               threads: int | None = None) -> bool:
    """Initialize ``torch.distributed`` from the environment (idempotent); True if this call did it.
    Also fixes glibc's mmap threshold in this rank process (``set_mmap_threshold``)."""
    import torch
    import torch.distributed as dist

    from ...algebra.mesh import auto_backend, check_backend, default_timeout

    set_mmap_threshold()
    if threads:
        torch.set_num_threads(threads)
    if dist.is_initialized():
        return False
    if backend is not None:
        check_backend(backend, "launch")
    backend = backend or auto_backend()
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout or default_timeout())
    return True


def set_rank_env(rank: int, nprocs: int, port: int) -> None:
    """torchrun's variables for a rank of a world whose store (``world_store``) the parent hosts at ``port``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      TORCHELASTIC_USE_AGENT_STORE="True")     # every rank a client of the parent's store


def leave_world() -> None:
    """Barrier, then ``destroy_process_group``: the exit that keeps gloo from aborting at shutdown."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except Exception:  # a peer already failed; tear down anyway
        pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def finish_rank(ok: bool) -> None:
    """Leave the world cleanly: barrier, destroy the process group, flush, ``os._exit`` (no atexit)."""
    try:
        if ok:
            leave_world()
    finally:
        for stream in (sys.stdout, sys.stderr):   # os._exit skips the flush of buffered prints
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0 if ok else 1)


def _worker(local_rank: int, fn: Callable, args: tuple, kwargs: dict, nprocs: int, port: int,
            result_dir: str, backend: str | None, timeout: float | None, threads: int,
            launcher_pid: int, parent: dict, streams: _StdFds) -> None:
    # spawned: the launcher is the parent; forked by the fork server: the server is, and it leaves
    # when the launcher goes — so die with the parent, and leave now if the launcher is already gone
    die_with_parent(os.getppid(), launcher_pid)
    adopt_parent_state(parent)
    streams.adopt()
    set_rank_env(local_rank, nprocs, port)
    progress.attach(progress_path(result_dir, local_rank))   # the last collective entered, for the parent
    # a rank killed by a signal (abort, segfault) leaves its Python stack here for the parent,
    # and so does a rank asked for it (diagnose.STACK_SIGNAL) because its peers wait for it
    fault_log = open(fault_path(result_dir, local_rank), "w")  # noqa: SIM115 — open until os._exit
    faulthandler.enable(file=fault_log, all_threads=True)
    if diagnose.STACK_SIGNAL is not None:
        faulthandler.register(diagnose.STACK_SIGNAL, file=fault_log, all_threads=True)
    path = result_path(result_dir, local_rank)
    ok = False
    try:
        init_world(backend, timeout, threads)
        result = fn(*args, **kwargs)
        write(path, {"ok": True, "result": result})
        ok = True
    except BaseException as e:  # noqa: BLE001 — report everything, including KeyboardInterrupt
        write(path, {"ok": False, "time": time.time(), "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc(), "exc": e})
    finish_rank(ok)


def launch(fn: Callable, nprocs: int, *args: Any, backend: str | None = None,
           timeout: float | None = None, run_timeout: float | None = None,
           threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return ``[result_of_rank_0, ...]``.

    ``fn`` must be importable (a module-level function). ``timeout`` bounds each collective
    (seconds; default ``SHARDLIB_TIMEOUT`` or 300), ``run_timeout`` the whole run. ``threads``
    is torch's intra-op thread count per rank (default: the machine's cores / ``nprocs``).
    If any rank raises or dies, the others are stopped (after a short grace) and ``WorkerError``
    names the first failing rank and carries its traceback.

    Under ``torchrun``, or in a program that already initialized ``torch.distributed``, ``fn``
    runs once in this process on that world and ``[result]`` is returned; ``nprocs`` is not used.
    A world that this call initialized is torn down (barrier, destroy) after ``fn`` returns.

    When ranks fail because others never reached a collective, ``WorkerError`` names those
    others (``rank``: the first of them), what they last did, and the collective timeout.
    """
    _check_not_bootstrapping()
    if problem := positive_int(nprocs, "launch: nprocs"):
        raise ShardingTypeError(f"{problem}.")
    if not callable(fn):
        raise ShardingTypeError(f"launch: fn must be callable — got {fn!r} of type {type(fn).__name__}.")
    if under_torchrun() or _world_initialized():
        created = init_world(backend, timeout, threads)
        watch = diagnose.WorldWatch()   # peers publish progress; a failed collective names who is behind
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            watch.annotate(e)
            if created:
                bound_exit()
            raise
        finally:
            watch.stop()
        if created:
            leave_world()
        return [result]
    import torch.multiprocessing as mp

    method = start_method()
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    result_dir = tempfile.mkdtemp(prefix="shardlib-launch-")
    reaper = Reaper(result_dir)   # removes the directory and the ranks if this process is killed
    saved = os.environ.get(_LAUNCH_DIR_ENV)
    store = world_store()         # held until the ranks are collected
    try:
        os.environ[_LAUNCH_DIR_ENV] = result_dir
        try:
            ctx = mp.start_processes(_worker, args=(fn, args, kwargs, nprocs, store.port, result_dir, backend,
                                                    timeout, threads, os.getpid(), parent_state(), _StdStreams()),
                                     nprocs=nprocs, join=False, start_method=method)
        finally:
            if saved is None:
                os.environ.pop(_LAUNCH_DIR_ENV, None)
            else:
                os.environ[_LAUNCH_DIR_ENV] = saved
        reaper.watch([p.pid for p in ctx.processes])
        if method == "forkserver":
            from multiprocessing import util
            reaper.remove_if_killed(util.get_temp_dir())
        return collect(ctx.processes, result_dir, nprocs, run_timeout, timeout=timeout)
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)
        reaper.close()


def bound_exit() -> None:
    """After a failure in a world ``launch`` joined under ``torchrun``: once the interpreter starts to
    exit, give it ``SHARDLIB_EXIT_GRACE`` seconds (default 30), then dump every thread's stack and
    ``_exit(1)``. A process group torn down while a peer still waits (or a thread that never ends) can
    otherwise hold the rank — and ``torchrun``, which waits for it — forever. Armed when the exit
    begins (before Python joins the threads), so a program that catches the error and goes on is
    not cut short."""
    global _EXIT_BOUND
    if _EXIT_BOUND:
        return
    _EXIT_BOUND = True
    grace = float(os.environ.get("SHARDLIB_EXIT_GRACE", "30"))

    def arm() -> None:
        print(f"shardlib: this rank failed; if it has not exited in {grace:g} s (SHARDLIB_EXIT_GRACE) its threads' "
              "stacks are dumped and it exits with status 1", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(grace, exit=True)

    import threading

    register = getattr(threading, "_register_atexit", None)   # runs before the interpreter joins threads
    try:
        register(arm) if register else None
    except RuntimeError:    # already shutting down
        register = None
    if register is None:
        import atexit
        atexit.register(arm)


_EXIT_BOUND = False


def _check_not_bootstrapping() -> None:
    """A script without the ``__main__`` guard calls ``launch`` again in every rank it spawns,
    while that rank imports it: stop there, with one line instead of multiprocessing's page."""
    import multiprocessing

    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    where = os.environ.get(_LAUNCH_DIR_ENV)
    if where:   # one of our ranks: tell the launcher, which raises the one line once
        try:
            open(os.path.join(where, "unguarded"), "w").close()
        except OSError:
            pass
        raise SystemExit(1)
    raise SystemExit(UNGUARDED)


def _world_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


