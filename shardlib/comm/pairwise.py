"""A two-member group's asynchronous reduce-scatter and all-gather on gloo as one pairwise exchange.

Over two ranks a ring reduce-scatter or all-gather is a single exchange: all-gather sends this
member's block and receives the other's; reduce-scatter sends the other's half and adds the
received half to its own. These are the ring's messages and bytes (``core``'s byte models count
them unchanged), posted as one ``irecv`` and one ``isend`` on the group. Gloo's own
``reduce_scatter_tensor`` all-reduces a copy of the whole input and its ``all_gather`` runs on
its collective thread; the exchange is the faster of the two for ZeRO's buckets and units
(``benchmarks/bench_gloo_pair.py``, the same engine stepping with and without it, alternated):
ZeRO-2 steps 0.90-0.95 and ZeRO-3 steps 0.92-0.94 of gloo's at 2 ranks.

Only the asynchronous calls take it (what ZeRO's units and buckets issue, overlapped with
compute): as synchronous calls on the critical path, the same exchanges made tensor-parallel
steps slower (sequence parallel's all-gathers and reduce-scatters 1.13x, the tensor axis's
all-reduces as exchanges 1.03-1.10x), so those stay gloo's collectives. So do groups of other
sizes, and reduce-scatters whose output passes ``SCRATCH_MAX_BYTES`` (the exchange receives the
peer's half into a scratch of that size). The reduction is ``mine ⊕ theirs`` (``+``, ``max``,
``min``), which commutes bit for bit: the result is the one gloo's collective gives two ranks.

The exchanges of a group share one tag, above the pipeline's: gloo delivers a pair's messages of
one tag in the order they were posted, and every member posts its group's collectives in the same
order. ``SHARDLIB_GLOO_PAIRWISE=0`` turns the exchange off.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

TAG = 1 << 24
_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.Tensor.add_, "max": lambda a, b: torch.maximum(a, b, out=a),
    "min": lambda a, b: torch.minimum(a, b, out=a)}


SCRATCH_MAX_BYTES = 4 << 20


def applies(k: int, x: torch.Tensor, gloo: bool, async_op: bool, op: str = "sum", scratch: int = 0) -> bool:
    """Whether a reduce-scatter or all-gather of ``k`` members over ``x`` runs as a pairwise exchange.
    ``scratch``: the bytes it needs for the peer's half (a reduce-scatter's output), at most
    ``SCRATCH_MAX_BYTES`` (shardlib's mmap threshold, ``allocator.py``: below it the scratch comes from
    the heap and goes back to it; a larger one would be mapped and faulted in anew each call, and add
    its size to the peak beside the gradients it reduces)."""
    return (k == 2 and gloo and async_op and op in _OPS and x.numel() > 0 and x.is_contiguous()
            and scratch <= SCRATCH_MAX_BYTES and os.environ.get("SHARDLIB_GLOO_PAIRWISE", "1") != "0")


class Exchange:
    """The posted send and receive of one exchange; ``wait()`` completes both, then runs ``post``
    (the reduction) and returns its result."""

    def __init__(self, works: list, post: Callable[[], torch.Tensor]):
        self._works, self._post = works, post

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        return self._post()


def _post(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> list:
    return [dist.irecv(recv, src=peer, group=group, tag=TAG), dist.isend(send, dst=peer, group=group, tag=TAG)]


def reduce_scatter(x: torch.Tensor, out: torch.Tensor, me: int, op: str, peer: int, group) -> Exchange:
    """This member's half of ``x`` ⊕ the peer's, into ``out`` (which may be that half of ``x``)."""
    half = x.shape[0] // 2
    mine, other = (x[:half], x[half:]) if me == 0 else (x[half:], x[:half])
    theirs = torch.empty_like(out)

    def reduce() -> torch.Tensor:
        if out.data_ptr() != mine.data_ptr():
            out.copy_(mine)
        return _OPS[op](out, theirs)

    return Exchange(_post(other, theirs, peer, group), reduce)


def all_gather(x: torch.Tensor, out: torch.Tensor, me: int, peer: int, group) -> Exchange:
    """``out`` = both members' ``x`` along dim 0, member 0's first (``x`` may be its block of ``out``)."""
    n = x.shape[0] if x.dim() else 1
    blocks = (out[:n], out[n:])
    if blocks[me].data_ptr() != x.data_ptr():
        blocks[me].copy_(x.reshape(blocks[me].shape))
    return Exchange(_post(blocks[me], blocks[1 - me], peer, group), lambda: out)
