"""Naming the rank a hang waits for, from every rank's progress record (``comm/progress.py``).

When one rank never reaches a collective, its peers wait in it until the collective timeout
and then fail; the rank at fault raised nothing. Ranks of an SPMD program enter the same
collectives in the same order, so the ranks with the lowest sequence number are the ones the
others wait for. Under ``sl.launch`` the parent reads each rank's record from its file
(``hang_report``) and asks the laggards for their Python stacks; under ``torchrun`` the rank
whose collective failed reads its peers' records from the world's store (``WorldWatch``) and
adds a note to its own exception.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping

from ...comm import progress

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)   # a rank dumps its Python stack on this (faulthandler)


def timeout_text(timeout: float | None = None) -> str:
    """Where the collective timeout comes from, and its value."""
    env = os.environ.get("SHARDLIB_TIMEOUT")
    if timeout is not None:
        text = f"{timeout:g} s from launch(timeout=...), in place of SHARDLIB_TIMEOUT"
    else:
        text = f"SHARDLIB_TIMEOUT={env} s" if env else "300 s by default (SHARDLIB_TIMEOUT)"
    return text + ", unless Mesh(timeout=...) set its own"


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def _where(rec: dict | None) -> str:
    return progress.describe(rec) if rec and rec["seq"] else "its first collective"


def dump_stacks(pids: Mapping[int, int], faults: Mapping[int, str], wait: float = 2.0) -> dict[int, str]:
    """Ask running ranks (``rank -> pid``) for their Python stacks; faulthandler appends them to
    ``faults[rank]``. Returns what each rank wrote (empty where nothing arrived in ``wait`` s)."""
    if STACK_SIGNAL is None:
        return {}
    start = {}
    for r, pid in pids.items():
        try:
            start[r] = os.path.getsize(faults[r])
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            pass
    out: dict[int, str] = {}
    sizes = dict(start)
    end = time.monotonic() + wait
    while start and time.monotonic() < end:
        time.sleep(0.05)
        for r in list(start):
            size = os.path.getsize(faults[r]) if os.path.exists(faults[r]) else 0
            if size > start[r] and size == sizes[r]:   # grew, and stopped growing
                with open(faults[r]) as f:
                    f.seek(start.pop(r))
                    out[r] = f.read().strip()
            sizes[r] = size
    return out


def hang_report(records: Mapping[int, dict | None], errors: Mapping[int, dict], returned: set[int],
                nprocs: int, timeout: float | None = None,
                stacks: Mapping[int, str] | None = None) -> tuple[list[int], str] | None:
    """``(laggards, message)`` when the failure is ranks waiting for ranks that never arrived.

    ``errors``: the ranks that failed (``{"time", "error"}``); ``returned``: ranks that returned
    a result. None where the records do not show a laggard that did not itself fail."""
    behind = progress.laggards(records)
    if not behind or not errors or any(r in errors for r in behind):
        return None
    first = min(errors, key=lambda r: (errors[r]["time"], r))
    failed_at = errors[first]["time"]
    who = _ranks(behind)
    msg = (f"{who} of {nprocs} never reached collective {_where(records[first])}, where rank {first} "
           f"waited until it failed")
    others = sorted(set(errors) - {first})
    msg += f" (then {_ranks(others)})." if others else "."
    for r in behind[:4]:
        rec = records[r]
        last = (f"its last collective was {progress.describe(rec, now=failed_at)}" if rec and rec["seq"]
                else "it had entered no collective")
        state = "it had returned its result" if r in returned else (
            "it was still running and was stopped" + (" (its stack is below)" if stacks and r in stacks else ""))
        msg += f" Rank {r}: {last}; {state}."
    if len(behind) > 4:
        msg += f" ({len(behind) - 4} more ranks likewise.)"
    one = len(behind) == 1
    msg += (f" A collective waits for every rank of its group up to the collective timeout "
            f"({timeout_text(timeout)}): raise it if {who} {'is' if one else 'are'} only slow, or look at what "
            f"{who} {'does' if one else 'do'} after {'its' if one else 'their'} last collective.")
    msg += f"\n--- error of rank {first} ---\n{errors[first]['error']}"
    for r, stack in (stacks or {}).items():
        msg += f"\n--- stack of rank {r} when stopped ---\n{stack}"
    return behind, msg


# ---- under torchrun: each rank publishes; the failing one reads its peers ---------------------------

class WorldWatch:
    """Publishes this rank's progress into the world's store while ``fn`` runs (``torchrun``, or a
    world the program made); ``annotate`` adds to a failing collective's error which peers are behind."""

    def __init__(self, store=None, rank: int | None = None, world: int | None = None) -> None:
        self._publisher = None
        try:
            if store is None:
                import torch.distributed as dist

                store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
            self._store, self.rank, self.world = store, rank, world
            if world > 1:
                self._publisher = progress.publish(store, rank)
        except Exception:   # no store to share (a custom process group): run without
            self._publisher = None

    def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.stop()
            self._publisher = None

    def annotate(self, exc: BaseException) -> None:
        """Add a note naming the peers that never reached this rank's last collective."""
        if self._publisher is None or not isinstance(exc, RuntimeError):
            return
        self.stop()
        now = time.time()
        records = progress.peers_from_store(self._store, self.world)
        records[self.rank] = mine = progress.current()
        behind = [r for r in range(self.world) if (records[r] or {"seq": 0})["seq"] < mine["seq"]]
        if not behind:
            return
        lag = progress.laggards(records)
        lines = [f"shardlib: rank {self.rank} was in collective {_where(mine)} when it failed; "
                 f"{_ranks(behind)} of {self.world} never reached it"]
        for r in behind[:4]:
            lines.append(f"  rank {r}: last collective {progress.describe(records[r], now=now)}"
                         if records[r] and records[r]["seq"] else f"  rank {r}: no collective yet")
        if len(behind) > 4:
            lines.append(f"  ... {len(behind) - 4} more")
        lines.append(f"Look at {_ranks(lag)} (the furthest behind). A collective waits for every rank of its "
                     f"group up to the collective timeout: {timeout_text()}.")
        if progress.parted(records) is not None:     # where ranks that had agreed took different paths
            lines.append(progress.flight_report(records))
        add_note(exc, "\n".join(lines))


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note`` (Python 3.11+: printed under the message); on 3.10, appended to the message."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",) + exc.args[1:]
