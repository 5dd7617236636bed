"""Where each rank is: the last collective it entered, so a hang names the rank that never arrived.

Every collective that goes through ``comm/core.py`` calls ``enter(op, axes)`` before it blocks.
The process keeps one fixed-size record: a sequence number (collectives entered so far), the
op, its axes, the wall time and the user's step (``set_step``). An SPMD program issues the same
collectives in the same order on every rank, so when a collective times out, the ranks whose
sequence number is the lowest are the ones the others are waiting for.

The record is a 128-byte buffer packed in place (no I/O on the hot path: well under a
microsecond per collective). Under ``sl.launch`` it is an ``mmap`` of a file in the launcher's
result directory (``attach``): the parent reads it even from a rank that is stuck, killed or
holds the GIL. Under ``torchrun`` there is no parent; a daemon thread (``publish``) copies it
into the world's key-value store when it changes, at most every ``interval`` seconds, and the
rank whose collective fails reads its peers' records from there (``peers_from_store``).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections.abc import Mapping, Sequence

_REC = struct.Struct("<qqdq24s64s8x")   # seq, step (-1: unknown), time, pid, op, axes
SIZE = _REC.size                         # 128
_KEY = "shardlib/progress/{}"


class _Record:
    """This process's progress; one per process (``_THIS``)."""

    def __init__(self) -> None:
        self.buf: bytearray | mmap.mmap = bytearray(SIZE)
        self.seq, self.step, self.time, self.pid = 0, -1, 0.0, os.getpid()
        self._names: dict[tuple[str, tuple[str, ...]], tuple[bytes, bytes]] = {}
        self._cur = (b"", b"")
        self._pack()

    def _pack(self) -> None:
        _REC.pack_into(self.buf, 0, self.seq, self.step, self.time, self.pid, *self._cur)

    def enter(self, op: str, axes: Sequence[str]) -> None:
        key = (op, tuple(axes))
        names = self._names.get(key)
        if names is None:
            names = self._names[key] = (op.encode()[:24], ",".join(key[1]).encode()[:64])
        self.seq += 1
        self.time = time.time()
        self._cur = names
        self._pack()

    def set_step(self, step: int) -> None:
        self.step = int(step)
        self._pack()

    def attach(self, path: str) -> None:
        """Keep the record in ``path`` (created, ``SIZE`` bytes, mapped) from now on."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        mm[:] = bytes(self.buf)
        self.buf = mm


_THIS = _Record()
enter = _THIS.enter


def set_step(step: int) -> None:
    """Note the user's training step (shown beside the last collective in a hang report)."""
    _THIS.set_step(step)


def attach(path: str) -> None:
    """Keep this process's record in a file that another process can read (``read_file``)."""
    _THIS.attach(path)


def current() -> dict:
    """This process's record as a dict (see ``unpack``)."""
    return unpack(bytes(_THIS.buf))


def unpack(data: bytes) -> dict | None:
    """``{"seq", "step", "time", "pid", "op", "axes"}``, or None for a missing/short record."""
    if len(data) < SIZE:
        return None
    seq, step, t, pid, op, axes = _REC.unpack_from(data)
    return {"seq": seq, "step": None if step < 0 else step, "time": t, "pid": pid,
            "op": op.rstrip(b"\0").decode(errors="replace"),
            "axes": tuple(a for a in axes.rstrip(b"\0").decode(errors="replace").split(",") if a)}


def read_file(path: str) -> dict | None:
    """Another process's record; read until two reads agree (the writer may be mid-update)."""
    last = None
    for _ in range(5):
        try:
            with open(path, "rb") as f:
                data = f.read(SIZE)
        except OSError:
            return None
        if data == last:
            break
        last = data
    return unpack(last or b"")


# ---- under torchrun: mirror the record into the world's store -----------------------------------

class Publisher:
    """A daemon thread copying this rank's record to ``store`` whenever it changed (every ``interval`` s)."""

    def __init__(self, store, rank: int, interval: float = 0.5):
        self.store, self.key, self.interval = store, _KEY.format(rank), interval
        self._stop = threading.Event()
        self._last = b""
        self._thread = threading.Thread(target=self._run, name="shardlib-progress", daemon=True)
        self._publish()
        self._thread.start()

    def _publish(self) -> None:
        data = bytes(_THIS.buf)
        if data[:8] != self._last[:8] or data[16:] != self._last[16:]:   # seq/step/op changed
            self.store.set(self.key, data)
            self._last = data

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
            except Exception:   # the store went away (world torn down): nothing left to report to
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._publish()
        except Exception:
            pass


def publish(store, rank: int, interval: float = 0.5) -> Publisher:
    """Start mirroring this rank's record into ``store`` (stop it with ``.stop()``)."""
    return Publisher(store, rank, interval)


def peers_from_store(store, world_size: int) -> dict[int, dict | None]:
    """Every rank's last published record (None where a rank published nothing)."""
    out: dict[int, dict | None] = {}
    for r in range(world_size):
        key = _KEY.format(r)
        try:
            out[r] = unpack(store.get(key)) if store.check([key]) else None
        except Exception:
            out[r] = None
    return out


# ---- comparing ranks ----------------------------------------------------------------------------

def laggards(records: Mapping[int, dict | None]) -> list[int]:
    """The ranks the others wait for: those at the lowest sequence number, if not all are equal.

    A rank that never entered a collective (no record) counts as sequence 0."""
    seqs = {r: (rec["seq"] if rec else 0) for r, rec in records.items()}
    if not seqs or min(seqs.values()) == max(seqs.values()):
        return []
    low = min(seqs.values())
    return sorted(r for r, s in seqs.items() if s == low)


def describe(rec: dict | None, now: float | None = None) -> str:
    """``'#5 all_reduce(data), 7.1 s ago, at step 3'``; ``'no collective yet'`` without one."""
    if not rec or rec["seq"] == 0:
        return "no collective yet"
    text = f"#{rec['seq']} {rec['op']}({', '.join(rec['axes'])})"
    if now is not None:
        text += f", {max(0.0, now - rec['time']):.1f} s before the failure"
    if rec.get("step") is not None:
        text += f", at step {rec['step']}"
    return text
