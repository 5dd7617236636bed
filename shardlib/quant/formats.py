"""How each quantized tensor type's components lie over its weight: the one place that knows the types.

A quantized weight is a wrapper tensor subclass holding *components* (codes, scales, ...). The layout
arithmetic (``quant/layout.py``) sees every component as a tensor with the weight's number of dims, each
entry covering a block of the weight. Two kinds of types:

* **weight-shaped components** (torchao's ``Int8Tensor``, the project's ``Int4Tensor``): codes
  ``qdata`` and scales are already ``[out, in // b]``-shaped; the views are the components themselves.
* **torchao's ``NF4Tensor``** (QLoRA's NormalFloat4, as torchtune holds it): every component is flat over
  the weight in row-major order — codes ``quantized_data`` (two per byte), one int8 scaler per block of
  ``block_size`` (64) elements, one ``quantization_factor`` per ``scaler_block_size`` (256) scalers (the
  double quantization), one global ``scaler_mean`` and the 16-entry ``nf4`` table. With in-features a
  multiple of 64 they are weight-shaped by a reshape: codes ``[out, in/2]``, scalers ``[out, in/64]``;
  a factor covers ``64·S`` in-features of a row where rows hold whole scaler blocks (``S`` = scaler
  block; ``in/64`` a multiple of ``S``), else ``R = S / gcd(in/64, S)`` whole rows — ``[out/R, F]`` with
  ``F`` factors per ``R`` rows. A slice of rows keeps whole ``R``-row groups; a slice of in-features keeps
  whole scaler blocks, or, where one factor spans whole rows (``S`` a multiple of ``in/64``), keeps that
  factor for every slice of those rows (the slice's own scaler block is then ``S / k``); where scaler
  blocks straddle rows otherwise, in-features cannot be split. The mean and the table are
  kept whole on every slice.

torchao is never imported here: types are recognized by name and attributes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

_NF4_INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def is_nf4(t: object) -> bool:
    return isinstance(t, torch.Tensor) and type(t).__name__ == "NF4Tensor" and hasattr(t, "quantized_data")


def is_quantized(t: object) -> bool:
    """A quantized weight: a tensor subclass with components (``__tensor_flatten__``) and codes."""
    return isinstance(t, torch.Tensor) and hasattr(type(t), "__tensor_flatten__") and (
        hasattr(t, "qdata") or is_nf4(t) or callable(getattr(t, "component_layout", None)))


def kind(t: torch.Tensor) -> str:
    return type(t).__name__


def components(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``t``'s components as views with the weight's number of dims (see the module doc), by name."""
    if is_nf4(t):
        return _nf4_views(t)
    names, _ = t.__tensor_flatten__()
    return {n: c for n in names if isinstance(c := getattr(t, n), torch.Tensor)}


def blocks(t: torch.Tensor) -> dict[str, tuple[tuple[int, ...], tuple[bool, ...] | None, tuple[int, ...]]] | None:
    """``{component: (block, whole, entries)}`` where a type fixes them (weight elements per entry per
    dim; kept whole per dim, or None to derive; entries per block per dim); None: derived from shapes."""
    layout = getattr(t, "component_layout", None)
    if callable(layout):                # the type states all three (``NF4Stack``)
        return layout()
    own = getattr(t, "component_blocks", None)
    if callable(own):
        return {k: (tuple(v), tuple(False for _ in v), tuple(1 for _ in v)) for k, v in own().items()}
    if is_nf4(t):
        return _nf4_blocks(t)
    return None


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The float weight ``t`` stands for."""
    if is_nf4(t):
        return t.get_original_weight()
    return t.dequantize()


def rebuild(like: torch.Tensor, inner: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """A weight of ``shape``, of ``like``'s type and metadata, from weight-shaped components ``inner``
    (as ``components`` gives them; missing ones taken from ``like``)."""
    names, meta = like.__tensor_flatten__()
    stride = torch.empty(shape, device="meta").stride() if shape else ()
    if is_nf4(like):
        flat = {n: inner[n].reshape(-1) if n in inner else getattr(like, n) for n in _NF4_INNER}
        flat["scaler_mean"] = flat["scaler_mean"].reshape(())
        n_blocks = math.prod(shape) // like.block_size
        meta = dict(meta, n_blocks=n_blocks,
                    scaler_block_size=n_blocks // max(flat["quantization_factor"].numel(), 1),
                    tensor_meta=dataclasses.replace(meta["tensor_meta"], original_shape=torch.Size(shape),
                                                    original_strides=stride, storage_offset=0))
        return type(like).__tensor_unflatten__(flat, meta, torch.Size(shape), stride)
    inner = {n: inner[n] if n in inner else getattr(like, n) for n in names}
    meta = dict(meta)
    if "shape" in meta:
        meta["shape"] = shape
    if meta.get("block_size"):          # torchao: a block spanning a whole dim (of more than one) spans the shard's
        meta["block_size"] = [n if b == full and full > 1 else b
                              for b, full, n in zip(meta["block_size"], like.shape, shape)]
    return type(like).__tensor_unflatten__(inner, meta, torch.Size(shape), stride)


# -- NF4 ------------------------------------------------------------------------------------------

def _nf4_geometry(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(R, F, blocks per row)`` of a 2-D NF4 weight whose rows hold whole blocks; None otherwise."""
    if t.dim() != 2 or t.shape[1] % t.block_size:
        return None
    per_row = t.shape[1] // t.block_size
    s = t.scaler_block_size
    rows = s // math.gcd(per_row, s)
    return rows, rows * per_row // s, per_row


def _nf4_blocks(t: torch.Tensor):
    out_f, in_f = (tuple(t.shape) + (1, 1))[:2] if t.dim() == 2 else (1, t.numel())
    geo = _nf4_geometry(t)
    whole2 = (True, True)
    if geo is None:            # blocks straddle rows: one unsplittable unit (ZeRO-3 still moves its bytes)
        unit = tuple(t.shape)
        return {"quantized_data": (unit, (False,) * t.dim(), (1,) * (t.dim() - 1) + (t.numel() // 2,)),
                "quantized_scalers": (unit, (False,) * t.dim(), (1,) * (t.dim() - 1) + (t.quantized_scalers.numel(),)),
                "quantization_factor": (unit, (False,) * t.dim(),
                                        (1,) * (t.dim() - 1) + (t.quantization_factor.numel(),)),
                "scaler_mean": (unit, (True,) * t.dim(), (1,) * t.dim()),
                "nf4": (unit, (True,) * t.dim(), (1,) * (t.dim() - 1) + (t.nf4.numel(),))}
    rows, factors, per_row = geo
    b, s = t.block_size, t.scaler_block_size
    if per_row % s == 0:        # a row holds whole scaler blocks: a factor per b * s in-features
        factor = ((1, b * s), (False, False), (1, 1))
    else:                       # one factor spans whole rows (F == 1): kept for every slice of the in-features
        factor = ((rows, in_f), (False, factors == 1), (1, factors))
    return {"quantized_data": ((1, 2), (False, False), (1, 1)),
            "quantized_scalers": ((1, b), (False, False), (1, 1)),
            "quantization_factor": factor,
            "scaler_mean": ((out_f, in_f), whole2, (1, 1)),
            "nf4": ((out_f, in_f), whole2, (1, t.nf4.numel()))}


def _nf4_views(t: torch.Tensor) -> dict[str, torch.Tensor]:
    geo = _nf4_geometry(t)
    lead = (1,) * (t.dim() - 1)
    if geo is None:
        return {"quantized_data": t.quantized_data.view(*lead, -1),
                "quantized_scalers": t.quantized_scalers.view(*lead, -1),
                "quantization_factor": t.quantization_factor.view(*lead, -1),
                "scaler_mean": t.scaler_mean.reshape((1,) * t.dim()), "nf4": t.nf4.view(*lead, -1)}
    rows, factors, per_row = geo
    out_f = t.shape[0]
    return {"quantized_data": t.quantized_data.view(out_f, -1),
            "quantized_scalers": t.quantized_scalers.view(out_f, per_row),
            "quantization_factor": t.quantization_factor.view(-(-out_f // rows), factors),
            "scaler_mean": t.scaler_mean.reshape(1, 1), "nf4": t.nf4.view(1, -1)}


_NF4_PIECE = 1 << 14           # elements quantized per call: torchao's nearest-code search holds ~140 B each
_NF4_TABLES: dict = {}


def nf4_from_float(w: torch.Tensor, block_size: int, scaler_block_size: int,
                   mean: torch.Tensor | None = None) -> Any:
    """torchao's ``to_nf4(w, block_size, scaler_block_size)``, bit for bit (same ops, same dtype, same
    order), its codes found ``_NF4_PIECE`` elements at a time (torchao searches a million at once: ~140 MB
    of temporaries). ``mean``: the double quantization's mean of block scales, given — the whole weight's,
    for ``w`` a slice of its rows: the slice's codes then equal the whole weight's cut to those rows (a
    factor's scaler block lies within the slice's whole ``R``-row groups)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (NF4Tensor, SubclassTensorArgs,
                                                                       get_block_absmax)
    with torch.no_grad():
        key = (w.dtype, w.device)
        if key not in _NF4_TABLES:           # torchao's table, in w's dtype
            _NF4_TABLES[key] = NF4Tensor.from_tensor(w.new_zeros(block_size * scaler_block_size), block_size,
                                                     scaler_block_size).nf4
        nf4 = _NF4_TABLES[key]
        n_blocks = w.numel() // block_size
        flat = w.contiguous().flatten()
        # NF4Tensor.double_quantize_scalers
        scalers = get_block_absmax(flat, block_size)
        mean = scalers.mean() if mean is None else mean
        scalers = scalers - mean
        n_scaler_blocks = scalers.numel() // scaler_block_size
        absmax = get_block_absmax(scalers, scaler_block_size)
        absmax = absmax.unsqueeze(-1).expand(n_scaler_blocks, scaler_block_size)
        factor = 256 / (2 * absmax)
        q = (scalers.view(n_scaler_blocks, scaler_block_size) * factor).round().clamp(-128, 127)
        step = max(block_size, _NF4_PIECE // block_size * block_size)
        data = torch.cat([NF4Tensor.convert_to_norm_float_weight(p, p.numel() // block_size, block_size, nf4)
                          for p in flat.split(step)])
        meta = SubclassTensorArgs(w.size(), w.stride(), w.storage_offset(), w.dtype, w.device, False)
        return NF4Tensor(meta, block_size, n_blocks, scaler_block_size, q.flatten().to(torch.int8),
                         factor[:, 0].view(n_scaler_blocks).contiguous(), mean.clone(), data, nf4.clone())


def nf4_block_absmax(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """The absmax of each block of ``block_size`` consecutive elements of ``w`` (row-major), as torchao
    computes it: rows' absmaxes concatenated are the whole weight's."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import get_block_absmax
    return get_block_absmax(w.flatten(), block_size)
