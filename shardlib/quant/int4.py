"""Group-wise packed int4 frozen weights: two 4-bit values per byte (GPTQ-style).

Why our own type: torchao 0.18's ``Int4WeightOnlyConfig`` has no packed format that runs on a CPU build
of torch 2.13 (``plain``/``preshuffled`` need the ``mslk`` kernel library, ``plain_int32`` refuses the
CPU, ``tile_packed_to_4d`` needs CUDA and bf16), and ``IntxWeightOnlyConfig(torch.int4)`` stores one
value per byte.

The format. A weight ``w`` of ``[out, in]`` is cut into groups of ``G`` consecutive in-features; each
group gets an asymmetric unsigned 4-bit code with its own scale and zero point::

    lo, hi = min(min(group), 0), max(max(group), 0)      # 0 stays exactly representable (GPTQ)
    scale  = (hi - lo) / 15                              # stored in the weight's float dtype
    zero   = clamp(round(-lo / scale), 0, 15)            # uint8
    q      = clamp(round(w / scale) + zero, 0, 15)       # |w - (q - zero) * scale| <= scale / 2

Two codes share a byte: ``qdata[r, j] = q[r, 2j] | q[r, 2j + 1] << 4`` (low nibble = even column). The
tensor holds ``out*in/2 + groups*(scale bytes + 1)`` bytes, about 1/8 of fp32 plus the scales.

``Int4Tensor`` is a wrapper tensor subclass (outer shape and dtype are the float weight's) that stands in
for a frozen ``nn.Linear`` weight: ``F.linear`` dequantizes per call (on CPU there is no int4 kernel to
call, so we trade a transient float copy of one weight for the packed bytes at rest), autograd reaches
the input and the bias, never the weight. Like bitsandbytes' 4-bit matmul, backward dequantizes again
rather than keeping each layer's float copy alive from forward to backward. ``__tensor_flatten__`` /
``__tensor_unflatten__`` and ``component_blocks`` let a runtime move and slice the packed bytes without
dequantizing them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shardlib.errors import Problems, ShardingError, ShardingTypeError
from shardlib.validate import is_int

from .wrapper import SHARED, frozen_linear, torch_dispatch, torch_function

aten = torch.ops.aten

_INNER = ("qdata", "scale", "zero_point")
_QMAX = 15


def _check_group_size(group_size: Any, api: str) -> None:
    if not is_int(group_size):
        raise ShardingTypeError(f"{api}: group_size must be an int — got {group_size!r}; expected an even "
                                f"positive int such as 32. Pass group_size=32.")
    if group_size <= 0 or group_size % 2:
        raise ShardingError(f"{api}: group_size must be even and positive (two 4-bit values share a byte) — "
                            f"got {group_size}; expected an even group size such as 32 or 64. Pick an even one.")


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"Int4Tensor: {what} is not supported on a packed int4 weight — it supports "
                               f"F.linear, detach, clone, .to(device or float dtype), empty_like, copy_ from an "
                               f"Int4Tensor, and slices or splits that keep groups whole. Call w.dequantize() for a "
                               f"float tensor and use that.")


class Int4Tensor(torch.Tensor):
    """A frozen ``[out, in]`` weight held as packed 4-bit codes with per-group scale and zero point.

    Inner tensors: ``qdata`` uint8 ``[out, in // 2]``, ``scale`` ``[out, in // G]`` (the weight's float
    dtype), ``zero_point`` uint8 ``[out, in // G]``. Build it with ``Int4Tensor.from_float(w, G)``.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    group_size: int

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int,
                shape: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> Int4Tensor:
        shape = tuple(shape) if shape is not None else (*qdata.shape[:-1], 2 * qdata.shape[-1])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or scale.dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int,
                 shape: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> None:
        *lead, cols = self.shape
        want = {"qdata": (torch.uint8, (*lead, cols // 2)), "scale": (self.dtype, (*lead, cols // group_size)),
                "zero_point": (torch.uint8, (*lead, cols // group_size))}
        got = {"qdata": qdata, "scale": scale, "zero_point": zero_point}
        bad = [f"{n} {got[n].dtype} {list(got[n].shape)} (expected {d} {list(s)})" for n, (d, s) in want.items()
               if got[n].dtype != d or tuple(got[n].shape) != s]
        if not lead or cols % group_size or bad:
            raise ShardingError(f"Int4Tensor: inner tensors do not fit a {list(self.shape)} weight in groups of "
                                f"{group_size} — got {'; '.join(bad) or f'{cols} in-features'}; expected in-features "
                                f"a multiple of group_size and the shapes above. Build it with Int4Tensor.from_float.")
        self.qdata, self.scale, self.zero_point, self.group_size = qdata, scale, zero_point, group_size

    # -- building and reading -------------------------------------------------------------------

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int = 32) -> Int4Tensor:
        """Quantize a float ``[out, in]`` weight — or a stack of them, ``[E, out, in]`` (fused experts: every
        leading dim is a stack) — min/max per group (0 included), round to nearest."""
        _check_group_size(group_size, "Int4Tensor.from_float")
        if not isinstance(w, torch.Tensor) or type(w) not in (torch.Tensor, nn.Parameter) or \
                not w.dtype.is_floating_point or w.dim() < 2:
            raise ShardingTypeError(f"Int4Tensor.from_float: expected a plain float weight of 2 or more dims — got "
                                    f"{type(w).__name__} {getattr(w, 'dtype', None)} of shape "
                                    f"{list(getattr(w, 'shape', []))}; expected a [out, in] (or [E, out, in]) float "
                                    f"tensor. Pass the float weight (dequantize a quantized one first).")
        *lead, cols = w.shape
        if cols % group_size:
            raise ShardingError(f"Int4Tensor.from_float: group_size {group_size} does not divide in-features — "
                                f"got {cols} in-features; expected a multiple of {group_size}. Use a group size "
                                f"that divides {cols}.")
        g = w.detach().reshape(*lead, cols // group_size, group_size).float()
        lo = g.amin(-1).clamp(max=0.0)
        hi = g.amax(-1).clamp(min=0.0)
        scale = ((hi - lo) / _QMAX).to(w.dtype)            # round the scale to its stored dtype first,
        s = torch.where(scale > 0, scale, torch.ones_like(scale)).float()  # then quantize with that one
        zero = torch.clamp(torch.round(-lo / s), 0, _QMAX)
        q = torch.clamp(torch.round(g / s[..., None]) + zero[..., None], 0, _QMAX).to(torch.uint8)
        q = q.reshape(*lead, cols // 2, 2)
        qdata = (q[..., 0] | (q[..., 1] << 4)).contiguous()
        return cls(qdata, scale.contiguous(), zero.to(torch.uint8).contiguous(), group_size, tuple(w.shape), w.dtype)

    def unpack(self) -> torch.Tensor:
        """The 4-bit codes ``q`` as uint8 ``[out, in]`` (values 0..15)."""
        q = torch.stack((self.qdata & 0xF, self.qdata >> 4), dim=-1)
        return q.reshape(self.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight ``(q - zero) * scale`` as a plain tensor of ``dtype`` (default: ``self.dtype``)."""
        dtype = dtype or self.dtype
        if not dtype.is_floating_point:
            raise ShardingTypeError(f"Int4Tensor.dequantize: dtype must be a float dtype — got {dtype}; expected "
                                    f"e.g. torch.float32 or torch.bfloat16. Dequantize to a float dtype.")
        *lead, cols = self.shape
        q = self.unpack().reshape(*lead, cols // self.group_size, self.group_size).to(dtype)
        w = (q - self.zero_point.to(dtype)[..., None]) * self.scale.to(dtype)[..., None]
        return w.reshape(self.shape)

    def component_blocks(self) -> dict[str, tuple[int, ...]]:
        """Weight elements one entry of each inner tensor covers, per dim: slice ``[a:b]`` of the weight
        along a dim is ``[a // k : b // k]`` of a component whose block is ``k`` there."""
        lead = (1,) * (self.dim() - 1)
        return {"qdata": (*lead, 2), "scale": (*lead, self.group_size), "zero_point": (*lead, self.group_size)}

    def packed_nbytes(self) -> int:
        """Bytes held: ``out*in/2`` codes plus ``groups * (scale bytes + 1)``."""
        return sum(getattr(self, n).nbytes for n in _INNER)

    def slice(self, rows: slice = slice(None), cols: slice = slice(None)) -> Int4Tensor:
        """``w[..., rows, cols]`` without dequantizing; ``cols`` must start and stop on group boundaries."""
        out = self
        for dim, s in ((self.dim() - 2, rows), (self.dim() - 1, cols)):
            if s.step not in (None, 1):
                raise _unsupported(f"a slice with step {s.step}")
            out = out._slice_dim(dim, s.start, s.stop)
        return out

    def _slice_dim(self, dim: int, start: int | None, stop: int | None) -> Int4Tensor:
        size = self.shape[dim]
        start, stop, _ = slice(start, stop).indices(size)
        stop = max(stop, start)
        blocks = self.component_blocks()
        unit = max(b[dim] for b in blocks.values())
        if start % unit or stop % unit:
            raise ShardingError(f"Int4Tensor.slice: the in-feature range cuts a quantization group — got "
                                f"[{start}:{stop}]; expected bounds that are multiples of group_size "
                                f"{self.group_size}. Slice at group boundaries, or dequantize first.")
        parts = [getattr(self, n).narrow(dim, start // blocks[n][dim], (stop - start) // blocks[n][dim])
                 for n in _INNER]
        shape = list(self.shape)
        shape[dim] = stop - start
        return Int4Tensor(*parts, self.group_size, tuple(shape), self.dtype)

    # -- the tensor-subclass protocol -----------------------------------------------------------

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return list(_INNER), {"group_size": self.group_size, "shape": tuple(self.shape), "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> Int4Tensor:
        """Rebuild from inner tensors. The shape comes from ``outer_size`` or, when it is ``None``, from
        ``qdata`` (``[r, c]`` packs ``[r, 2c]``): shards rebuild with the meta of the whole weight."""
        return Int4Tensor(inner["qdata"], inner["scale"], inner["zero_point"], meta["group_size"],
                          tuple(outer_size) if outer_size is not None else None, meta["dtype"])

    def _with(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None) -> Int4Tensor:
        dtype = dtype or self.dtype
        return Int4Tensor(fn(self.qdata), fn(self.scale).to(dtype), fn(self.zero_point), self.group_size,
                          tuple(self.shape), dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"Int4Tensor(shape={list(self.shape)}, group_size={self.group_size}, dtype={self.dtype}, "
                f"device={self.device}, packed_nbytes={self.packed_nbytes()})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch_function(Int4Tensor, func, args, kwargs, lambda *a, **k: frozen_linear(Int4Tensor, *a, **k))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch_dispatch(_DISPATCH, _unsupported, func, args, kwargs)


# -- what the subclass does under aten ops -------------------------------------------------------

def _copy_(func, self, src, non_blocking=False):
    if not (isinstance(src, Int4Tensor) and src.group_size == self.group_size and src.shape == self.shape
            and src.dtype == self.dtype):
        got = (f"Int4Tensor {list(src.shape)} group {src.group_size} {src.dtype}" if isinstance(src, Int4Tensor)
               else f"{type(src).__name__} {getattr(src, 'dtype', None)}")
        raise ShardingTypeError(f"Int4Tensor.copy_: can copy only an Int4Tensor of the same shape, group size and "
                                f"dtype — got {got}; expected Int4Tensor {list(self.shape)} group {self.group_size} "
                                f"{self.dtype}. Quantize the source with Int4Tensor.from_float(w, "
                                f"{self.group_size}) first.")
    for n in _INNER:
        getattr(self, n).copy_(getattr(src, n), non_blocking)
    return self


def _lead_dim(self: Int4Tensor, dim: int, what: str) -> int:
    dim %= self.dim()
    if dim == self.dim() - 1:
        raise _unsupported(f"{what} along the packed in-features")
    return dim


def _select(func, self, dim, index):
    """``w[e]`` of a stack ``[E, out, in]``: expert ``e``'s ``[out, in]`` weight, still packed."""
    dim = _lead_dim(self, dim, "select")
    shape = self.shape[:dim] + self.shape[dim + 1:]
    return Int4Tensor(*(func(getattr(self, n), dim, index) for n in _INNER), self.group_size, tuple(shape),
                      self.dtype)


def _index(func, self, indices):
    """``w[idx]`` with one integer tensor on dim 0 of a stack (what ``weight[expert_idx]`` runs): the chosen
    weights, still packed."""
    if len(indices) != 1 or indices[0] is None or self.dim() < 3 or indices[0].dtype.is_floating_point:
        raise _unsupported("indexing other than one integer index tensor on dim 0 of a stack [E, out, in]")
    idx = indices[0]
    shape = (*idx.shape, *self.shape[1:])
    return Int4Tensor(*(func(getattr(self, n), [idx]) for n in _INNER), self.group_size, tuple(shape), self.dtype)


_DISPATCH: dict[Any, Callable] = {
    **SHARED,
    aten.copy_.default: _copy_,
    aten.select.int: _select,
    aten.index.Tensor: _index,
}


# -- quantizing a model in place ----------------------------------------------------------------

def quantize_int4_(model: nn.Module, group_size: int = 32,
                   filter_fn: Callable[[nn.Module, str], bool] | None = None,
                   parameters: Iterable[str] = ()) -> nn.Module:
    """Replace ``nn.Linear`` weights by frozen ``Int4Tensor`` parameters in place (like torchao's
    ``quantize_``); returns ``model``. Call it before ``get_peft_model`` (QLoRA order).

    ``filter_fn(module, fqn)`` is asked about every ``nn.Linear`` and selects the ones to quantize. The
    default takes every Linear whose ``in_features`` is a multiple of ``group_size`` and leaves the
    others float, as it leaves weights tied to another module and weights already quantized. A Linear
    selected explicitly that cannot be quantized is an error (all of them are listed at once).

    ``parameters`` names more weights to quantize by their parameter names (as torchao's ``FqnToConfig``
    takes them): fused experts' stacks ``[E, out, in]`` (``mlp.experts.gate_up_proj``), grouped along
    their last dim; each must be a float Parameter of its own whose last dim holds whole groups.
    """
    _check_group_size(group_size, "quantize_int4_")
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    chosen: list[nn.Linear] = []
    stacks = _chosen_parameters(model, parameters, group_size, uses)
    with Problems("quantize_int4_") as problems:
        for fqn, mod in model.named_modules():
            if not isinstance(mod, nn.Linear):
                continue
            w = mod.weight
            name = fqn or "<root>"
            reasons = []                                    # (what is wrong, got, expected, fix)
            if mod.in_features % group_size:
                reasons.append(("its in-features do not split into whole groups", f"in_features "
                                f"{mod.in_features}", f"a multiple of group_size {group_size}", f"Use a group size "
                                f"that divides {mod.in_features}, or leave {name} out of filter_fn"))
            if type(w) is not nn.Parameter or not w.dtype.is_floating_point:
                reasons.append(("its weight is not a float Parameter", f"{type(w).__name__} {w.dtype}",
                                "a float nn.Parameter", f"Leave {name} out of filter_fn"))
            if uses[id(w)] > 1:
                reasons.append(("its weight is tied to another module's", f"{uses[id(w)]} uses of one weight",
                                "a weight of its own", f"Untie it, or leave {name} out of filter_fn"))
            if filter_fn is None:
                if not reasons:
                    chosen.append(mod)
            elif filter_fn(mod, fqn):
                for what, got, expected, fix in reasons:
                    problems.add(f"quantize_int4_: {name} cannot be quantized, {what} — got {got}; expected "
                                 f"{expected}. {fix}.")
                chosen.append(mod)
    for mod in chosen:
        mod.weight = nn.Parameter(Int4Tensor.from_float(mod.weight.detach(), group_size), requires_grad=False)
    for owner, leaf, w in stacks:
        setattr(owner, leaf, nn.Parameter(Int4Tensor.from_float(w.detach(), group_size), requires_grad=False))
    return model


def _chosen_parameters(model: nn.Module, names: Iterable[str], group_size: int,
                       uses: Counter) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(owner module, attribute, weight)`` of each parameter named in ``names``; every one that cannot
    be quantized is listed at once."""
    if isinstance(names, str):
        raise ShardingTypeError(f"quantize_int4_: parameters must be a list of parameter names — got the string "
                                f"{names!r}; expected e.g. ['model.layers.0.mlp.experts.gate_up_proj']. Wrap it in "
                                f"a list.")
    names = list(names)
    own = dict(model.named_parameters())
    out = []
    with Problems("quantize_int4_") as problems:
        for name in names:
            w = own.get(name)
            if w is None:
                near = [n for n in own if n.endswith(name.rsplit(".", 1)[-1])][:3]
                problems.add(f"quantize_int4_: parameter {name!r} is not in the model — got a name none of its "
                             f"{len(own)} parameters has; expected a full parameter name such as {near or list(own)[:3]}. "
                             f"Use the names model.named_parameters() gives.")
                continue
            got = []
            if type(w) is not nn.Parameter or not w.dtype.is_floating_point or w.dim() < 2:
                got.append(f"a {type(w).__name__} {w.dtype} of {w.dim()} dims (expected a float Parameter of 2 or "
                           f"more dims)")
            elif w.shape[-1] % group_size:
                got.append(f"last dim {w.shape[-1]} (expected a multiple of group_size {group_size})")
            if uses[id(w)] > 1:
                got.append(f"{uses[id(w)]} uses of one weight (expected a weight of its own)")
            if got:
                problems.add(f"quantize_int4_: parameter {name} {list(w.shape)} cannot be quantized — got "
                             f"{'; '.join(got)}. Leave it out of parameters, or pick a group size dividing its "
                             f"last dim.")
                continue
            owner_name, _, leaf = name.rpartition(".")
            out.append((model.get_submodule(owner_name), leaf, w))
    return out
