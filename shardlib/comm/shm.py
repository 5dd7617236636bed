"""A group's collectives through shared memory, where all its members run on this host (gloo, CPU).

Gloo moves every message through a TCP socket and hands it between the caller's thread and its own;
for the tensor axis's activations (hundreds of KB, several per block, on the critical path) those
hand-offs, not the bytes, are the cost: a 512 KB all-reduce over two ranks of the 2-core reference
machine takes 1.0 ms alone and 1.4-2.5 ms inside a step; copying it in, waiting for the peer and
adding takes 0.1-0.2 ms. DeepSpeed's CPU backend (its ``shm`` all-reduce) and oneCCL do the same for
ranks that share a host. All-reduces, all-gathers and reduce-scatters (``core``'s, what every axis
issues) take it; a pipeline's sends and receives between neighbours take ``comm/mailbox.py``, on the
same ``Files``.

**Set-up.** The group's first collective that asks for the channel sets it up, collectively: every
member creates a file under ``/dev/shm`` (named by a random token member 0 draws) with its pages
reserved, maps every peer's, checks the peer's pid in it, and unlinks its own once all are mapped —
nothing is left behind, even if a rank dies later. Every member keeps gloo for the group if any
member's host cannot run the channel (``supported``), its /dev/shm lacks room for twice the group's
files (``_room``: a container's 64 MB default can), or any step failed: all learn it in the same
collective. They also agree on whether every member's ranks fill its host's cores
(``Channel.filled``, for asynchronous reduce-scatters) and whether they see each other's pids (the
liveness check). A member's file holds a header (two counters on cache lines of their own, its pid)
and ``SLOTS`` slots of ``SLOT_BYTES``; a member reserves its slots' pages (``posix_fallocate``) as
far as its pieces first reach, so a /dev/shm filled meanwhile is an error that names the fix, not a
SIGBUS on a write, and a group of small collectives holds a few pages. A mesh holds its groups'
channels: they close with it.

**A collective** is cut into pieces of one slot along its last dim (the group's ``n``-th piece uses
slot ``n % SLOTS``). Issuing copies each piece's input into this member's slot and raises its
*arrived* counter to ``n`` — never waiting: a piece whose slot a member still reads is copied in
later, in order. Completing (``wait()``) waits for every member's *arrived* to reach ``n``, writes
the result from the members' slots — all-reduce: their values folded in member order; all-gather:
each member's block; reduce-scatter: this member's chunk of each folded in member order — and
raises *done* to ``n``; a slot is written again once every member's *done* passed its last use.
Every member folds in the same order, so all hold the same bits; over two members ``a + b`` is
gloo's result bit for bit. Waiting spins briefly, then sleeps on a futex on the counter (the writer
wakes it); it fails, with what gloo raises for a lost peer, at the group's timeout or within a
second of a peer's process exiting, naming it.

x86-64 Linux only (the counters rely on its store order; elsewhere gloo as before); ``sum``/
``max``/``min`` on float and integer tensors; groups of 2 to ``MAX_MEMBERS``; an asynchronous
reduce-scatter only where the ranks fill their hosts' cores (``reduce_scatter``). A collective of more
than ``SLOTS`` pieces (over 2 MiB) moves its later pieces only inside ``wait()``: a member's wait then
needs its peers to reach their wait of it too, as every rank of a shardlib step does; a program whose
ranks wait for the group's collectives in different orders from each other should keep gloo.
``SHARDLIB_SHM=0`` (alike on every rank) turns it off. Measured: ``benchmarks/bench_shm.py``,
``benchmarks/results/shm-2026-11-27.md``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import mmap
import os
import platform
import secrets
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from ..algebra.mesh import default_timeout

SLOT_BYTES = 1 << 19            # half-MiB pieces stay in cache (faster than 1 MiB ones per call)
SLOTS = 4
MAX_MEMBERS = 8
SPIN = 2000                      # counter reads before sleeping on the futex (~0.1 ms)
_HEADER = 4096
_ARRIVED, _DONE, _PID = 0, 8, 16  # int64 indices into the header: separate cache lines
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1
_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
_CHANNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # group -> Channel | None, without a mesh


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def supported() -> bool:
    """Whether this host can run the channel at all: x86-64 Linux with ``/dev/shm`` (each member's own
    answer; a group agrees on all of them at set-up)."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir("/dev/shm"))


def applies(k: int, x: torch.Tensor, gloo: bool, op: str = "sum") -> bool:
    """Whether a collective of ``x`` over ``k`` members asks for the group's channel: it depends only on
    what every member shares — the call's tensor, op and group, and ``SHARDLIB_SHM`` (read at every call
    so one process can measure both ways: set it alike on every rank). Whether the group has a channel
    is agreed at its set-up."""
    return (gloo and 2 <= k <= MAX_MEMBERS and op in _REDUCE and x.dtype != torch.bool and not x.is_complex()
            and x.numel() > 0 and x.is_contiguous() and os.environ.get("SHARDLIB_SHM", "1") != "0")


def channel(group, owner=None) -> Channel | None:
    """The group's channel, set up on first use (collective over the group); None where it keeps gloo.
    ``owner`` (the mesh that holds the group) keeps its channels, so they close when it is collected:
    their files' pages are reserved, and torch keeps a process group alive after its mesh is gone.
    Every member uses the group through the same mesh, so each mesh's channel is set up by all alike."""
    held = _CHANNELS if owner is None else owner.__dict__.setdefault("_shm_channels", {})
    try:
        return held[group]
    except KeyError:
        ch = held[group] = Channel.open(group)
        return ch


def all_reduce(x: torch.Tensor, op: str, group, owner=None) -> Issued | None:
    """Issue an all-reduce of ``x`` in place through the group's channel; ``wait()`` completes it.
    None when the group keeps gloo (decided once, by every member alike)."""
    ch = channel(group, owner)
    return None if ch is None else ch.issue("ar", x.view(-1), x.view(-1), op, x)


def all_gather(x: torch.Tensor, out: torch.Tensor, group, owner=None) -> Issued | None:
    """Issue an all-gather of every member's ``x`` into ``out`` (``k`` blocks of ``x``'s size, in member
    order; ``x`` may be this member's block of it)."""
    ch = channel(group, owner)
    return None if ch is None else ch.issue("ag", x.reshape(-1), out.view(ch.k, -1), "sum", out)


def reduce_scatter(x: torch.Tensor, out: torch.Tensor, op: str, group, async_op: bool = False,
                   owner=None) -> Issued | None:
    """Issue a reduce-scatter: ``out`` = this member's chunk of every member's ``x`` (``k`` chunks along
    dim 0), folded in member order (``out`` may be this member's chunk of ``x``: each piece of the input
    is copied into the slot before its result is written). An asynchronous one (ZeRO's buckets and
    units) only where every member's ranks fill its host's cores (``Channel.filled``): it folds on the
    caller's thread when waited for, where gloo folds on its own thread, beside the caller's work when a
    core is to spare (ZeRO-2 1.09x through shared memory on 16 cores)."""
    ch = channel(group, owner)
    if ch is None or (async_op and not ch.filled):
        return None
    return ch.issue("rs", x.view(ch.k, -1), out.view(-1), op, out)


class _Piece:
    """One slot's worth of a collective: ``src`` (what this member copies into its slot: ``w``
    elements, or ``k x w`` for a reduce-scatter) and ``dst`` (where the result goes)."""
    __slots__ = ("seq", "kind", "src", "dst", "op", "copied", "finished")

    def __init__(self, seq: int, kind: str, src: torch.Tensor, dst: torch.Tensor, op: str):
        self.seq, self.kind, self.src, self.dst, self.op = seq, kind, src, dst, op
        self.copied = self.finished = False


class Issued:
    """An issued collective: ``wait()`` completes its pieces (and the group's earlier ones) and returns
    its result."""

    def __init__(self, ch: Channel, last: _Piece, result: torch.Tensor):
        self._ch, self._last, self._result = ch, last, result

    def wait(self) -> torch.Tensor:
        self._ch.complete(self._last)
        return self._result


class Files:
    """The mapped files of a group's members (one per member, a header of int64 words first), set up
    collectively by ``open``; each word is written by one process and read by the others, with a
    futex wake-up on every write."""

    def __init__(self, me: int, k: int, maps: list, pids: list[int], timeout: float, name: str = "",
                 filled: bool = True, see_pids: bool = True):
        self.me, self.k, self.pids, self.timeout, self.name = me, k, pids, timeout, name
        self.filled, self.see_pids = filled, see_pids
        self.fd, self.reserved = -1, 0          # this member's file, and the bytes of each slot reserved
        self.maps = maps
        self.heads = [_words(m) for m in maps]
        with torch.inference_mode(False):      # plain tensors, whatever mode the first collective runs in
            self.bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self.addrs = [b.data_ptr() for b in self.bytes]

    @classmethod
    def open(cls, group, size: int) -> Files | None:
        """Every member creates its file under /dev/shm (named by a token member 0 draws; its header's
        page reserved, its slots' as they are first used: ``reserve``), maps every peer's and checks
        the peer's pid in it, then unlinks its own; None on every member if any member's host cannot
        (``supported``) or any step failed. Also agreed: whether every member's ranks fill their host's
        cores (``filled``), and whether all members see each other's pids (one pid namespace: the
        liveness check)."""
        from .pairwise import cores_filled
        me, k = dist.get_rank(group), dist.get_world_size(group)
        infos: list = [None] * k
        dist.all_gather_object(infos, [secrets.token_hex(8), os.getpid(), supported(), cores_filled(),
                                       _pid_namespace()], group=group)
        name = f"shardlib-{infos[0][0]}"
        paths = [f"/dev/shm/{name}-{j}" for j in range(k)]
        maps: list = [None] * k
        ok, created = all(i[2] for i in infos) and _room(k * size), False
        try:
            if ok:
                try:
                    fd = os.open(paths[me], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    created = True
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, _HEADER)
                    maps[me] = mmap.mmap(fd, size)
                    _words(maps[me])[_PID] = os.getpid()
                except Exception:   # noqa: BLE001 — any failure here is agreed on below, never raised alone
                    ok = False
            ok = _agree(ok, group)
            if ok:
                try:
                    for j in range(k):
                        if j != me:
                            maps[j] = _map(os.open(paths[j], os.O_RDWR), size)
                            ok = ok and _words(maps[j])[_PID] == infos[j][1]   # else another host's /dev/shm
                except Exception:   # noqa: BLE001
                    ok = False
                ok = _agree(ok, group)
        finally:
            if created:
                with contextlib.suppress(OSError):
                    os.unlink(paths[me])
        if not ok:
            if created:
                os.close(fd)
            return None
        files = cls(me, k, maps, [int(i[1]) for i in infos], _timeout_of(group), name,
                    filled=all(i[3] for i in infos), see_pids=len({i[4] for i in infos}) == 1)
        files.fd = fd
        weakref.finalize(files, os.close, fd)
        return files

    def reserve(self, nbytes: int) -> None:
        """Reserve the pages of this member's slots up to ``nbytes`` each before writing there: a full
        /dev/shm is then an error that says so, not a SIGBUS (only what the group's pieces need is
        reserved: a group of small collectives holds a few pages)."""
        if nbytes <= self.reserved or self.fd < 0:     # no file of its own: anonymous maps (tests)
            return
        nbytes = min(SLOT_BYTES, -(-nbytes // 4096) * 4096)
        for s in range(SLOTS):
            self.reserve_range(_HEADER + s * SLOT_BYTES, nbytes)
        self.reserved = nbytes

    def reserve_range(self, offset: int, nbytes: int) -> None:
        """Reserve ``nbytes`` of this member's file from ``offset`` (whole pages)."""
        if self.fd < 0:
            return
        try:
            os.posix_fallocate(self.fd, offset, -(-nbytes // 4096) * 4096)
        except OSError as e:
            raise dist.DistBackendError(
                f"shared memory: /dev/shm has no room for this group's slots ({e.strerror}) — give the machine "
                "or container a larger /dev/shm (docker run --shm-size=1g), or set SHARDLIB_SHM=0 on every "
                "rank to keep gloo's collectives and messages.") from e

    def put(self, j: int, idx: int, value: int) -> None:
        """Write word ``idx`` of member ``j``'s header and wake whoever sleeps on it."""
        self.heads[j][idx] = value
        self.wake(j, idx)

    def wake(self, j: int, idx: int) -> None:
        """Wake whoever sleeps on word ``idx`` of member ``j``'s header."""
        _libc().syscall(_SYS_FUTEX, ctypes.c_void_p(self.addrs[j] + idx * 8), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def wait(self, ready, j: int, idx: int, what: str, peer: int | None = None) -> None:
        """Until ``ready()``: spin briefly, then sleep on word ``idx`` of member ``j``'s header (whose
        writer wakes it). Fails when member ``peer``'s (default ``j``'s) process is gone (checked each
        second) or at the group's timeout (``Sleeper``)."""
        for _ in range(SPIN):
            if ready():
                return
        sleeper, head = Sleeper(self, j if peer is None else peer, what), self.heads[j]
        while True:
            v = head[idx]
            if ready():
                return
            sleeper.sleep(j, idx, v)


class Sleeper:
    """One wait's clock: ``sleep`` sleeps on a header word while it holds ``v`` (20 ms at most), and
    fails when member ``peer``'s process is gone (checked each second) or the group's timeout has
    passed since the wait began — however often the sleeper is woken meanwhile."""

    def __init__(self, files: Files, peer: int, what: str):
        self.f, self.peer, self.what = files, peer, what
        self.start = self.last_check = time.monotonic()
        self.ts = _Timespec(0, 20_000_000)

    def sleep(self, j: int, idx: int, v: int) -> None:
        f, peer = self.f, self.peer
        addr = ctypes.c_void_p(f.addrs[j] + idx * 8)
        _libc().syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_uint(v & 0xFFFFFFFF), ctypes.byref(self.ts), None, 0)
        now = time.monotonic()
        if now - self.last_check > 1.0:
            self.last_check = now
            if f.see_pids and not _alive(f.pids[peer]):
                raise dist.DistBackendError(f"shared memory: group member {peer} (pid {f.pids[peer]}) exited "
                                            f"while member {f.me} waited for it {self.what}.")
            if now - self.start > f.timeout:
                raise dist.DistBackendError(f"shared memory: group member {peer} (pid {f.pids[peer]}) did not "
                                            f"{self.what.removeprefix('to ')} within {f.timeout:.0f} s (the group's "
                                            "timeout) — a rank that stopped issuing this group's collectives, or "
                                            "a hang.")


class Channel:
    """A group's collectives through its members' files: ``seq`` counts the pieces issued."""

    def __init__(self, files: Files):
        self.f, self.me, self.k, self.filled = files, files.me, files.k, files.filled
        self._typed: dict[torch.dtype, list[torch.Tensor]] = {}
        self.seq = 0
        self._queue: collections.deque[_Piece] = collections.deque()

    @classmethod
    def open(cls, group) -> Channel | None:
        files = Files.open(group, _HEADER + SLOTS * SLOT_BYTES)
        return None if files is None else cls(files)

    # ---- collectives -------------------------------------------------------------------------
    def issue(self, kind: str, src: torch.Tensor, dst: torch.Tensor, op: str, result: torch.Tensor) -> Issued:
        """Split a collective into slot-sized pieces along its last dim and queue them; copy in those
        whose slots are free (never waits)."""
        n = src.shape[-1]
        w = max(1, SLOT_BYTES // (src.element_size() * (self.k if kind == "rs" else 1)))
        with _unseen():
            for a in range(0, n, w):
                self.seq += 1
                piece = _Piece(self.seq, kind, src[..., a:a + w], dst[..., a:a + w], op)
                self._queue.append(piece)
            self._copy_ready()
        return Issued(self, piece, result)

    def complete(self, last: _Piece) -> None:
        """Complete the group's pieces in order, up to and including ``last``."""
        with _unseen():
            while not last.finished:
                h = self._queue[0]
                if not h.copied:
                    self._wait_all(_DONE, h.seq - SLOTS, f"to finish reading slot {h.seq % SLOTS} (piece #{h.seq - SLOTS})")
                    self._copy_in(h)
                self._wait_all(_ARRIVED, h.seq, f"to arrive at piece #{h.seq}")
                self._finish(h)
                self.f.put(self.me, _DONE, h.seq)
                self._queue.popleft()
                h.finished = True
            self._copy_ready()

    def _finish(self, h: _Piece) -> None:
        k, me = self.k, self.me
        if h.kind == "ag":
            for j in range(k):
                if j != me or h.dst[me].data_ptr() != h.src.data_ptr():
                    h.dst[j].copy_(self._slot(j, h))
            return
        views = [self._slot(j, h) for j in range(k)]
        if h.kind == "rs":
            views = [v.view(k, -1)[me] for v in views]
        fold = _REDUCE[h.op]
        fold(views[0], views[1], out=h.dst)
        for v in views[2:]:
            fold(h.dst, v, out=h.dst)

    def _copy_ready(self) -> None:
        """Copy in, in order, the issued pieces whose slots every member has finished reading."""
        for h in self._queue:
            if h.copied:
                continue
            if any(self.f.heads[j][_DONE] < h.seq - SLOTS for j in range(self.k)):
                return
            self._copy_in(h)

    def _slot(self, j: int, h: _Piece) -> torch.Tensor:
        typed = self._typed.get(h.src.dtype)
        if typed is None:
            with torch.inference_mode(False):
                typed = self._typed[h.src.dtype] = [b[_HEADER:].view(h.src.dtype) for b in self.f.bytes]
        per = SLOT_BYTES // h.src.element_size()
        off = (h.seq % SLOTS) * per
        return typed[j][off:off + h.src.numel()]

    def _copy_in(self, h: _Piece) -> None:
        self.f.reserve(h.src.numel() * h.src.element_size())
        self._slot(self.me, h).view(h.src.shape).copy_(h.src)
        h.copied = True
        self.f.put(self.me, _ARRIVED, h.seq)

    def _wait_all(self, idx: int, target: int, what: str) -> None:
        for j in range(self.k):
            if j != self.me:
                head = self.f.heads[j]
                self.f.wait(lambda: head[idx] >= target, j, idx, what)


@contextlib.contextmanager
def _unseen():
    """The channel's copies and folds run outside autograd (as gloo's do: a gradient all-reduced under
    ``create_graph`` stays a plain value) and outside any dispatch mode the caller runs under (a counter
    of ops or of tensor sizes sees neither them nor a c10d op: ``sl.count_collectives`` still counts
    the collective, torch's ``CommDebugMode`` does not)."""
    with torch.no_grad():
        if torch._C._len_torch_dispatch_stack() == 0:
            yield
        else:
            with _disable_current_modes():
                yield


def _map(fd: int, size: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _words(m: mmap.mmap) -> memoryview:
    return memoryview(m).cast("B")[:_HEADER].cast("q")


def _room(nbytes: int) -> bool:
    """Whether /dev/shm has room for ``nbytes`` more, twice over: the group's files are reserved whole,
    and other users of /dev/shm (a data loader's workers) should find it not full."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes


def _agree(ok: bool, group) -> bool:
    """Whether every member of the group says ``ok`` (one all-reduce over gloo)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _timeout_of(group) -> float:
    try:
        t = group._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        t = None
    if isinstance(t, datetime.timedelta):
        return t.total_seconds()
    return default_timeout().total_seconds()
