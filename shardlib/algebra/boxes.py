"""Boxes: rectangular blocks of a tensor's index space, the unit of a layout-free checkpoint.

A rank holds of each parameter a flat range ``[lo, hi)`` of its tensor-parallel block (ZeRO's flat
pieces, ``planner/flat.py``), and the block is a box of the global tensor (``Layout.local_slices``).
``range_boxes`` writes a flat range of a box in row-major order as at most ``2·ndim - 1`` boxes, so
every rank's piece of every tensor is a few boxes in global coordinates — whatever the mesh, ZeRO
stage or tensor split that produced it. Two layouts exchange values through the overlaps of their
boxes (``overlap``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]       # (starts, sizes)


def range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes, in order (each box's
    elements follow the previous box's in the flat range)."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"range_boxes: [{lo}, {hi}) is not inside a tensor of {n} elements {shape}.")
    if lo == hi:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    a, b = lo // inner, (hi - 1) // inner            # the first and last rows touched
    out: list[Box] = []

    def row(r: int, l: int, h: int) -> None:
        for starts, sizes in range_boxes(shape[1:], l, h):
            out.append(((r, *starts), (1, *sizes)))

    if a == b:
        row(a, lo - a * inner, hi - a * inner)
        return out
    first_full = a if lo % inner == 0 else a + 1
    last_full = b if hi % inner == 0 else b - 1       # inclusive
    if first_full > a:
        row(a, lo - a * inner, inner)
    if last_full >= first_full:
        out.append(((first_full, *([0] * (len(shape) - 1))), (last_full - first_full + 1, *shape[1:])))
    if last_full < b:
        row(b, 0, hi - b * inner)
    return out


def shift(box: Box, offset: Sequence[int]) -> Box:
    starts, sizes = box
    return tuple(s + o for s, o in zip(starts, offset)), sizes


def overlap(a: Box, b: Box) -> Box | None:
    """The box where ``a`` and ``b`` meet (global coordinates), or None."""
    starts, sizes = [], []
    for (sa, na), (sb, nb) in zip(zip(*a), zip(*b)):
        s, e = max(sa, sb), min(sa + na, sb + nb)
        if s >= e:
            return None
        starts.append(s)
        sizes.append(e - s)
    return tuple(starts), tuple(sizes)


def slices_in(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Index of ``inner`` within a tensor holding ``outer`` (``inner`` lies inside ``outer``)."""
    return tuple(slice(si - so, si - so + ni) for si, ni, so in zip(inner[0], inner[1], outer[0]))
