"""A pool of worker ranks kept alive across tests, for multi-process tests on one machine.

Starting a gloo world costs seconds (each rank imports torch); a test suite that spawned one
per test would spend its time there. ``WorldPool(n)`` starts ``n`` ranks once, and
``pool.run(fn, *args)`` runs ``fn`` on every rank and returns the per-rank results. If any
rank raises, the pool is restarted before the next task (a failed collective can leave the
world out of step). Every collective has a timeout, so a bug fails the test instead of hanging.

``get_mesh(shape)`` returns a ``Mesh`` cached per worker, so tests do not create fresh process
groups each time (gloo groups hold sockets; thousands would exhaust file descriptors).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from .frontend.launcher import WorkerError, finish_rank, free_port, init_world, set_rank_env

_MESHES: dict = {}   # worker-process cache; the library itself never reads it


def get_mesh(shape: Mapping[str, int], **options: Any):
    """A ``Mesh`` over this worker's world, built once per shape (and ``Mesh`` keyword options)."""
    from .algebra.mesh import Mesh

    key = (tuple(shape.items()), tuple(sorted(options.items())))
    if key not in _MESHES:
        _MESHES[key] = Mesh(dict(shape), **options)
    return _MESHES[key]


def _pool_worker(local_rank: int, nprocs: int, port: int, conns: list, timeout: float) -> None:
    set_rank_env(local_rank, nprocs, port)
    conn = conns[local_rank]
    ok = True
    try:
        init_world("gloo", timeout, threads=1)
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
    """``n`` gloo ranks on this machine, reused across tasks."""

    def __init__(self, nprocs: int, timeout: float | None = None, grace: float = 2.0):
        self.nprocs = nprocs
        self.timeout = float(timeout or os.environ.get("SHARDLIB_TEST_TIMEOUT", "60"))
        self.grace = grace   # how long to wait for the other ranks once one has failed
        self._procs: list = []
        self._conns: list = []

    def start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        pairs = [ctx.Pipe() for _ in range(self.nprocs)]
        self._conns = [a for a, _ in pairs]
        pc = mp.start_processes(_pool_worker, args=(self.nprocs, free_port(), [b for _, b in pairs], self.timeout),
                                nprocs=self.nprocs, join=False, start_method="spawn")
        self._procs = pc.processes
        for _, b in pairs:
            b.close()

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        if not self._procs or any(not p.is_alive() for p in self._procs):
            self.close()
            self.start()
        for c in self._conns:
            c.send((fn, args, kwargs))
        results: dict[int, dict] = {}
        deadline = time.monotonic() + self.timeout * 2 + 30
        first_error_at = None
        while len(results) < self.nprocs:
            for r, c in enumerate(self._conns):
                if r in results:
                    continue
                if c.poll(0.01):
                    results[r] = self._receive(r, c)
                elif not self._procs[r].is_alive():
                    results[r] = {"ok": False, "time": time.time(), "traceback": "",
                                  "error": f"rank {r} died (exit code {self._procs[r].exitcode})"}
            errors = [r for r, v in results.items() if not v["ok"]]
            now = time.monotonic()
            if errors and first_error_at is None:
                first_error_at = now
            # once a rank failed, peers blocked in a collective only fail at its timeout; don't wait
            if now > deadline or (first_error_at is not None and now - first_error_at > self.grace):
                break
        errors = {r: v for r, v in results.items() if not v["ok"]}
        if errors or len(results) < self.nprocs:
            self.close(kill=True)   # the world may be out of step; the next task gets a fresh one
            if not errors:
                missing = [r for r in range(self.nprocs) if r not in results]
                raise WorkerError(f"ranks {missing} did not answer within {self.timeout * 2 + 30:.0f} s",
                                  rank=missing[0])
            first = min(errors, key=lambda r: errors[r]["time"])
            e = errors[first]
            raise WorkerError(f"rank {first} of {self.nprocs} failed: {e['error']}\n"
                              f"--- traceback of rank {first} ---\n{e['traceback']}",
                              rank=first, remote_traceback=e["traceback"], exc=e.get("exc"))
        return [results[r]["result"] for r in range(self.nprocs)]

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
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> WorldPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
