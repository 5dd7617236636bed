"""Module boundaries of the tensor axis: where a producer's layout differs from what its consumer
needs, the redistribution runs here, autograd-aware, so Megatron's f/g and sequence
parallelism's all-gather/reduce-scatter pairs emerge from the parameter specs
(``planner/tensor.py`` derives the sites; this file lowers them onto the modules).

============================  =================================  ===================================
boundary                      forward                            backward
============================  =================================  ===================================
replicated -> column input    identity (``f``)                   all-reduce over tensor
seq-split -> split region     all-gather of the sequence         reduce-scatter of the sequence
  (the module holding the
  column projections)
row output (partial)          all-reduce (``g``)                 identity
  inside the layer stack, SP  reduce-scatter of the sequence     all-gather of the sequence
vocab-split embedding output  all-reduce                         identity
  straight into the first     reduce-scatter of the sequence     all-gather of the sequence
  unit, SP (Llama: no
  position table added)
first unit's input, SP        keep this rank's sequence chunk    all-gather of the sequence
  (unless reduce-scattered
  above)
last unit's output, SP        all-gather of the sequence         keep this rank's chunk
  read by a root column (the  (that all-gather, reused)          reduce-scatter of the sequence;
  LM head) through views and                                     the column runs no ``f``
  root norms
replicated param used on the  identity                           all-reduce over tensor (its
  seq-split stream (SP), or                                      gradient is a partial sum)
  by a root norm between the
  last unit and the LM head
============================  =================================  ===================================

SP's edges send Megatron-LM's bytes (``comm/seq_edges.py``): the vocab-split embedding's partial
sum is reduce-scattered where it enters the first unit untouched (where the model adds nothing to the
word embedding: Llama, not GPT-2's ``wte + wpe``, which all-reduces before the add, as Megatron
does); a root column (the LM head) reading the last unit's gathered output — through views, and a
final norm replayed on it — reads it through a reduce-scatter in backward and runs no ``f``.

Model code runs unchanged on local shards, with two helps where it reads full widths: a split
``Conv1D`` (transformers; weight ``(in, out)``) runs a forward that takes its output width from
the local weight (its own views the output with the full ``nf``), and the module holding a fused
column gets the plan's local attributes (``planner/tensor.py``: GPT-2's ``split_size``, head counts,
an attention's ``config`` as a shallow copy with local head counts) until ``remove()``. A column input is memoised per tensor: the q, k
and v projections of one attention read one input and cost one ``f`` (one all-reduce in
backward), as Megatron's fused QKV does. ``Ops`` executes the collectives; the planner's tracer
(``planner/trace.py``) gives the same hooks an ``Ops`` that records them instead, so what a step
runs and what the plan counts are one code path.
"""

from __future__ import annotations

import collections
import copy
import types
from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..algebra.qualnames import unit_of
from .boundary_ops import Ops
from .boundary_ops import token_dim, vocab_range
from .column_async import ColumnFusion, fusable
from .seq_edges import SeqEdges
from .sp_saved import RegionSaving, regather_applies


class Boundaries(SeqEdges):
    """Installs the boundary redistributions of a ``TensorPlan`` on ``model``'s modules; ``remove()``
    takes them off. ``on_logits(tensor, site)`` is called with each vocab-split logits output."""

    def __init__(self, model: nn.Module, tplan: Any, ops: Ops, units: list[str], *, on_logits=None,
                 partial: bool = False, recomputed: Collection[str] = ()):
        """``partial``: the model holds only some of the plan's modules (the planner's trace of a
        shortened layer stack): sites, units and SP modules it does not hold are skipped. ``recomputed``:
        the units recomputed whole (their SP regions save nothing to keep as chunks: ``comm/sp_saved.py``)."""
        self.model, self.tplan, self.ops = model, tplan, ops
        recomputed = frozenset(recomputed)
        self._saving: dict[int, RegionSaving] = {}       # id(region) -> its forward's saved-chunk hooks
        self._no_saving: set[int] = set()               # regions inside a unit recomputed whole
        self.on_logits = on_logits
        # id(input) -> [input, what the columns see: f of it (None while only fused layers took it)]
        self._memo: dict[int, list] = {}
        self.shared_regions: set[str] = set()      # found by a trace: TensorPlan.shared_input
        self._fusion = ColumnFusion(getattr(ops, "mesh", None), getattr(ops, "axes", None))   # None: a trace
        self._handles: list[Any] = []
        self._forwards: list[tuple[nn.Module, Any]] = []     # (module, the instance forward it had)
        modules = dict(model.named_modules())
        sp = tplan.sequence_parallel and tplan.size > 1
        sp_modules = set(tplan.f_modules)
        regions: list[str] = []
        if partial:
            units = [u for u in units if not u or u in modules]
        self._saved_attrs: list[tuple[nn.Module, str, Any]] = []
        self._local_attrs(modules, tplan.local_attrs, partial)
        for ha in tplan.head_args:     # ALiBi: this rank's heads' biases
            if not (partial and ha.module not in modules):
                self._handles.append(modules[ha.module].register_forward_pre_hook(self._head_arg_pre(ha),
                                                                                  with_kwargs=True))
        for name in tplan.output_f:        # derived f on a module's output (planner/varying.py)
            if not (partial and name not in modules):
                self._handles.append(modules[name].register_forward_hook(self._output_f))
        no_f = set(tplan.no_f)
        columns_in = collections.Counter(site.region for site in tplan.sites if site.kind == "column")
        for site in tplan.sites:
            if partial and site.module not in modules:
                continue
            mod = modules[site.module]
            in_sp = sp and bool(site.unit)
            if site.conv1d and site.kind in ("column", "logits"):
                self._override(mod, _conv_column_forward)
            region = site.region
            if in_sp and site.kind == "column" and region != site.unit and region.startswith(site.unit + "."):
                # SP: the sequence is gathered where the split region begins (the attention or MLP
                # module holding the column projections), so the region's own code sees the whole
                # sequence — a model that reshapes by its input's shape (``view(*input_shape, -1,
                # head_dim)``) reshapes the gathered stream. Its backward reduce-scatter also sums
                # the columns' partial input gradients: no f on the columns inside.
                if region not in regions:
                    regions.append(region)
                    self._handles.append(modules[region].register_forward_pre_hook(self._region_pre, with_kwargs=True))
                    self._handles.append(modules[region].register_forward_hook(self._region_post, always_call=True))
                    if unit_of(region, set(units)) in recomputed:       # its checkpoint keeps nothing of it
                        self._no_saving.add(id(modules[region]))
                continue
            if site.kind in ("column", "logits") and site.module in no_f:
                continue                 # its input already varies: its gradient is summed upstream
            if site.kind in ("column", "logits"):
                fuse = (site.kind == "column" and not in_sp and not site.conv1d and fusable(mod)
                        and columns_in[site.region] == 1 and self._fusion.mesh is not None
                        and site.region not in tplan.shared_input)
                if fuse:       # Megatron's async input-gradient all-reduce (column_async.py)
                    self._fusion.eligible.add(id(mod))
                    self._override(mod, _fused_column_forward(self._fusion))
                self._handles.append(mod.register_forward_pre_hook(self._column_pre(in_sp, fuse, region)))
                if site.kind == "logits":
                    self._handles.append(mod.register_forward_hook(self._logits_post(site)))
            elif site.kind == "row":
                self._override(mod, _row_forward(self, in_sp, site.module in sp_modules, site.conv1d))
            elif site.kind == "vocab":
                self._override(mod, _vocab_forward(self, site, in_sp))
            elif site.kind == "norm":
                self._override(mod, _norm_forward(self, site))
            elif site.kind == "experts":       # around the forward it has (the expert axis's routing, if any)
                self._override(mod, _experts_forward(self, mod.forward, in_sp))
        # SP: a unit's tensor-replicated parameters (norms, row biases) enter its forward through
        # one f over all of them, laid end to end: one all-reduce of their partial gradients per
        # unit in backward (Megatron sums these "sequence-parallel gradients" in one all-reduce too)
        self._sp_params: dict[str, list[tuple[nn.Module, str]]] = {}
        self._sp_values: dict[tuple[int, str], torch.Tensor] = {}
        factors = {param.rpartition(".")[0] for _, param in getattr(tplan, "adapter_f", ())}
        for name in tplan.f_modules:
            if (partial and name not in modules) or name in factors:     # (factors: at their wrapper, below)
                continue
            mod = modules[name]
            unit = unit_of(name, set(units))
            for a, p in mod._parameters.items():
                if p is not None and (tplan.site(name) is None or a == "bias"):
                    self._sp_params.setdefault(unit, []).append((mod, a))
            if tplan.site(name) is None:
                self._override(mod, _sp_param_forward(self, mod))
        # LoRA factors of a 3-D weight whose gradients are partial sums over tensor (whole beside a split weight,
        # or SP's): read by their ParamWrapper's forward (PEFT builds the weight's delta from them there), so
        # they enter that forward through the unit's f
        wrapped: dict[str, list[tuple[nn.Module, str]]] = {}
        for wrapper, param in getattr(tplan, "adapter_f", ()):
            if partial and wrapper not in modules:
                continue
            owner, _, attr = param.rpartition(".")
            self._sp_params.setdefault(unit_of(wrapper, set(units)), []).append((modules[owner], attr))
            wrapped.setdefault(wrapper, []).append((modules[owner], attr))
        for wrapper, held in wrapped.items():
            self._override(modules[wrapper], _sp_param_forward(self, modules[wrapper], held))
        # the layer stack's units, not those nested in one (ZeRO-3's experts unit inside its block): the block
        # is what runs, is recomputed, and begins and ends the sequence-split stream
        body = [u for u in units if u and not any(u.startswith(o + ".") for o in units if o)]
        for u in body:
            self._handles.append(modules[u].register_forward_pre_hook(self._unit_pre(u, sp and u == body[0])))
        for u in body:
            last_sp = sp and u == body[-1]
            self._handles.append(modules[u].register_forward_hook(self._unit_post(last_sp)))
        # SP's edges (comm/seq_edges.py): the root leaf modules with parameters (a final norm) are
        # watched for the gathered stream on its way to a root column
        unit_set = set(units)
        tails = [mod for name, mod in modules.items()
                 if name and not mod._modules and unit_of(name, unit_set) == "" and tplan.site(name) is None
                 and any(p is not None for p in mod._parameters.values())
                 and all(b is None for b in mod._buffers.values())]
        self._install_edges(modules[body[0]] if body else None, tails, partial_sums=sp and bool(body),
                            head=sp and bool(body) and any(s.kind in ("column", "logits") and not s.unit
                                                           for s in tplan.sites))

    # ---- hooks ---------------------------------------------------------------------------------
    def _column_pre(self, in_sp: bool, fuse: bool, region: str):
        def hook(module, args):
            if not args:
                return None
            x = args[0]
            hit = self._memo.get(id(x))
            if hit is None or hit[0] is not x:
                hit = self._memo[id(x)] = [x, None, region]
            elif hit[2] != region and self._fusion.mesh is None:   # a trace: two regions read one input
                self.shared_regions |= {hit[2], region}
            if fuse and not self._tails and hit[1] is None and self._fusion.runs_fused(module, x):
                return None              # its own backward all-reduces the input's gradient
            if fuse and hit[1] is not None:  # another column's f of this input (a parallel block): reuse it
                self._fusion.shared.add(id(hit[1]))
            if hit[1] is None:
                if in_sp:
                    hit[1] = self.ops.gather_seq(x)
                else:
                    twin = self._twin(x) if self._tails and x.requires_grad and torch.is_grad_enabled() else None
                    hit[1] = twin if twin is not None and twin.requires_grad else self.ops.f(x)
            return (hit[1], *args[1:])
        return hook

    def _region_pre(self, module, args, kwargs):
        """SP: gather the sequence of the region's stream input (its first tensor argument); while the region
        runs, what autograd saves of the gathered input is kept as the chunk (``comm/sp_saved.py``)."""
        if args and isinstance(args[0], torch.Tensor):
            full = self._gather_region(module, args[0])
            return (full, *args[1:]), kwargs
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                return args, {**kwargs, k: self._gather_region(module, v)}
        return None

    def _gather_region(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # (contiguous once here: the columns' matmuls view it whole, instead of each copying a permuted gather)
        full = self.ops.gather_seq(x).contiguous()
        if torch.is_grad_enabled() and id(module) not in self._no_saving and regather_applies(x, full):
            self._saving[id(module)] = RegionSaving(self.ops, x.detach(), full, token_dim(x, self.ops.seq_dim))
        return full

    def _region_post(self, module, args, output):
        saving = self._saving.pop(id(module), None)
        if saving is not None:
            saving.exit()

    def _output_f(self, module, args, output):
        if isinstance(output, torch.Tensor):
            return self.ops.f(output)
        return None

    def _head_arg_pre(self, ha):
        def hook(module, args, kwargs):
            t = kwargs.get(ha.arg)
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] % ha.heads:
                return None
            lo, hi = vocab_range(ha.heads, self.ops.size, self.ops.coord())
            local = t.reshape(-1, ha.heads, *t.shape[1:])[:, lo:hi].reshape(-1, *t.shape[1:])
            return args, {**kwargs, ha.arg: local}
        return hook

    def _logits_post(self, site):
        def hook(module, args, output):       # on_logits may replace the output (the planner's trace)
            return self.on_logits(output, site) if self.on_logits is not None else None
        return hook

    def _unit_pre(self, unit: str, first_sp: bool):
        def hook(module, args):
            self._memo.clear()
            self._fusion.shared.clear()
            out = None
            if first_sp and self._scattered:
                self._scattered = False
            elif first_sp and args and isinstance(args[0], torch.Tensor):
                out = (self.ops.slice_seq(args[0]), *args[1:])      # before the unit: not recomputed
            self.ops.unit = unit
            owned = self._sp_params.get(unit)
            self._sp_values.clear()
            if owned:
                params = [m._parameters[a] for m, a in owned]
                flat = self.ops.param_f(torch.cat([p.reshape(-1) for p in params]))
                for (m, a), p, v in zip(owned, params, flat.split([p.numel() for p in params])):
                    self._sp_values[(id(m), a)] = v.view(p.shape)
            return out
        return hook

    def _unit_post(self, last_sp: bool):
        def hook(module, args, output):
            self.ops.unit = ""
            self._sp_values.clear()
            if not last_sp:
                return None
            if isinstance(output, torch.Tensor):
                return self._gathered(output)
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (self._gathered(output[0]), *output[1:])
            return None
        return hook

    def unfuse_columns(self) -> None:
        """Every column layer takes ``f`` (``column_async.py``'s fused backward assumes it runs once:
        a split backward — torch's ``stage_backward_input`` then ``..._weight`` — runs it twice)."""
        self._fusion.eligible.clear()

    def sp_value(self, mod: nn.Module, attr: str) -> torch.Tensor:
        """The parameter as its unit's forward uses it under SP (a view of the unit's f)."""
        v = self._sp_values.get((id(mod), attr))
        return v if v is not None else self.ops.param_f(mod._parameters[attr])   # called outside its unit

    def clear(self) -> None:
        """Forget memoised inputs (end of a forward or backward)."""
        self._memo.clear()
        self._fusion.shared.clear()
        self._sp_values.clear()
        self._clear_edges()
        self.ops.unit = ""

    # ---- installing ----------------------------------------------------------------------------
    def _local_attrs(self, modules: dict[str, nn.Module], attrs, partial: bool) -> None:
        """Give the modules holding fused columns their local attributes (this rank's ceil chunk of
        each full count); ``config.x`` goes to a shallow copy of the module's config."""
        configs: dict[str, Any] = {}
        for la in attrs:
            if partial and la.module not in modules:
                continue
            mod = modules[la.module]
            lo, hi = vocab_range(la.full, self.ops.size, self.ops.coord())
            if la.attr.startswith("config."):
                cfg = configs.get(la.module)
                if cfg is None:
                    self._saved_attrs.append((mod, "config", mod.config))
                    cfg = configs[la.module] = copy.copy(mod.config)
                    mod.config = cfg
                setattr(cfg, la.attr[len("config."):], hi - lo)
            else:
                self._saved_attrs.append((mod, la.attr, getattr(mod, la.attr)))
                setattr(mod, la.attr, hi - lo)

    def _override(self, mod: nn.Module, fn) -> None:
        self._forwards.append((mod, mod.__dict__.get("forward")))     # an instance forward before: restored
        mod.forward = types.MethodType(fn, mod)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for mod, before in reversed(self._forwards):
            if before is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = before
        for mod, attr, value in reversed(self._saved_attrs):
            setattr(mod, attr, value)
        self._handles, self._forwards, self._saved_attrs = [], [], []
        self.clear()


def _fused_column_forward(fusion: ColumnFusion):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return fusion.forward(self, x)
    return forward


def _conv_column_forward(self, x):
    """transformers' ``Conv1D`` on a column shard: its own forward views the output with the full
    ``nf``; the width here is the local weight's."""
    return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.weight.shape[1])


def _row_forward(b: Boundaries, in_sp: bool, bias_partial: bool, conv1d: bool = False):
    def forward(self, x):
        if conv1d:                               # Conv1D: weight (in, out)
            y = (x.reshape(-1, x.shape[-1]) @ self.weight).view(*x.shape[:-1], self.weight.shape[1])
        else:
            y = F.linear(x, self.weight)
        y = b.ops.scatter_seq(y) if in_sp else b.ops.g(y)
        if self.bias is not None:
            y = y + (b.sp_value(self, "bias") if bias_partial else self.bias)
        return y
    return forward


def _vocab_forward(b: Boundaries, site, in_sp: bool):
    def forward(self, ids):
        lo, hi = vocab_range(site.width, b.ops.size, b.ops.coord())
        w = self.weight
        out_of_range = (ids < lo) | (ids >= hi)
        if w.shape[0] == 0:                      # an empty trailing shard holds no ids
            y = w.new_zeros((*ids.shape, w.shape[1])) + w.sum()
        else:
            pad = self.padding_idx
            pad = pad - lo if pad is not None and lo <= pad < hi else None
            y = F.embedding((ids - lo).masked_fill(out_of_range, 0), w, pad)
            y = y.masked_fill(out_of_range.unsqueeze(-1), 0)
        return b.ops.scatter_seq(y) if in_sp else b.partial_sum(y)
    return forward


def _norm_forward(b: Boundaries, site):
    """An RMSNorm over a width split over tensor (OLMo-2's ``q_norm``): this rank's features, scaled by the
    statistics of the whole width — the sum of squares all-reduced forward (``g``) and its gradient
    all-reduced backward (``f``: every rank's features depend on it) — equal to one process."""
    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        ss = b.ops.f(b.ops.g(h.pow(2).sum(-1, keepdim=True)))
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        h = h * torch.rsqrt(ss / site.width + eps)
        return (self.weight * h).to(dt)
    return forward


def _experts_forward(b: Boundaries, inner, in_sp: bool):
    """Experts whose own widths are split over tensor (Megatron's tensor-parallel experts: gate|up a column,
    down a row, ``planner/tensor.py``'s experts site): the rows and their routing weights enter through ``f``
    (their gradients, partial sums over tensor, all-reduced in backward), the output, a partial sum, leaves
    through ``g``. ``inner``: the forward the module had (on an expert axis: routed to this rank's experts and
    back, so ``g`` sums the tokens' rows, not the routed ones). Under sequence parallelism each tensor rank holds
    its chunk's rows: they, their routing and its weights are all-gathered over tensor (dim 0; the backward
    reduce-scatter sums the partial gradients) and the output is reduce-scattered back to the chunk (Megatron's
    expert-tensor-parallel all-gather dispatch)."""
    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if in_sp:
            return b.ops.scatter_seq(inner(b.ops.gather_seq(hidden_states, 0), b.ops.gather_seq(top_k_index, 0),
                                           b.ops.gather_seq(top_k_weights, 0), *args, **kwargs), 0)
        return b.ops.g(inner(b.ops.f(hidden_states), top_k_index, b.ops.f(top_k_weights), *args, **kwargs))
    return forward


def _sp_param_forward(b: Boundaries, mod: nn.Module, held: list[tuple[nn.Module, str]] | None = None):
    """A module with tensor-replicated parameters acting on the sequence-split stream: its
    parameters enter through ``f`` so their gradients (partial sums over the sequence chunks)
    are summed over tensor in backward. Around the forward it has: an experts module's is routed over the expert
    axis (``runtime/experts.route_experts``), each tensor rank routing its own chunk's tokens. ``held``: the
    parameters (of children) that do so instead of the module's own (a ParamWrapper's LoRA factors)."""
    own = mod.__dict__.get("forward")
    inner = own if own is not None else types.MethodType(type(mod).forward, mod)

    def forward(self, *args, **kwargs):
        params = held if held is not None else [(self, a) for a, p in self._parameters.items() if p is not None]
        saved = [(m, a, m._parameters[a]) for m, a in params]
        try:
            for m, a, _ in saved:
                m._parameters[a] = b.sp_value(m, a)
            return inner(*args, **kwargs)
        finally:
            for m, a, p in saved:
                m._parameters[a] = p
    return forward
