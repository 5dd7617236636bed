"""Flat groups: how ZeRO splits parameters over the data axis so every rank holds ``1/N``.

Splitting each parameter by dim-0 rows (ceil chunks of ``ceil(d0/N)`` rows) costs up to a chunk
per parameter per rank: with ``d0 < N`` the first ``d0`` ranks hold a whole row each and the
rest nothing, so at 16,384 ranks a 125M-parameter GPT's worst rank held several times the ZeRO
formula. Here the parameters a collective moves together — a *flat group*: a ZeRO-3 unit, or a
ZeRO-1/2 gradient bucket — are laid end to end in up to two flat **segments**:

* ``train``: the trainable parameters, in the group's order (their gradients are
  reduce-scattered, their optimizer state and masters sharded);
* ``frozen`` (ZeRO-3 only): the parameters without gradients, gathered with the unit but left
  out of the reduce-scatter.

A segment of ``T`` elements is a 1-D tensor with layout ``Layout(mesh, P(data))``: ceil chunks
``c = ceil(T/N)``, data rank ``i`` owning ``[i·c, min((i+1)·c, T))`` (``Segment.bounds``). A
parameter sits at ``[offset, offset + numel)`` of its segment (its ``FlatSlot``); its *piece* on
rank ``i`` is the intersection of that range with rank ``i``'s: a contiguous range
``[lo, hi)`` of the parameter's flattened elements, possibly empty. A rank stores exactly its
pieces, so it holds at most ``ceil(T/N) <= T/N + 1`` elements of each segment, and a collective
over the group moves ``c`` elements per rank: the ring minimum plus less than one element per
rank.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..algebra.layout import Layout
from ..algebra.spec import PartitionSpec

if TYPE_CHECKING:
    from .plan import Plan

TRAIN, FROZEN = "train", "frozen"


@dataclass(frozen=True)
class Segment:
    """``numel`` elements laid end to end: a 1-D tensor with ``layout`` (``P(data)``)."""

    numel: int
    layout: Layout

    @functools.cached_property
    def chunk(self) -> int:
        """Elements per rank, padded: ``ceil(T/N)`` (what a collective moves per rank)."""
        return self.layout.padded_local_shape((self.numel,))[0]

    def bounds(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the segment that mesh rank ``rank`` owns."""
        s = self.layout.local_slices((self.numel,), rank)[0]
        return s.start, s.stop

    def local_numel(self, rank: int) -> int:
        start, stop = self.bounds(rank)
        return stop - start


@dataclass(frozen=True)
class FlatSlot:
    """Where a parameter lies: group ``group`` (index into ``FlatLayout.groups``), segment
    ``segment`` (``train`` or ``frozen``), elements ``[offset, offset + numel)``."""

    group: int
    segment: str
    offset: int
    numel: int

    def piece(self, bounds: tuple[int, int]) -> tuple[int, int]:
        """``[lo, hi)`` of the parameter's flattened elements inside a rank's segment range
        ``bounds`` (``lo == hi`` where the rank holds none of it)."""
        start, stop = bounds
        lo = min(max(start - self.offset, 0), self.numel)
        return lo, max(min(stop - self.offset, self.numel), lo)


@dataclass(frozen=True)
class FlatGroup:
    """Parameters moved by one collective, laid end to end: ``train`` and ``frozen`` name the
    parameters of each segment in order; ``segments`` gives each segment's size and layout."""

    name: str                         # the unit ("" = root) or "bucket <i>"
    train: tuple[str, ...]
    frozen: tuple[str, ...]
    segments: Mapping[str, Segment]

    def local_numel(self, rank: int, segment: str) -> int:
        return self.segments[segment].local_numel(rank)

    def chunk(self, segment: str) -> int:
        return self.segments[segment].chunk

    @functools.cached_property
    def ranks(self) -> int:
        """The ranks the group's segments are split over (``data``, or data x expert for what is not an
        expert: ``Plan.shard_axes``)."""
        lay = self.segments[TRAIN].layout
        return lay.mesh.axis_size(lay.spec.axes) if lay.spec.axes else 1


@dataclass(frozen=True)
class FlatLayout:
    """A plan's flat groups, in the order they are reduced (buckets) or listed (units), and each
    parameter's slot; a parameter in no group (DP-only, or frozen under ZeRO-1/2) has none."""

    groups: tuple[FlatGroup, ...]
    slots: Mapping[str, FlatSlot]

    def slot(self, name: str) -> FlatSlot | None:
        return self.slots.get(name)

    def piece(self, name: str, rank: int) -> tuple[int, int] | None:
        """``[lo, hi)`` of parameter ``name``'s flattened elements that mesh rank ``rank`` holds; None for a
        parameter in no group."""
        slot = self.slots.get(name)
        if slot is None:
            return None
        return slot.piece(self.groups[slot.group].segments[slot.segment].bounds(rank))


def flat_layout(plan: Plan) -> FlatLayout:
    """The flat groups of ``plan``: its units when parameters are sharded at rest (ZeRO-3),
    else its gradient buckets. One pass over the parameters."""
    c = plan.compute_dtype.itemsize
    if plan.states.params is not None:
        members = [(u.name, [plan.param(n) for n in u.params]) for u in plan.units]
    else:
        members = [(f"bucket {i}", bucket) for i, bucket in enumerate(plan.buckets())]
    groups, slots = [], {}
    for g, (name, params) in enumerate(members):
        # a group's states are split over its parameters' axes (data; with an expert axis data x expert, or an
        # expert's data alone: Plan.shard_axes). Buckets and units never mix the two kinds
        axes = plan.shard_axes(params[0].name) if params else (plan.data_axis,)
        layout = Layout(plan.mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))
        names: dict[str, list[str]] = {TRAIN: [], FROZEN: []}
        sizes = {TRAIN: 0, FROZEN: 0}
        for p in params:
            seg = TRAIN if p.trainable else FROZEN
            n = p.stored(c)          # a quantized weight: its packed bytes, as compute-dtype elements
            slots[p.name] = FlatSlot(g, seg, sizes[seg], n)
            names[seg].append(p.name)
            sizes[seg] += n
        groups.append(FlatGroup(name, tuple(names[TRAIN]), tuple(names[FROZEN]),
                                {k: Segment(v, layout) for k, v in sizes.items()}))
    return FlatLayout(tuple(groups), slots)
