"""A group's asynchronous reduce-scatter and all-gather on gloo as direct pairwise exchanges.

Where the group's ranks share a host, the shared-memory channel (``shm.py``) takes these collectives
first; the exchanges are for groups it cannot serve (ranks on several hosts, ``SHARDLIB_SHM=0``).

Each member sends every peer what the peer needs and receives what it needs from every peer, all
posted at once as ``irecv``/``isend`` pairs on the group: all-gather sends this member's block to each
peer and receives each peer's block into place; reduce-scatter sends each peer its chunk of the input
and folds the peers' parts of its own chunk into it. These are the ring's bytes (``(k-1)`` blocks or
chunks per member: ``core``'s byte models count them unchanged) in one round instead of ``k-1``
dependent steps. Gloo's own ``reduce_scatter_tensor`` all-reduces a copy of the whole input and its
``all_gather`` runs on its collective thread; the exchanges are the faster for ZeRO's buckets and
units (``benchmarks/bench_gloo_pair.py``: the same engine stepping with and without them,
alternated; ``benchmarks/results/gloo_pair-2026-11-26.md``): on the 2-core reference machine ZeRO-2
steps 0.90-1.00 of gloo's at 2-4 ranks, 0.84 at 8, ZeRO-3 steps 0.89-0.99, 0.85 at 8.

Only the asynchronous calls take them (what ZeRO's units and buckets issue, overlapped with
compute, and ZeRO-1/2's gathers of the updated parameters, waited for at once): as synchronous calls on the critical path, the same exchanges made tensor-parallel
steps no faster (sequence parallel's all-gathers and reduce-scatters 1.13x in one run, the tensor
axis's all-reduces as exchanges 0.99-1.10x in seven, where A/A runs read 1.00-1.06), so those stay
gloo's collectives. So do groups of more than ``MAX_MEMBERS`` (``k-1`` messages each way per
member; not measured beyond 8); and a reduce-scatter is exchanged only where this host's ranks
fill its cores (``cores_filled``) and its peers' parts fit in ``SCRATCH_MAX_BYTES`` (they are
received into a scratch of that size). The reduction folds each peer's part into this member's own
in member order (``+``, ``max``, ``min``): over two members ``mine ⊕ theirs``, which commutes bit
for bit, the value gloo gives two ranks.

The exchanges of a group share one tag, above the pipeline's: gloo delivers a pair's messages of
one tag in the order they were posted, and every member posts its group's collectives in the same
order. ``SHARDLIB_GLOO_PAIRWISE=0`` turns the exchanges off.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

TAG = 1 << 24
_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.Tensor.add_, "max": lambda a, b: torch.maximum(a, b, out=a),
    "min": lambda a, b: torch.minimum(a, b, out=a)}
SCRATCH_MAX_BYTES = 4 << 20
MAX_MEMBERS = 8


def applies(k: int, x: torch.Tensor, gloo: bool, async_op: bool, op: str = "sum", scratch: int | None = None) -> bool:
    """Whether a reduce-scatter (``scratch`` given) or all-gather of ``k`` members over ``x`` runs as
    pairwise exchanges. ``scratch``: the bytes a reduce-scatter needs for each peer's part (its output),
    at most ``SCRATCH_MAX_BYTES`` for all peers (shardlib's mmap threshold, ``allocator.py``: below it
    the scratch comes from the heap and goes back to it; a larger one would be mapped and faulted in
    anew each call, and add its size to the peak beside the gradients it reduces); and only where this
    host's ranks fill its cores (``cores_filled``)."""
    if not (2 <= k <= MAX_MEMBERS and gloo and async_op and op in _OPS and x.numel() > 0 and x.is_contiguous()
            and os.environ.get("SHARDLIB_GLOO_PAIRWISE", "1") != "0"):
        return False
    return scratch is None or ((k - 1) * scratch <= SCRATCH_MAX_BYTES and cores_filled())


@functools.cache
def cores_filled() -> bool:
    """Whether this host's ranks (``LOCAL_WORLD_SIZE``, as torchrun and ``sl.launch`` set it) times this
    rank's threads take all the cores it may run on. A reduce-scatter's exchange adds the peers' parts
    on the caller's thread when it is waited for, where gloo's collective reduces on its own thread:
    with a core to spare, gloo's runs beside the backward and the exchange only lengthens the step
    (ZeRO-2 1.00-1.08x on 16 cores with 2-4 ranks); with none (2-4 ranks on 2 cores), that thread
    takes the same core time as the fold, and the exchange's fewer hand-offs win (ZeRO-2 0.90-1.00x)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        cores = os.cpu_count() or 1
    return local > 0 and local * torch.get_num_threads() >= cores


class Exchange:
    """The posted sends and receives of one collective; ``wait()`` completes them, then runs ``post``
    (the reduction) and returns its result."""

    def __init__(self, works: list, post: Callable[[], torch.Tensor]):
        self._works, self._post = works, post

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        return self._post()


def _post(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> list:
    return [dist.irecv(recv, src=peer, group=group, tag=TAG), dist.isend(send, dst=peer, group=group, tag=TAG)]


def reduce_scatter(x: torch.Tensor, out: torch.Tensor, me: int, op: str, members: list[int], group) -> Exchange:
    """This member's chunk of ``x`` ⊕ every peer's, into ``out`` (which may be that chunk of ``x``);
    the peers' chunks are folded in in member order."""
    k = len(members)
    c = x.shape[0] // k
    chunks = [x[j * c:(j + 1) * c] for j in range(k)]
    peers = [j for j in range(k) if j != me]
    theirs = out.new_empty((len(peers),) + tuple(out.shape))
    works = []
    for t, j in enumerate(peers):
        works += _post(chunks[j], theirs[t], members[j], group)

    def reduce() -> torch.Tensor:
        if out.data_ptr() != chunks[me].data_ptr():
            out.copy_(chunks[me])
        for t in range(len(peers)):
            _OPS[op](out, theirs[t])
        return out

    return Exchange(works, reduce)


def all_gather(x: torch.Tensor, out: torch.Tensor, me: int, members: list[int], group) -> Exchange:
    """``out`` = every member's ``x`` along dim 0, in member order (``x`` may be its block of ``out``)."""
    k = len(members)
    n = x.shape[0] if x.dim() else 1
    blocks = [out[j * n:(j + 1) * n] for j in range(k)]
    if blocks[me].data_ptr() != x.data_ptr():
        blocks[me].copy_(x.reshape(blocks[me].shape))
    works = []
    for j in range(k):
        if j != me:
            works += _post(blocks[me], blocks[j], members[j], group)
    return Exchange(works, lambda: out)
