"""PEFT models on the mesh: names seen through PEFT's wrappers, adapters laid out from their base.

``peft.get_peft_model(model, LoraConfig(...))`` wraps the model (``base_model.model.<name>``) and each
adapted layer (``<layer>.base_layer`` is the original module, ``<layer>.lora_A.<adapter>`` and
``<layer>.lora_B.<adapter>`` the adapters). Nothing here imports peft: a model is a PEFT model by its
``peft_config`` and ``base_model`` attributes, an adapter parameter by its name.

**Names are transparent.** Spec tables written against the base model keep matching after wrapping:
a parameter is matched under its own name and under its *base name*, the name with ``.base_layer``
dropped (and, for tables on the PEFT model itself, the leading ``base_model.model.``). A table set on
the base model before wrapping is found where the base model now sits. Adapter parameters never match
a table: their layouts follow their base weight.

**An adapter is a layout of its base** (W ``[out, in]``, A ``[r, in]``, B ``[out, r]``; PEFT's
``tp_layer.py`` and vLLM's scheme, ``../shared/ANCHORS.md`` §7):

==============================  ======================  ======================  ===========================
base weight                     lora_A                  lora_B                  collectives (tensor)
==============================  ======================  ======================  ===========================
column ``P(t, None)`` (or       replicated ``P()``      ``P(t, None)`` (its     *f* at B's input: B's input
``Fused(k, t)``; Conv1D                                 out entry, fused too)   gradient is summed, so A's
``P(None, t)``)                                                                 gradient is whole
row ``P(None, t)`` (Conv1D      ``P(None, t)``          replicated ``P()``      *g* at A's output: an all-
``P(t, None)``)                                                                 reduce of ``r`` features
replicated                      replicated              replicated              none
==============================  ======================  ======================  ===========================

The base output and the adapter output are then both split (column) or both whole (row) where PEFT
adds them. A row base costs one extra all-reduce of ``tokens x r`` per adapted layer (r ≪ features);
splitting A on ``r`` instead (S-LoRA) would trade it for an all-gather of the same size.

Only LoRA is planned: another PEFT method (prefix tuning, IA3, ...) is refused by name, as are DoRA on a
split base and LoRA on a module the tensor axis splits but an adapter cannot follow (a vocab-split
embedding). On a replicated base every adapter is replicated and any LoRA variant runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from torch import nn

from ..algebra.spec import PartitionSpec

_ADAPTER = re.compile(r"^(?P<layer>.*)\.(?P<part>lora_A|lora_B)\.(?P<adapter>[^.]+)\.(?P<attr>weight|bias)$")
_OTHER_ADAPTER = re.compile(r"(^|\.)(lora_embedding_A|lora_embedding_B|lora_magnitude_vector|"
                            r"lora_[A-Za-z_]+)(\.|$)")
BASE_LAYER = ".base_layer"
ROOT = "base_model.model."


def is_peft(model: nn.Module) -> bool:
    """``model`` is a PEFT model (``peft.PeftModel``): it has a ``peft_config`` and a ``base_model``."""
    return isinstance(getattr(model, "peft_config", None), dict) and isinstance(getattr(model, "base_model", None),
                                                                                 nn.Module)


def peft_base(model: nn.Module) -> tuple[nn.Module, str]:
    """``(the transformers model a PEFT model wraps, the prefix of its names)``; ``(model, "")`` for
    any other model. PEFT's LoRA forward is the base model's: its layers hold the adapters."""
    if is_peft(model):
        inner = getattr(model.base_model, "model", None)
        if isinstance(inner, nn.Module):
            return inner, ROOT
    return model, ""


def base_name(name: str, root: bool = False) -> str:
    """``name`` seen through PEFT's wrappers: ``.base_layer`` dropped, and with ``root`` (a name relative
    to the PEFT model itself) the leading ``base_model.model.``."""
    if root and name.startswith(ROOT):
        name = name[len(ROOT):]
    return name.replace(BASE_LAYER + ".", ".") if BASE_LAYER in name else name


def adapted_layer(module: str) -> str:
    """The PEFT layer a module belongs to: ``<layer>`` for ``<layer>.base_layer`` and
    ``<layer>.lora_A.<adapter>``; ``module`` itself otherwise."""
    if module.endswith(BASE_LAYER):
        return module[:-len(BASE_LAYER)]
    i = module.find(".lora_")
    return module[:i] if i >= 0 else module


def param_wrappers(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """``(wrapper name, wrapper, its weight's name)`` of each PEFT ``ParamWrapper`` in ``model`` (LoRA of a
    parameter, ``LoraConfig(target_parameters=...)``: the routed experts' 3-D weights), the weight named where
    the wrapped module holds it."""
    name_of = {id(m): n for n, m in model.named_modules()}
    for name, m in model.named_modules():
        pname = getattr(m, "parameter_name", None)
        if pname is None or not hasattr(m, "lora_A") or not hasattr(m, "get_base_layer"):
            continue
        base = name_of.get(id(m.get_base_layer()))
        if base is not None:
            yield name, m, f"{base}.{pname}" if base else pname


def is_adapter(name: str) -> bool:
    """``name`` is a parameter PEFT added (``lora_A``/``lora_B``/other ``lora_*`` tensors)."""
    return bool(_OTHER_ADAPTER.search(name))


def adapter_specs(model: nn.Module, specs: dict[str, PartitionSpec], axis: str, size: int = 2
                  ) -> tuple[dict[str, PartitionSpec], list[str]]:
    """``specs`` with every LoRA adapter parameter laid out from its base weight (the module doc's
    table), and the problems found: adapters that cannot follow their base (on a ``tensor`` axis of
    ``size`` > 1: at size 1 nothing is split)."""
    if not is_peft(model):
        return specs, []
    problems = method_problems(model)
    out = dict(specs)
    modules = dict(model.named_modules())
    for name in specs:
        if not is_adapter(name):
            continue
        m = _ADAPTER.match(name)
        layer = name[:name.index(".lora_")] if ".lora_" in name else name.rpartition(".")[0]
        base = modules.get(f"{layer}{BASE_LAYER}")
        base_w = f"{layer}{BASE_LAYER}.weight"
        wspec = specs.get(base_w, PartitionSpec())
        if not uses_axis(wspec, axis) or size == 1:
            out[name] = PartitionSpec()
            continue
        where = f"plan: adapter {name} of {type(modules.get(layer)).__name__} {layer!r}"
        dims = projection_dims(base)
        if "lora_magnitude_vector" in name:
            problems.append(f"{where}: DoRA (use_dora=True) on a base split {wspec} on {axis!r} — expected plain "
                            "LoRA there: DoRA's magnitude needs each base row's full norm, which a split base does "
                            f"not hold. Set use_dora=False, or keep {base_w} replicated.")
            continue
        if m is None or dims is None:
            kind = type(base).__name__ if base is not None else "module"
            problems.append(f"{where}: its base {base_w} ({kind}) is split {wspec} on {axis!r}, and an adapter of a "
                            f"{kind} cannot follow that split — expected LoRA on nn.Linear or transformers' Conv1D "
                            f"layers only where the base is split. Keep {base_w} replicated (drop it from the spec "
                            "table), or leave this module out of LoraConfig(target_modules=...).")
            continue
        out_dim, in_dim = dims[:2]
        entries = tuple(wspec) + (None,) * (2 - len(tuple(wspec)))
        out_e, in_e = entries[out_dim], entries[in_dim]
        if m["part"] == "lora_B":                      # [out, r] (bias [out])
            out[name] = PartitionSpec(out_e, None) if m["attr"] == "weight" and out_e is not None else (
                PartitionSpec(out_e) if out_e is not None else PartitionSpec())
        else:                                          # lora_A [r, in]
            out[name] = PartitionSpec(None, in_e) if m["attr"] == "weight" and in_e is not None else PartitionSpec()
    return out, problems


def method_problems(model: nn.Module) -> list[str]:
    """PEFT methods and options the planner cannot lay out, by name."""
    out = []
    for adapter, cfg in getattr(model, "peft_config", {}).items():
        method = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", type(cfg).__name__)))
        if method.upper() != "LORA":
            out.append(f"plan: the PEFT adapter {adapter!r} is {method} ({type(cfg).__name__}) — expected LoRA "
                       "(peft.LoraConfig): only LoRA adapters are laid out on the mesh. Use LoraConfig, or merge "
                       "this adapter into the base model first.")
    return out


def uses_axis(spec: PartitionSpec, axis: str) -> bool:
    """Some dim of ``spec`` is split over ``axis`` (alone or with others, plainly or fused)."""
    for e in tuple(spec):
        if e is not None and axis in (tuple(e) if not isinstance(e, str) else (e,)):
            return True
    return False


def projection_dims(mod: nn.Module | None) -> tuple[int, int, int, int] | None:
    """``(out dim, in dim, out features, in features)`` of the weight of an ``nn.Linear`` or of
    transformers' ``Conv1D`` (by class name and its ``nf``/``nx``: weight ``(nx, nf)``); None otherwise."""
    if isinstance(mod, nn.Linear):
        return 0, 1, mod.out_features, mod.in_features
    w = mod._parameters.get("weight") if mod is not None else None
    nf, nx = getattr(mod, "nf", None), getattr(mod, "nx", None)
    if (type(mod).__name__ == "Conv1D" and isinstance(nf, int) and isinstance(nx, int) and w is not None
            and tuple(w.shape) == (nx, nf)):
        return 1, 0, nf, nx
    return None
