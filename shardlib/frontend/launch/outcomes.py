"""A launch's outcome, read by the parent: each rank's result file, and when one fails or dies, which
rank to name (the first to fail, a rank that died before the peers it took down, or the ranks that
never reached a collective: ``frontend/launch/diagnose.py``). The ranks write their outcome with ``write``
(``launcher._worker``)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from typing import Any

from ...comm import progress
from ...errors import ShardingError
from . import diagnose

UNGUARDED = ("launch: called while a spawned rank was importing the main script — got sl.launch(...) at the "
             "top level of the script; expected it under `if __name__ == \"__main__\":`. Put the call (and the "
             "code that starts the run) under that guard: every rank imports the script, and must not launch again.")

class WorkerError(RuntimeError):
    """A rank raised (or died). ``rank`` is the first failing rank; ``remote_traceback`` its stack."""

    def __init__(self, message: str, *, rank: int, remote_traceback: str = "", exc: BaseException | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exc = exc


def write(path: str, payload: dict) -> None:
    """Write a rank's outcome atomically. The exception travels pickled on its own, so one that
    cannot be rebuilt in the parent still leaves its message and traceback readable."""
    payload = dict(payload)
    exc = payload.pop("exc", None)
    if exc is not None:
        try:
            payload["exc"] = pickle.dumps(exc)
        except Exception:
            pass
    try:
        data = pickle.dumps(payload)
    except Exception as e:  # unpicklable result
        what = "result" if payload.get("ok") else "error"
        data = pickle.dumps({"ok": False, "time": time.time(), "traceback": payload.get("traceback", ""),
                             "error": f"could not pickle the rank's {what}: {e!r} — return plain data "
                                      "(tensors, numbers, containers), not objects that hold processes or locks"})
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def result_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.pkl")


def fault_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.fault")


def progress_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.progress")


def collect(processes: list, result_dir: str, nprocs: int, run_timeout: float | None,
            grace: float = 3.0, timeout: float | None = None) -> list[Any]:
    """Wait for every rank's result file; once one fails or dies, stop the rest after ``grace`` s.

    Success is decided from the result files alone: a rank that wrote its result and then died
    (gloo's abort at exit) counts as done. A rank that died without a result is dated by the last
    time it was seen alive, so it is reported ahead of the peers that failed because it vanished.
    Ranks that failed waiting for peers that never reached their collective are reported after
    those peers (``diagnose.hang_report``; ``timeout``, the collective timeout, is named there).
    """
    deadline = time.monotonic() + run_timeout if run_timeout else None
    results: dict[int, dict] = {}
    seen_alive = {r: time.time() for r in range(nprocs)}
    failed_at: float | None = None
    try:
        while True:
            for r in range(nprocs):
                if r in results:
                    continue
                path = result_path(result_dir, r)
                now = time.time()
                if os.path.exists(path):
                    results[r] = _read(path, r)
                elif processes[r].exitcode is None:
                    seen_alive[r] = now
                elif not os.path.exists(path):  # the file may have landed between the two checks
                    results[r] = _death(r, processes[r].exitcode, seen_alive[r], result_dir)
            errors = {r: v for r, v in results.items() if not v["ok"]}
            if len(results) == nprocs and not errors:
                _reap(processes, grace)
                return [results[r]["result"] for r in range(nprocs)]
            now = time.monotonic()
            if errors and failed_at is None:
                failed_at = now
            timed_out = deadline is not None and now > deadline
            if (errors and (len(results) == nprocs or now - failed_at > grace)) or timed_out:
                err = _failure(processes, result_dir, errors, results, nprocs, run_timeout, timeout)
                _reap(processes, 0.5)
                raise err
            time.sleep(0.02)
    except BaseException:  # Ctrl-C or our own error: never leave ranks running
        _reap(processes, 0.0)
        raise


def _failure(processes: list, result_dir: str, errors: dict[int, dict], results: dict[int, dict], nprocs: int,
             run_timeout: float | None, timeout: float | None) -> BaseException:
    """The error to raise: the unguarded script, ranks that never arrived, or the first failure."""
    if os.path.exists(os.path.join(result_dir, "unguarded")):
        return ShardingError(UNGUARDED)
    records = {r: progress.read_file(progress_path(result_dir, r)) for r in range(nprocs)}
    returned = {r for r, v in results.items() if v["ok"]}
    found = diagnose.hang_report(records, errors, returned, nprocs, timeout)
    # the flight recorder where collectives are in question: a hang, ranks that parted, a collective that failed
    # (a rank that died or raised elsewhere keeps the launcher's one line)
    first = errors[min(errors, key=lambda r: (errors[r]["time"], r))]["error"] if errors else ""
    flight = ("\n" + progress.flight_report(records)) if any(rec and rec.get("recent") for rec in records.values()) \
        and (found is not None or progress.parted(records) is not None
             or first.startswith(("CollectiveError", "DistBackendError"))) else ""
    if found is None:
        err = _worker_error(errors, results, nprocs, run_timeout)
        behind = progress.laggards(records)
        if not errors and behind:   # the run timed out while some ranks were behind the others
            err.args = (err.args[0] + " Behind the others: " + "; ".join(
                f"rank {r} (last collective {progress.describe(records[r])})" for r in behind[:4]) + ".",)
        if flight and err.args and isinstance(err.args[0], str):
            err.args = (err.args[0] + flight,) + err.args[1:]
        return err
    running = {r: processes[r].pid for r in found[0] if r not in results and processes[r].exitcode is None}
    stacks = diagnose.dump_stacks(running, {r: fault_path(result_dir, r) for r in running})
    behind, msg = diagnose.hang_report(records, errors, returned, nprocs, timeout, stacks)
    return WorkerError(msg + flight, rank=behind[0], remote_traceback=stacks.get(behind[0], ""))


def _worker_error(errors: dict[int, dict], results: dict[int, dict], nprocs: int,
                  run_timeout: float | None) -> WorkerError:
    if not errors:
        missing = [r for r in range(nprocs) if r not in results]
        return WorkerError(f"launch: ranks {missing} did not finish within {run_timeout} s — raise run_timeout, "
                           "or look for a rank stuck outside a collective.", rank=missing[0])
    first = min(errors, key=lambda r: (errors[r]["time"], r))
    e = errors[first]
    msg = f"rank {first} of {nprocs} failed: {e['error']}"
    others = sorted(set(errors) - {first})
    if others:
        msg += f" (ranks {others} failed after it)"
    stopped = [r for r in range(nprocs) if r not in results]
    if stopped:
        msg += f" (ranks {stopped} were stopped)"
    if e["traceback"]:
        msg += "\n--- traceback of rank %d ---\n%s" % (first, e["traceback"])
    return WorkerError(msg, rank=first, remote_traceback=e["traceback"], exc=e.get("exc"))


def _death(rank: int, exitcode: int, last_alive: float, result_dir: str) -> dict:
    """The outcome of a rank that exited without writing a result, dated by the last time it was seen
    alive or, where a fatal signal made faulthandler write its stack, by when that was written: the
    moment it died. The parent learns of a forked rank's exit through the fork server, which a busy
    machine can delay past the error of a peer that lost its connection to the dead rank; the stack's
    time still puts the death first."""
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    when, path = last_alive, fault_path(result_dir, rank)
    try:
        with open(path) as f:
            stack = f.read().strip()
        if stack and exitcode < 0:
            when = min(last_alive, os.path.getmtime(path))
    except OSError:
        stack = ""
    return {"ok": False, "time": when, "traceback": stack,
            "error": f"rank {rank} {how} before returning a result"}


def _read(path: str, rank: int) -> dict:
    try:
        with open(path, "rb") as f:
            payload = pickle.load(f)
    except Exception as e:
        return {"ok": False, "time": time.time(), "traceback": "",
                "error": f"rank {rank}'s result could not be read back: {e!r}"}
    exc = payload.get("exc")
    if isinstance(exc, bytes):
        try:
            payload["exc"] = pickle.loads(exc)
        except Exception:  # e.g. an exception type whose __init__ takes other arguments
            payload["exc"] = None
    return payload


def _reap(processes: list, grace: float) -> None:
    end = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)
