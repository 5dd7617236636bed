"""What the project's quantized wrapper types (``Int4Tensor``, ``NF4Stack``) share under ``__torch_dispatch__``
and ``__torch_function__``: the aten ops that act on every component alike (through the type's ``_with``), a
split into slices (through its ``_slice_dim``), and the products that run on the dequantized weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ..errors import ShardingError, ShardingTypeError

aten = torch.ops.aten

# run on the dequantized float weight (a transient copy without grad): products other than one weight's F.linear,
# and a transpose (transformers' grouped experts multiply ``grouped_mm(x, w.transpose(-2, -1))``)
FLOAT_FUNCS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
               torch.bmm, torch.Tensor.bmm, torch.transpose, torch.Tensor.transpose,
               *(f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None)}


def check_frozen(w: torch.Tensor, func: Any) -> None:
    """A quantized weight takes no gradient step: refused where one would be recorded for it."""
    if w.requires_grad and torch.is_grad_enabled():
        raise ShardingError(f"{type(w).__name__}: a quantized weight cannot be trained — got requires_grad=True on a "
                            f"{list(w.shape)} weight in {getattr(func, '__name__', func)}; expected a frozen weight. "
                            "Freeze it (w.requires_grad_(False); the quantizers do) and train adapters beside it "
                            "(PEFT LoRA).")


def call_dequantized(cls: type, func, args, kwargs):
    """Run ``func`` with every ``cls`` argument dequantized (a plain float with no grad)."""
    def swap(a):
        if not isinstance(a, cls):
            return a
        check_frozen(a, func)
        return a.dequantize()
    return func(*tree_map(swap, args), **tree_map(swap, kwargs))


class FrozenLinear(torch.autograd.Function):
    """``y = x W^T + b`` with ``W`` quantized (anything with ``dequantize(dtype)``): saves the quantized weight,
    dequantizes it again for ``dx = dy W`` rather than keeping each layer's float copy alive to backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.w, ctx.has_bias = w, b is not None
        # in the input's dtype: a bf16/fp16 forward of an fp32-scaled weight (mixed precision) runs in bf16
        return F.linear(x, w.dequantize(x.dtype if x.is_floating_point() else None), b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx = dy @ ctx.w.dequantize().to(dy.dtype) if ctx.needs_input_grad[0] else None  # dy: autocast's dtype
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db


def frozen_linear(cls: type, input: torch.Tensor, weight: Any, bias: Any = None) -> torch.Tensor:
    """``F.linear`` under ``cls.__torch_function__``: the frozen product when ``weight`` is the ``cls`` weight,
    else on dequantized floats."""
    if isinstance(input, cls) or isinstance(bias, cls) or not isinstance(weight, cls):
        return call_dequantized(cls, F.linear, (input, weight, bias), {})
    check_frozen(weight, F.linear)
    return FrozenLinear.apply(input, weight, bias)


def alias(func, self, *args, **kwargs):
    """``detach``, ``alias``, ``clone``: the op on every component."""
    return self._with(lambda t: func(t, *args, **kwargs))


def split(func, self, split_size, dim=0):
    """``split`` / ``split_with_sizes`` (and so ``chunk``): consecutive slices, each keeping blocks whole."""
    dim %= self.dim()
    size = self.shape[dim]
    sizes = list(split_size) if isinstance(split_size, (list, tuple)) else \
        [min(split_size, size - i) for i in range(0, size, split_size)]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [self._slice_dim(dim, a, b) for a, b in zip(bounds, bounds[1:])]


def slice_(func, self, dim=0, start=None, end=None, step=1):
    """``w[..., a:b]`` on one dim (steps of 1, on block boundaries): every component cut to match."""
    if step != 1:
        raise NotImplementedError(f"{type(self).__name__}: a slice with step {step} is not supported on a quantized "
                                  "weight — call w.dequantize() for a float tensor and slice that.")
    dim %= self.dim()
    start, end, _ = slice(start, end).indices(self.shape[dim])
    return self._slice_dim(dim, start, max(start, end))


def empty_like(func, self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """Uninitialized components of the same shapes (``Module.to_empty`` materializes a meta model so)."""
    out = self._with(lambda t: torch.empty_like(t, device=device))
    return type(self).__torch_dispatch__(aten._to_copy.default, (type(self),), (out,),
                                         {"dtype": dtype, "layout": layout})


def torch_function(cls: type, func, args, kwargs, linear: Callable) -> Any:
    """A wrapper type's ``__torch_function__``: ``F.linear`` through ``linear``, the products of ``FLOAT_FUNCS`` on
    dequantized floats, anything else as torch runs it (then ``__torch_dispatch__``)."""
    kwargs = kwargs or {}
    if func is F.linear:
        return linear(*args, **kwargs)
    if func in FLOAT_FUNCS:
        return call_dequantized(cls, func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def torch_dispatch(table: dict, unsupported: Callable[[str], Exception], func, args, kwargs) -> Any:
    """A wrapper type's ``__torch_dispatch__``: the op's handler in ``table``, or ``unsupported`` naming it."""
    handler = table.get(func)
    if handler is None:
        raise unsupported(f"operator {func}")
    return handler(func, *args, **(kwargs or {}))


def to_copy(func, self, *, dtype=None, device=None, layout=None, memory_format=None, non_blocking=False,
            pin_memory=None):
    """``.to(device or float dtype)``: every component moved (through the type's ``_with``; a float dtype is the
    weight's: the type casts what it keeps in float)."""
    name = type(self).__name__
    if dtype is not None and not dtype.is_floating_point:
        raise ShardingTypeError(f"{name}.to: a quantized weight keeps a float dtype — got {dtype}; expected a float "
                                f"dtype. Call w.dequantize() and convert that.")
    if layout not in (None, torch.strided):
        raise NotImplementedError(f"{name}: .to(layout={layout}) is not supported on a quantized weight — call "
                                  f"w.dequantize() for a float tensor and use that.")
    return self._with(lambda t: t.to(device=device, non_blocking=non_blocking), dtype)


SHARED: dict[Any, Callable] = {
    aten._to_copy.default: to_copy,
    aten.slice.Tensor: slice_,
    aten.empty_like.default: empty_like,
    aten.detach.default: alias,
    aten.alias.default: alias,
    aten.clone.default: alias,
    aten.split.Tensor: split,
    aten.split_with_sizes.default: split,
}
