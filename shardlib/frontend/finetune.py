"""Fine-tuning a transformers folder with LoRA adapters, over a frozen (optionally quantized) base:
the main job's ``lora`` and ``quant`` groups (``model=hf model.path=<folder> lora=r16 quant=int8``).

Two small frozen dataclasses carry the groups: ``AdapterConfig`` (``lora``: rank, alpha, dropout,
target modules — PEFT's ``LoraConfig`` fields) and ``QuantConfig`` (``quant``: ``int8``, torchao's
``Int8WeightOnlyConfig``, per-row scales; or ``int4``, the project's packed group-wise int4,
``shardlib.quant.quantize_int4_``). ``lora=none`` and ``quant=none`` (the defaults) are ``None``:
the run is the plain transformers job and neither peft nor torchao is imported.

The model is built in one order everywhere (``adapt``): the base with its layout table, every
``nn.Linear`` but the output head quantized (``sl.quantize``), then ``torch.manual_seed(train.seed)`` and
``peft.get_peft_model`` — so every rank draws the same adapters, and the layouts set on the base carry
over (the planner reads through PEFT's names). ``check`` (``frontend/run.py``) builds it on the meta
device and plans it, so a bad target, a quantization the layout cannot split or a missing folder is
named by config key before any process starts. With ``quant`` set each rank builds the same meta model
(``build``): ``sl.quantize`` marks the weights (no values), PEFT draws the adapters on the CPU as one
process does, the engine is made with ``init=False`` and ``engine.load_pretrained`` reads each rank's
float rows and quantizes them there — no rank ever holds the whole base. With ``lora`` alone the base
is read whole (``from_pretrained``) on every rank and the engine starts from its values. At the end the
job writes the adapter folder with ``engine.save_pretrained`` (what ``peft_model.save_pretrained`` writes).
"""

from __future__ import annotations

import difflib
import math
import re
import warnings

import torch
from torch import nn

from ..errors import ShardingError
from .config.checking import ConfigError, collapse
from .config.run_config import RunConfig
from .config.finetune import ALL_LINEAR, QuantConfig

# ---- building -----------------------------------------------------------------------------------

def build(run: RunConfig) -> nn.Module:
    """This rank's model with seeded adapters: with ``quant``, on the meta device, its base marked for
    quantizing while ``engine.load_pretrained`` reads it (``loads_base``); else the folder's values
    (``from_pretrained``, whole)."""
    from .hf import meta_model, pretrained_model
    return adapt(meta_model(run) if loads_base(run) else pretrained_model(run), run)


def loads_base(run: RunConfig) -> bool:
    """Whether the engine is made without values (``init=False``) and reads the folder into its shards
    (``engine.load_pretrained``): a plain transformers run, or LoRA over a quantized base."""
    return run.model.kind == "hf" and (run.lora is None or run.quant is not None)


def adapt(model: nn.Module, run: RunConfig) -> nn.Module:
    """``model`` (the base, its layout table set; real or on the meta device) quantized by ``run.quant``
    and wrapped by ``peft.get_peft_model`` with ``run.lora`` after seeding with ``train.seed``. A target
    that matches no module, or a quantization with nothing to quantize, is a ``ConfigError`` by key."""
    problems = target_problems(model, run)
    if problems:
        raise ConfigError(problems, api="config")
    if run.quant is not None:
        quantize(model, run.quant, run.model.path)
    from peft import get_peft_model
    torch.manual_seed(run.train.seed)        # every rank the same adapters
    try:
        with warnings.catch_warnings():      # PEFT's advice on merging a torchao base and its own Conv1D setting
            for noise in ("TorchaoLoraLinear was instantiated", "fan_in_fan_out is set to False",
                          "`is_gradient_checkpointing` is deprecated"):      # transformers' rename
                warnings.filterwarnings("ignore", message=noise)
            model = get_peft_model(model, run.lora.peft())
    except ValueError as e:                  # e.g. a target of a module type LoRA does not adapt
        raise ConfigError(f"lora.target_modules: {run.lora.target_modules!r} — PEFT refuses it ({_first(e)}); "
                          f"expected linear layers such as {', '.join(_linear_leaves(model)[:6])}.",
                          api="config") from None
    unread = sorted({n.split(".lora_")[0].removeprefix("base_model.model.") for n, p in model.named_parameters()
                     if p.requires_grad and p.is_meta})
    if unread and run.quant is not None:     # adapters beside a float base on the meta device: nothing draws them
        raise ConfigError(f"lora.target_modules: {run.lora.target_modules!r} adapts {', '.join(unread[:3])}"
                          f"{' ...' if len(unread) > 3 else ''}, which quant={run.quant.name} leaves in float "
                          "(the output head, or a layer the format cannot take) — expected adapters on the "
                          "quantized linear layers only (e.g. all-linear). Leave these out of lora.target_modules.",
                          api="config")
    return model


def quantize(model: nn.Module, quant: QuantConfig, path: str | None) -> None:
    """Quantize every ``nn.Linear`` of ``model`` but the output head (``sl.quantize``): in place on a real
    model, marked for ``engine.load_pretrained`` on the meta device."""
    from ..quant.api import quantize as mark
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and m is not head]
    if not names:
        kinds = sorted({type(m).__name__ for _, m in model.named_modules() if "Conv1D" in type(m).__name__})
        raise ConfigError(f"quant: quant={quant.name} quantizes nn.Linear layers, and the model in model.path={path} "
                          f"has none but its output head (its projections are {', '.join(kinds) or 'other modules'})"
                          " — expected a model of nn.Linear projections (Llama, Qwen2, Mistral, ...), or quant=none.",
                          api="config")
    if quant.method == "int4":
        _check_groups(model, names, quant.group_size)
    try:
        mark(model, quant.method, names,
             **({"group_size": quant.group_size} if quant.group_size else {}))
    except ShardingError as e:           # a weight tied to another module's, a shape the format cannot take
        fix = "Use another quant.method for this model (int8 takes any shape), or quant=none."
        raise ConfigError([f"quant: {p.replace('Leave it out of modules.', fix)}" for p in collapse(e.problems)],
                          api="config") from None


def _check_groups(model: nn.Module, names: list[str], group: int) -> None:
    """Each quantized layer's in-features must be whole groups: one problem for all that are not."""
    layers = dict(model.named_modules())
    bad: dict[int, list[str]] = {}
    for n in names:
        if layers[n].in_features % group:
            bad.setdefault(layers[n].in_features, []).append(n.rsplit(".", 1)[-1])
    if not bad:
        return
    width = math.gcd(*(layers[n].in_features for n in names))
    fits = [g for g in (128, 64, 32, 16, 8) if width % g == 0] or [width]
    raise ConfigError(f"quant.group_size: {group} does not divide the in-features of "
                      + " and ".join(f"{', '.join(dict.fromkeys(v))} ({k})" for k, v in sorted(bad.items()))
                      + f" — expected a divisor of every quantized layer's in-features. Use quant.group_size="
                      f"{fits[0]}" + (f" (or {', '.join(map(str, fits[1:]))})" if fits[1:] else "") + ".",
                      api="config")


def target_problems(model: nn.Module, run: RunConfig) -> list[str]:
    """Each of ``lora.target_modules`` that matches no module of ``model``, as PEFT matches them."""
    targets = run.lora.target_modules
    if targets == ALL_LINEAR:
        return []
    names = [n for n, _ in model.named_modules() if n]
    leaves = _linear_leaves(model)
    where = f"the model in model.path={run.model.path}"
    if isinstance(targets, str):
        if any(re.fullmatch(targets, n) for n in names):
            return []
        return [f"lora.target_modules: the pattern {targets!r} matches no module name of {where} (a single string is "
                f"a regular expression over full names, e.g. model.layers.0.self_attn.q_proj) — expected a list of "
                f"names such as [{', '.join(leaves[:4])}], or {ALL_LINEAR}."]
    out = []
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            near = difflib.get_close_matches(t, leaves, n=1)
            out.append(f"lora.target_modules: {t!r} matches no module of {where} — expected names of its linear "
                       f"layers ({', '.join(leaves)}) or {ALL_LINEAR}." + (f" Did you mean {near[0]}?" if near else ""))
    return out


def _linear_leaves(model: nn.Module) -> list[str]:
    """The last name components of the model's linear layers (``q_proj``, ``down_proj``...), in order."""
    seen: dict[str, None] = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            seen.setdefault(n.rsplit(".", 1)[-1], None)
    return list(seen)


def _first(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
