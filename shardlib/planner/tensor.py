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
============================  ==========================  ==========================================

Between a column and the row that consumes its output, model code runs unchanged on the local
feature slice (heads are inferred from the local width, as ``view(..., -1, head_dim)`` and
``einops`` do), so a block costs 2 all-reduces forward and 2 backward, exactly Megatron's.
With ``sequence_parallel=True`` the residual stream inside the layer-stack units is split on the
sequence dim (batch-first: dim 1) between the split regions: each all-reduce becomes an
all-gather + reduce-scatter pair of the same total volume, and the parameters replicated over
``tensor`` that act on the split stream (LayerNorms, row biases) get partial gradients, summed
over ``tensor`` in backward.

Everything here is data decided from the model's structure and the specs, before any process
runs; errors name the module, the parameter, its shape, the spec and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch import nn

from ..algebra.spec import PartitionSpec

COLUMN, ROW, VOCAB, LOGITS = "column", "row", "vocab", "logits"
_HEADS = ("n_heads", "num_heads", "num_attention_heads")
_KV_HEADS = ("n_kv_heads", "num_kv_heads", "num_key_value_heads")


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

    def site(self, module: str) -> Site | None:
        return self._by_module.get(module)

    @cached_property
    def _by_module(self) -> dict[str, Site]:
        return {s.module: s for s in self.sites}

    @property
    def has_logits(self) -> bool:
        return any(s.kind == LOGITS for s in self.sites)


def _on(spec: PartitionSpec, dim: int, axis: str) -> bool:
    entries = tuple(spec)
    if dim >= len(entries) or entries[dim] is None:
        return False
    e = entries[dim]
    return axis in (e if isinstance(e, tuple) else (e,))


def _uses(spec: PartitionSpec, axis: str) -> bool:
    return any(_on(spec, d, axis) for d in range(len(tuple(spec))))


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
    for mname, mod in modules.items():
        own = [(a, p) for a, p in mod._parameters.items() if p is not None]
        if not own:
            continue
        qual = {a: f"{mname}.{a}" if mname else a for a, _ in own}
        split = {a: specs.get(qual[a], PartitionSpec()) for a, _ in own}
        split = {a: s for a, s in split.items() if _uses(s, axis)}
        unit = _unit(mname, unit_set)
        if not split:
            if sequence_parallel and size > 1 and unit:
                sp_modules.append(mname)
            continue
        where = f"{type(mod).__name__} {mname or '<root>'!r}"
        if isinstance(mod, nn.Linear):
            w = split.get("weight")
            wq = qual["weight"]
            wshape = tuple(mod.weight.shape)
            if w is None:
                problems.append(f"plan: {qual['bias']} {tuple(mod.bias.shape)} of {where} is split on {axis!r} by "
                                f"{_fmt(split['bias'])} while its weight is not — expected the bias split only with "
                                f"the weight's output features (weight P({axis!r}, None)). Split the weight too, or "
                                "keep the bias replicated.")
                continue
            col, row = _on(w, 0, axis), _on(w, 1, axis)
            bias_spec = specs.get(qual.get("bias", ""), PartitionSpec()) if mod.bias is not None else None
            if col and tuple(w) != (axis,) and tuple(w) != (axis, None):
                problems.append(_combo(wq, wshape, w, axis, where))
                continue
            if row and tuple(w) != (None, axis):
                problems.append(_combo(wq, wshape, w, axis, where))
                continue
            projections.setdefault(mname.rpartition(".")[0], []).append(f"{wq} {wshape} {_fmt(w)}")
            if col:
                if bias_spec is not None and not _on(bias_spec, 0, axis):
                    problems.append(f"plan: {qual['bias']} {tuple(mod.bias.shape)} of {where} is {_fmt(bias_spec)} but "
                                    f"its weight {wq} {wshape} is column-split {_fmt(w)}: each rank computes only its "
                                    f"features, so it adds only their bias — expected the bias P({axis!r}). Add "
                                    f"'{qual['bias']}': P({axis!r}) (or the logical name of its dim) to the spec table.")
                    continue
                sites.append(Site(mname, COLUMN, wq, qual.get("bias"), mod.out_features, unit))
            else:
                if bias_spec is not None and _uses(bias_spec, axis):
                    problems.append(f"plan: {qual['bias']} {tuple(mod.bias.shape)} of {where} is {_fmt(bias_spec)} but "
                                    f"its weight {wq} {wshape} is row-split {_fmt(w)}: the output is a partial sum "
                                    "over the full features, so the bias is added once, after the sum — expected "
                                    f"the bias replicated, P(). Drop it from the spec table.")
                    continue
                sites.append(Site(mname, ROW, wq, qual.get("bias"), mod.in_features, unit))
                if sequence_parallel and size > 1 and unit and mod.bias is not None:
                    sp_modules.append(mname)
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
        else:
            for a, s in split.items():
                problems.append(f"plan: {qual[a]} {tuple(mod._parameters[a].shape)} of {where} is {_fmt(s)}, but a "
                                f"{type(mod).__name__} cannot consume a parameter split on {axis!r} — only the weights "
                                "of nn.Linear (out- or in-features) and nn.Embedding (vocabulary), and a column "
                                f"Linear's bias, can be split. Keep {qual[a]} replicated (P()); with "
                                "sequence_parallel=True a norm runs on sequence shards with its weights replicated.")
    for parent, weights in projections.items():
        problems += _head_problems(parent, modules[parent], size, axis, weights)
    # a column whose output no row of the same parent consumes ends the model: the LM head
    row_parents = {s.module.rpartition(".")[0] for s in sites if s.kind == ROW}
    sites = [Site(s.module, LOGITS, s.weight, s.bias, s.width, s.unit)
             if s.kind == COLUMN and s.module.rpartition(".")[0] not in row_parents and not s.unit else s
             for s in sites]
    if sequence_parallel and size > 1 and not units:
        problems.append("plan: sequence_parallel=True splits the residual stream on the sequence dim inside the "
                        "layer stack — got a model with no layer-stack units (no nn.ModuleList of blocks, and "
                        "units= not given). Pass units=[...] naming the blocks, or sequence_parallel=False.")
    return TensorPlan(axis, size, bool(sequence_parallel), tuple(sites), tuple(sp_modules)), problems


def _unit(name: str, units: set[str]) -> str:
    """The unit containing module ``name`` (itself or an ancestor), ``""`` when none."""
    probe = name
    while probe:
        if probe in units:
            return probe
        probe = probe.rpartition(".")[0]
    return ""


def _combo(name: str, shape: tuple[int, ...], spec: PartitionSpec, axis: str, where: str) -> str:
    return (f"plan: {name} {shape} of {where} is {_fmt(spec)} — expected P({axis!r}, None) (column: output "
            f"features split) or P(None, {axis!r}) (row: input features split). Use one of them.")


def _count(mod: nn.Module, names: tuple[str, ...]) -> int | None:
    """A head count of ``mod``: its own attribute, else (for an attention module only: one that
    has a ``head_dim`` or ``num_key_value_groups``) its ``config``'s. An MLP or a whole model
    holding the same ``config`` has no heads of its own."""
    for n in names:
        v = getattr(mod, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    if not any(hasattr(mod, a) for a in ("head_dim", "num_key_value_groups")):
        return None
    cfg = getattr(mod, "config", None)
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
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
