"""``sl.quantize(model, "int8" | "int4" | "nf4", modules=...)``: the format of a model's frozen weights.

On a real model it quantizes in place — torchao's ``Int8Tensor`` (per-row scales, ``Int8WeightOnlyConfig``),
the project's packed ``Int4Tensor`` (groups of ``group_size``), torchao's ``NF4Tensor`` (QLoRA's NormalFloat4:
blocks of ``block_size`` 64, scales double-quantized in blocks of ``scaler_block_size`` 256) — and freezes
each weight. Call it before ``peft.get_peft_model`` (QLoRA's order).

On a model built on the meta device it *marks* them: each chosen weight becomes a ``PendingWeight`` — shape,
dtype and format, no values, no memory — whose packed layout the planner counts (``QuantSpec``) and whose
codes ``engine.load_pretrained(folder)`` writes, each rank quantizing its own slices of the folder's floats
(``runtime/pretrained/quantized.py``). A pending weight says it lives on the CPU (it holds nothing there):
``peft.get_peft_model`` creates each adapter on its base weight's device, so the adapters of a meta model
get the values one process would draw from the same seed, instead of being moved to the meta device.

Default targets: every ``nn.Linear`` but the output head, as QLoRA does (embeddings are not ``nn.Linear``),
leaving out a weight tied to another module's and, by default, one whose shape the format cannot take.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import Problems, ShardingError, ShardingTypeError
from ..validate import is_int
from . import formats

FORMATS = ("int8", "int4", "nf4")


@dataclass(frozen=True)
class QuantFormat:
    """A quantization format and its options."""

    name: str
    group_size: int = 32               # int4: in-features per scale
    block_size: int = 64               # nf4: elements per scale
    scaler_block_size: int = 256       # nf4: scales per double-quantization factor

    def problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a float weight of ``shape`` (``[out, in]``, or a stack of experts ``[E, out, in]``) cannot take
        this format; None if it can. (NF4: each expert of a stack on its own, as ``to_nf4`` would take it.)"""
        if len(shape) not in (2, 3):
            return f"{len(shape)} dims (expected an [out, in] weight or a stack of experts [E, out, in])"
        out_f, in_f = shape[-2:]
        if self.name == "int4" and in_f % self.group_size:
            return f"in-features {in_f} (expected a multiple of group_size {self.group_size})"
        if self.name == "nf4":
            if in_f % self.block_size:
                return f"in-features {in_f} (expected a multiple of block_size {self.block_size})"
            if (out_f * in_f) % (self.block_size * self.scaler_block_size):
                return (f"{out_f * in_f} elements (expected a multiple of block_size x scaler_block_size = "
                        f"{self.block_size * self.scaler_block_size})")
        return None

    def make(self, w: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
        """``w`` (a float ``[out, in]`` tensor, or a stack of experts ``[E, out, in]``; real or meta) quantized.
        ``mean`` (nf4): the whole weight's mean block scale when ``w`` is a slice of its rows."""
        w = w.detach()
        if self.name == "int4":                 # (a stack of experts [E, out, in] too: grouped along its last dim)
            from .int4 import Int4Tensor
            return Int4Tensor.from_float(w, self.group_size)
        if self.name == "nf4" and w.dim() == 3:  # each expert as to_nf4 would quantize it
            from .nf4_stack import NF4Stack
            return NF4Stack.from_float(w, self.block_size, self.scaler_block_size)
        if self.name == "nf4":
            return formats.nf4_from_float(w.contiguous(), self.block_size, self.scaler_block_size, mean)
        if w.dim() == 3:                        # int8 per row of each expert: torchao's FqnToConfig on the stack
            from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig, quantize_
            holder = nn.Module()
            holder.stack = nn.Parameter(w, requires_grad=False)
            quantize_(holder, FqnToConfig({"stack": Int8WeightOnlyConfig()}), filter_fn=None)
            return holder.stack.detach()
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        lin.weight = nn.Parameter(w, requires_grad=False)
        quantize_(lin, Int8WeightOnlyConfig())
        return lin.weight.detach()


class PendingWeight(torch.Tensor):
    """A frozen weight marked for quantization on a meta-device model: its shape, dtype and format, no
    values. ``quantized_layout`` is a meta tensor of the quantized type (its components' shapes and dtypes)."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, fmt: QuantFormat, name: str) -> PendingWeight:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu", requires_grad=False)

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, fmt: QuantFormat, name: str) -> None:
        self.format, self.weight_name = fmt, name
        self.quantized_layout = fmt.make(torch.empty(shape, dtype=dtype, device="meta"))

    def __repr__(self) -> str:
        return f"PendingWeight({list(self.shape)}, {self.dtype}, {self.format.name}, no values)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]
        pending = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, PendingWeight))
        raise ShardingError(f"{pending.weight_name}: a {pending.format.name} weight marked by sl.quantize on a meta-device "
                            f"model has no values yet — got {func} on it; expected a load first. Parallelize with "
                            "init=False and call engine.load_pretrained(folder), which quantizes each rank's slices.")


def is_pending(t: object) -> bool:
    return isinstance(t, PendingWeight)


def quantize(model: nn.Module, format: str, modules: str | Iterable[str] | None = None, *,
             parameters: Iterable[str] = (), group_size: int = 32, block_size: int = 64,
             scaler_block_size: int = 256) -> nn.Module:
    """Quantize (a real model) or mark for quantization (a meta-device model) the weights of
    ``modules`` — ``nn.Linear`` layers named in full or by a suffix (``"q_proj"``), or ``fnmatch``
    patterns (``"*.mlp.*"``); default: every ``nn.Linear`` but the output head — in ``format``; returns
    ``model``. ``parameters`` names more weights by their parameter names or patterns: fused experts' stacks
    ``[E, out, in]`` (``"*.experts.gate_up_proj"``), quantized expert by expert (with ``parameters`` alone,
    no Linear is chosen by default). Every target that cannot be quantized is named at once, and nothing
    changes then."""
    fmt = _format(format, group_size, block_size, scaler_block_size)
    stacks = _stacks(model, fmt, parameters)
    if stacks and modules is None:
        modules = []
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    peft = isinstance(getattr(model, "peft_config", None), dict)
    explicit = modules is not None
    if isinstance(modules, str):
        modules = [modules]
    chosen = []
    with Problems("quantize") as problems:
        if explicit:
            modules = list(modules)
            for pattern in modules:
                if not any(_matches(n, pattern) for n, _ in layers):
                    problems.add(f"quantize: modules entry {pattern!r} matches no nn.Linear of "
                                 f"{type(model).__name__} — expected a name, a name's last parts or an fnmatch "
                                 f"pattern such as {[n for n, _ in layers][:3]}. Use names model.named_modules() "
                                 "gives.")
        for name, mod in layers:
            if explicit and not any(_matches(name, p) for p in modules):
                continue
            if not explicit and (mod is head or "lora_" in name):
                continue
            w = mod.weight
            if (formats.is_quantized(w) or is_pending(w)) and not explicit:
                continue
            why = _unfit(w, fmt, uses, peft)
            if why and not explicit:
                continue            # the default leaves what the format cannot take in float
            for w_ in why:
                problems.add(f"quantize: {name} {list(w.shape)} cannot be quantized as {fmt.name} — got {w_}. "
                             + ("Leave it out of modules." if "trainable" not in w_ else
                                "Quantize the base before peft.get_peft_model, and train adapters beside it."))
            chosen.append((name, mod))
        if not chosen and not stacks and not problems:
            problems.add(f"quantize: no nn.Linear of {type(model).__name__} can be quantized as {fmt.name} — got "
                         f"{len(layers)} linear layer(s), none a float weight of a shape the format takes; "
                         "expected at least one. Check the model, or pick another format.")
    for name, mod in chosen:
        w = mod.weight
        if w.is_meta:
            q = PendingWeight(tuple(w.shape), w.dtype, fmt, f"{name}.weight")
        else:
            q = fmt.make(w)
        mod.weight = nn.Parameter(q, requires_grad=False)
    for name, w in stacks:
        owner_name, _, leaf = name.rpartition(".")
        q = PendingWeight(tuple(w.shape), w.dtype, fmt, name) if w.is_meta else fmt.make(w)
        setattr(model.get_submodule(owner_name), leaf, nn.Parameter(q, requires_grad=False))
    return model


def _unfit(w: torch.Tensor, fmt: QuantFormat, uses: Counter, peft: bool) -> list[str]:
    """Why weight ``w`` cannot be quantized as ``fmt`` (each a "got ..." phrase); empty if it can."""
    why = []
    if formats.is_quantized(w) or is_pending(w):
        why.append(f"a weight quantized already ({type(w).__name__})")
    elif not w.dtype.is_floating_point:
        why.append(f"a {w.dtype} weight (expected a float weight)")
    elif (problem := fmt.problem(tuple(w.shape))) is not None:
        why.append(problem)
    if uses[id(w)] > 1:
        why.append(f"a weight tied to another module's ({uses[id(w)]} uses)")
    if peft and w.requires_grad:
        why.append("a trainable weight (a LoRA adapter, or a module PEFT trains)")
    return why


def _stacks(model: nn.Module, fmt: QuantFormat, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
    """``(name, weight)`` of each parameter ``names`` matches (a full name, its last parts, or an ``fnmatch``
    pattern); every one that cannot be quantized is named at once."""
    if isinstance(names, str):
        raise ShardingTypeError(f"quantize: parameters must be a list of parameter names or patterns — got the "
                                f"string {names!r}; expected e.g. ['*.experts.gate_up_proj']. Wrap it in a list.")
    names = list(names)
    if not names:
        return []
    own = dict(model.named_parameters())
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    out = []
    with Problems("quantize") as problems:
        for pattern in names:
            if not any(_matches(n, pattern) for n in own):
                problems.add(f"quantize: parameters entry {pattern!r} matches no parameter of {type(model).__name__} "
                             f"— expected a name, a name's last parts or an fnmatch pattern such as "
                             f"{[n for n, p in own.items() if p.dim() == 3][:2] or list(own)[:2]}. Use names "
                             "model.named_parameters() gives.")
        for name, w in own.items():
            if not any(_matches(name, p) for p in names):
                continue
            why = _unfit(w, fmt, uses, isinstance(getattr(model, "peft_config", None), dict))
            for w_ in why:
                problems.add(f"quantize: parameter {name} {list(w.shape)} cannot be quantized as {fmt.name} — got "
                             f"{w_}. Leave it out of parameters.")
            out.append((name, w))
    return out


def pending_weights(model: nn.Module) -> dict[str, PendingWeight]:
    """Every weight of ``model`` marked by ``sl.quantize`` and waiting for its values, by name."""
    return {n: p for n, p in model.named_parameters() if is_pending(p)}


def _format(format: Any, group_size: Any, block_size: Any, scaler_block_size: Any) -> QuantFormat:
    if not isinstance(format, str) or format.lower() not in FORMATS:
        raise ShardingError(f"quantize: unknown format {format!r} — expected one of {list(FORMATS)} (int8: "
                            "torchao per-row; int4: packed group-wise; nf4: QLoRA's NormalFloat4). Pass one of them.")
    for key, v in (("group_size", group_size), ("block_size", block_size), ("scaler_block_size", scaler_block_size)):
        if not is_int(v) or v <= 0 or v % 2:
            raise ShardingTypeError(f"quantize: {key} must be an even positive int — got {v!r}; expected e.g. "
                                    f"{ {'group_size': 32, 'block_size': 64, 'scaler_block_size': 256}[key] }.")
    return QuantFormat(format.lower(), group_size, block_size, scaler_block_size)


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def format_of(t: torch.Tensor) -> QuantFormat | None:
    """The format (with its options) ``quantize`` gives a weight like ``t``, a whole weight; None for a type
    it does not make (an ``Int8Tensor`` with other than per-row scales)."""
    if is_pending(t):
        return t.format
    if formats.is_nf4(t) or formats.kind(t) == "NF4Stack":
        return QuantFormat("nf4", block_size=t.block_size, scaler_block_size=t.scaler_block_size)
    kind = formats.kind(t)
    if kind == "Int4Tensor":
        return QuantFormat("int4", group_size=t.group_size)
    if kind == "Int8Tensor" and t.dim() == 2 and list(getattr(t, "block_size", [])) == [1, t.shape[1]]:
        return QuantFormat("int8")
    return None
