"""The ``lora`` and ``quant`` config groups of the main job: what they hold and how they are read, by
config key (``finetune.py`` builds the model from them)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checking import Checker


METHODS = ("int8", "int4", "nf4")
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterConfig:
    """``lora``: PEFT LoRA adapters of rank ``r`` scaled by ``alpha / r`` on ``target_modules`` (a list
    of module names, matched as PEFT matches them — the name or its last components; one string, a
    regular expression over the full names; or ``all-linear``, every linear layer but the output head)."""

    name: str
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = ALL_LINEAR

    def peft(self):
        from peft import LoraConfig
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          task_type="CAUSAL_LM")


@dataclass(frozen=True)
class QuantConfig:
    """``quant``: the frozen base's linear weights as ``int8`` (per-row scales, torchao), ``int4`` (two
    values a byte, a scale and zero point per ``group_size`` in-features) or ``nf4`` (QLoRA's 4-bit
    NormalFloat, torchao's ``NF4Tensor``: a scale per 64 values, the scales double-quantized)."""

    name: str
    method: str
    group_size: int | None = None


def adapter_config(raw: Any, problems: list[str]) -> AdapterConfig | None:
    """The ``lora`` group (``None`` for ``lora=none``), every bad key noted in ``problems``."""
    if raw is None or (isinstance(raw, Mapping) and raw.get("name") == "none" and set(raw) == {"name"}):
        return None
    c = Checker("lora", raw, problems, ("name", "r", "alpha", "dropout", "target_modules"))
    dropout = c.number("dropout", 0.0)
    if dropout is not None and dropout >= 1:
        c.bad("dropout", dropout, "a probability in [0, 1)")
    targets = c.get("target_modules", ALL_LINEAR)
    if isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets):
        targets = tuple(targets)
    elif not (isinstance(targets, str) and targets):
        c.bad("target_modules", targets, f"{ALL_LINEAR!r}, a list of module names (e.g. [q_proj, v_proj]) or "
                                         "one regular expression over the full module names")
        targets = ALL_LINEAR
    return AdapterConfig(name=c.str("name", "lora"), r=c.int("r", 8), alpha=c.number("alpha", 16.0, strict=True),
                         dropout=dropout if dropout is not None and dropout < 1 else 0.0, target_modules=targets)


def quant_config(raw: Any, problems: list[str]) -> QuantConfig | None:
    """The ``quant`` group (``None`` for ``quant=none``), every bad key noted in ``problems``."""
    if raw is None or (isinstance(raw, Mapping) and raw.get("name") == "none" and set(raw) == {"name"}):
        return None
    c = Checker("quant", raw, problems, ("name", "method", "group_size"))
    method = c.get("method")
    if method not in METHODS:
        near = difflib.get_close_matches(str(method), METHODS, n=1)
        problems.append(f"quant.method: {method!r} is unknown — expected one of {', '.join(METHODS)} (quant=int8: "
                        f"torchao's Int8WeightOnlyConfig; quant=int4: packed group-wise int4)."
                        + (f" Did you mean quant.method={near[0]}?" if near else ""))
        method = "int8"
    group = c.int("group_size", None, optional=True)
    if method == "int4" and group is None:
        c.bad("group_size", None, "an int >= 1 for quant.method=int4 (in-features per scale and zero point, e.g. 32)")
    elif method == "int4" and group % 2:
        c.bad("group_size", group, "an even int (two 4-bit codes share a byte), e.g. 32")
    if method in ("int8", "nf4") and group is not None:
        why = "one scale per output row" if method == "int8" else "blocks of 64 values"
        problems.append(f"quant.group_size: {group} is not used by quant.method={method} ({why}) — "
                        "remove it, or use quant=int4.")
    return QuantConfig(name=c.str("name", "quant"), method=method, group_size=group)


def cross_problems(lora: AdapterConfig | None, quant: QuantConfig | None, model: Any) -> list[str]:
    """What the groups need of each other and of the model, by config key."""
    out = []
    for key, cfg in (("lora", lora), ("quant", quant)):
        if cfg is not None and model.kind != "hf":
            out.append(f"{key}: {key}={cfg.name} fine-tunes a transformers folder — got model={model.name} (the "
                       f"reference GPT); expected model=hf model.path=<folder>, or {key}=none.")
    if quant is not None and lora is None:
        out.append(f"quant: quant={quant.name} freezes the base in {quant.method}, and with lora=none nothing would "
                   "train — expected adapters to train over it (e.g. lora=r16), or quant=none.")
    return out
