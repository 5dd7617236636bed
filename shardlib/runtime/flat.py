"""Fused collectives over a flat group (FSDP's flat parameter, copy-in / copy-out).

A flat group (a ZeRO-3 unit, or a ZeRO-1/2 gradient bucket; ``planner/flat.py``) lays its
parameters end to end in a ``train`` and a ``frozen`` segment; a segment of ``T`` elements is
split in ``N`` chunks of ``c = ceil(T/N)``, and this rank holds its parameters' *pieces*: the
parts of their flattened elements that fall in its chunk (``ParamState.lo:hi``). The pieces of a
segment tile this rank's chunk in order, with zero padding after the last one.

* all-gather input: this rank's chunk of each segment, ``c_train + c_frozen`` elements (the
  same on every rank); the output is ``N`` such blocks, block ``i`` rank ``i``'s. Segment
  element ``j`` sits in block ``j // c`` at ``j % c`` (after the train chunk, for frozen ones);
  a parameter's contiguous range ``[offset, offset + numel)`` is copied out in at most three
  copies (a partial block, the whole blocks between, a partial block) — one when the group has
  no frozen segment, since the train chunks then lie end to end.
* reduce-scatter input: the trainable gradients laid end to end (one contiguous copy each)
  and padded to ``N·c_train``; the output is this rank's chunk, and each parameter's reduced
  piece is a view of it at a known offset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..planner.flat import FROZEN, TRAIN, FlatGroup
from .state import ParamState


class FlatRun:
    """One flat group on this rank: its states by segment, in segment order, and this rank's
    ``[start, stop)`` of each segment."""

    def __init__(self, group: FlatGroup, train: Sequence[ParamState], frozen: Sequence[ParamState], rank: int):
        self.group = group
        self.train, self.frozen = list(train), list(frozen)
        seg_t, seg_f = group.segments[TRAIN], group.segments[FROZEN]
        self.n = seg_t.layout.dim_shards(0)
        self.numel_t, self.numel_f = seg_t.numel, seg_f.numel
        self.ct, self.cf = seg_t.chunk, seg_f.chunk
        self.start_t, self.stop_t = seg_t.bounds(rank)
        self.start_f, self.stop_f = seg_f.bounds(rank)

    # ---- all-gather ----------------------------------------------------------------------------
    def pack(self, source: Callable[[ParamState], torch.Tensor], dtype: torch.dtype,
             device: torch.device | str | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's chunk of each segment, ``c_train + c_frozen`` elements in ``dtype``:
        ``source(state)`` gives each parameter's piece (1-D, ``hi - lo`` elements). ``out``: where to
        write it (e.g. this rank's block of an all-gather output, ``comm_buffers.py``)."""
        if out is None:
            out = torch.empty(self.ct + self.cf, dtype=dtype, device=device)
        for states, base, held, chunk in ((self.train, 0, self.stop_t - self.start_t, self.ct),
                                          (self.frozen, self.ct, self.stop_f - self.start_f, self.cf)):
            pos = base
            for s in states:
                k = s.hi - s.lo
                if k:
                    out[pos:pos + k].copy_(source(s))
                    pos += k
            out[base + held:base + chunk].zero_()            # padding (the trailing ranks)
        return out

    def unpack(self, out: torch.Tensor, dest: Callable[[ParamState], torch.Tensor]) -> None:
        """Copy every parameter out of an all-gather output ``out`` (``N`` blocks) into
        ``dest(state)`` (a contiguous full tensor)."""
        if self.cf == 0:                                     # the train chunks lie end to end
            for s in self.train:
                o = s.slot.offset
                dest(s).view(-1).copy_(out[o:o + s.slot.numel])
            return
        blocks = out.view(self.n, self.ct + self.cf)
        for states, seg, c in ((self.train, blocks[:, :self.ct], self.ct),
                               (self.frozen, blocks[:, self.ct:], self.cf)):
            for s in states:
                _copy_range(dest(s).view(-1), seg, c, s.slot.offset)

    # ---- reduce-scatter ------------------------------------------------------------------------
    def pack_grads(self, grads: Sequence[torch.Tensor | None], dtype: torch.dtype,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """The trainable gradients (in ``self.train`` order; None: zeros) laid end to end, padded to
        ``N·c_train``: the reduce-scatter input."""
        if device is None:
            device = next((g.device for g in grads if g is not None), None)
        out = torch.empty(self.n * self.ct, dtype=dtype, device=device)
        for s, g in zip(self.train, grads):
            o = s.slot.offset
            view = out[o:o + s.slot.numel]
            if g is None:
                view.zero_()
            else:
                view.copy_(g.reshape(-1))
        out[self.numel_t:].zero_()
        return out

    def copy_grad(self, buf: torch.Tensor, state: ParamState, grad: torch.Tensor | None) -> None:
        """Lay ``state``'s gradient (None: zeros) into its place in ``buf``, a reduce-scatter input
        (``N·c_train`` elements, filled as gradients arrive, then ``zero_padding``: ``pack_grads``
        one gradient at a time)."""
        view = buf[state.slot.offset:state.slot.offset + state.slot.numel]
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.reshape(-1))

    def zero_padding(self, buf: torch.Tensor) -> None:
        buf[self.numel_t:].zero_()

    def reduced(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Views of each trainable parameter's reduced piece in this rank's chunk ``out``."""
        views = []
        for s in self.train:
            pos = s.slot.offset + s.lo - self.start_t if s.hi > s.lo else 0
            views.append(out[pos:pos + s.hi - s.lo])
        return views


def _copy_range(dest: torch.Tensor, seg: torch.Tensor, c: int, offset: int) -> None:
    """``dest`` (1-D, ``k`` elements) := segment elements ``[offset, offset + k)`` of ``seg``, an
    ``(N, c)`` view: a partial block, the whole blocks between, a partial block."""
    k = dest.numel()
    b0, r0 = divmod(offset, c)
    b1, r1 = divmod(offset + k, c)
    if b0 == b1:
        dest.copy_(seg[b0, r0:r1])
        return
    pos = 0
    if r0:
        dest[:c - r0].copy_(seg[b0, r0:])
        pos, b0 = c - r0, b0 + 1
    if b1 > b0:
        m = b1 - b0
        dest[pos:pos + m * c].view(m, c).copy_(seg[b0:b1])
        pos += m * c
    if r1:
        dest[pos:].copy_(seg[b1, :r1])


def flat_runs(groups: Sequence[FlatGroup], by_name: dict[str, ParamState], rank: int) -> list[FlatRun]:
    """A ``FlatRun`` for each group, its states looked up by parameter name."""
    return [FlatRun(g, [by_name[n] for n in g.train], [by_name[n] for n in g.frozen], rank) for g in groups]
