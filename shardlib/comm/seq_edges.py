"""Sequence parallelism's edges at Megatron-LM's bytes: where the layer stack meets the rest of
the model (``comm/boundaries.py``'s table, its last rows), SP sends what Megatron sends — without
knowing the model's code, and exact whatever else that code does with the tensors it sees.

**The head** (Megatron's output layer under ``sequence_parallel``: the final norm inside the SP
region, one all-gather before the LM head, a reduce-scatter of the gradient). The last unit's
output is all-gathered, as before, so the model's code after the stack — a final norm, GPT-2's
``view(output_shape)``, Llama's ``[:, slice_indices]``, a value head — sees the whole sequence. A
root column (the vocab-split LM head) that reads that stream — itself, a view of it, or the output
of a root leaf module with parameters (the final norm: ``Boundaries`` watches them with forward
hooks) applied to it — reads a *twin* instead: the same gathered values through ``Regathered``,
whose backward reduce-scatters the sequence, with the norm replayed on it (its parameters entering
through one ``f``: their gradients from the head are partial sums over the vocab shards, all-reduced
over tensor — Megatron all-reduces the final norm's gradients too). The column runs no ``f``. Per
micro-batch of ``s·b·h`` elements, backward sends one reduce-scatter (``(t-1)/t`` of it) where it
sent the head's all-reduce (``2(t-1)/t``), plus the norm's parameters' all-reduce.

Every other reader of the gathered stream keeps the replicated semantics: its gradient, the same on
every rank, is kept chunk-wise (``_GatherInvariant``, no collective), and the two gradients add up on
the last unit's chunk — so a value head, or a loss on the hidden states, stays exact. The replay
costs the norm's forward once more, on the whole sequence (the first run's graph is dropped when
nothing else reads it). A stream changed in place since it was gathered, or reaching the head
through anything else (dropout, a replicated projection with buffers, a module with children),
keeps the head's ``f``: correct, at the old bytes.

**The embedding** (Megatron's ``reduce_scatter_embeddings``). The vocab-split embedding's output is
each rank's partial sum; it is handed to the model's code unreduced, as a ``PartialSum``: reading
its shape, dtype or device costs nothing, and where it reaches the first unit untouched the first
unit's slice of it is one reduce-scatter of the sequence — forward sends ``(t-1)/t`` of ``s·b·h``
where it sent an all-reduce, backward all-gathers as before. That is where the model adds nothing
to the word embedding before the stack: Llama, Mistral, Qwen2 (rotary positions; their mask and
rotary code reads the embedding's shape and dtype only). Any other use — GPT-2's ``wte(idx) +
wpe(pos)``, Gemma's scaling by ``sqrt(h)`` — all-reduces it first (once) and runs on the sum, as
Megatron does with learned position embeddings: the partial sum would otherwise have to be carried
past the add.

The tracer (``planner/trace.py``) runs these same hooks with its recording ``Ops``
(``regather`` records the reduce-scatter), so the plan counts what a step sends.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from .execute import scatter_dim


class Regathered(torch.autograd.Function):
    """``full``, the all-gather of ``x`` made already, again as a new tensor whose backward
    reduce-scatters the gradient into ``x``'s: an all-gather's transpose without a second forward
    collective (each rank's gradient of it is a partial sum, as a column's input gradient is)."""

    @staticmethod
    def forward(ctx, x, full, mesh, axes, dim):
        ctx.mesh, ctx.axes, ctx.dim = mesh, axes, dim
        return full.view_as(full)

    @staticmethod
    def backward(ctx, g):
        return scatter_dim(g.contiguous(), ctx.mesh, ctx.axes, ctx.dim), None, None, None, None


# what reads a tensor's metadata only: a PartialSum answers these without its all-reduce
_META_CALLS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
                         "element_size", "storage_offset", "get_device", "is_floating_point", "is_complex",
                         "__len__"})
_META_PROPS = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_meta", "is_cuda", "is_cpu", "is_xpu",
                         "is_mps", "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "requires_grad",
                         "is_leaf", "grad_fn", "_base", "_version", "itemsize", "nbytes", "names"})


class PartialSum(torch.Tensor):
    """A vocab-split embedding's output before its all-reduce: each rank's partial sum (see the
    module doc). Reading its metadata (shape, dtype, device, ...) answers from the partial sum;
    ``Boundaries`` reduce-scatters it where the first unit takes it; any other operation on it
    all-reduces it first (``_reduce``, once per grad mode) and runs on the sum."""

    _plain: torch.Tensor                    # the partial sum, a plain tensor
    _reduce: Callable[[torch.Tensor], torch.Tensor]
    _sum: torch.Tensor | None

    @staticmethod
    def wrap(y: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> PartialSum:
        out = y.as_subclass(PartialSum)
        out._plain, out._reduce, out._sum = y, reduce, None
        return out

    def summed(self) -> torch.Tensor:
        """The all-reduced tensor (plain); kept for later uses unless made where autograd is off
        while the partial sum needs a gradient (a use with autograd on must record its own)."""
        s = self._sum
        if s is None or (torch.is_grad_enabled() and self._plain.requires_grad and not s.requires_grad):
            s = self._reduce(self._plain)
            self._sum = s
        return s

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            meta = getattr(getattr(func, "__self__", None), "__name__", "") in _META_PROPS
        else:
            meta = name in _META_CALLS
        if meta:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(PartialSum, PartialSum.summed, (args, kwargs))
        return func(*args, **kwargs)


@dataclass
class _Tail:
    """A tensor of the whole sequence after the last unit, as the model's code holds it (weakly: it
    lives as long as the model's code keeps it), and how to build its twin — the same values, a
    column's partial input gradient reduce-scattered in backward — once, when a column asks."""

    ref: weakref.ref
    version: int                  # the tensor's version when made: a twin of a changed tensor is none
    build: Callable[[], torch.Tensor | None] | None
    twin: torch.Tensor | None = None


class SeqEdges:
    """SP's edges, mixed into ``Boundaries`` (which holds ``ops`` and ``_handles``)."""

    ops: object
    _handles: list

    def _install_edges(self, first: nn.Module | None, tails: list[nn.Module], *, partial_sums: bool,
                       head: bool) -> None:
        """``first``: the first unit (its partial-sum input is reduce-scattered; before the engine's
        own hooks on it see it: prepended); ``tails``: the root leaf modules with parameters that
        may run between the last unit and a root column; ``head``: a root column exists."""
        self._partial_sums = partial_sums
        self._head_edge = head
        self._scattered = False
        self._tails: dict[int, _Tail] = {}
        if partial_sums and first is not None:
            self._handles.append(first.register_forward_pre_hook(self._first_pre, prepend=True))
        for mod in tails if head else ():
            self._handles.append(mod.register_forward_hook(self._tail_post, with_kwargs=True))

    def _clear_edges(self) -> None:
        self._tails = {}
        self._scattered = False

    def partial_sum(self, y: torch.Tensor) -> torch.Tensor:
        """A root vocab-split embedding's output ``y`` (a partial sum over tensor): under SP handed
        on unreduced (``PartialSum``), otherwise all-reduced (``g``)."""
        return PartialSum.wrap(y, self.ops.g) if self._partial_sums else self.ops.g(y)

    def _first_pre(self, module, args):
        """SP, the first unit: the embedding's partial sum it takes becomes this rank's chunk of the
        sum by one reduce-scatter (a partial sum already summed for another use: the sum, sliced
        by ``_unit_pre``)."""
        self._scattered = False
        x = args[0] if args else None
        if type(x) is not PartialSum:
            return None
        if x._sum is None:
            self._scattered = True
            return (self.ops.scatter_seq(x._plain), *args[1:])      # before the unit: not recomputed
        return (x.summed(), *args[1:])

    def _gathered(self, chunk: torch.Tensor) -> torch.Tensor:
        """SP, the last unit's output: the whole sequence, for the model's code after the stack;
        a root column that reads it (or what the final norm makes of it) reads its twin."""
        full = self.ops.unslice_seq(chunk)
        self._tails = {}
        if self._head_edge:         # the chunk and the gathered tensor are held until the twin is built
            self._tails[id(full)] = _Tail(weakref.ref(full), full._version, lambda: self.ops.regather(chunk, full))
        return full

    def _tail_post(self, module, args, kwargs, output):
        """A root leaf module with parameters (the final norm) that ran on the gathered stream (or a
        view of it): its output's twin is the module replayed on the input's twin."""
        if not self._tails or not isinstance(output, torch.Tensor):
            return None
        if args and isinstance(args[0], torch.Tensor):
            where: int | str = 0
        else:
            where = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
            if where is None:
                return None
        x = args[0] if where == 0 else kwargs[where]
        if self._tail_of(x) is None:
            return None
        rest = args[1:] if where == 0 else args
        others = {k: v for k, v in kwargs.items() if k != where}
        stream = weakref.ref(x)
        self._tails[id(output)] = _Tail(weakref.ref(output), output._version,
                                        lambda: self._replay(module, rest, others, where, stream()))
        return None

    def _tail_of(self, x: torch.Tensor) -> _Tail | None:
        """The tail ``x`` is, or is a view of, unchanged since it was made; None if none."""
        base = x
        t = self._tails.get(id(x))
        if t is None or t.ref() is not x:
            base = x._base
            t = self._tails.get(id(base)) if base is not None else None
            if t is None or t.ref() is not base:
                return None
        return t if base._version == t.version else None

    def _twin(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` (a tail or a view of one) with the same values, whose gradient reaches the last
        unit's chunk by a reduce-scatter: what a root column reads in place of ``x``."""
        t = self._tail_of(x)
        if t is None:
            return None
        if t.build is not None:
            build, t.build = t.build, None          # what it held is let go once built
            t.twin = build()
        twin, base = t.twin, t.ref()
        if twin is None or x is base:
            return twin
        if twin.shape != base.shape or twin.stride() != base.stride():
            return None
        return twin.as_strided(x.size(), x.stride(), twin.storage_offset() + x.storage_offset() - base.storage_offset())

    def _replay(self, mod: nn.Module, rest: tuple, others: dict, where: int | str,
                x: torch.Tensor | None) -> torch.Tensor | None:
        """``mod``'s forward again with its stream argument ``where`` (``x``; None: no longer held by
        anything) replaced by ``x``'s twin and the other arguments as they were, its parameters
        entering through one ``f`` (their gradients from the twin are partial sums over tensor)."""
        twin = self._twin(x) if x is not None else None
        if twin is None:
            return None
        args, kwargs = ((twin, *rest), others) if where == 0 else (rest, {**others, where: twin})
        own = [(a, p) for a, p in mod._parameters.items() if p is not None]
        if not any(p.requires_grad for _, p in own):
            return mod.forward(*args, **kwargs)
        flat = self.ops.param_f(torch.cat([p.reshape(-1) for _, p in own]))
        try:
            for (a, p), v in zip(own, flat.split([p.numel() for _, p in own])):
                mod._parameters[a] = v.view(p.shape)
            return mod.forward(*args, **kwargs)
        finally:
            mod._parameters.update(own)
