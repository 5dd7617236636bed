"""The model's tensor names against a transformers folder's: every name of a tied parameter, the
persistent buffers, transformers' checkpoint renamings (GPT-NeoX's ``embed_out`` is ``lm_head``)
applied on load and reverted on save, the MoE converters a load follows (each expert's tensors joined into
fused stacks), and the names ``save_pretrained`` keeps of tied weights.
Shared by ``pretrained.py`` (load), ``runtime/pretrained/save.py`` and ``runtime/pretrained/peft_export.py``."""

from __future__ import annotations

import re

import torch
from torch import nn

from ..checkpoint.files import CheckpointError
from .files import Entry


def _mapping(model: nn.Module) -> list:
    """transformers' conversion mapping of ``model``'s checkpoint keys (renamings and converters), as
    ``from_pretrained`` applies it; none for other models."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return list(get_model_conversion_mapping(model, add_legacy=True))


def _renamings(model: nn.Module) -> list:
    """transformers' renamings of checkpoint keys for ``model`` (GPT-NeoX's ``embed_out`` is ``lm_head``)."""
    try:
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return []
    return [c for c in _mapping(model) if isinstance(c, WeightRenaming)]


def expert_converters(model) -> list[tuple[str, list[str], int]]:
    """transformers' conversions of a MoE family's checkpoint experts into its fused stacks that a load can
    follow: ``(target suffix, source patterns, cat dim within an expert)`` for each ``WeightConverter`` whose
    operations are ``MergeModulelist(dim=0)`` then at most one ``Concatenate`` (Mixtral, Qwen2/3-MoE, OLMoE,
    DeepSeek-V3: each expert's ``w1``/``w3`` or ``gate_proj``/``up_proj`` into ``gate_up_proj``)."""
    out = []
    for c in _mapping(model):
        ops = getattr(c, "operations", None) or []
        names = [type(o).__name__ for o in ops]
        if type(c).__name__ != "WeightConverter" or len(c.target_patterns) != 1 or not names or \
                names[0] != "MergeModulelist" or ops[0].dim != 0 or names[1:] not in ([], ["Concatenate"]):
            continue
        cat = ops[1].dim - 1 if len(ops) > 1 else 0
        if cat < 0 or (len(c.source_patterns) > 1) != (len(ops) > 1):
            continue
        out.append((c.target_patterns[0].lstrip("."), [p.lstrip(".") for p in c.source_patterns], cat))
    return out


def conversion_hint(model, name: str) -> str | None:
    """Where transformers builds ``name`` on load by a conversion this load does not follow: what it does."""
    for c in _mapping(model):
        targets = [t.lstrip(".") for t in getattr(c, "target_patterns", [])]
        if type(c).__name__ == "WeightConverter" and any(name == t or name.endswith("." + t) for t in targets):
            return (f"transformers builds it on load from {c.source_patterns} by {c.operations}; this load follows "
                    "only each expert's tensors merged (MergeModulelist) and at most one Concatenate, with every "
                    "expert's tensors present. Build the model with from_pretrained in one process and hand it to "
                    "sl.parallelize (its values are the engine's), or complete the folder.")
    return None


def converted_rows(name: str, entries: dict[str, Entry], converters: list) -> tuple[list[list[str]], int] | None:
    """The folder's per-expert tensors a converter joins into ``name`` (``[expert][source]``), and the cat dim;
    None where no converter names it or the folder lacks them."""
    for target, sources, cat in converters:
        if not (name == target or name.endswith("." + target)):
            continue
        prefix = name[:len(name) - len(target)]
        found = []
        for src in sources:
            pat = re.compile(re.escape(prefix + src).replace(r"\*", r"(\d+)") + "$")
            hits = {int(m.group(1)): k for k in entries if (m := pat.match(k))}
            if not hits or sorted(hits) != list(range(len(hits))):
                return None
            found.append([hits[i] for i in range(len(hits))])
        if len({len(f) for f in found}) != 1:
            return None
        return [list(r) for r in zip(*found)], cat
    return None


def renamed(model: nn.Module, entries: dict[str, Entry]) -> dict[str, Entry]:
    """The file's tensors by the model's names (each still knows its name in the file)."""
    renamings, out = _renamings(model), {}
    for key, e in entries.items():
        for r in renamings:
            key, _ = r.rename_source_key(key)
        out.setdefault(key, e)
    return out


def reverted(model: nn.Module, names: list[tuple[str, str]], meta: dict[str, torch.Tensor]
              ) -> tuple[list[tuple[str, str]], dict[str, torch.Tensor]]:
    """The names transformers' ``save_pretrained`` writes (its renamings reverted, in its order); a conversion
    that does more than rename is refused (``converted`` handles it)."""
    out, meta_out, derived = converted(model, names, meta)
    if derived:
        raise CheckpointError(f"save_pretrained: transformers converts {type(model).__name__}'s weights on save "
                              "(not only renames them) — expected a model whose checkpoint names map one to one. "
                              "Save engine.full_state_dict() with model.save_pretrained in one process instead.")
    return out, meta_out


def converted(model: nn.Module, names: list[tuple[str, str]], meta: dict[str, torch.Tensor]
              ) -> tuple[list[tuple[str, str]], dict[str, torch.Tensor], dict[str, str]]:
    """``_converted``, then each stacked experts' weight (``planner/stacked.py``) written as its experts' own
    tensors (``experts.3.w1.weight``: row 3 of ``experts.w1_weight``), derived from it as a split is."""
    listed, out, derived = _converted(model, names, meta)
    from ...planner.stacked import per_expert_names
    stacks = per_expert_names(model)
    if not stacks:
        return listed, out, derived
    rows, meta_rows = [], {}
    for k, src in listed:
        if k in stacks and src == k:
            for i, n in enumerate(stacks[k]):
                rows.append((n, src))
                meta_rows[n] = out[k][i]
                derived[n] = k
        else:
            rows.append((k, src))
            meta_rows[k] = out[k]
    return rows, meta_rows, derived


def _converted(model: nn.Module, names: list[tuple[str, str]], meta: dict[str, torch.Tensor]
               ) -> tuple[list[tuple[str, str]], dict[str, torch.Tensor], dict[str, str]]:
    """The tensors transformers' ``save_pretrained`` writes: ``(name in the file, its source's plan name)`` in
    its order, their meta tensors, and ``{name in the file: the model's name of its source}`` for those a
    conversion derives from one source each (a MoE family's fused experts ``[E, 2I, H]`` written as each expert's
    ``w1``/``w3``: ``revert_weight_conversion`` of that source alone gives them). A tensor derived from several
    sources is refused by name."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return names, meta, {}
    if not isinstance(model, PreTrainedModel):
        return names, meta, {}
    src_of, by_id = dict(names), {id(t): n for n, t in meta.items()}
    out = revert_weight_conversion(model, dict(meta))
    derived: dict[str, str] = {}
    if any(id(t) not in by_id for t in out.values()):
        for n, t in meta.items():
            alone = revert_weight_conversion(model, {n: t})
            if not (len(alone) == 1 and id(next(iter(alone.values()))) == id(t)):
                derived.update((k, n) for k in alone)
        unknown = [k for k, t in out.items() if id(t) not in by_id and k not in derived]
        if unknown:
            raise CheckpointError(f"save_pretrained: transformers writes {type(model).__name__}'s {unknown[:3]} from "
                                  "several of its tensors at once — expected each written tensor converted from one "
                                  "(a renaming, or a fused tensor split). Save engine.full_state_dict() with "
                                  "model.save_pretrained in one process instead.")
    listed = [(k, src_of[derived[k]] if k in derived else src_of[by_id[id(t)]]) for k, t in out.items()]
    return listed, out, derived


def param_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter, keyed by its first (the plan's) name."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(first.setdefault(id(p), name), []).append(name)
    return out


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` names of the persistent buffers, in ``state_dict`` order (the first name of a shared one)."""
    out, seen = {}, set()
    for mname, mod in model.named_modules(remove_duplicate=False):
        for k, b in mod._buffers.items():
            if b is not None and k not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out[f"{mname}.{k}" if mname else k] = b
    return out


def saved_names(model: nn.Module) -> list[tuple[str, str]]:
    """``(name in the file, plan name or buffer name)`` in ``state_dict`` order, one name per tensor:
    of tied names transformers drops those its tied-weight keys match (as ``save_pretrained`` does)."""
    aliases = param_aliases(model)
    first = {n: f for f, names in aliases.items() for n in names}
    buffers = persistent_buffers(model)
    order = []
    for mname, mod in model.named_modules(remove_duplicate=False):
        for k, t in list(mod._parameters.items()) + [(k, b) for k, b in mod._buffers.items()
                                                     if k not in mod._non_persistent_buffers_set]:
            name = f"{mname}.{k}" if mname else k
            if t is not None and (name in first or name in buffers) and name not in order:
                order.append(name)
    try:
        from transformers.modeling_utils import _get_tied_weight_keys
        tied = list(_get_tied_weight_keys(model)) if hasattr(model, "config") else []
    except (ImportError, AttributeError, TypeError):
        tied = []
    drop = set()
    for f, names in aliases.items():
        names = [n for n in names if n in order]
        found = 0
        for n in sorted(names):
            if any(re.search(pat, n) for pat in tied):
                found += 1
                if found < len(names):
                    drop.add(n)
        keep = [n for n in names if n not in drop]
        drop.update(keep[1:])
    return [(n, first.get(n, n)) for n in order if n not in drop]
