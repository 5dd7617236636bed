"""Low-level collectives over mesh axes, and the collective counter.

Every collective shardlib issues goes through this module, so a ``CollectiveCounter`` sees all
of them. Functions here take a *mesh* and *axes* and work on dim 0 of contiguous tensors; the
group members are in mesh order (``mesh.canonical_axes``). Callers that want another axis order
permute chunks themselves (see ``group_perm``).

Bytes are what this rank *sends* in the ring model, on the padded buffers actually passed:

* all-gather of an ``s``-byte shard over ``k`` ranks: ``(k-1)·s``
* reduce-scatter of a ``k·s``-byte input: ``(k-1)·s``
* all-reduce of ``n`` elements: ``min(2·(k-1)·ceil(n/k), 2·n)`` elements (reduce-scatter +
  all-gather; the ring sends no padding, so no element is sent more than twice)
* broadcast of ``n`` elements: ``min((k-1)·ceil(n/k), n)`` elements (half an all-reduce)
* all-to-all: the bytes of every split sent to another rank
* send/recv (``ppermute``): the bytes of the tensor, when the peer is another rank

The same formulas price plans (``plan_redistribute``, the planner), so a test can check that
what ran is what was planned.
"""

from __future__ import annotations

import threading
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..algebra.mesh import Mesh
from ..errors import CollectiveError, ShardingTypeError
from ..validate import is_int
from . import mailbox, pairwise, shm
from . import progress as _progress

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.AVG}
_UNSUPPORTED_DTYPES = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                   "float8_e5m2fnuz") if hasattr(torch, n)}


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued: ``op`` over ``axes``, ``bytes`` sent by this rank.

    ``tag`` says what it was for where that is not the computation itself (``"metadata"``:
    shapes exchanged by ``shard_map``)."""

    op: str
    axes: tuple[str, ...]
    bytes: int
    dtype: torch.dtype
    numel: int
    group_size: int
    tag: str = ""

    def __str__(self) -> str:
        return f"{self.op}({', '.join(self.axes)}) {format_bytes(self.bytes)}"


NETWORK_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv", "broadcast")
RAGGED_OPS = ("all_to_all", "send_recv")      # their bytes differ by rank by design: fingerprinted without them

# The fingerprint of the collectives this process entered since the last ``fingerprint_reset``: a CRC-32 over
# each one's (op, axes, bytes, tag), in order, one over (op, axes, tag) alone, and their count. Ranks that run
# the same program on the same shapes agree on the first; ranks of a tensor axis, whose shards (and so their
# buckets' bytes) may differ, on the second. The engine compares one in the step's scalar all-reduce
# (runtime/parted.py).
_FP = [0, 0, 0]


def fingerprint(bytes_too: bool = True) -> tuple[int, int]:
    """``(crc, count)`` of the collectives entered since the last reset (``bytes_too``: their bytes included)."""
    return (_FP[0] if bytes_too else _FP[1]), _FP[2]


def fingerprint_reset() -> None:
    _FP[0] = _FP[1] = _FP[2] = 0


class CollectiveCounter:
    """Records every collective issued while it is active (``with sl.count_collectives() as c``).

    Counters nest; each active counter sees every collective of its process, from every
    thread (the autograd engine runs backward collectives on its own threads on CUDA).
    """

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def record(self, rec: CollectiveRecord) -> None:
        self.records.append(rec)

    @property
    def bytes(self) -> int:
        """Network bytes sent by this rank: collectives and point-to-point sends (copies between
        memory kinds excluded)."""
        return sum(r.bytes for r in self.records if r.op in NETWORK_OPS or r.op == "send")

    def total_bytes(self, op: str | None = None) -> int:
        return sum(r.bytes for r in self.records if op is None or r.op == op)

    def count(self, op: str | None = None, *, tag: str | None = None) -> int:
        """How many collectives (of ``op``; with ``tag``, only those so tagged)."""
        return sum(1 for r in self.records if (op is None or r.op == op) and (tag is None or r.tag == tag))

    def by_op(self) -> dict[str, tuple[int, int]]:
        """``{op: (count, bytes)}``."""
        n, b = Counter(), Counter()
        for r in self.records:
            n[r.op] += 1
            b[r.op] += r.bytes
        return {op: (n[op], b[op]) for op in n}

    def by_axes(self) -> dict[tuple[str, ...], int]:
        b = Counter()
        for r in self.records:
            b[r.axes] += r.bytes
        return dict(b)

    def summary(self) -> str:
        rows = [f"{op:<15} x{n:<4} {format_bytes(b)}" for op, (n, b) in sorted(self.by_op().items())]
        return "\n".join(rows) if rows else "(no collectives)"

    def clear(self) -> None:
        self.records.clear()

    def __enter__(self) -> CollectiveCounter:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _ACTIVE.remove(self)


# Active counters are process-wide (not per-thread) on purpose: see CollectiveCounter.
_ACTIVE: list[CollectiveCounter] = []
_LOCK = threading.Lock()


def count_collectives() -> CollectiveCounter:
    """A fresh counter; use as ``with sl.count_collectives() as counter: ...``."""
    return CollectiveCounter()


def _enter(op: str, axes: Sequence[str], nbytes: int, tag: str = "") -> None:
    """A collective this rank enters: its progress record and the fingerprint."""
    _progress.enter(op, axes, nbytes)
    kind = f"{op}|{','.join(axes)}|{tag}"
    _FP[0] = zlib.crc32(f"{kind}|{'-' if op in RAGGED_OPS else nbytes}".encode(), _FP[0])
    _FP[1] = zlib.crc32(kind.encode(), _FP[1])
    _FP[2] += 1


def _record(op: str, axes: Sequence[str], nbytes: int, t: torch.Tensor, k: int, tag: str = "") -> None:
    if op in NETWORK_OPS:   # every rank enters the same collectives in order: a hang names who is behind
        _enter(op, axes, nbytes, tag)
    if not _ACTIVE:
        return
    rec = CollectiveRecord(op, tuple(axes), int(nbytes), t.dtype, t.numel(), k, tag)
    with _LOCK:
        for c in _ACTIVE:
            c.record(rec)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Byte models (shared by execution and planning)
# ---------------------------------------------------------------------------------------------

def all_gather_bytes(shard_numel: int, k: int, itemsize: int) -> int:
    return (k - 1) * shard_numel * itemsize


def reduce_scatter_bytes(out_numel: int, k: int, itemsize: int) -> int:
    return (k - 1) * out_numel * itemsize


def all_reduce_bytes(numel: int, k: int, itemsize: int) -> int:
    """All-reduce of ``n`` elements over ``k`` ranks: ``min(2·(k-1)·ceil(n/k), 2·n)`` elements.

    What runs is a ring (gloo's ``allreduce``, the algorithm ``ProcessGroupGloo`` uses; NCCL's
    ring for large messages): reduce-scatter then all-gather over ``k`` chunks, each rank sending
    ``k-1`` chunks in each phase — ``2·(k-1)·ceil(n/k)`` when chunks are ``ceil(n/k)``. The ring
    sends only the chunks' real bytes, never padding, so each rank forwards every element at
    most twice (once per phase): at most ``2·n``. The first term is the smaller whenever ``k``
    divides ``n`` or ``n >= k·(k-1)``; for a handful of scalars over many ranks (``n < k``) most
    chunks are empty and every rank whose chunk and neighbour's chunk are empty sends ``2·n`` —
    150 floats over 16,384 ranks are 1.2 KiB, not the 128 KiB of ``2·(k-1)`` padded elements."""
    return min(2 * (k - 1) * (-(-numel // k)), 2 * numel) * itemsize if k > 1 else 0


def broadcast_bytes(numel: int, k: int, itemsize: int) -> int:
    """Broadcast of ``n`` elements: the ``k-1`` receivers need ``(k-1)·n`` in all, spread over the
    ``k`` ranks (scatter + all-gather, or a pipelined chain) that is ``(k-1)·ceil(n/k)`` per rank —
    half an all-reduce — and never more than ``n`` (a chain forwards the message once)."""
    return min((k - 1) * (-(-numel // k)), numel) * itemsize if k > 1 else 0


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------

class Pending:
    """An issued async collective: ``wait()`` returns its result."""

    def __init__(self, work, result: torch.Tensor, post=None):
        self._work, self._result, self._post = work, result, post

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._post is not None:
                self._result = self._post(self._result)
                self._post = None
        return self._result


def _done(t: torch.Tensor, async_op: bool):
    return Pending(None, t) if async_op else t


def _require_mesh(mesh, api: str) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise ShardingTypeError(f"{api}: collectives need a Mesh over running processes — got "
                                f"{type(mesh).__name__}. An AbstractMesh can plan but not run.")
    return mesh


def _check_tensor(x: object, api: str, mesh: Mesh) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShardingTypeError(f"{api}: expected a torch.Tensor — got {type(x).__name__}.")
    if x.dtype in _UNSUPPORTED_DTYPES and mesh.backend and "gloo" in mesh.backend:
        raise CollectiveError(f"{api}: dtype {x.dtype} cannot go through gloo collectives — expected a "
                              "float, int or bool dtype. Cast to bfloat16 (or view as uint8) first.")
    return x.contiguous()


def group_size(mesh, axes: str | Sequence[str]) -> int:
    return mesh.axis_size(mesh.canonical_axes(axes)) if mesh.canonical_axes(axes) else 1


def group_perm(mesh, axes: Sequence[str]) -> list[int]:
    """``perm[g]``: index in ``axes`` order (first axis major) of the group member at mesh-order
    position ``g``. The identity when ``axes`` is in mesh order."""
    axes = tuple(a for a in axes if mesh.axis_size(a) > 1)
    canon = mesh.canonical_axes(axes)
    rank = getattr(mesh, "rank", 0)
    return [mesh.group_index(r, axes) for r in mesh.group_ranks(rank, canon)]


def all_gather_single_fn():
    """torch 2.13's ``all_gather_single``; before it, ``all_gather_into_tensor`` (same arguments)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single_fn():
    """torch 2.13's ``reduce_scatter_single``; before it, ``reduce_scatter_tensor`` (same arguments)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group_call(api: str, x: object, mesh, axes: str | Sequence[str]) -> tuple[Mesh, torch.Tensor, tuple[str, ...], int]:
    """A collective's checked arguments: the mesh, the tensor, the group's axes in mesh order and its size."""
    mesh = _require_mesh(mesh, api)
    x = _check_tensor(x, api, mesh)
    canon = mesh.canonical_axes(axes)
    return mesh, x, canon, group_size(mesh, canon)


def _alone(x: torch.Tensor, out: torch.Tensor | None, async_op: bool):
    """A group of one: ``x`` itself is the result (copied into ``out`` when one is given)."""
    if out is not None and out.data_ptr() != x.data_ptr():
        out.copy_(x.reshape(out.shape))
        x = out
    return _done(x, async_op)


def all_gather(x: torch.Tensor, mesh: Mesh, axes: str | Sequence[str], *, async_op: bool = False,
               tag: str = "", out: torch.Tensor | None = None):
    """Concatenate every group member's ``x`` along dim 0, in mesh order of the members.

    ``out``: the result's buffer (contiguous, ``k`` times ``x``'s shape along dim 0, its dtype)
    instead of a new tensor; ``x`` may be this member's block of it (in place, as FSDP2 gathers)."""
    mesh, x, canon, k = _group_call("all_gather", x, mesh, axes)
    if k == 1:
        return _alone(x, out, async_op)
    shape = (k * x.shape[0],) + tuple(x.shape[1:]) if x.dim() else (k,)
    if out is None:
        out = x.new_empty(shape)
    elif tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise CollectiveError(f"all_gather over {canon}: out must be a contiguous {x.dtype} tensor of shape "
                              f"{shape} — got {out.dtype} {tuple(out.shape)}. Pass a buffer of that shape.")
    _record("all_gather", canon, all_gather_bytes(x.numel(), k, x.element_size()), x, k, tag)
    if shm.applies(k, x, _gloo(mesh, x)) and (work := shm.all_gather(x, out, mesh.group(canon), mesh)) is not None:
        return Pending(work, out) if async_op else work.wait()
    if pairwise.applies(k, x, _gloo(mesh, x), async_op):
        ex = pairwise.all_gather(x, out, mesh.group_index(mesh.rank, canon), mesh.group_ranks(mesh.rank, canon),
                                 mesh.group(canon))
        return Pending(ex, out)
    work = all_gather_single_fn()(out, x.reshape(-1) if x.dim() == 0 else x, group=mesh.group(canon),
                                async_op=async_op)
    return Pending(work, out) if async_op else out


def reduce_scatter(x: torch.Tensor, mesh: Mesh, axes: str | Sequence[str], *, op: str = "sum",
                   async_op: bool = False, out: torch.Tensor | None = None):
    """Sum ``x`` over the group and keep this member's chunk of dim 0 (``x.shape[0] % k == 0``).

    ``out``: the chunk's buffer (contiguous, ``x``'s dtype) instead of a new tensor; it may be this
    member's chunk of ``x`` itself (in place: ``x`` is scratch then). On gloo, whose
    ``reduce_scatter_tensor`` all-reduces a clone of ``x`` and copies the chunk out, an in-place
    reduce-scatter is that all-reduce run on ``x`` itself: the same messages, without the clone (a
    block of ``x``'s size allocated each call) and the copy. It is counted as the reduce-scatter
    it is."""
    mesh, x, canon, k = _group_call("reduce_scatter", x, mesh, axes)
    if k == 1:
        return _alone(x, out, async_op)
    if x.dim() == 0 or x.shape[0] % k:
        raise CollectiveError(f"reduce_scatter over {canon}: dim 0 of shape {tuple(x.shape)} does not "
                              f"divide by the group size {k} — expected a multiple of {k}. Pad first.")
    shape = (x.shape[0] // k,) + tuple(x.shape[1:])
    if out is None:
        out = x.new_empty(shape)
    elif tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise CollectiveError(f"reduce_scatter over {canon}: out must be a contiguous {x.dtype} tensor of shape "
                              f"{shape} — got {out.dtype} {tuple(out.shape)}. Pass a buffer of that shape.")
    _record("reduce_scatter", canon, reduce_scatter_bytes(out.numel(), k, x.element_size()), x, k)
    if (shm.applies(k, x, _gloo(mesh, x), op)
            and (work := shm.reduce_scatter(x, out, op, mesh.group(canon), async_op, mesh)) is not None):
        return Pending(work, out) if async_op else work.wait()
    if pairwise.applies(k, x, _gloo(mesh, x), async_op, op, scratch=out.numel() * out.element_size()):
        ex = pairwise.reduce_scatter(x, out, mesh.group_index(mesh.rank, canon), op,
                                     mesh.group_ranks(mesh.rank, canon), mesh.group(canon))
        return Pending(ex, out)
    if _gloo(mesh, x) and out.data_ptr() == x.data_ptr() + mesh.group_index(mesh.rank, canon) * out.nbytes:
        work = dist.all_reduce(x, op=_REDUCE_OPS[op], group=mesh.group(canon), async_op=async_op)
    else:
        work = reduce_scatter_single_fn()(out, x, op=_REDUCE_OPS[op], group=mesh.group(canon),
                                        async_op=async_op)
    return Pending(work, out) if async_op else out


def _gloo(mesh: Mesh, x: torch.Tensor) -> bool:
    """Whether ``x``'s collectives run on gloo (the mesh's backend for its device)."""
    b = (mesh.backend or "").replace(" ", "")
    return x.device.type == "cpu" and (b == "gloo" or "cpu:gloo" in b.split(","))


def all_reduce(x: torch.Tensor, mesh: Mesh, axes: str | Sequence[str], *, op: str = "sum",
               async_op: bool = False, inplace: bool = False):
    """Reduce ``x`` over the group; every member gets the result."""
    mesh = _require_mesh(mesh, "all_reduce")
    if op not in _REDUCE_OPS:
        raise CollectiveError(f"all_reduce: unknown op {op!r} — expected one of {tuple(_REDUCE_OPS)}.")
    canon = mesh.canonical_axes(axes)
    k = group_size(mesh, canon)
    if k == 1:
        return _done(x, async_op)
    if inplace and not x.is_contiguous():
        raise CollectiveError("all_reduce(inplace=True) needs a contiguous tensor.")
    x = _check_tensor(x, "all_reduce", mesh)
    out = x if inplace else x.clone()
    if op == "avg" and not out.is_floating_point():
        raise CollectiveError(f"all_reduce: op 'avg' on dtype {out.dtype} — expected a floating dtype "
                              "(gloo cannot average integers). Sum, then divide.")
    _record("all_reduce", canon, all_reduce_bytes(out.numel(), k, out.element_size()), out, k)
    if shm.applies(k, out, _gloo(mesh, out), op) and (work := shm.all_reduce(out, op, mesh.group(canon), mesh)) is not None:
        return Pending(work, out) if async_op else work.wait()
    work = dist.all_reduce(out, op=_REDUCE_OPS[op], group=mesh.group(canon), async_op=async_op)
    return Pending(work, out) if async_op else out


def broadcast(x: torch.Tensor, mesh: Mesh, axes: str | Sequence[str], *, src: int = 0,
              async_op: bool = False, inplace: bool = False, tag: str = ""):
    """Every group member gets member ``src``'s ``x`` (``src`` = index in mesh order of the members)."""
    mesh = _require_mesh(mesh, "broadcast")
    canon = mesh.canonical_axes(axes)
    k = group_size(mesh, canon)
    if k == 1:
        return _done(x, async_op)
    if not is_int(src) or not 0 <= src < k:
        raise CollectiveError(f"broadcast over {canon}: src={src!r} is not a member — expected 0..{k - 1}.")
    if inplace and not x.is_contiguous():
        raise CollectiveError("broadcast(inplace=True) needs a contiguous tensor.")
    x = _check_tensor(x, "broadcast", mesh)
    out = x if inplace else x.clone()
    _record("broadcast", canon, broadcast_bytes(out.numel(), k, out.element_size()), out, k, tag)
    root = mesh.group_ranks(mesh.rank, canon)[src]
    work = dist.broadcast(out, src=root, group=mesh.group(canon), async_op=async_op)
    return Pending(work, out) if async_op else out


def all_to_all(x: torch.Tensor, mesh: Mesh, axes: str | Sequence[str], *,
               in_splits: Sequence[int] | None = None, out_splits: Sequence[int] | None = None,
               async_op: bool = False):
    """Send chunk ``g`` of dim 0 to group member ``g`` (mesh order); receive theirs, in order.

    Without splits, dim 0 must divide by the group size; with them, sizes may be uneven
    (and ``out_splits`` gives what arrives from each member).
    """
    mesh, x, canon, k = _group_call("all_to_all", x, mesh, axes)
    if k == 1:
        return _done(x, async_op)
    if x.dim() == 0:
        raise CollectiveError(f"all_to_all over {canon}: expected a tensor with a dim 0 — got a scalar.")
    if in_splits is None:
        if x.shape[0] % k:
            raise CollectiveError(f"all_to_all over {canon}: dim 0 of shape {tuple(x.shape)} does not "
                                  f"divide by the group size {k}. Pad first, or pass splits.")
        in_splits = [x.shape[0] // k] * k
        out_splits = list(in_splits)
        out = torch.empty_like(x)
    else:
        if out_splits is None or len(in_splits) != k or len(out_splits) != k:
            raise CollectiveError(f"all_to_all over {canon}: expected {k} in_splits and out_splits.")
        if sum(in_splits) != x.shape[0]:
            raise CollectiveError(f"all_to_all: in_splits {list(in_splits)} do not add up to dim 0 of "
                                  f"shape {tuple(x.shape)}.")
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    me = mesh.group_ranks(mesh.rank, canon).index(mesh.rank)
    row = int(torch.Size(x.shape[1:]).numel()) * x.element_size()
    sent = sum(s for g, s in enumerate(in_splits) if g != me) * row
    _record("all_to_all", canon, sent, x, k)
    work = dist.all_to_all_single(out, x, output_split_sizes=list(out_splits),
                                  input_split_sizes=list(in_splits), group=mesh.group(canon),
                                  async_op=async_op)
    return Pending(work, out) if async_op else out


def send_recv(x: torch.Tensor, mesh: Mesh, axes: str | Sequence[str], pairs: Sequence[tuple[int, int]], *,
              async_op: bool = False):
    """Point-to-point within each group over ``axes``: ``(src, dst)`` are group indices in ``axes``
    order. Returns what this rank received, or zeros if nothing is sent to it (JAX ``ppermute``);
    with ``async_op`` a ``Pending`` whose ``wait()`` returns it (the sends and receives run meanwhile)."""
    mesh = _require_mesh(mesh, "ppermute")
    x = _check_tensor(x, "ppermute", mesh)
    axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if mesh.axis_size(a) > 1)
    members = sorted(mesh.group_ranks(mesh.rank, mesh.canonical_axes(axes)),
                     key=lambda r: mesh.group_index(r, axes))
    me = mesh.group_index(mesh.rank, axes) if axes else 0
    out = torch.zeros_like(x)
    ops = []
    sent = 0
    for src, dst in pairs:
        if src == me and dst == me:
            out = x.clone()
        elif src == me:
            ops.append(dist.isend(x, dst=members[dst]))
            sent += x.numel() * x.element_size()
        elif dst == me:
            ops.append(dist.irecv(out, src=members[src]))
    if sent or ops:
        _record("send_recv", mesh.canonical_axes(axes), sent, x, len(members))
    else:   # not a party to any pair: still a step of the program every rank takes
        _enter("send_recv", mesh.canonical_axes(axes), 0)
    if async_op:
        return Pending(_Works(ops), out)
    for w in ops:
        w.wait()
    return out


class _Works:
    """Several issued point-to-point works waited as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def send(x: torch.Tensor, mesh: Mesh, axis: str, dst: int, *, tag: int = 0) -> Pending:
    """Asynchronous point-to-point send of ``x`` to member ``dst`` (index along ``axis``) of this
    rank's group over ``axis`` (a pipeline stage's output or input gradient). Counted as
    ``send`` with its bytes; ``wait()`` on the result before reusing ``x``."""
    mesh = _require_mesh(mesh, "send")
    x = _check_tensor(x, "send", mesh)
    peer = _peer(mesh, axis, dst, "send")
    _record("send", (axis,), x.numel() * x.element_size(), x, 2)
    box = mesh.__dict__.get("_mailboxes", {}).get(axis)
    if mailbox.takes(box, dst, x):
        return Pending(box.send(x, dst, tag), x)
    return Pending(dist.isend(x, dst=peer, tag=tag), x)


def recv(out: torch.Tensor, mesh: Mesh, axis: str, src: int, *, tag: int = 0) -> Pending:
    """Asynchronous receive into ``out`` from member ``src`` (index along ``axis``); ``wait()``
    returns ``out`` once the data is in. Counted as ``recv`` (no bytes sent)."""
    mesh = _require_mesh(mesh, "recv")
    peer = _peer(mesh, axis, src, "recv")
    _record("recv", (axis,), 0, out, 2)
    box = mesh.__dict__.get("_mailboxes", {}).get(axis)
    if mailbox.takes(box, src, out):
        return Pending(box.recv(out, src, tag), out)
    return Pending(dist.irecv(out, src=peer, tag=tag), out)


open_mailboxes = mailbox.open_mailboxes     # a pipeline's messages between neighbours through shared memory


def _peer(mesh: Mesh, axis: str, index: int, api: str) -> int:
    """The global rank of member ``index`` of this rank's group over ``axis`` (kept on the mesh: a
    pipeline asks twice per micro-batch)."""
    known = mesh.__dict__.setdefault("_peers", {})
    if type(index) is int and type(axis) is str and (axis, index) in known:
        return known[(axis, index)]
    k = mesh.axis_size(axis)
    if not is_int(index) or not 0 <= index < k:
        raise CollectiveError(f"{api} over {axis!r}: peer {index!r} is not a member — expected 0..{k - 1}.")
    members = sorted(mesh.group_ranks(mesh.rank, (axis,)), key=lambda r: mesh.group_index(r, (axis,)))
    known[(axis, index)] = members[index]
    return members[index]


def copy_to(x: torch.Tensor, device: torch.device | str, *, non_blocking: bool = False) -> torch.Tensor:
    """Move between memory kinds (device <-> cpu), counted as a copy, not network traffic."""
    device = torch.device(device)
    op = "copy_d2h" if device.type == "cpu" else "copy_h2d"
    _record(op, (), x.numel() * x.element_size(), x, 1)
    return x.to(device, non_blocking=non_blocking, copy=True)
