"""A PEFT model saved as users expect, from any layout: ``engine.save_pretrained(dir)`` on a
``peft.PeftModel`` writes the adapter folder, ``engine.save_pretrained(dir, merged=True)`` a plain
transformers folder with the adapters folded into the base weights.

**Adapters.** What ``peft_model.save_pretrained(dir)`` writes in one process, written by PEFT
itself on rank 0: ``adapter_config.json``, ``adapter_model.safetensors`` (full tensors under PEFT's
names, metadata ``{"format": "pt"}``) and its ``README.md`` model card. Which tensors those are is
PEFT's choice: ``get_peft_model_state_dict`` is asked on a state dict of shapes only (meta tensors,
no values: the ranks' placeholders are never read), and only what it picks — the adapters, never
the base weights — is assembled on rank 0, one parameter at a time from the ranks' boxes
(``pretrained.save.Sender``), then handed to ``PeftModel.save_pretrained(dir, state_dict=...)``.

**Merged.** ``W + scaling · (B @ A)`` per adapted ``Linear`` (transposed where ``fan_in_fan_out``:
GPT-2's ``Conv1D``), computed as PEFT's ``merge`` does, for every active adapter not merged
already, written under the base model's own names (no ``base_model.model.``, no ``.base_layer``,
no ``lora_*``) as ``model.save_pretrained`` of ``merge_and_unload()`` writes them: ``config.json``,
safetensors sharded above ``max_shard_size`` with its index. Rank 0 holds one base weight at a time
and its adapters. A weight's value comes from ``FloatSender.full``: a quantized base
weight (torchao ``Int8Tensor``, ``Int4Tensor``) is dequantized tensor shard by tensor shard on the ranks
holding it and its float boxes sent to rank 0 — so merged weights are floats, an integer ``dtype`` is
refused, and the folder's ``config.json`` carries no quantization config.

**A folder of another model** is refused before anything is written, on every rank (rank 0 looks,
one broadcast): an adapter save into a full model's folder or over another adapter's config (other
base model, PEFT type or target modules); a merged export over an adapter folder or a folder of
another architecture. Saving again over the same adapter (or model) is allowed.
"""

from __future__ import annotations

import copy
import json
import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...algebra.boxes import Box
from ...planner.peft import is_adapter, is_peft
from ...quant import formats
from ..checkpoint.core import from_rank_zero, gather_objects
from ..checkpoint.pieces import Piece, quant_shard, tensor_block
from ..checkpoint.files import CheckpointError
from .names import param_aliases, persistent_buffers, reverted, saved_names
from .files import CONFIG, INDEX, SAFE, OutFile, header_bytes, tidy
from .save import Sender, on_rank_zero

if TYPE_CHECKING:
    from ..training import TrainingState

ADAPTER_CONFIG, ADAPTER_SAFE = "adapter_config.json", "adapter_model.safetensors"
_SAVEABLE = (torch.float32, torch.float16, torch.bfloat16)
_AGAIN = "Save into another folder, or remove it first."


class FloatSender(Sender):
    """``Sender`` (full fp32 parameters on rank 0, one at a time, box by box) that also sends quantized
    weights: each rank holding one dequantizes its tensor shard (under ZeRO-3 rebuilt from the data
    group's pieces of its packed bytes first, ``checkpoint.quant_shard``), and the shards' boxes go to
    rank 0 as floats — one weight's shards at a time."""

    def __init__(self, training: TrainingState):
        super().__init__(training)
        self.quant = {s.name: s for s in training.states if s.plan.quant is not None}
        self.quant_owner: dict[str, list[tuple[int, Box]]] = {}
        mine = {}
        for n, st in self.quant.items():
            _, (_, start) = tensor_block(training, st)
            mine[n] = (start, tuple(st.plan.shape))
        for r, got in enumerate(gather_objects(training, mine)):
            for n, b in got.items():
                have = self.quant_owner.setdefault(n, [])
                if math.prod(b[1]) and all(b != x for _, x in have):
                    have.append((r, b))

    def full(self, name: str) -> torch.Tensor | None:
        """Parameter ``name``'s full value as fp32 on rank 0 (None elsewhere), dequantized if quantized.
        A collective."""
        if name not in self.quant_owner:
            return super().full(name)
        st = self.quant.get(name)
        if st is not None:
            f = formats.dequantize(quant_shard(self.training.mesh, self.training.plan, st)[0]).to(
                torch.float32).contiguous()
            shape, block = tensor_block(self.training, st)
            self.mine[name] = Piece(f"param/{name}", shape, block, tuple(st.plan.shape), 0, f.numel(), f.view(-1))
        self.owner[name] = self.quant_owner[name]
        try:
            return super().full(name)
        finally:
            self.mine.pop(name, None)


def refuse_quantized(training: TrainingState) -> None:
    """A model with quantized weights that is not a PEFT model cannot be written by
    ``pretrained.save_pretrained`` (its sender assembles float parameters only): refused by name."""
    names = [p.name for p in training.global_plan.params if p.quant is not None]
    if names:
        raise CheckpointError(
            f"save_pretrained: {type(training.model).__name__} holds {len(names)} quantized weight(s) (e.g. "
            f"{names[0]!r}) — expected float weights for a transformers folder. Wrap the model with "
            "peft.get_peft_model and save the adapter folder (or merged=True: a float model with the adapters "
            "folded in), or take engine.full_state_dict() (quantized weights dequantized).")


@torch.no_grad()
def save_peft(training: TrainingState, path: str | os.PathLike, *, merged: bool, max_shard_size: int | str,
              dtype: torch.dtype) -> Path:
    """The adapter folder (``merged=False``) or the merged plain model (see the module doc). A
    collective; a bad argument or folder is refused on every rank before anything is written."""
    model = training.model
    if not is_peft(model):
        raise CheckpointError(f"save_pretrained: merged=True folds PEFT adapters into their base weights — got a "
                              f"{type(model).__name__}, not a peft PeftModel; expected a model wrapped by "
                              "peft.get_peft_model. Call save_pretrained(path) without merged=True.")
    if dtype not in _SAVEABLE:
        kinds = sorted({p.quant.kind for p in training.global_plan.params if p.quant is not None})
        what = ("a merged export" + (f" of a quantized ({', '.join(kinds)}) base" if kinds else "")) if merged \
            else "a PEFT adapter"
        raise CheckpointError(f"save_pretrained: {what} to dtype {dtype} — merged weights and adapters are floats "
                              f"(an int8/int4 base is dequantized first); expected torch.float32, bfloat16 or "
                              "float16. Pass dtype=torch.bfloat16 (or torch.float32).")
    path = Path(path).absolute()
    layers = _lora_layers(model) if merged else {}          # refuses what cannot merge, on every rank
    problems = from_rank_zero(training, _folder_problems(model, path, merged) if training.mesh.rank == 0 else None)
    if problems:
        raise CheckpointError(problems, api="save_pretrained")
    if merged:
        return _save_merged(training, path, layers, max_shard_size, dtype)
    return _save_adapters(training, path, dtype)


# ---- the folder -----------------------------------------------------------------------------------

def _expected_config(model: nn.Module, adapter: str) -> dict:
    """The fields of ``adapter_config.json`` that name the adapter's model, as PEFT would write them."""
    cfg = model.peft_config[adapter]
    base = cfg.base_model_name_or_path or model.get_base_model().__dict__.get("name_or_path") or None
    targets = cfg.target_modules
    return {"peft_type": str(getattr(cfg.peft_type, "value", cfg.peft_type)), "base_model_name_or_path": base,
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets}


def _folder_problems(model: nn.Module, path: Path, merged: bool) -> list[str]:
    """Why ``path`` cannot take this save: it is a file, or holds another model's files."""
    if path.exists() and not path.is_dir():
        return [f"save_pretrained: {path} is a file — expected a folder. Pass a folder path."]
    if not path.is_dir():
        return []
    out = []
    if merged:
        adapter = [f for f in (ADAPTER_CONFIG, ADAPTER_SAFE) if (path / f).exists()]
        if adapter:
            out.append(f"save_pretrained: {path} holds a PEFT adapter ({', '.join(adapter)}) — expected an empty "
                       f"folder or an earlier merged export of this model (a plain transformers folder). {_AGAIN}")
        if (path / CONFIG).is_file():
            base = model.get_base_model()
            try:
                got = json.loads((path / CONFIG).read_text())
            except ValueError:
                got = {}
            want = (getattr(getattr(base, "config", None), "model_type", None), [type(base).__name__])
            if hasattr(getattr(base, "config", None), "model_type") and \
                    (got.get("model_type"), got.get("architectures")) != want:
                out.append(f"save_pretrained: {path} holds another model's {CONFIG} — got model_type "
                           f"{got.get('model_type')!r}, architectures {got.get('architectures')}; expected {want[0]!r}, "
                           f"{want[1]}. {_AGAIN}")
        return out
    full = [f for f in (CONFIG, SAFE, INDEX) if (path / f).exists()]
    if full:
        out.append(f"save_pretrained: {path} holds a full model's files ({', '.join(full)}) — expected an empty folder "
                   f"or an earlier save of this adapter. {_AGAIN}")
    for name in model.peft_config:
        file = (path if name == "default" else path / name) / ADAPTER_CONFIG
        if not file.is_file():
            continue
        try:
            got = json.loads(file.read_text())
        except ValueError:
            got = {}
        for field, want in _expected_config(model, name).items():
            theirs = got.get(field)
            theirs = sorted(theirs) if field == "target_modules" and isinstance(theirs, list) else theirs
            if theirs != want:
                out.append(f"save_pretrained: {file} is another adapter's — got {field} {theirs!r}; expected "
                           f"{want!r} (adapter {name!r} of this model). {_AGAIN}")
    return out


# ---- adapters -------------------------------------------------------------------------------------

def _adapter_names(training: TrainingState) -> list[str]:
    """The model's names of the tensors PEFT saves, each once, in PEFT's order: PEFT picks them from a
    state dict of shapes only (meta tensors)."""
    from peft import get_peft_model_state_dict

    model = training.model
    shapes = {p.name: tuple(p.shape) for p in training.global_plan.params}
    meta = {n: torch.empty(shapes[first], device="meta")
            for first, names in param_aliases(model).items() for n in names}
    meta.update({n: torch.empty(b.shape, dtype=b.dtype, device="meta")
                 for n, b in persistent_buffers(model).items()})
    name_of = {id(t): n for n, t in meta.items()}
    out: list[str] = []
    for adapter in model.peft_config:
        picked = get_peft_model_state_dict(model, state_dict=meta, adapter_name=adapter)
        out += [name_of[id(t)] for t in picked.values() if name_of[id(t)] not in out]
    return out


def _save_adapters(training: TrainingState, path: Path, dtype: torch.dtype) -> Path:
    model, rank0 = training.model, training.mesh.rank == 0
    first = {n: f for f, names in param_aliases(model).items() for n in names}
    buffers = persistent_buffers(model)
    # the base never leaves its ranks: only trainable pieces are read (a frozen adapter, if any, needs them all)
    sender = Sender(training, frozen=not all(s.trainable for s in training.states if is_adapter(s.name)))
    full = {}
    for n in _adapter_names(training):
        t = sender.full(first[n]) if n in first else buffers[n]
        if rank0:
            full[n] = t.to(dtype) if t.is_floating_point() else t
    return on_rank_zero(training, path, lambda: model.save_pretrained(str(path), state_dict=full))


# ---- merged ---------------------------------------------------------------------------------------

def _lora_layers(model: nn.Module) -> dict[str, tuple[nn.Module, list[str]]]:
    """Each adapted module of the base model (by its name there) and the adapters a merge folds into
    it (active, not merged already); what cannot be merged here refused at once, by name."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils.other import AuxiliaryTrainingWrapper

    out, problems = {}, []
    for name, mod in model.get_base_model().named_modules():
        if isinstance(mod, AuxiliaryTrainingWrapper):
            problems.append(f"save_pretrained: {name} is a {type(mod).__name__} (modules_to_save or trainable tokens) "
                            "— got a module a merged export does not fold; expected LoRA adapters on Linear layers "
                            "only. Save the adapter folder (merged=False), or merge in one process.")
            continue
        if not isinstance(mod, LoraLayer):
            continue
        adapters = [] if mod.disable_adapters else [a for a in mod.active_adapters
                                                    if a in mod.lora_A and a not in mod.merged_adapters]
        if not isinstance(mod, LoraLinear):
            problems.append(f"save_pretrained: {name} is a LoRA {type(mod).__name__} — expected LoRA on Linear (or "
                            "Conv1D) layers for a merged export. Save the adapter folder (merged=False).")
            continue
        odd = [a for a in adapters if a in mod.lora_variant or mod.lora_bias.get(a)]
        if odd:
            problems.append(f"save_pretrained: {name}'s adapter(s) {odd} use DoRA, a LoRA variant or lora_bias — "
                            "expected plain LoRA for a merged export (W + scaling·B·A). Save the adapter folder "
                            "(merged=False).")
            continue
        out[name] = (mod, adapters)
    if problems:
        raise CheckpointError(problems[:20], api="save_pretrained")
    return out


def _merged_names(base: nn.Module, layers: dict) -> list[tuple[str, str]]:
    """``(name in the file, base-model name)`` of the merged folder's tensors: an adapted layer's
    ``base_layer`` under the layer's own name, its adapters left out."""
    out = []
    for fname, src in saved_names(base):
        owner = next((m for m in layers if src.startswith(f"{m}.")), None)
        if owner is None:
            out.append((fname, src))
        elif src.startswith(f"{owner}.base_layer."):
            out.append((f"{owner}.{src[len(owner) + len('.base_layer.'):]}", src))
    return out


def _save_merged(training: TrainingState, path: Path, layers: dict, max_shard_size: int | str, dtype: torch.dtype) -> Path:
    from huggingface_hub import split_torch_state_dict_into_shards
    from huggingface_hub.serialization._base import parse_size_to_int

    model, rank0 = training.model, training.mesh.rank == 0
    base = model.get_base_model()
    prefix = next(n for n, m in model.named_modules() if m is base) + "."
    first = {n: f for f, names in param_aliases(model).items() for n in names}
    shapes = {p.name: tuple(p.shape) for p in training.global_plan.params}
    buffers = persistent_buffers(base)
    names = _merged_names(base, layers)
    kinds = {src: (shapes[first[prefix + src]], dtype) if prefix + src in first else
             (tuple(buffers[src].shape), dtype if buffers[src].is_floating_point() else buffers[src].dtype)
             for _, src in names}
    meta = {n: torch.empty(kinds[src][0], dtype=kinds[src][1], device="meta") for n, src in names}
    names, meta = reverted(base, names, meta)
    size = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=size)
    del meta
    hf = hasattr(getattr(base, "config", None), "save_pretrained")

    def configs() -> None:
        path.mkdir(parents=True, exist_ok=True)
        if hf:
            _plain_config(base, dtype).save_pretrained(path)
            can = getattr(base, "can_generate", None)
            if callable(can) and can() and getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(path)

    on_rank_zero(training, path, configs)
    failed = None
    merged_of = {f"{m}.base_layer.weight": m for m in layers}
    sender, src_of = FloatSender(training), dict(names)
    for fname, tensors in split.filename_to_tensors.items():
        head, offsets = header_bytes([(n, kinds[src_of[n]][1], kinds[src_of[n]][0]) for n in tensors])
        out = OutFile(path / f".{fname}.tmp-{uuid.uuid4().hex[:8]}", head) if rank0 and failed is None else None
        for n in sorted(tensors, key=lambda n: offsets[n]):
            src = src_of[n]
            if src in merged_of:
                t = _merge(sender, first, prefix, merged_of[src], *layers[merged_of[src]])
            else:
                t = sender.full(first[prefix + src]) if prefix + src in first else buffers[src]
            if out is not None and out.ok:
                out.write(len(head) + offsets[n], t.to(kinds[src][1]).contiguous().view(-1).view(torch.uint8)
                          .numpy().data)
            del t
        if out is not None:
            failed = out.install(path / fname)
    return on_rank_zero(training, path, lambda: tidy(
        path, split, sum(math.prod(kinds[src][0]) for _, src in names if src not in buffers), hf), failed)


def _plain_config(base: nn.Module, dtype: torch.dtype):
    """The base's config as ``save_pretrained`` writes it for the merged weights: the saved dtype, the
    class, and no quantization (merged weights are floats)."""
    cfg = copy.deepcopy(base.config)
    cfg.dtype = str(dtype).split(".")[1]
    cfg.architectures = [type(base).__name__]
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def _merge(sender: FloatSender, first: dict[str, str], prefix: str, layer: str, mod: nn.Module,
           adapters: list[str]) -> torch.Tensor | None:
    """The merged weight of adapted ``layer`` on rank 0: its base weight, then each adapter's
    ``scaling · (B @ A)`` (transposed where ``fan_in_fan_out``) added as PEFT's ``merge`` adds it."""
    w = sender.full(first[f"{prefix}{layer}.base_layer.weight"])
    for a in adapters:
        wa = sender.full(first[f"{prefix}{layer}.lora_A.{a}.weight"])
        wb = sender.full(first[f"{prefix}{layer}.lora_B.{a}.weight"])
        if w is not None:
            delta = wb @ wa
            w += (delta.T if mod.fan_in_fan_out else delta) * mod.scaling[a]
    return w
