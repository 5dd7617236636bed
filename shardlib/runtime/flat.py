"""Fused collectives over many parameters sharded on dim 0 (FSDP2's copy-in / copy-out).

A parameter of shape ``(d0, *rest)`` split ``n`` ways holds rows ``chunk_bounds(d0, n, i)``;
every shard is padded to ``c = ceil(d0/n)`` rows so that one collective moves all parameters of
a unit or bucket:

* all-gather input: ``cat(shard_p padded to c_p rows, flattened)`` — the same length on
  every rank; the output is ``n`` such blocks, one per rank; parameter ``p`` is rebuilt from
  its slice of each block.
* reduce-scatter input: ``(n, Σ c_p·rest_p)``, row ``i`` holding every parameter's rows of
  rank ``i``; the output is this rank's row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..algebra.layout import chunk_bounds, chunk_size


@dataclass(frozen=True)
class RowSharding:
    """How one parameter's dim 0 is split over ``n`` ranks."""

    shape: tuple[int, ...]   # full shape (0-d parameters are treated as (1,))
    n: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def chunk(self) -> int:
        """Rows per (padded) shard."""
        return chunk_size(self.rows, self.n)

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.row_numel

    def bounds(self, i: int) -> tuple[int, int]:
        return chunk_bounds(self.rows, self.n, i)

    def shard_shape(self, i: int) -> tuple[int, ...]:
        lo, hi = self.bounds(i)
        return (hi - lo,) + self.shape[1:]


def flat_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape) if len(shape) else (1,)


def pack_shards(shards: Sequence[torch.Tensor], specs: Sequence[RowSharding], dtype: torch.dtype) -> torch.Tensor:
    """This rank's shards, each padded to ``chunk`` rows, concatenated flat (all-gather input)."""
    total = sum(s.padded_numel for s in specs)
    out = torch.zeros(total, dtype=dtype, device=shards[0].device if shards else None)
    off = 0
    for x, s in zip(shards, specs):
        n = x.numel()
        out[off:off + n].copy_(x.reshape(-1))
        off += s.padded_numel
    return out


def _by_rank(block: torch.Tensor, s: RowSharding) -> torch.Tensor:
    """A ``(n, padded)`` slice of a flat buffer viewed as ``(n, chunk, *rest)`` (no copy)."""
    return block.view((s.n, s.chunk) + s.shape[1:])


def _copy_rows(dst_rows: torch.Tensor, src_chunks: torch.Tensor, s: RowSharding, to_chunks: bool) -> None:
    """Copy between a ``(rows, *rest)`` tensor and its ``(n, chunk, *rest)`` padded form: the full
    chunks in one copy, the trailing partial chunk in another (padding is left alone)."""
    full = s.rows // s.chunk if s.chunk else 0
    rem = s.rows - full * s.chunk
    rows = dst_rows[:full * s.chunk].view((full, s.chunk) + s.shape[1:])
    if to_chunks:
        src_chunks[:full].copy_(rows)
        if rem:
            src_chunks[full, :rem].copy_(dst_rows[full * s.chunk:])
    else:
        rows.copy_(src_chunks[:full])
        if rem:
            dst_rows[full * s.chunk:].copy_(src_chunks[full, :rem])


def unpack_gathered(out: torch.Tensor, specs: Sequence[RowSharding], dests: Sequence[torch.Tensor]) -> None:
    """Copy each parameter's rows out of an all-gather output into ``dests`` (full tensors)."""
    n = specs[0].n
    blocks = out.view(n, -1)
    off = 0
    for s, dest in zip(specs, dests):
        _copy_rows(dest.view(s.shape), _by_rank(blocks[:, off:off + s.padded_numel], s), s, to_chunks=False)
        off += s.padded_numel


def pack_for_reduce_scatter(grads: Sequence[torch.Tensor | None], specs: Sequence[RowSharding],
                            dtype: torch.dtype) -> torch.Tensor:
    """``(n, Σ padded)`` flattened: row ``i`` holds every gradient's rows of rank ``i``."""
    n = specs[0].n
    total = sum(s.padded_numel for s in specs)
    device = next((g.device for g in grads if g is not None), None)
    out = torch.zeros((n, total), dtype=dtype, device=device)
    off = 0
    for g, s in zip(grads, specs):
        if g is not None:
            _copy_rows(g.reshape(s.shape), _by_rank(out[:, off:off + s.padded_numel], s), s, to_chunks=True)
        off += s.padded_numel
    return out.view(-1)


def unpack_reduced(out: torch.Tensor, specs: Sequence[RowSharding], rank_index: int) -> list[torch.Tensor]:
    """Views of each parameter's reduced shard (its real rows) in a reduce-scatter output."""
    views, off = [], 0
    for s in specs:
        shard = out[off:off + s.padded_numel].view((s.chunk,) + s.shape[1:])
        lo, hi = s.bounds(rank_index)
        views.append(shard[:hi - lo])
        off += s.padded_numel
    return views
