"""Boxes: rectangular blocks of a tensor's index space, the unit of a layout-free checkpoint.

A rank holds of each parameter a flat range ``[lo, hi)`` of its tensor-parallel block (ZeRO's flat
pieces, ``planner/flat.py``), and the block is a box of the global tensor (``Layout.local_slices``).
``range_boxes`` writes a flat range of a box in row-major order as at most ``2·ndim - 1`` boxes, so
every rank's piece of every tensor is a few boxes in global coordinates — whatever the mesh, ZeRO
stage or tensor split that produced it. Two layouts exchange values through the overlaps of their
boxes (``overlap``).

A fused dim (``Fused(parts, axis)``) makes the block ``parts`` boxes per dim (its chunk of each
block), so a flat range of it is not always a row-major range of a box: ``piece_boxes`` works in the
blocked view (each dim ``(parts, n/parts)``), where the block is one box, and maps each of its range
boxes back to global boxes — one where it stays inside a block or covers whole blocks, one per block
otherwise — each with the strides at which its elements lie in the flat piece.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]       # (starts, sizes)
Strided = tuple[Box, int, tuple[int, ...]]           # (global box, offset in the flat piece, strides there)


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


def _contiguous(sizes: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def piece_boxes(shape: Sequence[int], parts: Sequence[int], start: Sequence[int], local: Sequence[int],
                lo: int, hi: int) -> list[Strided]:
    """Elements ``[lo, hi)`` of a rank's block as global boxes. The block (shape ``local``) holds, of
    each dim ``d`` of the global ``shape``, the chunk ``[start[d], start[d] + local[d] / parts[d])`` of
    each of its ``parts[d]`` equal blocks, concatenated in block order (``parts`` all 1: the plain
    box at ``start``). Returns ``(box, offset, strides)``: the box's elements are the flat piece's
    ``as_strided(box sizes, strides, offset)``, in row-major order of the box within each."""
    shape, local = tuple(int(n) for n in shape), tuple(int(n) for n in local)
    if all(p == 1 for p in parts):
        out, off = [], 0
        for b in range_boxes(local, lo, hi):
            out.append((shift(b, start), off, _contiguous(b[1])))
            off += math.prod(b[1])
        return out
    blocked = tuple(x for p, n in zip(parts, local) for x in (p, n // p))
    out, off = [], 0
    for starts, sizes in range_boxes(blocked, lo, hi):
        st = _contiguous(sizes)
        choices: list[list[tuple[int, int, int]]] = []       # per dim: (global start, size, extra offset)
        for d, (p, n) in enumerate(zip(parts, shape)):
            width = n // p
            k0, nk, i0, ni = starts[2 * d], sizes[2 * d], starts[2 * d + 1] + start[d], sizes[2 * d + 1]
            if nk == 1:
                choices.append([(k0 * width + i0, ni, 0)])
            elif ni == width:                                # whole blocks: one box
                choices.append([(k0 * width, nk * width, 0)])
            else:
                choices.append([((k0 + j) * width + i0, ni, j * st[2 * d]) for j in range(nk)])
        strides = tuple(st[2 * d + 1] for d in range(len(shape)))
        combos: list[tuple[tuple[int, ...], tuple[int, ...], int]] = [((), (), 0)]
        for opts in choices:
            combos = [(a + (g,), b + (z,), e + x) for a, b, e in combos for g, z, x in opts]
        out += [((a, b), off + e, strides) for a, b, e in combos]
        off += math.prod(sizes)
    return out
