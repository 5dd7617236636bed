"""Quantizing while loading: each rank reads the float rows of its tensor shard of a quantized weight from
a transformers folder and quantizes them there, the codes equal to the whole weight quantized in one
process and cut to that shard (``quant/api.py`` formats; ``engine.load_pretrained``, ``core.py``).

A rank reads whole rows (every in-feature) in chunks of at most ``chunk`` bytes, each a whole number of the
format's row groups (one row for int8's per-row and int4's per-group scales; NF4's ``R`` rows per
double-quantization factor), quantizes each chunk as one process quantizes those rows, keeps the columns
of its shard, and joins the chunks' components. NF4's one statistic of the whole weight — the mean of its
block scales — comes first, from a pass over every row (block scales only: 1/64 of the elements, as
torchao computes them). Reading whole rows gives every format its scales over the whole row, so a split of
the in-features (row-parallel) quantizes exactly as the whole weight does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ...algebra.layout import Layout
from ...quant import formats
from ...quant.layout import cat_rows, cut, pack, slice_weight
from .files import DTYPES, Entry

if TYPE_CHECKING:
    from ..state import ParamState
    from ..training import TrainingState


def read_rows(e: Entry, rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` of tensor ``e`` in its file, every column, as ``dtype`` (of a stack of experts read from
    its experts' own tensors, ``StackedEntry``: experts ``rows``)."""
    if callable(getattr(e, "read", None)):
        return e.read((rows,)).to(dtype)
    from safetensors import safe_open
    with safe_open(str(e.file), framework="pt") as f:        # mapped pages let go after
        return f.get_slice(e.key)[rows].to(dtype)


def row_chunks(e: Entry, start: int, stop: int, unit: int, chunk: int) -> list[slice]:
    """``[start, stop)`` in slices of whole ``unit``-row groups, each at most ``chunk`` bytes (at least one group)."""
    row = math.prod(e.shape[1:]) * DTYPES[e.dtype].itemsize
    step = max(1, chunk // max(row * unit, 1)) * unit
    return [slice(i, min(i + step, stop)) for i in range(start, stop, step)]


def quantized_shard(st: ParamState, e: Entry, mesh_rank: int, mesh, chunk: int,
                    read: Callable[[Entry, slice, torch.dtype], torch.Tensor] = read_rows) -> torch.Tensor:
    """This rank's tensor shard of quantized weight ``st``, quantized from the float rows of ``e``."""
    pp, fmt = st.plan, st.quant_format
    full = tuple(pp.full_shape or pp.shape)
    dtype = st.param.dtype
    if len(full) == 3:
        layout = Layout(mesh, pp.spec)
        boxes = [g for g, _ in layout.local_boxes(full, mesh_rank)] if pp.full_shape is not None \
            else [tuple(slice(0, n) for n in full)]
        return _stack_shard(e, fmt, full, boxes, next(iter(layout.fused), 0), dtype, chunk, read)
    slices = Layout(mesh, pp.spec).local_slices(full, mesh_rank) if pp.full_shape is not None else \
        tuple(slice(0, n) for n in full)
    rows, cols = slices[0].indices(full[0])[:2], slices[1]
    unit = _row_unit(pp.quant)
    mean = None
    if fmt.name == "nf4":            # the whole weight's mean block scale, as to_nf4 computes it
        absmax = [formats.nf4_block_absmax(read(e, s, dtype), fmt.block_size)
                  for s in row_chunks(e, 0, full[0], unit, chunk)]
        mean = torch.cat(absmax).mean()
        del absmax
    parts = []
    for s in row_chunks(e, rows[0], rows[1], unit, chunk):
        q = fmt.make(read(e, s, dtype), mean)
        if cols.indices(full[1])[:2] != (0, full[1]):
            q = slice_weight(q, (slice(None), cols))
        parts.append(q)
    return cat_rows(parts)


def _stack_shard(e: Entry, fmt, full: tuple[int, ...], boxes: list[tuple[slice, ...]], fused: int,
                 dtype: torch.dtype, chunk: int, read: Callable[[Entry, slice, torch.dtype], torch.Tensor]
                 ) -> torch.Tensor:
    """A stack of experts ``[E, out, in]``: this rank's experts read whole, a chunk of experts at a time, each
    expert quantized on its own (int8's rows, int4's groups and NF4's blocks, scalers and mean lie within one
    expert: no statistic spans experts), then cut to this rank's rows and columns — ``boxes`` of them, joined
    along the ``fused`` dim (gate|up split over tensor) where there are several."""
    first = boxes[0][0].indices(full[0])[:2]
    whole = len(boxes) == 1 and all(s.indices(n)[:2] == (0, n) for s, n in zip(boxes[0][1:], full[1:]))
    parts = []
    for s in row_chunks(e, first[0], first[1], 1, chunk):
        q = fmt.make(read(e, s, dtype))
        parts.append(q if whole else cut(q, [(slice(None), *b[1:]) for b in boxes], fused))
    return cat_rows(parts)


def fill(training: TrainingState, st: ParamState, q: torch.Tensor) -> None:
    """Write the quantized shard ``q`` into state ``st``: its components in place, or under ZeRO-3 this
    rank's piece of its packed bytes (the layout ``setup.quantized_state`` gave it)."""
    if st.store is None:
        mine = formats.components(q)
        for name, dst in formats.components(st.param).items():
            dst.copy_(mine[name])
        return
    packed = pack(q)
    store = torch.zeros(st.store.numel() * st.store.element_size(), dtype=torch.uint8, device=packed.device)
    store[:packed.numel()] = packed
    st.shard.view(torch.uint8).copy_(st.local_piece(store.view(st.store.dtype)).view(torch.uint8))


def _row_unit(spec) -> int:
    """Rows a slice of the weight must keep whole: the largest block of rows of a component cut by rows."""
    return max((c.block[0] for c in spec.components if not c.whole[0]), default=1)
