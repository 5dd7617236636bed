"""A pool of worker ranks kept alive across tests, for multi-process tests on one machine.

Starting a gloo world costs seconds (each rank imports torch); a test suite that spawned one
per test would spend its time there. ``WorldPool(n)`` starts ``n`` ranks once, and
``pool.run(fn, *args)`` runs ``fn`` on every rank and returns the per-rank results. If any
rank raises, the pool is restarted before the next task (a failed collective can leave the
world out of step).

No wall-clock deadline decides a task's verdict: on a busy machine a healthy task may take
minutes. Instead the pool watches *progress*. Every rank publishes, through shared memory, the
CPU time of its main thread (a heartbeat thread reads it) and a counter that
``progress()`` bumps. A rank that has not answered is *stalled* when neither moved for
``stall`` seconds (default ``2 * timeout``). That cannot happen to a rank that is merely slow
(it uses CPU time) nor to one waiting in a collective for a slow peer: every collective has a
timeout (``timeout``, from ``SHARDLIB_TEST_TIMEOUT``, default 60 s) shorter than ``stall``, so a
collective that never completes raises in the rank first. What is left is a rank stuck outside
any collective (asleep, blocked on a lock or a subprocess); the pool names it, with the stack
it is stuck in, and restarts the world.

``get_mesh(shape)`` returns a ``Mesh`` cached per worker, so tests do not create fresh process
groups each time (gloo groups hold sockets; thousands would exhaust file descriptors).

**Starting ranks.** As ``sl.launch`` starts its ranks (``frontend/launch/launcher.py``): forked from
multiprocessing's fork server, which imports torch's parts and shardlib once (an 8-rank world: 14-17 s
wall -> 3 s on two cores), each rank taking the parent's environment, working directory and ``sys.path``
as of ``start()``. (torch's import starts one native thread of its own in the server, as it does before
DataLoader forks its workers; a fork copies none.)
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from typing import Any

from .frontend.launch.launcher import (adopt_parent_state, finish_rank, init_world, parent_state, set_rank_env, start_method,
                                world_store)
from .frontend.launch.outcomes import WorkerError

_MESHES: dict = {}   # worker-process cache; the library itself never reads it
_WORKER: dict = {}   # worker-process state: this rank's progress slot; empty outside a pool worker
_MIN_CPU = 0.05      # seconds of main-thread CPU time that count as progress
def get_mesh(shape: Mapping[str, int], **options: Any):
    """A ``Mesh`` over this worker's world, built once per shape (and ``Mesh`` keyword options)."""
    from .algebra.mesh import Mesh

    key = (tuple(shape.items()), tuple(sorted(options.items())))
    if key not in _MESHES:
        _MESHES[key] = Mesh(dict(shape), **options)
    return _MESHES[key]


def progress() -> None:
    """Tell the pool this rank is making progress (a no-op outside a pool worker).

    Work that uses CPU time counts by itself; call this in a task that legitimately waits
    outside collectives (on a subprocess, a sleep) for longer than the pool's stall window."""
    steps = _WORKER.get("steps")
    if steps is not None:
        steps[_WORKER["rank"]] += 1


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k == key)


def peak_rss_reset() -> int:
    """Start a peak-memory measurement (Linux): freed heap pages handed back to the kernel
    (``malloc_trim``, so a new allocation shows as a rise, not a reused hole), then the kernel's
    high-water mark reset (``VmHWM := VmRSS``). Returns the resident bytes now."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """The most resident bytes since the last ``peak_rss_reset`` (the kernel's ``VmHWM``)."""
    return _status_bytes("VmHWM")


def _heartbeat(cpu, rank: int, interval: float) -> None:
    """Publish the main thread's CPU time every ``interval`` seconds (the whole process's where a
    thread's clock cannot be read)."""
    try:
        clock = time.pthread_getcpuclockid(threading.main_thread().ident)

        def read() -> float:
            return time.clock_gettime(clock)
    except (AttributeError, OSError):
        read = time.process_time
    while True:
        cpu[rank] = read()
        time.sleep(interval)


def _pool_worker(local_rank: int, nprocs: int, port: int, conns: list, timeout: float,
                 steps, cpu, interval: float, stack_pipes: list, parent: dict) -> None:
    adopt_parent_state(parent)   # a forked rank starts from the fork server's state: take the parent's
    _WORKER.update(steps=steps, rank=local_rank, stack_pipe=stack_pipes[local_rank])   # kept open
    if hasattr(signal, "SIGUSR1"):   # the parent asks for our stack when we stall; it reads the pipe
        faulthandler.register(signal.SIGUSR1, file=stack_pipes[local_rank].fileno(), all_threads=True)
    set_rank_env(local_rank, nprocs, port)
    conn = conns[local_rank]
    ok = True
    try:
        init_world("gloo", timeout, threads=1)   # the rendezvous has its own timeout
        # until the first heartbeat the pool counts this rank as starting, not stalled
        threading.Thread(target=_heartbeat, args=(cpu, local_rank, interval), name="shardlib-heartbeat",
                         daemon=True).start()
        while True:
            task = conn.recv()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                conn.send({"ok": True, "result": fn(*args, **kwargs)})
            except BaseException as e:  # noqa: BLE001 — includes a result that cannot be pickled
                payload = {"ok": False, "time": time.time(), "error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc()}
                try:  # pickled on its own: an exception the parent cannot rebuild keeps its message
                    payload["exc"] = pickle.dumps(e)
                except Exception:
                    pass
                conn.send(payload)
    except (EOFError, KeyboardInterrupt):
        ok = False
    finish_rank(ok)


class WorldPool:
    """``n`` gloo ranks on this machine, reused across tasks.

    ``timeout``: every collective's timeout (default ``SHARDLIB_TEST_TIMEOUT``, else 60 s).
    ``stall``: how long an unanswered rank may go without progress (default ``2 * timeout``;
    keep it above ``timeout``, or a rank waiting in a collective for a slow peer looks stalled).
    ``grace``: how long to wait for the other ranks once one has failed.
    ``heartbeat``: how often each rank publishes its CPU time."""

    def __init__(self, nprocs: int, timeout: float | None = None, grace: float = 2.0,
                 stall: float | None = None, heartbeat: float = 0.5):
        self.nprocs = nprocs
        self.timeout = float(timeout or os.environ.get("SHARDLIB_TEST_TIMEOUT", "60"))
        self.stall = float(stall) if stall is not None else 2 * self.timeout
        self.grace = grace
        self.heartbeat = min(heartbeat, self.stall / 4)
        self._procs: list = []
        self._conns: list = []
        self._steps = self._cpu = None
        self._stack_pipes: list = []   # read ends: where each rank's faulthandler writes its stack
        self._store = None

    def start(self) -> None:
        import torch.multiprocessing as mp

        method = start_method()
        ctx = mp.get_context(method)
        pairs = [ctx.Pipe() for _ in range(self.nprocs)]
        self._conns = [a for a, _ in pairs]
        self._steps = ctx.RawArray("q", self.nprocs)
        self._cpu = ctx.RawArray("d", [-1.0] * self.nprocs)   # -1: no heartbeat yet (still starting)
        stack_pipes = [ctx.Pipe(duplex=False) for _ in range(self.nprocs)]
        self._stack_pipes = [a for a, _ in stack_pipes]
        self._store = world_store()    # the world's rendezvous, hosted here until close()
        pc = mp.start_processes(_pool_worker, args=(self.nprocs, self._store.port, [b for _, b in pairs],
                                                    self.timeout, self._steps, self._cpu, self.heartbeat,
                                                    [b for _, b in stack_pipes],
                                                    parent_state()),
                                nprocs=self.nprocs, join=False, start_method=method)
        self._procs = pc.processes
        for _, b in pairs + stack_pipes:
            b.close()

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        if not self._procs or any(not p.is_alive() for p in self._procs):
            self.close()
            self.start()
        try:
            for c in self._conns:
                c.send((fn, args, kwargs))
            results, marks = self._collect()
        except BaseException:   # interrupted (a test timeout, Ctrl-C): the ranks are still on the task
            self.close(kill=True)
            raise
        now = time.monotonic()
        idle = {r: now - marks[r][2] for r in range(self.nprocs) if r not in results}
        errors = {r: v for r, v in results.items() if not v["ok"]}
        if not errors and not idle:
            return [results[r]["result"] for r in range(self.nprocs)]
        # ranks that went without progress for long: their stacks say where they are stuck
        stuck = [r for r, t in idle.items() if t > (min(self.stall, self.timeout / 2) if errors else self.stall)]
        stacks = self._stacks(stuck[:4])
        self.close(kill=True)   # the world may be out of step; the next task gets a fresh one
        if not errors:
            raise self._stalled_error(fn, stuck, idle, sorted(results), stacks)
        first = min(errors, key=lambda r: errors[r]["time"])
        e = errors[first]
        quiet = (f"\nranks {stuck} had not answered and made no progress for {max(idle[r] for r in stuck):.0f} s;"
                 f" a rank stuck outside collectives makes its peers' collectives time out.\n{stacks}"
                 if stuck else "")
        raise WorkerError(f"rank {first} of {self.nprocs} failed: {e['error']}\n"
                          f"--- traceback of rank {first} ---\n{e['traceback']}{quiet}",
                          rank=first, remote_traceback=e["traceback"], exc=e.get("exc"))

    def _collect(self) -> tuple[dict[int, dict], list[tuple[int, float, float]]]:
        """Wait for the ranks' answers until all answered, one failed (plus ``grace``), or the
        unanswered ones stalled. Returns the answers and, per rank, (steps, cpu, time) of the last
        progress seen."""
        results: dict[int, dict] = {}
        start = time.monotonic()
        marks = [(self._steps[r], self._cpu[r], start) for r in range(self.nprocs)]   # last progress seen
        first_error_at = first_stall_at = None
        while len(results) < self.nprocs:
            pending = {c: r for r, c in enumerate(self._conns) if r not in results}
            ready = wait(list(pending), timeout=min(0.2, self.heartbeat))
            for c, r in pending.items():
                if c in ready:
                    results[r] = self._receive(r, c)
                elif not self._procs[r].is_alive():
                    results[r] = {"ok": False, "time": time.time(), "traceback": "",
                                  "error": f"rank {r} died (exit code {self._procs[r].exitcode})"}
            now = time.monotonic()
            for r in range(self.nprocs):
                steps, cpu = self._steps[r], self._cpu[r]
                if cpu < 0 or steps != marks[r][0] or cpu - marks[r][1] >= _MIN_CPU:
                    marks[r] = (steps, cpu, now)   # starting up (alive, importing) or progressing
            if first_error_at is None and any(not v["ok"] for v in results.values()):
                first_error_at = now
            # once a rank failed, peers blocked in a collective only fail at its timeout; don't wait
            if first_error_at is not None:
                if now - first_error_at > self.grace:
                    break
                continue
            waiting = [r for r in range(self.nprocs) if r not in results]
            if first_stall_at is None and any(now - marks[r][2] > self.stall for r in waiting):
                first_stall_at = now
            # name every rank that stopped: wait until each unanswered one has stalled or moved since
            if first_stall_at is not None and all(
                    now - marks[r][2] > self.stall or marks[r][2] > first_stall_at for r in waiting):
                break
        return results, marks

    def _stalled_error(self, fn: Callable, stalled: list[int], idle: dict[int, float], answered: list[int],
                       stacks: str) -> WorkerError:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        running = sorted(set(idle) - set(stalled))
        return WorkerError(
            f"ranks {stalled} of {self.nprocs} made no progress for {self.stall:.0f} s in {name} "
            f"(no CPU time used, no shardlib.testing.progress() call); ranks {answered} had answered"
            + (f", ranks {running} were still working" if running else "") + ". "
            f"A collective waiting on a peer fails by itself after its {self.timeout:.0f} s timeout "
            f"(SHARDLIB_TEST_TIMEOUT), so these ranks are stuck outside collectives (asleep, on a lock, "
            f"on a subprocess). Call shardlib.testing.progress() in a task that waits on purpose."
            + (f"\n{stacks}" if stacks else ""),
            rank=stalled[0], remote_traceback=stacks)

    def _stacks(self, ranks: list[int]) -> str:
        """Where each of ``ranks`` is stuck: its Python stack, dumped by faulthandler on SIGUSR1."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        dumps = {r: b"" for r in ranks}
        end = time.monotonic() + 3
        while time.monotonic() < end:   # read until every rank's dump is in and then quiet
            ready = wait([self._stack_pipes[r] for r in ranks], timeout=0.2)
            for r in ranks:
                if self._stack_pipes[r] in ready:
                    dumps[r] += os.read(self._stack_pipes[r].fileno(), 1 << 16)
            if not ready and all(dumps.values()):
                break
        out = []
        for r in ranks:
            # the heartbeat thread's stack is noise; keep the threads that run the task
            blocks = [b for b in dumps[r].decode(errors="replace").strip().split("\n\n")
                      if b.strip() and "_heartbeat" not in b]
            if blocks:
                out.append(f"--- where rank {r} is (most recent call first) ---\n" + "\n\n".join(blocks))
        return "\n".join(out)

    def _receive(self, r: int, conn) -> dict:
        try:
            payload = conn.recv()
        except EOFError:
            return {"ok": False, "time": time.time(), "traceback": "",
                    "error": f"rank {r} died (exit code {self._procs[r].exitcode})"}
        except Exception as e:  # a result whose type cannot be rebuilt here
            return {"ok": False, "time": time.time(), "traceback": "",
                    "error": f"rank {r}'s result could not be read back: {e!r}"}
        if isinstance(payload.get("exc"), bytes):
            try:
                payload["exc"] = pickle.loads(payload["exc"])
            except Exception:
                payload["exc"] = None
        return payload

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: cleanly (barrier, destroy) by default; at once with ``kill=True``,
        for a world left out of step, where the clean exit's barrier could only hang."""
        if not kill:
            for c in self._conns:
                try:
                    c.send(None)
                except Exception:
                    pass
        end = time.monotonic() + (0 if kill else 10)
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self._conns + self._stack_pipes:
            c.close()
        self._procs, self._conns, self._stack_pipes = [], [], []
        self._store = None

    def __enter__(self) -> WorldPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
