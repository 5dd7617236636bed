"""The tensor axis, derived from parameter specs: which modules run split, and how.

A parameter's spec fixes what its module consumes and produces (Megatron-LM's column/row
pairs, derived — nobody names a layer class):

============================  ==========================  ==========================================
weight spec                   module computes             boundary collectives (``t`` = tensor ranks)
============================  ==========================  ==========================================
Linear ``P("tensor", None)``  ``x @ W_iᵀ (+ b_i)``:       input replicated -> Megatron *f*: identity
(``column``)                  features split              forward, all-reduce backward (SP: all-gather
                                                          of the sequence, reduce-scatter backward)
Linear ``P(None, "tensor")``  ``x_i @ W_iᵀ``: a partial   output -> Megatron *g*: all-reduce forward,
(``row``)                     sum over ``tensor``         identity backward (SP: reduce-scatter of the
                                                          sequence, all-gather backward); the bias
                                                          (replicated) is added after the sum
Embedding ``P("tensor",       a masked lookup of the      output -> all-reduce (the ids a rank does
None)`` (``vocab``)           ids in this rank's range    not hold contribute zeros)
Linear ``P("tensor", None)``  logits split on the vocab   none: ``F.cross_entropy`` on them becomes
outside the layer stack, no   (the LM head)               vocab-parallel cross-entropy (2 all-reduces
row beside it (``logits``)                                of ``N`` and ``2N`` floats), never holding
                                                          the full logits
Conv1D ``P(None, "tensor")``  as a column Linear            as a column Linear (``transformers``'
/ ``P("tensor", None)``                                   ``Conv1D``: weight stored ``(in, out)``)
Linear ``P(Fused(3,           a column whose features     as a column; the bias ``P(Fused(3,
"tensor"), None)``, Conv1D    are ``parts`` blocks        "tensor"))`` follows
``P(None, Fused(3, ...))``    (``q|k|v``): this rank's
                              chunk of each, in order
stacked experts ``[E, out,    each expert's gate|up on    the rows and routing weights in through
in]``: gate|up ``P(.., Fused  its width slice, down a     *f*, the output out through *g* (outside
(2, "tensor"), None)``, down  partial sum (Megatron's     the expert axis's routing: the tokens'
``P(.., None, "tensor")``     tensor-parallel experts)    rows, not the routed ones)
(``experts``)
============================  ==========================  ==========================================

Between a column and the row that consumes its output, model code runs unchanged on the local
feature slice (heads are inferred from the local width, as ``view(..., -1, head_dim)`` and
``einops`` do), so a block costs 2 all-reduces forward and 2 backward, exactly Megatron's.
With ``sequence_parallel=True`` the residual stream inside the layer-stack units is split on the
sequence dim (batch-first: dim 1) between the split regions: each all-reduce becomes an
all-gather + reduce-scatter pair of the same total volume, and the parameters replicated over
``tensor`` that act on the split stream (LayerNorms, row biases) get partial gradients, summed
over ``tensor`` in backward. Where the stack meets the embedding and the LM head, SP sends
Megatron-LM's bytes (``comm/seq_edges.py``): a reduce-scatter of the embedding's partial sums where
nothing is added to them before the first block, and a reduce-scatter in place of the head's ``f``.

**Conv1D** (``transformers.pytorch_utils.Conv1D``, found by its class name and ``nf``/``nx``
attributes: transformers is never imported here) is a Linear with its weight stored transposed; its
forward views the output with the full ``nf``, so while split the runtime replaces it with one that
takes the width from the local weight (``comm/boundaries.py``), as it does a row Linear's.

**Fused columns.** ``Fused(parts, axis)`` on a column's out-features says the features are
``parts`` equal blocks (GPT-2's ``c_attn`` ``q|k|v``, Phi-3's ``qkv_proj`` and ``gate_up_proj``): each
rank holds its chunk of every block, so the unchanged module code that ``.split()``s or
``.chunk()``s the output gets this rank's q, k and v. Module code that slices by full-width
attributes gets *local attributes* while split (``LocalAttr``; installed by ``Boundaries``,
restored by ``remove()``), on the module holding a fused column only:

=================================================  ==============================================
attribute of the module holding the fused column   local value
=================================================  ==============================================
``split_size`` equal to the block width            this rank's chunk of a block (GPT-2's
                                                   ``c_attn(h).split(self.split_size, dim=2)``)
head counts ``num_heads``, ``num_attention_heads``,  the count / tensor size (heads split whole),
``n_heads``, their KV forms — its own, and its      its ``config`` replaced by a shallow copy
``config``'s (an attention module's)               holding them (Phi-3's ``config.num_attention_
                                                   heads * head_dim`` query width)
=================================================  ==============================================

A row's in-features may be fused too (CodeGen's ``out_proj``, ``P(None, Fused(4, "tensor"))``: its input
holds the heads of the 4 chunks its ``qkv_proj`` is cut in). Which layout a packed projection's forward
reads is not in its shape: ``packed.py`` names the known ones and refuses a split against them.

A fused ``q|k|v`` needs equal blocks: with fewer KV heads than query heads (grouped-query Phi-3)
the blocks differ and the projection is refused (keep it replicated). A per-head interleaved
projection (GPT-NeoX's ``query_key_value``: rows ``[head0: q k v][head1: q k v]...``) is a plain
column ``P("tensor", None)``: contiguous rows are whole heads. ``hf_tp.py`` holds the tables.

Everything here is data decided from the model's structure and the specs, before any process
runs; errors name the module, the parameter, its shape, the spec and the fix.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from functools import cached_property

from torch import nn

from ..algebra.qualnames import unit_of
from ..algebra.spec import Fused, PartitionSpec
from ..validate import is_int
from .packed import packed_problem, per_head_problems
from .experts import wrapper_factors
from .peft import adapted_layer, is_adapter, projection_dims, uses_axis

COLUMN, ROW, VOCAB, LOGITS, NORM, EXPERTS = "column", "row", "vocab", "logits", "norm", "experts"
_HEADS = ("n_heads", "num_heads", "num_attention_heads")
_KV_HEADS = ("n_kv_heads", "num_kv_heads", "num_key_value_heads")
_WIDTH_ATTRS = ("split_size",)
_WIDTHS = ("embed_dim", "hidden_size", "all_head_size")      # an attention's full q width, where it reshapes by it
_ATTENTION_MARKS = ("head_dim", "head_size", "num_key_value_groups")


@dataclass(frozen=True)
class Site:
    """A module that runs split over ``tensor``: its kind, the parameters it owns and the full
    width of its split dim (features of a column/logits Linear, in-features of a row Linear,
    vocabulary of an embedding)."""

    module: str
    kind: str
    weight: str
    bias: str | None
    width: int
    unit: str
    fused: int = 1          # a column's feature blocks (``Fused(parts, axis)``); 1: plain
    conv1d: bool = False    # transformers' Conv1D: weight (in, out)
    holder: str = ""        # the module holding the projection (its attention or MLP), through PEFT's wrappers

    @property
    def region(self) -> str:
        """Where sequence parallelism gathers the sequence for this site: the module holding it."""
        return self.holder or self.module.rpartition(".")[0]


@dataclass(frozen=True)
class LocalAttr:
    """An int attribute of ``module`` (``"config.x"``: of its ``config``) that counts ``full`` split
    elements: while split it holds this rank's ceil chunk of them."""

    module: str
    attr: str
    full: int


@dataclass(frozen=True)
class HeadArg:
    """A keyword argument of attention module ``module`` that holds one slice per head of ``heads`` (ALiBi's
    biases: BLOOM's ``alibi`` ``(batch x heads, 1, keys)``, MPT's ``position_bias`` ``(heads, 1, keys)``),
    computed by the model for all heads: while split the module gets this rank's heads' slices."""

    module: str
    arg: str
    heads: int


_HEAD_ARGS = ("alibi", "position_bias")


@dataclass(frozen=True)
class TensorPlan:
    """How the tensor axis lowers on one model: the split sites, sequence parallelism, and the
    modules whose tensor-replicated parameters act on the sequence-split stream (their gradients
    are summed over ``tensor`` where they are used)."""

    axis: str
    size: int
    sequence_parallel: bool
    sites: tuple[Site, ...]
    sp_modules: tuple[str, ...] = ()
    seq_dim: int = 1
    local_attrs: tuple[LocalAttr, ...] = ()
    # modules with tensor-replicated parameters that meet split values (``planner/varying.py``): their
    # gradients are partial sums, so the parameters enter through ``f`` as SP's do
    partial_modules: tuple[str, ...] = ()
    head_args: tuple[HeadArg, ...] = ()
    dims_from: str = ""          # where the specs' logical dims came from (explain)
    # derived f (planner/varying.py): modules whose output enters split regions through f (a value shared
    # by every head: MLA's rope key), and the columns that then read an already varying value (no f of theirs)
    output_f: tuple[str, ...] = ()
    no_f: tuple[str, ...] = ()
    # regions (attention, MLP) whose column input another region's column reads too (a parallel block's
    # attention and MLP off one norm): their columns share one f and run unfused (comm/column_async.py)
    shared_input: tuple[str, ...] = ()
    # LoRA factors of a 3-D weight split over tensor that are whole on every tensor rank (``planner/experts.py``:
    # ``tensor_adapters``): (their ParamWrapper, the parameter), entering the wrapper's forward through ``f``
    adapter_f: tuple[tuple[str, str], ...] = ()

    @property
    def sp_axis(self) -> str | None:
        """The axis sequence parallelism splits the residual stream over; None without it."""
        return self.axis if self.sequence_parallel and self.size > 1 else None

    @property
    def f_modules(self) -> tuple[str, ...]:
        """Modules whose tensor-replicated parameters enter their unit's forward through ``f``."""
        return self.sp_modules + tuple(m for m in self.partial_modules if m not in self.sp_modules)

    def site(self, module: str) -> Site | None:
        return self._by_module.get(module)

    @cached_property
    def _by_module(self) -> dict[str, Site]:
        return {s.module: s for s in self.sites}

    @property
    def has_logits(self) -> bool:
        return any(s.kind == LOGITS for s in self.sites)


def _fmt(spec: PartitionSpec) -> str:
    return repr(spec)


def derive(model: nn.Module, specs: dict[str, PartitionSpec], *, axis: str, size: int, units: list[str],
           sequence_parallel: bool) -> tuple[TensorPlan, list[str]]:
    """The tensor plan of ``model`` under ``specs`` and every problem found (empty: none).
    ``units``: the layer-stack units (a module outside all of them is in the root unit)."""
    problems: list[str] = []
    sites: list[Site] = []
    sp_modules: list[str] = []
    unit_set = set(units)
    projections: dict[str, list[str]] = {}     # parent module -> its split Linear weights, for messages
    modules = dict(model.named_modules())
    factors = wrapper_factors(model)
    for mname, mod in modules.items():
        own = [(a, p) for a, p in mod._parameters.items() if p is not None]
        if not own:
            continue
        qual = {a: f"{mname}.{a}" if mname else a for a, _ in own}
        split = {a: specs.get(qual[a], PartitionSpec()) for a, _ in own}
        split = {a: s for a, s in split.items() if uses_axis(s, axis)}
        unit = unit_of(mname, unit_set)
        if not split:
            if sequence_parallel and size > 1 and unit:
                sp_modules.append(mname)
            continue
        if mname in factors:          # a LoRA factor of a 3-D weight: laid out with it (planner/experts.py)
            continue
        where = f"{type(mod).__name__} {mname or '<root>'!r}"
        dims = projection_dims(mod)
        if dims is not None:
            site, found, described = _projection_site(mname, mod, dims, qual, split, specs, axis, unit)
            problems += found
            if described:
                projections.setdefault(_parent(mname), []).append(described)
            if site is not None:
                sites.append(site)
                if site.kind == ROW and sequence_parallel and size > 1 and unit and mod.bias is not None:
                    sp_modules.append(mname)
        elif _stacked(mod):
            site, found = _experts_site(mname, mod, qual, split, axis, unit, size)
            problems += found
            if site is not None:
                sites.append(site)
        elif isinstance(mod, nn.Embedding):
            w = split.get("weight")
            if w is not None and tuple(w) in ((axis,), (axis, None)):
                bad = [n for n in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(mod, n, None)]
                if bad:
                    problems.append(f"plan: {qual['weight']} {tuple(mod.weight.shape)} of {where} is vocab-split "
                                    f"{_fmt(w)} but the embedding uses {bad} — expected none of them (they need the "
                                    "whole table). Keep this embedding replicated.")
                    continue
                sites.append(Site(mname, VOCAB, qual["weight"], None, mod.num_embeddings, unit))
            else:
                problems.append(f"plan: {qual['weight']} {tuple(mod.weight.shape)} of {where} is "
                                f"{_fmt(w if w is not None else PartitionSpec())} — expected the vocabulary split "
                                f"(P({axis!r}, None)) or the table replicated; splitting the embedding dim leaves "
                                f"each rank a slice of the residual stream. Use P({axis!r}, None).")
        elif _rms_norm(mod) and set(split) == {"weight"} and tuple(split["weight"]) in ((axis,),):
            # an RMSNorm over a split width (OLMo-2's q_norm over all heads' q): its weight split with the
            # features, its statistics summed over tensor (comm/boundaries.py's _norm_forward)
            sites.append(Site(mname, NORM, qual["weight"], None, mod.weight.numel(), unit, holder=_parent(mname)))
        else:
            for a, s in split.items():
                problems.append(f"plan: {qual[a]} {tuple(mod._parameters[a].shape)} of {where} is {_fmt(s)}, but a "
                                f"{type(mod).__name__} cannot consume a parameter split on {axis!r} — only the weights "
                                "of nn.Linear and transformers' Conv1D (out- or in-features) and nn.Embedding "
                                f"(vocabulary), and a column's bias, can be split. Keep {qual[a]} replicated (P()); with "
                                "sequence_parallel=True a norm runs on sequence shards with its weights replicated.")
    for parent, weights in projections.items():
        problems += _head_problems(parent, modules[parent], size, axis, weights)
    problems += _layout_problems(sites, modules, specs, size, axis)
    local_attrs: list[LocalAttr] = []
    head_args: list[HeadArg] = []
    for site in sites:
        parent = _parent(site.module)
        if site.fused > 1 and site.kind == COLUMN:
            found, why = _fused_attrs(parent, modules[parent], site)
            if why:
                problems.append(f"plan: {site.weight} of {type(modules[site.module]).__name__} {site.module!r} is "
                                f"{_fmt(specs[site.weight])}: {why}")
        elif site.kind == COLUMN:
            found = _head_attrs(parent, modules[parent])
        else:
            continue
        local_attrs += [a for a in found if a not in local_attrs]
        heads = _count(modules[parent], _HEADS)
        if heads is not None:
            head_args += [h for h in _head_args(parent, modules[parent], heads) if h not in head_args]
    # a column whose output no row of the same parent consumes ends the model: the LM head
    row_parents = {_parent(s.module) for s in sites if s.kind == ROW}
    sites = [replace(s, kind=LOGITS)
             if s.kind == COLUMN and _parent(s.module) not in row_parents and not s.unit and not is_adapter(s.module)
             else s for s in sites]
    capped = [n for n in _routed_experts(modules, unit_set)
              if getattr(modules[_parent(n)], "capacity_factor", 0)] if sequence_parallel and size > 1 else []
    if capped:
        problems.append(f"plan: sequence_parallel=True with a capacity per expert ({', '.join(capped[:2])}"
                        f"{', ...' if len(capped) > 2 else ''}) is not supported yet: the capacity keeps each "
                        "expert's earliest tokens in the batch's order, and each tensor rank routes its own chunk of "
                        "the sequence — expected capacity_factor=0 (dropless) with sequence parallelism, or "
                        "sequence_parallel=False.")
    if sequence_parallel and size > 1 and not units:
        problems.append("plan: sequence_parallel=True splits the residual stream on the sequence dim inside the "
                        "layer stack — got a model with no layer-stack units (no nn.ModuleList of blocks, and "
                        "units= not given). Pass units=[...] naming the blocks, or sequence_parallel=False.")
    return TensorPlan(axis, size, bool(sequence_parallel), tuple(sites), tuple(sp_modules),
                      local_attrs=tuple(local_attrs), head_args=tuple(head_args)), problems


def _routed_experts(modules: dict[str, nn.Module], units: set[str]) -> list[str]:
    """The experts modules inside the layer stack's units: a 3-D weight ``[E, out, in]`` and a forward taking the
    routing ``(hidden_states, top_k_index, top_k_weights)`` (transformers 5's fused experts, the reference GPT's,
    a stacked list of experts)."""
    out = []
    for mname, mod in modules.items():
        if not unit_of(mname, units) or not any(p is not None and p.dim() == 3 for p in mod._parameters.values()):
            continue
        try:
            params = [p for p in inspect.signature(type(mod).forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            continue
        if len(params) >= 4:
            out.append(mname)
    return out


def _projection_site(mname: str, mod: nn.Module, dims: tuple[int, int, int, int], qual: dict[str, str],
                     split: dict[str, PartitionSpec], specs: dict[str, PartitionSpec], axis: str, unit: str
                     ) -> tuple[Site | None, list[str], str]:
    """The column or row site of projection ``mod`` (a Linear or a Conv1D: ``dims``) whose parameters ``split``
    uses ``axis``, the problems of its specs, and its weight described for the heads' messages ("" when
    its weight is not split)."""
    problems: list[str] = []
    described = ""
    where = f"{type(mod).__name__} {mname or '<root>'!r}"
    out_dim, in_dim, out_features, in_features = dims
    conv = out_dim == 1
    w = split.get("weight")
    wq = qual["weight"]
    wshape = tuple(mod.weight.shape)
    if w is None:
        problems.append(f"plan: {qual['bias']} {tuple(mod.bias.shape)} of {where} is split on {axis!r} by "
                        f"{_fmt(split['bias'])} while its weight is not — expected the bias split only with "
                        f"the weight's output features (weight {_fmt(_col_spec(conv, axis))}). Split the "
                        "weight too, or keep the bias replicated.")
        return None, problems, described
    entries = tuple(w) + (None,) * (2 - len(tuple(w)))
    col = _is(entries[out_dim], axis) and entries[in_dim] is None
    row = _is(entries[in_dim], axis) and entries[out_dim] is None     # Fused: blocks of the heads
    if not (col or row):
        problems.append(_combo(wq, wshape, w, axis, where, conv, in_dim, entries[in_dim]))
        return None, problems, described
    described = f"{wq} {wshape} {_fmt(w)}"
    bias_spec = specs.get(qual.get("bias", ""), PartitionSpec()) if mod.bias is not None else None
    if col:
        parts = entries[out_dim].parts if isinstance(entries[out_dim], Fused) else 1
        want = PartitionSpec(entries[out_dim])
        if bias_spec is not None and PartitionSpec(*tuple(bias_spec)[:1]) != want:
            problems.append(f"plan: {qual['bias']} {tuple(mod.bias.shape)} of {where} is {_fmt(bias_spec)} but "
                            f"its weight {wq} {wshape} is column-split {_fmt(w)}: each rank computes only its "
                            f"features, so it adds only their bias — expected the bias {_fmt(want)}. Add "
                            f"'{qual['bias']}': {_fmt(want)} (or the logical name of its dim) to the spec table.")
            return None, problems, described
        if parts > 1 and out_features % parts:
            problems.append(f"plan: {wq} {wshape} of {where} is {_fmt(w)}, but dim {out_dim} ({out_features} "
                            f"features) is not {parts} equal blocks — expected Fused parts dividing the "
                            f"width. Declare the blocks it holds, or split it plainly ({_fmt(_col_spec(conv, axis))}).")
            return None, problems, described
        return Site(mname, COLUMN, wq, qual.get("bias"), out_features, unit, parts, conv, _parent(mname)), problems, described
    else:
        if bias_spec is not None and uses_axis(bias_spec, axis):
            problems.append(f"plan: {qual['bias']} {tuple(mod.bias.shape)} of {where} is {_fmt(bias_spec)} but "
                            f"its weight {wq} {wshape} is row-split {_fmt(w)}: the output is a partial sum "
                            "over the full features, so the bias is added once, after the sum — expected "
                            f"the bias replicated, P(). Drop it from the spec table.")
            return None, problems, described
        parts = entries[in_dim].parts if isinstance(entries[in_dim], Fused) else 1
        if parts > 1 and in_features % parts:
            problems.append(f"plan: {wq} {wshape} of {where} is {_fmt(w)}, but dim {in_dim} ({in_features} "
                            f"features) is not {parts} equal blocks — expected Fused parts dividing the "
                            "width. Declare the blocks it holds, or split it plainly.")
            return None, problems, described
        return Site(mname, ROW, wq, qual.get("bias"), in_features, unit, parts, conv, _parent(mname)), problems, described


def _stacked(mod: nn.Module) -> bool:
    """A module holding experts as stacked 3-D weights ``[E, out, in]`` (transformers 5's fused ``*Experts``,
    ``models/moe.py``'s ``Experts``): every parameter of its own 3-D (biases ``[E, out]`` aside)."""
    own = [p for p in mod._parameters.values() if p is not None]
    return bool(own) and any(p.dim() == 3 for p in own) and all(p.dim() in (2, 3) for p in own)


def _experts_site(mname: str, mod: nn.Module, qual: dict[str, str], split: dict[str, PartitionSpec], axis: str,
                  unit: str, size: int) -> tuple[Site | None, list[str]]:
    """The experts site of ``mod`` (stacked 3-D weights ``[E, out, in]``, as ``F.linear`` takes each expert's
    slice) whose weights ``split`` use ``axis``: each expert's own width split as Megatron's tensor-parallel
    experts split it — the first projection a column (``out`` over ``axis``: gate|up as
    ``Fused(2, axis)``), the last a row (``in`` over ``axis``), so the module's output is a partial sum over
    ``axis`` (``g``) and its inputs, the rows and their routing weights, enter through ``f``. Any other
    split, a bias, or a forward not taking ``(hidden_states, top_k_index, top_k_weights)`` is refused."""
    where = f"{type(mod).__name__} {mname or '<root>'!r}"
    problems: list[str] = []
    own = {a: p for a, p in mod._parameters.items() if p is not None}
    cols, rows = [], []
    for a, p in own.items():
        spec = split.get(a)
        entries = tuple(spec) + (None,) * (p.dim() - len(tuple(spec))) if spec is not None else ()
        if p.dim() != 3 or spec is None:
            problems.append(f"plan: {qual[a]} {tuple(p.shape)} of {where} is "
                            f"{_fmt(spec if spec is not None else PartitionSpec())} while the experts' other weights "
                            f"split on {axis!r} — expected every 3-D expert weight split over {axis!r} (the first "
                            f"projection's out-features, the last's in-features) and no bias. Split it too, or keep "
                            f"all of {where}'s weights replicated over {axis!r}.")
        elif _is(entries[1], axis) and not uses_axis(PartitionSpec(entries[0], entries[2]), axis):
            cols.append(a)
        elif _is(entries[2], axis) and not uses_axis(PartitionSpec(entries[0], entries[1]), axis):
            rows.append(a)
        else:
            problems.append(f"plan: {qual[a]} {tuple(p.shape)} of {where} is {_fmt(spec)} — expected the expert "
                            f"weights [experts, out, in] split over {axis!r} on out (a column, P(.., {axis!r} or "
                            f"Fused(2, {axis!r}), None)) or on in (a row, P(.., None, {axis!r})).")
    if problems:
        return None, problems
    if not cols or not rows:
        problems.append(f"plan: {where}'s weights {', '.join(qual[a] for a in own)} split over {axis!r} only as "
                        f"{'columns' if cols else 'rows'} — expected a column (gate|up's out-features) and a row "
                        "(down's in-features), whose output the module sums over the axis.")
        return None, problems
    try:
        params = [p for p in inspect.signature(type(mod).forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if len(params) < 4:       # self, hidden_states, top_k_index, top_k_weights
        problems.append(f"plan: {where} holds experts split over {axis!r}, but its forward takes "
                        f"{[p.name for p in params[1:]]} — expected transformers' experts signature (hidden_states, "
                        "top_k_index, top_k_weights), whose rows and routing weights enter the split experts.")
        return None, problems
    width = own[cols[0]].shape[1]
    for a in cols + rows:
        dim = 1 if a in cols else 2
        n = own[a].shape[dim]
        entry = tuple(split[a])[dim]
        parts = entry.parts if isinstance(entry, Fused) else 1
        if n % (parts * size):
            problems.append(f"plan: {qual[a]} {tuple(own[a].shape)} of {where} is {_fmt(split[a])}: dim {dim} ({n}) "
                            f"does not split into {parts} block(s) over {axis}={size} — expected a width divisible "
                            f"by {parts * size}. Use a {axis} degree dividing the expert width.")
    return (None if problems else Site(mname, EXPERTS, qual[cols[0]], None, width, unit)), problems


def _layout_problems(sites: list[Site], modules: dict[str, nn.Module], specs: dict[str, PartitionSpec],
                     size: int, axis: str) -> list[str]:
    """Columns split against the layout their module's forward reads (``packed.PACKED``), and split
    attentions holding per-head parameters (``packed.per_head_problems``)."""
    out: list[str] = []
    split: dict[str, set[str]] = {}
    for s in sites:
        if s.kind not in (COLUMN, ROW) or is_adapter(s.module):
            continue
        parent, layer = _parent(s.module), adapted_layer(s.module)
        split.setdefault(parent, set()).add(layer)
        why = packed_problem(modules[parent], parent, layer.rpartition(".")[2], s.weight, _fmt(specs[s.weight]),
                             s.fused, _count(modules[parent], _HEADS), _count(modules[parent], _KV_HEADS), size,
                             axis, s.conv1d, s.kind == ROW)
        if why:
            out.append(why)
    for parent, layers in split.items():
        counts = {c for c in (_count(modules[parent], _HEADS), _count(modules[parent], _KV_HEADS)) if c}
        if counts:
            out += per_head_problems(parent, modules[parent], counts, layers, axis)
    return out


def _parent(name: str) -> str:
    """The module holding projection ``name``, seen through PEFT's wrapper: ``<layer>.base_layer`` and
    the adapters ``<layer>.lora_A.<adapter>`` are held by ``<layer>``'s parent, as ``<layer>`` was."""
    return adapted_layer(name).rpartition(".")[0]


def _combo(name: str, shape: tuple[int, ...], spec: PartitionSpec, axis: str, where: str, conv: bool,
           in_dim: int, in_entry) -> str:
    col, row = _col_spec(conv, axis), _col_spec(not conv, axis)
    extra = ""
    return (f"plan: {name} {shape} of {where} is {_fmt(spec)} — expected {_fmt(col)} (column: output "
            f"features split; P(..Fused(parts, {axis!r})..) in that place for parts equal blocks) or {_fmt(row)} "
            f"(row: input features split, plainly or in Fused blocks).{extra} Use one of them.")


def _col_spec(conv: bool, axis) -> PartitionSpec:
    """The column spec of a Linear (weight (out, in)) or a Conv1D (weight (in, out))."""
    return PartitionSpec(None, axis) if conv else PartitionSpec(axis, None)


def _is(entry, axis: str) -> bool:
    """``entry`` splits a dim over ``axis`` alone (plainly or fused)."""
    return entry == axis or (isinstance(entry, Fused) and tuple(entry) == (axis,))


def _fused_attrs(name: str, mod: nn.Module, site: Site) -> tuple[list[LocalAttr], str]:
    """The local attributes of ``mod``, the module holding the fused column ``site`` (see the
    module doc), and why its blocks cannot be split ("" when they can)."""
    block = site.width // site.fused
    out = [LocalAttr(name, a, block) for a in _WIDTH_ATTRS if getattr(mod, a, None) == block]
    heads, kv = _count(mod, _HEADS), _count(mod, _KV_HEADS)
    if site.fused == 3 and heads is not None and kv is not None and heads != kv:
        return [], (f"{site.fused} equal blocks of {block}, but {name or '<root>'!r} has {heads} query and {kv} KV "
                    f"heads, so its q|k|v blocks differ in width — expected equal blocks. Keep this projection "
                    "and its output projection replicated (P()), or split q, k and v as separate projections.")
    return out + _count_attrs(name, mod), ""


def _count_attrs(name: str, mod: nn.Module) -> list[LocalAttr]:
    """The head counts of attention module ``mod`` as local attributes: its own, and (an attention module's)
    its ``config``'s."""
    out = []
    for n in _HEADS + _KV_HEADS:
        v = getattr(mod, n, None)
        if is_int(v):
            out.append(LocalAttr(name, n, v))
    cfg = getattr(mod, "config", None)
    if cfg is not None and any(hasattr(mod, a) for a in _ATTENTION_MARKS):
        for n in _HEADS + _KV_HEADS:
            v = getattr(cfg, n, None)
            if is_int(v):
                out.append(LocalAttr(name, f"config.{n}", v))
    return out


def _head_attrs(name: str, mod: nn.Module) -> list[LocalAttr]:
    """The local attributes of an attention module ``mod`` holding plain column projections: its head
    counts (its own and its ``config``'s), and the widths equal to heads x head_dim that its code reshapes
    by (``embed_dim``, ``hidden_size``, ``all_head_size``: GPT-J, GPT-Neo, OPT, StableLM). Nothing for a
    module with no head count of its own (an MLP)."""
    heads = _count(mod, _HEADS)
    if heads is None:
        return []
    out = _count_attrs(name, mod)
    head_dim = getattr(mod, "head_dim", None) or getattr(mod, "head_size", None)
    if isinstance(head_dim, int) and head_dim > 0:
        for n in _WIDTHS:
            v = getattr(mod, n, None)
            if is_int(v) and v == heads * head_dim:
                out.append(LocalAttr(name, n, v))
    return out


def _rms_norm(mod: nn.Module) -> bool:
    """An RMSNorm (transformers' ``*RMSNorm``): a 1-D weight, no bias, an epsilon."""
    w = mod._parameters.get("weight")
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    return (type(mod).__name__.endswith("RMSNorm") and w is not None and w.dim() == 1
            and mod._parameters.get("bias") is None and isinstance(eps, float))


def _head_args(name: str, mod: nn.Module, heads: int) -> list[HeadArg]:
    """The per-head arguments (``_HEAD_ARGS``) attention module ``mod``'s forward takes."""
    try:
        params = inspect.signature(type(mod).forward).parameters
    except (TypeError, ValueError):
        return []
    return [HeadArg(name, a, heads) for a in _HEAD_ARGS if a in params]


def _count(mod: nn.Module, names: tuple[str, ...]) -> int | None:
    """A head count of ``mod``: its own attribute, else (for an attention module only: one that
    has a ``head_dim``, ``head_size`` or ``num_key_value_groups``) its ``config``'s. An MLP or a whole model
    holding the same ``config`` has no heads of its own."""
    for n in names:
        v = getattr(mod, n, None)
        if is_int(v):
            return v
    if not any(hasattr(mod, a) for a in _ATTENTION_MARKS):
        return None
    cfg = getattr(mod, "config", None)
    for n in names:
        v = getattr(cfg, n, None)
        if is_int(v):
            return v
    return None


def _head_problems(name: str, mod: nn.Module, size: int, axis: str, weights: list[str]) -> list[str]:
    """Attention heads must split whole over ``tensor``: a shard holding part of a head would
    compute a wrong softmax. Read off the module holding the split projections ``weights``
    (``n_heads``, ``num_heads``, ``num_attention_heads``, their KV forms, or its ``config``'s)."""
    out = []
    heads, kv = _count(mod, _HEADS), _count(mod, _KV_HEADS)
    where = name or "<root>"
    for what, n in (("attention heads", heads), ("KV heads", kv)):
        if n is not None and n % size:
            ok = [t for t in range(1, n + 1) if n % t == 0]
            out.append(f"plan: {type(mod).__name__} {where!r} has {n} {what}, which {axis}={size} ranks cannot split "
                       f"whole — got heads={heads}, kv_heads={kv}, projections {', '.join(weights)}; expected a "
                       f"{axis} degree dividing {n} (one of {ok}). Use such a {axis} degree, or keep the "
                       f"projections of {where} replicated (P()).")
    return out
