"""Where each rank is: the last collective it entered, so a hang names the rank that never arrived.

Every collective that goes through ``comm/core.py`` calls ``enter(op, axes)`` before it blocks.
The process keeps one fixed-size record: a sequence number (collectives entered so far), the
op, its axes, the wall time and the user's step (``set_step``). An SPMD program issues the same
collectives in the same order on every rank, so when a collective times out, the ranks whose
sequence number is the lowest are the ones the others are waiting for.

The record is a 128-byte head and a ring of the last ``RING`` collectives (sequence number, op,
axes, bytes, step: the flight recorder), packed in place (no I/O on the hot path: about a
microsecond per collective). On a failure the reports set every rank's ring side by side and name
the first collective where ranks that had agreed parted (``flight_report``). Under ``sl.launch`` it is an ``mmap`` of a file in the launcher's
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
_ENTRY = struct.Struct("<qqq16s24s")     # seq, bytes, step, op, axes: one collective of the ring
RING = 16                                # the flight recorder: the last collectives each rank entered
SIZE = _REC.size + RING * _ENTRY.size    # 128 + 16 x 64
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

    def enter(self, op: str, axes: Sequence[str], nbytes: int = 0) -> None:
        key = (op, tuple(axes))
        names = self._names.get(key)
        if names is None:
            names = self._names[key] = (op.encode()[:24], ",".join(key[1]).encode()[:64])
        self.seq += 1
        self.time = time.time()
        self._cur = names
        self._pack()
        _ENTRY.pack_into(self.buf, _REC.size + (self.seq % RING) * _ENTRY.size, self.seq, int(nbytes), self.step,
                         names[0][:16], names[1][:24])

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
    """``{"seq", "step", "time", "pid", "op", "axes", "recent"}`` (``recent``: the flight recorder's
    collectives, oldest first, each ``{"seq", "op", "axes", "bytes", "step"}``), or None for a
    missing/short record."""
    if len(data) < _REC.size:
        return None
    seq, step, t, pid, op, axes = _REC.unpack_from(data)
    recent = []
    for i in range(RING if len(data) >= SIZE else 0):
        s, nbytes, st, o, a = _ENTRY.unpack_from(data, _REC.size + i * _ENTRY.size)
        if s > 0:
            recent.append({"seq": s, "op": o.rstrip(b"\0").decode(errors="replace"), "bytes": nbytes,
                           "axes": tuple(x for x in a.rstrip(b"\0").decode(errors="replace").split(",") if x),
                           "step": None if st < 0 else st})
    recent.sort(key=lambda e: e["seq"])
    return {"seq": seq, "step": None if step < 0 else step, "time": t, "pid": pid,
            "op": op.rstrip(b"\0").decode(errors="replace"),
            "axes": tuple(a for a in axes.rstrip(b"\0").decode(errors="replace").split(",") if a),
            "recent": recent}


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


def entry_words(e: dict) -> str:
    """``'#5 all_reduce(data) 16 B step 3'``: one collective of the flight recorder."""
    return f"#{e['seq']} {e['op']}({', '.join(e['axes'])}) {e['bytes']:,} B" + (
        f" step {e['step']}" if e.get("step") is not None else "")


def parted(records: Mapping[int, dict | None]) -> tuple[int, list[int]] | None:
    """``(sequence number, ranks that differ from the lowest rank there)``: the first collective in every
    rank's flight recorder where ranks that had entered the same collectives (op, axes, bytes) before it
    entered different ones — an SPMD program's ranks that took different paths. None where their recorders
    agree wherever they overlap, or never agreed (ranks of different roles, such as pipeline stages)."""
    rings = {r: {e["seq"]: (e["op"], e["axes"], e["bytes"]) for e in rec.get("recent", [])}
             for r, rec in records.items() if rec}
    if len(rings) < 2:
        return None
    common = sorted(set.intersection(*(set(v) for v in rings.values())))
    agreed = 0
    for s in common:
        kinds = {r: ring[s] for r, ring in rings.items()}
        first = kinds[min(kinds)]
        differ = sorted(r for r, k in kinds.items() if k != first)
        if differ:
            return (s, differ) if agreed else None
        agreed += 1
    return None


def flight_report(records: Mapping[int, dict | None], limit: int = 8) -> str:
    """Every rank's last collectives (the flight recorder), and where ranks parted (``parted``)."""
    lines = ["flight recorder (each rank's last collectives, oldest first):"]
    for r in sorted(records):
        rec = records[r]
        recent = (rec or {}).get("recent", [])[-limit:]
        lines.append(f"  rank {r}: " + ("; ".join(entry_words(e) for e in recent) if recent else "no collective yet"))
    found = parted(records)
    if found is not None:
        s, differ = found
        ref = min(r for r in records if records[r])
        kinds = {r: next((e for e in records[r]["recent"] if e["seq"] == s), None) for r in [ref, *differ]}
        lines.append(f"  the ranks parted at collective #{s}: rank {ref} entered {entry_words(kinds[ref])}, "
                     + "; ".join(f"rank {r} {entry_words(kinds[r])}" for r in differ)
                     + " — a data-dependent branch sent them down different paths before it")
    return "\n".join(lines)


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
