"""Which gradients are partial sums over the tensor axis, derived from the layouts (JAX's ``check_vma``).

A traced value *varies* over ``tensor`` when its cotangent on a rank is only that rank's share, which a
collective upstream sums: a split parameter's shard and everything computed from it, the output of
Megatron's ``f`` (its backward all-reduces), of sequence parallelism's gathers (a reduce-scatter in
backward), a sequence chunk. ``g`` (all-reduce forward, identity backward) and the vocab-split
embedding's sum make their outputs *invariant*: the same value and the same cotangent on every rank.

Where an invariant value that needs a gradient meets a varying one in an op, its cotangent on each rank
is a partial sum: JAX inserts ``pvary`` there (identity forward, ``psum`` backward). One forward of the
model on the meta device, with the tensor plan's boundaries installed and a ``TorchFunctionMode``
propagating the two states through every op, finds each such meeting:

=======================================  ========================================================
what meets a split value                 what the plan does
=======================================  ========================================================
a parameter replicated over ``tensor``   its module's parameters enter the forward through ``f``
(Qwen3's and Gemma-3's per-head          (one all-reduce of the unit's partial gradients in
``q_norm``/``k_norm`` inside split        backward, as sequence parallelism's norms do): in
attention), or a value computed from     ``TensorPlan.partial_modules``, ``comm_per_step`` and
parameters alone (Gemma's ``1 + w``)     ``explain``
a value from one module's output that     ``f`` on that module's output (``TensorPlan.output_f``); a
reached the split region without passing  column then reading a value that already varies runs no
a column layer (DeepSeek-V3 MLA's rope    ``f`` of its own (``no_f``); traced again until nothing new
key, from ``kv_a_proj_with_mqa``)         is found (``derive_f``)
any other value meeting a split one       refused by name (the module, the op, the shape)
=======================================  ========================================================

Under sequence parallelism every replicated parameter of a unit already enters through ``f`` and the
split regions begin at a gather, so nothing is found there; without it, this is what keeps a per-head
norm's copies equal across the tensor ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import ShardingError
from .peft import uses_axis
from .trace import RecordingOps, run_traced, short_stack, trace_values, uniform_stack

if TYPE_CHECKING:
    from .plan import Plan

_ACT = "<activation>"       # an origin: the value depends on the batch through a differentiable path
_OUT = "<output>"           # an origin: ``<output>name``, the output of module ``name``
# ops whose output holds no value of their input (its shape, dtype and device only)
_FRESH = frozenset(("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "zeros_like", "ones_like",
                    "empty_like", "full_like", "rand_like", "randn_like"))


def _inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__setitem__":
        return True
    return name.endswith("_") and not name.endswith("__")


class _Vma(TorchFunctionMode):
    """Propagates varying / invariant through torch ops and records where an invariant value that
    needs a gradient meets a varying one."""

    def __init__(self, names: dict[int, str], module_names: dict[int, str]):
        super().__init__()
        self.varying = WeakTensorKeyDictionary()
        self.origin = WeakTensorKeyDictionary()     # invariant value -> the parameters it derives from
        self.names, self.module_names = names, module_names
        self.stack: list[str] = []
        self.params: dict[str, str] = {}            # parameter -> where it first met a split value
        self.activations: dict[str, str] = {}       # where -> what
        self.outputs: dict[str, str] = {}           # module whose output needs f -> where it met a split value
        self.no_f: set[str] = set()                 # columns whose input already varies (no f of their own)

    def mark(self, t: torch.Tensor, varying: bool) -> torch.Tensor:
        if varying:
            self.varying[t] = True
        elif t in self.varying:
            del self.varying[t]
        return t

    def _origin(self, t: torch.Tensor) -> frozenset[str]:
        name = self.names.get(id(t))
        if name is not None:
            return frozenset((name,))
        got = self.origin.get(t)
        if got is not None:
            return got
        return frozenset((_ACT,)) if t.requires_grad else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        needs = [t.requires_grad for t in ins]         # before an in-place op makes its destination need one
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if _inplace(func) and args and isinstance(args[0], torch.Tensor):
            outs.append(args[0])
            if args[0]._base is not None:          # writing into a view writes into its base
                outs.append(args[0]._base)
        if getattr(func, "__name__", "") in _FRESH:
            return out
        if any(t in self.varying for t in ins):
            for t, need in zip(ins, needs):
                if t not in self.varying and need:
                    self._met(t, func)
            for o in outs:
                self.varying[o] = True
        else:
            origin = frozenset().union(*(self._origin(t) for t in ins)) if ins else frozenset()
            for o in outs:
                if o.requires_grad and id(o) not in self.names:
                    self.origin[o] = origin | self.origin.get(o, frozenset()) if _inplace(func) else origin
        return out

    def _met(self, t: torch.Tensor, func) -> None:
        where = self.stack[-1] if self.stack else "<root>"
        op = getattr(func, "__name__", repr(func))
        origin = self._origin(t)
        outputs = [o[len(_OUT):] for o in origin if o.startswith(_OUT)]
        if _ACT in origin or len(outputs) > 1:
            self.activations.setdefault(f"{where} ({op})", f"a value of shape {tuple(t.shape)}")
            return
        if outputs:          # one module's output: f on it (its gradient summed there), the rest follows
            self.outputs.setdefault(outputs[0], f"{where} ({op})")
            return
        for name in origin:
            self.params.setdefault(name, f"{where} ({op})")

    def push(self, module, args):
        self.stack.append(self.module_names.get(id(module), type(module).__name__))

    def pop(self, module, args, output):
        if self.stack:
            self.stack.pop()
        # a module's output is an activation: a value derived from parameters is treated as theirs only
        # inside the forward that uses them (Gemma's ``1 + weight``), where ``f`` on the module's own
        # parameters sums exactly their partial uses; past it the value may also reach a column's f
        name = self.module_names.get(id(module))
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t not in self.varying and id(t) not in self.names:
                self.origin[t] = frozenset((f"{_OUT}{name}",))


class VaryingOps(RecordingOps):
    """``RecordingOps`` whose outputs carry their state: ``f``, the gathers and chunks vary; ``g`` and
    the invariant gather do not. Each returns a fresh alias so the input keeps its own state."""

    def __init__(self, *args, vma: _Vma, **kwargs):
        super().__init__(*args, **kwargs)
        self.vma = vma

    def f(self, x):
        if x in self.vma.varying and self.vma.stack:     # a column reading a value that already varies
            self.vma.no_f.add(self.vma.stack[-1])
        return self.vma.mark(super().f(x).view_as(x), True)

    def g(self, y):
        return self.vma.mark(super().g(y).view_as(y), False)

    def gather_seq(self, x, dim=None):
        return self.vma.mark(super().gather_seq(x, dim), True)

    def scatter_seq(self, y, dim=None):
        return self.vma.mark(super().scatter_seq(y, dim), True)

    def slice_seq(self, x):
        return self.vma.mark(super().slice_seq(x), True)

    def unslice_seq(self, x):
        return self.vma.mark(super().unslice_seq(x), False)

    def regather(self, x, full):
        return self.vma.mark(super().regather(x, full), True)

    def param_f(self, p):
        return self.vma.mark(super().param_f(p).view_as(p), True)

    def full_logits(self, output, width):
        # vocab-parallel cross-entropy (runtime/vocab.py) sums over tensor: what it yields is invariant
        return self.vma.mark(super().full_logits(output, width), False)


@dataclass(frozen=True)
class Partials:
    """What one traced forward found: parameters replicated over ``tensor`` whose gradients are partial
    sums (name -> where they met a split value), modules whose output needs ``f`` (name -> where), columns
    reading a value that already varies, and activations that meet one unreduced (where -> what)."""

    params: dict[str, str]
    activations: dict[str, str]
    outputs: dict[str, str]
    no_f: frozenset[str]
    shared: frozenset[str] = frozenset()      # regions whose column input another region reads too


def find_partials(model: nn.Module, plan: Plan, batch: Any) -> Partials:
    """The partial gradients of ``plan``'s tensor plan on ``model`` (see the module doc), from one
    forward on the meta device (zero-filled CPU tensors where the model reads values); a uniform
    layer stack is traced as its first, second and last block, the second's findings standing for
    every middle block's."""
    stack = uniform_stack(model, plan)
    last: Exception | None = None
    for device in ("meta", "cpu"):
        try:
            if stack is not None:
                try:
                    with short_stack(model, stack):
                        found = _find(model, plan, batch, device, partial=True)
                    return _spread(found, stack)
                except Exception:       # the forward needs its whole stack
                    pass
            return _find(model, plan, batch, device)
        except (RuntimeError, NotImplementedError) as e:
            last = e
            if device == "cpu" or "meta" not in str(e):
                raise
    raise AssertionError(f"unreachable: {last}")


def _find(model: nn.Module, plan: Plan, batch: Any, device: str, *, partial: bool = False) -> Partials:
    tp = plan.tensor
    mb, values = trace_values(model, plan, batch, 0, device, partial=partial)
    modules = {id(m): n or "<root>" for n, m in model.named_modules()}
    split = {p.name for p in plan.params if p.name in values and uses_axis(p.spec, tp.axis)}
    vma = _Vma({id(v): n for n, v in values.items() if n not in split}, modules)
    for n in split:
        vma.mark(values[n], True)
    ops = VaryingOps(tp.axis, tp.size, 0, tp.seq_dim, set(), vma=vma)
    pre = nn.modules.module.register_module_forward_pre_hook(vma.push)
    post = nn.modules.module.register_module_forward_hook(vma.pop)
    try:
        with vma:
            shared = run_traced(model, plan, mb, values, ops, partial=partial)
    finally:
        pre.remove()
        post.remove()
    return Partials(dict(vma.params), dict(vma.activations), dict(vma.outputs), frozenset(vma.no_f),
                    frozenset(shared))


def _spread(found: Partials, stack: tuple[str, list[str]]) -> Partials:
    """The short stack's findings for the whole stack: the second block's repeated for the middle ones."""
    name, keys = stack
    prefix = f"{name}." if name else ""
    middle = f"{prefix}{keys[1]}."

    def spread(d: dict[str, str]) -> dict[str, str]:
        out = dict(d)
        for k, v in d.items():
            if k.startswith(middle):
                for key in keys[2:-1]:
                    out[f"{prefix}{key}.{k[len(middle):]}"] = v.replace(middle, f"{prefix}{key}.")
        return out

    def spread_names(names) -> set[str]:
        out = set(names)
        for k in names:
            if k.startswith(middle):
                out |= {f"{prefix}{key}.{k[len(middle):]}" for key in keys[2:-1]}
        return out
    return Partials(spread(found.params), spread(found.activations), spread(found.outputs),
                    frozenset(spread_names(found.no_f)), frozenset(spread_names(found.shared)))


def partial_modules(model: nn.Module, plan: Plan, found: Partials) -> tuple[str, ...]:
    """The modules owning ``found``'s parameters (each parameter's first owner), in model order;
    raises naming every activation that meets a split value unreduced."""
    if found.activations:
        raise ShardingError([
            f"plan: {what} computed in {where} meets values split over {plan.tensor.axis!r} without having "
            "passed a column layer, so each rank's gradient of it would be a partial sum that nothing reduces "
            "— expected every value entering a split region to pass a column projection (Megatron's f). Keep "
            f"the projections of {where.split(' ')[0]!r} replicated (P()), split the projection that computes it "
            "as a column too, or use sequence_parallel=True (its region gather sums it)."
            for where, what in sorted(found.activations.items())], api="plan")
    owner: dict[str, str] = {}
    for mname, mod in model.named_modules():
        for a, p in mod._parameters.items():
            if p is not None:
                owner.setdefault(f"{mname}.{a}" if mname else a, mname)
    wanted = {owner[n] for n in found.params if n in owner}
    return tuple(m for m, _ in model.named_modules() if m in wanted)


def derive_f(model: nn.Module, plan: Plan, batch: Any, rounds: int = 4) -> Plan:
    """``plan`` with its tensor plan's derived ``f``s: modules whose output meets split values unreduced get
    ``f`` on their output (``output_f``: DeepSeek-V3 MLA's ``kv_a_proj_with_mqa``, whose rope slice is shared by
    every head), the columns then reading an already varying value run none (``no_f``), and the replicated
    parameters that meet split values enter through ``f`` (``partial_modules``). Traced until nothing new is
    found; an activation that meets a split value with no single module output to put ``f`` on is refused."""
    from dataclasses import replace
    tp = plan.tensor
    for _ in range(rounds):
        found = find_partials(model, replace(plan, tensor=tp), batch)
        outputs = tuple(m for m in found.outputs if m not in tp.output_f)
        no_f = tuple(sorted(found.no_f - set(tp.no_f)))
        if not outputs and not no_f:
            break
        tp = replace(tp, output_f=tp.output_f + outputs, no_f=tp.no_f + no_f)
    partial = partial_modules(model, replace(plan, tensor=tp), found)
    shared = tuple(m for m, _ in model.named_modules() if m in found.shared)
    return replace(plan, tensor=replace(tp, partial_modules=partial, shared_input=shared))
