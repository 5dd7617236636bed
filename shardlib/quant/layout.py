"""Quantized frozen weights as layouts: what a shard of one holds, in packed bytes.

A quantized weight (torchao's ``Int8Tensor``, the project's ``Int4Tensor``: wrapper tensor subclasses
with ``__tensor_flatten__``) is a float ``[out, in]`` weight stored as *components*: codes (``qdata``)
and per-block scales and zero points. Each component entry covers a block of the weight — ``(1, 1)``
for int8 codes, ``(1, 2)`` for packed int4 codes, ``(1, G)`` for group-wise scales, ``(1, in)`` for
per-row (channel) scales — so a slice of the weight is a slice of every component:

* rows (out-features: a column-parallel split, ZeRO's data axis on a tensor-local weight's rows) cut
  every component on its rows: a row's scale goes with its values;
* in-features (a row-parallel split) cut codes and group-wise scales at group boundaries; a
  component with one entry across the in-features (a per-row scale) is kept whole on every slice:
  each slice of a row keeps that row's scale. A slice boundary inside a group would cut it: refused
  (``split_problems``), naming the group size and the tensor degrees that keep groups whole.

``QuantSpec`` is the arithmetic of a weight's components (names, dtypes, blocks, whole dims), enough to
give the packed bytes of any shard shape at plan time; ``slice_weight`` cuts a real weight;
``pack``/``views`` lay a weight's components end to end in one byte buffer (aligned for each dtype)
and rebuild the weight as views of such a buffer, so ZeRO-3 moves a quantized weight as its packed
bytes, in the same all-gather as the unit's other parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShardingError
from . import formats
from .formats import is_quantized as is_quantized

_ALIGN = 8          # byte offsets of components in a packed buffer: every dtype's alignment


def inner_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with each quantized weight replaced by its components (plain tensors): what a
    broadcast or a byte count moves for them."""
    out = []
    for t in tensors:
        if is_quantized(t):
            out += [c for c in (getattr(t, n) for n in t.__tensor_flatten__()[0]) if isinstance(c, torch.Tensor)]
        else:
            out.append(t)
    return out


def _blocks(t: torch.Tensor) -> dict[str, tuple[tuple[int, ...], tuple[bool, ...] | None, tuple[int, ...]]]:
    """``{component: (block, whole or None, entries)}``: weight elements per component entry per dim,
    whether it is kept whole per dim (None: one entry spanning a dim of a shard is), entries per block."""
    own = formats.blocks(t)
    if own is not None:
        return own
    _, meta = t.__tensor_flatten__()
    out = {}
    block = tuple(meta.get("block_size") or getattr(t, "block_size", ()) or ())
    ones = (1,) * t.dim()
    for n, c in formats.components(t).items():
        if tuple(c.shape) == tuple(t.shape):
            out[n] = (ones, None, ones)
        elif block:
            out[n] = (tuple(block), None, ones)
        else:
            out[n] = (tuple(math.ceil(s / max(cs, 1)) for s, cs in zip(t.shape, c.shape)), None, ones)
    return out


@dataclass(frozen=True)
class Component:
    name: str
    dtype: torch.dtype
    block: tuple[int, ...]        # weight elements per entry, per dim
    whole: tuple[bool, ...]       # one entry spans the whole dim (kept whole on every slice of it)
    entries: tuple[int, ...] = ()  # entries per block, per dim (default: one)

    def shape(self, weight: tuple[int, ...]) -> tuple[int, ...]:
        per = self.entries or (1,) * len(weight)
        return tuple((1 if w else math.ceil(n / b)) * e for n, b, w, e in zip(weight, self.block, self.whole, per))


@dataclass(frozen=True)
class QuantSpec:
    """The components of a quantized weight of global shape ``shape``, and its type's name."""

    kind: str
    shape: tuple[int, ...]
    components: tuple[Component, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> QuantSpec:
        comps, blocks = [], _blocks(t)
        for n, c in formats.components(t).items():
            b, whole, entries = blocks[n]
            if whole is None:   # torchao's block_size spanning a whole dim follows a shard's
                whole = tuple(cs == 1 and b_ >= s > 1 for cs, b_, s in zip(c.shape, b, t.shape))
            comps.append(Component(n, c.dtype, b, whole, entries if any(e != 1 for e in entries) else ()))
        return cls(type(t).__name__, tuple(t.shape), tuple(comps))

    def packed_bytes(self, shape: tuple[int, ...] | None = None) -> int:
        """Bytes of a shard of ``shape`` (default: the whole weight) laid end to end (``pack``)."""
        shape = self.shape if shape is None else shape
        if not math.prod(shape):
            return 0
        return _round(sum(_round(math.prod(c.shape(shape)) * c.dtype.itemsize) for c in self.components))

    def held_bytes(self, shape: tuple[int, ...] | None = None) -> int:
        """Bytes of the components of a shard of ``shape`` held as separate tensors (no alignment)."""
        shape = self.shape if shape is None else shape
        return sum(math.prod(c.shape(shape)) * c.dtype.itemsize for c in self.components) if math.prod(shape) else 0

    def group(self, dim: int) -> int:
        """Weight elements of the largest block along ``dim`` that a slice must keep whole (1: any)."""
        return max((c.block[dim] for c in self.components if not c.whole[dim]), default=1)


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def quant_spec(p: torch.Tensor) -> QuantSpec | None:
    """The packed layout of a quantized weight, or of one ``sl.quantize`` marked on a meta-device model
    (``PendingWeight``: the layout its load will give it); None for any other tensor."""
    layout = getattr(p, "quantized_layout", None)
    if layout is not None:
        return QuantSpec.of(layout)
    return QuantSpec.of(p) if is_quantized(p) else None


def split_problems(name: str, spec: QuantSpec, dims: list[tuple[int, int, str]]) -> list[str]:
    """Problems of splitting quantized weight ``name`` on ``dims``: ``(dim, shards, axis)`` each. A
    shard boundary must fall on a block boundary of every component cut there."""
    out = []
    for dim, k, axis in dims:
        g = spec.group(dim)
        n = spec.shape[dim]
        chunk = math.ceil(n / k)
        if g > 1 and (chunk % g or (n % g)):
            ok = [d for d in range(1, n // g + 1) if (n // g) % d == 0 and n % g == 0]
            what = "in-features" if dim == len(spec.shape) - 1 else f"dim {dim}"
            out.append(f"plan: {name} {spec.shape} is a {spec.kind} quantized in groups of {g} along its {what}, "
                       f"and {axis}={k} shards of {chunk} would cut a group — expected each shard to hold whole "
                       f"groups ({n} = {n // g} groups of {g}). Use a {axis} degree among {ok}, keep this weight "
                       f"unsplit on {axis!r}, or " + (f"quantize with a scaler_block_size whose blocks fit {chunk} "
                       f"{'in-features' if dim == len(spec.shape) - 1 else 'rows'}." if spec.kind == "NF4Tensor"
                       else f"quantize with a group size dividing {chunk}."))
    return out


def quantized_problems(model, specs: dict, mesh) -> list[str]:
    """Plan-time problems of the model's quantized weights under ``specs`` on ``mesh``: a quantized
    weight marked trainable, a fused split of one, a split that cuts a quantization group (bitsandbytes'
    4-bit weights are laid out by ``sl.plan`` first: ``quant/bnb4.py``)."""
    out = []
    for name, p in model.named_parameters():
        spec = quant_spec(p)
        if spec is None:
            continue
        if p.requires_grad:
            out.append(f"plan: {name} {spec.shape} is a quantized {spec.kind} marked trainable (requires_grad=True) "
                       "— expected quantized weights frozen: their codes cannot take a gradient step. Call "
                       f"requires_grad_(False) on it and train adapters (PEFT LoRA) beside it, or keep it in float.")
        entries = tuple(specs.get(name, ()))
        dims = []
        for d, e in enumerate(entries):
            if e is None:
                continue
            axes = (e,) if isinstance(e, str) else tuple(e)
            k = math.prod(mesh.axis_sizes[a] for a in axes)
            parts = getattr(e, "parts", 1)
            if parts > 1:            # a fused dim (gate|up): each part split on its own, its blocks kept whole
                part_shape = list(spec.shape)
                part_shape[d] //= parts
                out += split_problems(f"{name} (each of its {parts} fused parts)",
                                      QuantSpec(spec.kind, tuple(part_shape), spec.components), [(d, k, "x".join(axes))])
                continue
            dims.append((d, k, "x".join(axes)))
        out += split_problems(name, spec, dims)
        out += _grouped_problems(model, name, p, spec)
    return out


def _grouped_problems(model, name: str, p: torch.Tensor, spec: QuantSpec) -> list[str]:
    """A stack of quantized experts ``[E, out, in]`` in a transformers experts module that multiplies them
    grouped (``grouped_mm(x, w.transpose(-2, -1))``, transformers 5's default) must take that transpose:
    ``Int4Tensor`` dequantizes for it; torchao's ``Int8Tensor`` has none, so it would fail inside the first
    forward, in one process as on a mesh."""
    if p.dim() < 3:
        return []
    owner = model.get_submodule(name.rpartition(".")[0])
    impl = getattr(getattr(owner, "config", None), "_experts_implementation", None)
    if impl in (None, "eager"):
        return []
    try:
        p.narrow(0, 0, 1).transpose(-2, -1)           # one expert's worth: what the grouped product runs
    except NotImplementedError:
        return [f"plan: {name} {spec.shape} is a quantized {spec.kind} stack of experts that "
                f"{type(owner).__name__} multiplies with experts_implementation={impl!r}, which transposes it — got "
                f"{spec.kind}, which has no transpose; expected a weight the grouped product can take. Run the experts "
                f"eagerly (one F.linear per expert): model.set_experts_implementation('eager'), or quantize them "
                f"with shardlib.quant.quantize_int4_(model, parameters=[...]), whose weights dequantize for it."]
    return []


def component_slices(t: torch.Tensor, slices: tuple[slice, ...]) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """The components of the quantized weight ``t`` cut to ``slices`` (one per dim, steps of 1, on block
    boundaries), as views, and the cut weight's shape: a component is kept whole where one entry spans the dim."""
    spec = QuantSpec.of(t)
    comps = formats.components(t)
    inner = {}
    for c in spec.components:
        idx = []
        for d, s in enumerate(slices):
            start, stop, _ = s.indices(t.shape[d])
            if c.whole[d] or (start == 0 and stop == t.shape[d]):
                idx.append(slice(None))
                continue
            b = c.block[d]
            e = c.entries[d] if c.entries else 1
            if start % b or (stop % b and stop != t.shape[d]):
                raise ShardingError(f"slice_weight: {spec.kind} {tuple(t.shape)}: slice {start}:{stop} of dim {d} "
                                    f"cuts a block of {b} — got bounds inside a block; expected multiples of {b}. "
                                    "Slice on block boundaries (the planner refuses such splits).")
            idx.append(slice(start // b * e, math.ceil(stop / b) * e))
        inner[c.name] = comps[c.name][tuple(idx)]
    return inner, tuple(len(range(*s.indices(n))) for s, n in zip(slices, t.shape))


def slice_weight(t: torch.Tensor, slices: tuple[slice, ...]) -> torch.Tensor:
    """The quantized weight ``t`` cut to ``slices`` (one per dim, steps of 1, on block boundaries), its
    components copies (the rest of ``t`` can be freed): ``component_slices``."""
    inner, shape = component_slices(t, slices)
    return formats.rebuild(t, {n: c.clone(memory_format=torch.contiguous_format) for n, c in inner.items()}, shape)


def cat_rows(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Quantized weights of the same type and other dims, joined along ``dim`` (default the rows; each part
    whole blocks of it): every component concatenated along ``dim``, one kept whole there taken from the first."""
    if len(parts) == 1:
        return parts[0]
    spec = QuantSpec.of(parts[0])
    views_ = [formats.components(p) for p in parts]
    inner = {c.name: (views_[0][c.name] if c.whole[dim] else torch.cat([v[c.name] for v in views_], dim))
             for c in spec.components}
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return formats.rebuild(parts[0], inner, tuple(shape))


def local_weight(full: torch.Tensor, layout: Any, rank: int) -> torch.Tensor:
    """``rank``'s shard of the quantized weight ``full`` under ``layout`` (an ``algebra.layout.Layout``): its box
    cut, or, with a fused dim (gate|up as ``Fused(2, 'tensor')``), each part's box (``cut``)."""
    fused = layout.fused
    if len(fused) > 1:
        raise ShardingError(f"slice_weight: a quantized {tuple(full.shape)} weight fused on dims {sorted(fused)} — "
                            "expected at most one fused dim.")
    return cut(full, [g for g, _ in layout.local_boxes(full.shape, rank)], next(iter(fused), 0))


def cut(t: torch.Tensor, boxes: list[tuple[slice, ...]], dim: int) -> torch.Tensor:
    """The quantized weight ``t`` cut to each of ``boxes`` (``slice_weight``), the pieces joined along ``dim``
    in order (a shard of a fused dim: one box per part)."""
    pieces = [slice_weight(t, b) for b in boxes]
    return pieces[0] if len(pieces) == 1 else cat_rows(pieces, dim)


def zeros(like: torch.Tensor, shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """A weight of ``shape`` of ``like``'s type, every component zeros of its own (what a load fills)."""
    spec = QuantSpec.of(like)
    return formats.rebuild(like, {c.name: torch.zeros(c.shape(shape), dtype=c.dtype, device=device)
                                  for c in spec.components}, shape)


def pack(t: torch.Tensor) -> torch.Tensor:
    """``t``'s components laid end to end (each at an offset aligned to 8 bytes), as one uint8 tensor
    of ``QuantSpec.of(t).packed_bytes(t.shape)`` bytes."""
    spec = QuantSpec.of(t)
    comps = formats.components(t)
    out = torch.zeros(spec.packed_bytes(tuple(t.shape)), dtype=torch.uint8, device=t.device)
    pos = 0
    for c in spec.components:
        # (a copy in contiguous strides: a one-entry view may keep a stride that refuses a byte view)
        raw = comps[c.name].reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)
        out[pos:pos + raw.numel()] = raw
        pos = _round(pos + raw.numel())
    return out


def views(like: torch.Tensor, buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A weight of ``shape`` whose components are views of ``buffer`` (laid out as ``pack`` does), of the
    type and metadata of ``like``: refilling the buffer refills the weight, freeing its storage frees it."""
    spec = QuantSpec.of(like)
    raw = buffer.view(-1).view(torch.uint8)
    inner: dict[str, Any] = {}
    pos = 0
    for c in spec.components:
        cshape = c.shape(shape)
        n = math.prod(cshape) * c.dtype.itemsize
        inner[c.name] = raw[pos:pos + n].view(c.dtype).view(cshape)
        pos = _round(pos + n)
    return formats.rebuild(like, inner, shape)
