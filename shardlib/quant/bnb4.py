"""bitsandbytes' 4-bit weights laid out on a mesh: the model users bring quantized by
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``.

bitsandbytes holds a ``Linear4bit``'s weight as a ``Params4bit``: the packed codes flattened to
``[out·in/2, 1]`` uint8 (two per byte, row-major, in whatever ``bnb_4bit_quant_storage`` views them as),
beside a ``quant_state`` holding one ``absmax`` per block of ``blocksize`` (64) consecutive elements —
with ``bnb_4bit_use_double_quant`` those are themselves uint8 codes with one float scale per 256 and a
global offset. Neither is a tensor a mesh can cut: the codes' shape says nothing of the weight's, and the
scales live outside the parameter.

``Bnb4Tensor`` is the same weight as a wrapper tensor subclass of the float weight's shape
``[out, in]`` with two weight-shaped components, exactly what bitsandbytes multiplies by:

* ``qdata`` uint8 ``[out, in/2]``: bitsandbytes' bytes, untouched (a row of the weight is a row here);
* ``absmax`` fp32 ``[out, in/blocksize]``: each block's scale as bitsandbytes' own product computes it —
  for a double-quantized weight ``dequantize_blockwise(absmax, state2) + offset``, the expression its
  ``gemm_4bit`` and ``dequantize_4bit`` evaluate at every call — so a shard's product is bit for bit the
  rows (or the block-aligned columns) of the whole weight's.

A slice of rows or of whole blocks of in-features is a slice of both, so the layout arithmetic
(``quant/layout.py``) splits it on every axis as the project's ``Int4Tensor``: a tensor split never cuts a
block, ZeRO-3 moves the packed bytes. The price of the exact scales: 4 bytes per 64 weights where double
quantization keeps about 1 (0.56 bytes per weight where bitsandbytes holds 0.52).

``from_bitsandbytes(model)`` turns each ``Linear4bit`` of a model into a ``Linear4bitLaidOut`` (an
``nn.Linear`` whose forward is ``Linear4bit.forward``'s casts around ``F.linear``) holding a
``Bnb4Tensor``; ``sl.plan`` calls it, in place, as it stacks experts. What cannot be laid out is named:
bitsandbytes' 8-bit ``Int8Params``, a weight repacked for bitsandbytes' CPU inference kernel, in-features
that do not hold whole blocks. bitsandbytes is imported only to dequantize.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ShardingError, ShardingTypeError
from .wrapper import SHARED, frozen_linear, torch_dispatch, torch_function

aten = torch.ops.aten

_INNER = ("qdata", "absmax")


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"Bnb4Tensor: {what} is not supported on a bitsandbytes 4-bit weight — it supports "
                               f"F.linear, detach, clone, .to(device or float dtype), empty_like, copy_ from a "
                               f"Bnb4Tensor, and slices or splits that keep blocks whole. Call w.dequantize() for a "
                               f"float tensor and use that.")


class Bnb4Tensor(torch.Tensor):
    """A frozen ``[out, in]`` weight as bitsandbytes' packed 4-bit codes ``qdata`` uint8 ``[out, in/2]`` and
    per-block scales ``absmax`` fp32 ``[out, in/blocksize]`` (module doc); ``quant_type`` ``"nf4"`` or
    ``"fp4"`` names bitsandbytes' table, ``dtype`` the float weight's (its ``quant_state.dtype``)."""

    qdata: torch.Tensor
    absmax: torch.Tensor
    blocksize: int
    quant_type: str

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                shape: tuple[int, int], dtype: torch.dtype) -> Bnb4Tensor:
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                 shape: tuple[int, int], dtype: torch.dtype) -> None:
        want = {"qdata": (torch.uint8, (shape[0], shape[1] // 2)),
                "absmax": (torch.float32, (shape[0], shape[1] // blocksize))}
        got = {"qdata": qdata, "absmax": absmax}
        bad = [f"{n} {got[n].dtype} {list(got[n].shape)} (expected {d} {list(s)})" for n, (d, s) in want.items()
               if got[n].dtype != d or tuple(got[n].shape) != s]
        if len(shape) != 2 or shape[1] % blocksize or bad or quant_type not in ("nf4", "fp4"):
            raise ShardingError(f"Bnb4Tensor: components do not fit a {list(shape)} {quant_type} weight in blocks of "
                                f"{blocksize} — got {'; '.join(bad) or f'{shape[1]} in-features'}; expected "
                                f"in-features a multiple of the block and the shapes above. Build it with "
                                f"from_bitsandbytes(model).")
        self.qdata, self.absmax, self.blocksize, self.quant_type = qdata, absmax, blocksize, quant_type

    @classmethod
    def from_params4bit(cls, w: torch.Tensor) -> Bnb4Tensor:
        """The ``Bnb4Tensor`` of a bitsandbytes ``Params4bit`` (its ``quant_state`` read, nothing requantized)."""
        qs = w.quant_state
        out_f, in_f = (int(s) for s in qs.shape)
        absmax = qs.absmax
        if qs.nested:          # bitsandbytes' gemm_4bit: code[absmax] * state2.absmax[i // 256] + offset, in fp32
            absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
                absmax, qs.state2.absmax, qs.state2.code, qs.state2.blocksize, torch.float32) + qs.offset
        qdata = w.data.contiguous().view(torch.uint8).reshape(out_f, in_f // 2)
        return cls(qdata, absmax.float().reshape(out_f, in_f // qs.blocksize).contiguous(), qs.blocksize,
                   qs.quant_type, (out_f, in_f), qs.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight, bitsandbytes' ``dequantize_4bit`` of these codes and scales, in ``dtype``
        (default: ``self.dtype``): what its ``gemm_4bit`` multiplies by."""
        dtype = dtype or self.dtype
        if not dtype.is_floating_point:
            raise ShardingTypeError(f"Bnb4Tensor.dequantize: dtype must be a float dtype — got {dtype}.")
        if self.qdata.is_meta:
            return torch.empty(self.shape, dtype=dtype, device="meta")
        importlib.import_module("bitsandbytes")        # registers its ops
        return torch.ops.bitsandbytes.dequantize_4bit.default(
            self.qdata.contiguous().view(-1, 1), self.absmax.contiguous().view(-1), self.blocksize, self.quant_type,
            list(self.shape), dtype)

    def component_blocks(self) -> dict[str, tuple[int, ...]]:
        """Weight elements one entry of each component covers, per dim (``quant/layout.py``)."""
        return {"qdata": (1, 2), "absmax": (1, self.blocksize)}

    def packed_nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in _INNER)

    def _slice_dim(self, dim: int, start: int, stop: int) -> Bnb4Tensor:
        blocks = self.component_blocks()
        unit = max(b[dim] for b in blocks.values())
        if start % unit or stop % unit:
            raise ShardingError(f"Bnb4Tensor.slice: the range [{start}:{stop}] of dim {dim} cuts a block — expected "
                                f"bounds that are multiples of {unit}. Slice at block boundaries, or dequantize first.")
        parts = [getattr(self, n).narrow(dim, start // blocks[n][dim], (stop - start) // blocks[n][dim])
                 for n in _INNER]
        shape = list(self.shape)
        shape[dim] = stop - start
        return Bnb4Tensor(*parts, self.blocksize, self.quant_type, tuple(shape), self.dtype)

    # -- the tensor-subclass protocol -----------------------------------------------------------

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return list(_INNER), {"blocksize": self.blocksize, "quant_type": self.quant_type,
                              "shape": tuple(self.shape), "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> Bnb4Tensor:
        shape = tuple(outer_size) if outer_size is not None else meta["shape"]
        return Bnb4Tensor(inner["qdata"], inner["absmax"], meta["blocksize"], meta["quant_type"], shape, meta["dtype"])

    def _with(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None) -> Bnb4Tensor:
        """``fn`` on both components; ``dtype`` the float weight's (the scales stay fp32, as bitsandbytes')."""
        return Bnb4Tensor(fn(self.qdata), fn(self.absmax), self.blocksize, self.quant_type, tuple(self.shape),
                          dtype or self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"Bnb4Tensor(shape={list(self.shape)}, {self.quant_type}, blocksize={self.blocksize}, "
                f"dtype={self.dtype}, device={self.device}, packed_nbytes={self.packed_nbytes()})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch_function(Bnb4Tensor, func, args, kwargs, lambda *a, **k: frozen_linear(Bnb4Tensor, *a, **k))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch_dispatch(_DISPATCH, _unsupported, func, args, kwargs)


def _copy_(func, self, src, non_blocking=False):
    if not (isinstance(src, Bnb4Tensor) and src.shape == self.shape and src.blocksize == self.blocksize
            and src.quant_type == self.quant_type):
        raise ShardingTypeError(f"Bnb4Tensor.copy_: can copy only a Bnb4Tensor of the same shape, blocks and table — "
                                f"got {src!r}; expected {self!r}.")
    for n in _INNER:
        getattr(self, n).copy_(getattr(src, n), non_blocking)
    return self


_DISPATCH: dict[Any, Callable] = {**SHARED, aten.copy_.default: _copy_}


class Linear4bitLaidOut(nn.Linear):
    """A bitsandbytes ``Linear4bit`` whose weight is a ``Bnb4Tensor``: its forward's casts (an fp32 or bf16
    input computes in its own dtype, an fp16 one in ``compute_dtype``; the output in the input's dtype)
    around ``F.linear``, which runs the weight's frozen product."""

    compute_dtype: torch.dtype | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = x.dtype
        cd = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else getattr(self, "compute_dtype", None)
        if cd is not None:
            x = x.to(cd)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight, bias).to(given)


def bitsandbytes_weights(model: nn.Module) -> list[tuple[str, nn.Module, torch.Tensor]]:
    """``(module name, module, weight)`` of every module holding a bitsandbytes weight (``Params4bit``,
    ``Int8Params``)."""
    return [(n, m, w) for n, m in model.named_modules()      # (its own: PEFT's wrappers show the base's too)
            if type(w := m._parameters.get("weight")).__name__ in ("Params4bit", "Int8Params")
            and type(w).__module__.startswith("bitsandbytes")]


def _reason(w: torch.Tensor) -> str | None:
    """Why ``w`` (a bitsandbytes weight) cannot be a ``Bnb4Tensor``, with the fix; None when it can."""
    if type(w).__name__ == "Int8Params":
        return ("bitsandbytes Int8Params (load_in_8bit, LLM.int8()): their row-wise codes and outlier columns are "
                "not laid out on a mesh — expected a 4-bit model (BitsAndBytesConfig(load_in_4bit=True)), or "
                "torchao's int8: build the model on the meta device, sl.quantize(model, 'int8'), then "
                "engine.load_pretrained(folder)")
    qs = getattr(w, "quant_state", None)
    if qs is None:
        return ("bitsandbytes Params4bit not yet quantized (no quant_state) — expected the codes "
                "from_pretrained(quantization_config=..., device_map='cpu') leaves. Load it so")
    shape = tuple(int(s) for s in qs.shape)
    why = []
    if getattr(qs, "packing_format_for_cpu", False):
        why.append("repacked for bitsandbytes' CPU inference kernel (by a forward in eval mode without grad)")
    if len(shape) != 2 or shape[-1] % qs.blocksize or shape[-1] % 2:
        why.append(f"in-features {shape[-1]} that do not hold whole blocks of {qs.blocksize}")
    if qs.nested and qs.state2.blocksize != 256:
        why.append(f"double-quantized in blocks of {qs.state2.blocksize} (bitsandbytes multiplies only 256)")
    if not why and w.data.nbytes * 2 != math.prod(shape):
        why.append(f"a quant storage of {w.data.nbytes} bytes for {math.prod(shape)} codes")
    if not why:
        return None
    return (f"bitsandbytes 4-bit weights whose quant storage cannot be sharded: {'; '.join(why)} — expected the "
            "codes row-major over whole blocks of each row. Load the model again with "
            "BitsAndBytesConfig(load_in_4bit=True) and keep it in train mode (model.train()), or use torchao's "
            "NF4: sl.quantize(model, 'nf4') on a meta model, then engine.load_pretrained(folder)")


def from_bitsandbytes(model: nn.Module) -> list[str]:
    """Each bitsandbytes ``Linear4bit`` of ``model`` made a ``Linear4bitLaidOut`` holding its ``Bnb4Tensor``, in
    place; the problems of the weights that cannot be, one per reason naming its weights (nothing is changed
    when there is one)."""
    found = bitsandbytes_weights(model)
    by_reason: dict[str, list[str]] = {}
    for n, _, w in found:
        if (why := _reason(w)) is not None:
            by_reason.setdefault(why, []).append(f"{n}.weight")
    if by_reason:
        return [f"plan: {', '.join(names[:2])}{f' and {len(names) - 2} more' if len(names) > 2 else ''}: {why}."
                for why, names in by_reason.items()]
    for _, mod, w in found:
        mod.weight = nn.Parameter(Bnb4Tensor.from_params4bit(w), requires_grad=False)
        mod.__class__ = Linear4bitLaidOut
    return []
