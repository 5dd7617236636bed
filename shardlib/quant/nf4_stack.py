"""A stack of NF4 experts ``[E, out, in]``: QLoRA's NormalFloat4 for fused experts.

Why our own type: torchao's ``NF4Tensor`` (QLoRA's format, as torchtune holds it) takes at most 2 dims
(``to_nf4`` asserts it), and a mixture of experts keeps its experts as one 3-D stack (transformers 5's
``experts.gate_up_proj [E, 2I, H]``, the reference GPT's ``ExpertMLP``) that the expert axis splits on dim 0.

The format: expert ``e`` of the stack is exactly ``to_nf4(w[e], block_size, scaler_block_size)`` — its own
block scales, its own double quantization (its own mean of block scales), torchao's 16-entry table. So
``stack[e]`` is a torchao ``NF4Tensor`` bit for bit (a view of the stack's components, nothing copied),
and the model's own ``F.linear(x, w[e])`` runs torchao's NF4 product, which dequantizes per call and again
in backward (autograd reaches the input, never the weight).

Components are held weight-shaped (what ``quant/layout.py`` cuts and packs): codes ``quantized_data``
uint8 ``[E, out, in/2]``, scalers ``quantized_scalers`` int8 ``[E, out, in/b]``, double-quantization
factors ``quantization_factor`` ``[E, out/R, F]`` (one per ``S`` scalers: ``R`` rows hold ``F`` factors,
as for a 2-D NF4 weight, ``quant/formats.py``), the means ``scaler_mean`` ``[E, 1, 1]`` and the table
``nf4`` ``[1, 1, 16]`` (kept whole on every slice). A slice of experts is a slice of every component but
the table; the expert axis never cuts a block.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ShardingError, ShardingTypeError
from .wrapper import SHARED, torch_dispatch, torch_function

aten = torch.ops.aten

INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def geometry(out_f: int, in_f: int, block_size: int, scaler_block_size: int) -> tuple[int, int] | str:
    """``(R, F)``: rows per group of factors and factors per group of an expert ``[out, in]``; or why an
    expert of that shape cannot be NF4 in these blocks."""
    if in_f % block_size:
        return f"in-features {in_f} (expected a multiple of block_size {block_size})"
    if (out_f * in_f) % (block_size * scaler_block_size):
        return (f"{out_f * in_f} elements per expert (expected a multiple of block_size x scaler_block_size = "
                f"{block_size * scaler_block_size})")
    per_row = in_f // block_size
    rows = scaler_block_size // math.gcd(per_row, scaler_block_size)
    return rows, rows * per_row // scaler_block_size


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"NF4Stack: {what} is not supported on a stack of NF4 experts — it supports "
                               f"stack[e] (a torchao NF4Tensor), stack[idx], detach, clone, .to(device), empty_like, "
                               f"copy_ from an NF4Stack, slices that keep blocks whole, and products that "
                               f"dequantize. Call w.dequantize() for a float tensor and use that.")


class NF4Stack(torch.Tensor):
    """``E`` NF4 weights ``[out, in]`` stacked on dim 0, each torchao's ``to_nf4`` of its expert (module doc).
    Build it with ``NF4Stack.from_float(w, block_size, scaler_block_size)``."""

    quantized_data: torch.Tensor
    quantized_scalers: torch.Tensor
    quantization_factor: torch.Tensor
    scaler_mean: torch.Tensor
    nf4: torch.Tensor

    @staticmethod
    def __new__(cls, inner: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> NF4Stack:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=inner["quantized_data"].device,
                                                   requires_grad=False)

    def __init__(self, inner: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if len(self.shape) != 3:
            raise ShardingError(f"NF4Stack: a stack of experts is [E, out, in] — got shape {list(self.shape)}; "
                                "expected 3 dims. Use torchao's to_nf4 for a 2-D weight.")
        e, out_f, in_f = self.shape
        scalers, factors = inner["quantized_scalers"], inner["quantization_factor"]
        want = {"quantized_data": (e, out_f, in_f // 2), "quantized_scalers": (e, out_f, scalers.shape[-1]),
                "scaler_mean": (e, 1, 1)}
        bad = [f"{n} {list(inner[n].shape)} (expected {list(s)})" for n, s in want.items()
               if tuple(inner[n].shape) != s]
        if bad or scalers.shape[-1] == 0 or in_f % scalers.shape[-1] or factors.dim() != 3 or factors.shape[0] != e:
            raise ShardingError(f"NF4Stack: components do not fit a {list(self.shape)} stack — got "
                                f"{'; '.join(bad) or 'scalers ' + str(list(scalers.shape))}. Build it with "
                                "NF4Stack.from_float.")
        for n in INNER:
            setattr(self, n, inner[n])

    @property
    def block_size(self) -> int:
        return self.shape[2] // self.quantized_scalers.shape[-1]

    @property
    def scaler_block_size(self) -> int:
        """Scalers per factor (a slice of in-features keeping a factor spanning whole rows has fewer)."""
        f = self.quantization_factor
        return (self.shape[1] * self.quantized_scalers.shape[-1]) // max(f.shape[1] * f.shape[2], 1)

    # -- building and reading -------------------------------------------------------------------

    @classmethod
    def from_float(cls, w: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256) -> NF4Stack:
        """Each expert ``w[e]`` quantized as ``to_nf4(w[e], block_size, scaler_block_size)``."""
        from .formats import nf4_from_float
        if w.dim() != 3:
            raise ShardingError(f"NF4Stack.from_float: expected a stack [E, out, in] — got {list(w.shape)}.")
        geo = geometry(w.shape[1], w.shape[2], block_size, scaler_block_size)
        if isinstance(geo, str):
            raise ShardingError(f"NF4Stack.from_float: a {list(w.shape)} stack cannot be NF4 in blocks of {block_size} "
                                f"and scaler blocks of {scaler_block_size} — got {geo}. Pick block sizes that divide it.")
        rows, factors = geo
        e, out_f, in_f = w.shape
        if w.is_meta:
            parts = [{"quantized_data": torch.empty(out_f * in_f // 2, dtype=torch.uint8, device="meta"),
                      "quantized_scalers": torch.empty(out_f * in_f // block_size, dtype=torch.int8, device="meta"),
                      "quantization_factor": torch.empty(out_f // rows * factors, dtype=w.dtype, device="meta"),
                      "scaler_mean": torch.empty((), dtype=w.dtype, device="meta"),
                      "nf4": torch.empty(16, dtype=w.dtype, device="meta")}]
            parts *= e
        else:
            parts = [{n: getattr(q, n) for n in INNER}
                     for q in (nf4_from_float(w[i].detach(), block_size, scaler_block_size) for i in range(e))]
        inner = {"quantized_data": torch.stack([p["quantized_data"] for p in parts]).view(e, out_f, in_f // 2),
                 "quantized_scalers": torch.stack([p["quantized_scalers"] for p in parts]).view(e, out_f, -1),
                 "quantization_factor": torch.stack([p["quantization_factor"] for p in parts]).view(
                     e, out_f // rows, factors),
                 "scaler_mean": torch.stack([p["scaler_mean"] for p in parts]).view(e, 1, 1),
                 "nf4": parts[0]["nf4"].reshape(1, 1, -1).clone()}
        return cls(inner, tuple(w.shape), w.dtype)

    def expert(self, e: int) -> torch.Tensor:
        """Expert ``e``'s weight as torchao's 2-D ``NF4Tensor``, its components views of the stack's."""
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs
        shape = torch.Size(self.shape[1:])
        meta = SubclassTensorArgs(shape, (shape[1], 1), 0, self.dtype, self.device, False)
        n_blocks = shape.numel() // self.block_size
        return NF4Tensor(meta, self.block_size, n_blocks, self.scaler_block_size, self.quantized_scalers[e].reshape(-1),
                         self.quantization_factor[e].reshape(-1), self.scaler_mean[e].reshape(()),
                         self.quantized_data[e].reshape(-1), self.nf4.reshape(-1))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float stack (each expert torchao's ``get_original_weight``), in ``dtype`` (default: its own)."""
        out = torch.stack([self.expert(e).get_original_weight() for e in range(self.shape[0])]) \
            if self.shape[0] else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return out.to(dtype or self.dtype)

    def component_layout(self) -> dict[str, tuple[tuple[int, ...], tuple[bool, ...], tuple[int, ...]]]:
        """``{component: (block, whole, entries)}`` (``quant/formats.blocks``): weight elements per entry per
        dim, kept whole per dim, entries per block per dim."""
        e, out_f, in_f = self.shape
        b, f = self.block_size, self.quantization_factor
        rows, factors = max(out_f // max(f.shape[1], 1), 1), f.shape[2]
        if rows == 1:           # a row holds whole scaler blocks: a factor per b * S in-features
            factor = ((1, 1, in_f // max(factors, 1)), (False, False, False), (1, 1, 1))
        else:                   # F factors per R rows, kept for every slice of the in-features where F == 1
            factor = ((1, rows, in_f), (False, False, factors == 1), (1, 1, factors))
        return {"quantized_data": ((1, 1, 2), (False, False, False), (1, 1, 1)),
                "quantized_scalers": ((1, 1, b), (False, False, False), (1, 1, 1)),
                "quantization_factor": factor,
                "scaler_mean": ((1, out_f, in_f), (False, True, True), (1, 1, 1)),
                "nf4": ((e, out_f, in_f), (True, True, True), (1, 1, self.nf4.shape[-1]))}

    def _slice_dim(self, dim: int, start: int, stop: int) -> NF4Stack:
        """``[start:stop]`` of dim ``dim`` (on block boundaries), every component a view of this one's."""
        from .layout import component_slices
        slices = [slice(None)] * 3
        slices[dim] = slice(start, stop)
        inner, shape = component_slices(self, tuple(slices))
        return NF4Stack(inner, shape, self.dtype)

    def __tensor_flatten__(self):
        return list(INNER), {"shape": tuple(self.shape), "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> NF4Stack:
        return NF4Stack(inner, tuple(outer_size) if outer_size is not None else meta["shape"], meta["dtype"])

    def _with(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None) -> NF4Stack:
        """``fn`` on every component (the float ones then in ``dtype``, default the stack's own)."""
        dtype = dtype or self.dtype
        inner = {n: fn(getattr(self, n)) for n in INNER}
        for n in ("quantization_factor", "scaler_mean", "nf4"):
            inner[n] = inner[n].to(dtype)
        return NF4Stack(inner, tuple(self.shape), dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"NF4Stack(shape={list(self.shape)}, block_size={self.block_size}, "
                f"scaler_block_size={self.scaler_block_size}, dtype={self.dtype}, device={self.device})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch_function(NF4Stack, func, args, kwargs, _whole_stack_linear)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch_dispatch(_DISPATCH, _unsupported, func, args, kwargs)


def _whole_stack_linear(*args, **kwargs):
    raise _unsupported("F.linear of the whole stack (take one expert: w[e])")


def _copy_(func, self, src, non_blocking=False):
    if not (isinstance(src, NF4Stack) and src.shape == self.shape and src.dtype == self.dtype
            and all(getattr(src, n).shape == getattr(self, n).shape for n in INNER)):
        raise ShardingTypeError(f"NF4Stack.copy_: can copy only an NF4Stack of the same shape, blocks and dtype — got "
                                f"{src!r}; expected {self!r}. Quantize the source with NF4Stack.from_float first.")
    for n in INNER:
        getattr(self, n).copy_(getattr(src, n), non_blocking)
    return self


def _select(func, self, dim, index):
    """``w[e]``: expert ``e`` as torchao's ``NF4Tensor``."""
    if dim % 3 != 0:
        raise _unsupported(f"select on dim {dim} (only dim 0, the experts)")
    return self.expert(index % self.shape[0] if index < 0 else index)


def _index(func, self, indices):
    """``w[idx]`` with one integer tensor on dim 0 (``weight[expert_idx]``): a 0-d index is that expert's
    ``NF4Tensor``; otherwise a stack of the chosen experts."""
    if len(indices) != 1 or indices[0] is None or indices[0].dtype.is_floating_point:
        raise _unsupported("indexing other than one integer index tensor on dim 0")
    idx = indices[0]
    if idx.dim() == 0:
        return _select(func, self, 0, int(idx))
    if idx.dim() != 1:
        raise _unsupported(f"an index of {idx.dim()} dims")
    inner = {n: getattr(self, n) if n == "nf4" else getattr(self, n)[idx] for n in INNER}
    return NF4Stack(inner, (idx.numel(), *self.shape[1:]), self.dtype)


_DISPATCH: dict[Any, Callable] = {
    **SHARED,
    aten.copy_.default: _copy_,
    aten.select.int: _select,
    aten.index.Tensor: _index,
}
