"""Pretrained weights straight into the shards, and back out: ``engine.load_pretrained(path)`` and
``engine.save_pretrained(path)`` on transformers folders (``config.json`` + safetensors).

This module loads; ``runtime/pretrained/empty.py`` builds the empty states a load fills, ``runtime/pretrained/save.py``
saves, ``runtime/pretrained/names.py`` matches the model's names with the folder's and ``runtime/pretrained/files.py``
reads and writes the files.

**Load.** Every rank reads the safetensors headers (no tensor data) and checks, before writing any
value: the architecture in ``config.json``, every parameter and persistent buffer present (under
any of its tied names), its shape, a floating dtype, and every file whole (a tensor's bytes inside
the file). The ranks agree on the verdict in one gather (ranks of different nodes may see
different files): a rank raises its own problem, the others name it and refuse too.
Then each rank reads only its pieces — the boxes ``checkpoint.pieces.rank_pieces`` gives in global
coordinates — through ``safe_open(...).get_slice(name)[rows]``, cast to fp32 as it is copied in.
A read holds its bytes about three times (the file's mapped pages, safetensors' buffer, the tensor
it returns), so each spans at most a quarter of the largest tensor (and 64 MB), the file reopened
per read so its mapped pages are let go: a load holds at most ~3/4 of the largest tensor beyond the
rank's states (the RSS high-water mark, measured in tests/runtime/test_pretrained.py on data 2 x tensor 2
ZeRO-3 and, building included, in tests/runtime/test_pretrained_memory.py on pipe 2 and data 2 ZeRO-3).
transformers' checkpoint renamings (GPT-NeoX's ``embed_out`` for ``lm_head``) apply both ways.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...algebra.boxes import Box
from ...planner.stacked import per_expert_names
from ...planner.peft import base_name, is_adapter, is_peft, peft_base
from ..checkpoint.core import gather_objects
from ..checkpoint.files import CheckpointError
from ..checkpoint.pieces import rank_pieces
from .files import CONFIG, DTYPES, FLOATS, RELOAD, Entry, read_folder
from .names import conversion_hint, converted_rows, expert_converters, param_aliases, persistent_buffers, renamed
from .quantized import fill, quantized_shard
from .names import reverted as reverted
from .names import saved_names as saved_names
from .save import Sender as Sender
from .save import save_pretrained as save_pretrained
from .save import whole_index

if TYPE_CHECKING:
    from ..training import TrainingState

_CHUNK = 64 << 20            # bytes: the most one read spans in a file


def _check(training: TrainingState, path: Path, config: dict | None, entries: dict[str, Entry], strict: bool
           ) -> tuple[dict[str, str], dict[str, str]]:
    """Every problem with the folder for this model, raised at once; else the file name of each
    parameter (by plan name) and of each persistent buffer found."""
    model, problems = training.model, []
    base = peft_base(model)[0]
    mconf = getattr(base, "config", None)
    if config is not None and mconf is not None and hasattr(mconf, "model_type"):
        arch, want = config.get("architectures") or [], type(base).__name__
        if config.get("model_type") != mconf.model_type or (arch and want not in arch):
            problems.append(f"load_pretrained: {path} holds a {config.get('model_type')!r} model ({', '.join(arch)}) "
                            f"— expected {mconf.model_type!r} ({want}). Load the folder of this architecture, or "
                            "build the model from this folder's config.")
    elif config is None and mconf is not None and hasattr(mconf, "model_type") and path.is_dir():
        problems.append(f"load_pretrained: {path} has no {CONFIG} — expected a transformers folder for "
                        f"{type(model).__name__}. Write it with save_pretrained.")
    params: dict[str, str] = {}
    shapes = {p.name: tuple(p.shape) for p in training.global_plan.params}
    stacks = per_expert_names(model)
    quantized = {p.name for p in training.global_plan.params if p.quant is not None}
    peft = is_peft(model)
    converters, sources = expert_converters(base), set()
    for first, names in param_aliases(model).items():
        if peft and is_adapter(first):          # PEFT's adapters: not in a base folder, initialized by PEFT
            continue
        if peft:
            names = [folder_name(n) for n in names]
        found = next((n for n in names if n in entries), None)
        experts = [folder_name(n) for n in stacks.get(first, [])] if peft else stacks.get(first, [])
        if found is None and experts and all(n in entries for n in experts):
            # stacked experts (planner/stacked.py) from a folder of the list's: each expert's own tensor
            entries[names[0]] = _stacked_entry([[n] for n in experts], entries)
            problems += [p for n in experts for p in _entry_problems(path, n, entries[n], shapes[first][1:], None)]
            params[first] = names[0]
            continue
        converted = converted_rows(names[0], entries, converters) if found is None else None
        if converted is not None:
            # fused experts from a folder of each expert's own tensors, as transformers converts them on load
            rows, cat = converted
            sources.update(n for r in rows for n in r)
            entries[names[0]] = _stacked_entry(rows, entries, cat)
            problems += [p for r in rows for n in r
                         for p in _entry_problems(path, n, entries[n], tuple(entries[n].shape), None,
                                                  quantized=first in quantized)]
            problems += _entry_problems(path, names[0], entries[names[0]], shapes[first], None)
            params[first] = names[0]
            continue
        if found is None:
            problems.append(f"load_pretrained: {path} holds no tensor {first!r}"
                            + (f" (nor its tied names {names[1:]})" if len(names) > 1 else "")
                            + f" — expected every parameter of {type(model).__name__}. "
                            + (conversion_hint(base, names[0]) or RELOAD))
            continue
        params[first] = found
        problems += _entry_problems(path, found, entries[found], shapes[first], None,
                                    quantized=first in quantized)
        if first not in quantized and (q := _quantized_in_folder(found, entries)):
            problems.append(f"load_pretrained: {path} holds {found!r} quantized ({q}) — expected a float tensor "
                            f"for {type(model).__name__}'s float weight. Mark the weights the folder holds "
                            "quantized with sl.quantize(meta_model, 'nf4' | 'int4' | 'int8', modules=[...]) "
                            "and load a folder of float weights (load_pretrained quantizes them on each rank).")
    buffers: dict[str, str] = {}
    for name, b in persistent_buffers(model).items():
        fname = folder_name(name) if peft else name
        if fname in entries:
            buffers[name] = fname
            problems += _entry_problems(path, fname, entries[fname], tuple(b.shape), b.dtype)
        elif training.needs_load and name in training.awaited:     # zeroed by init=False: a load must fill it
            problems.append(f"load_pretrained: {path} holds no buffer {name!r} — expected every persistent buffer "
                            f"of a model built without values (init=False). {RELOAD}")
    if strict:
        known = {folder_name(n) if peft else n for names in param_aliases(model).values() for n in names} | \
            {folder_name(n) if peft else n for n in persistent_buffers(model)} | \
            {folder_name(n) if peft else n for names in stacks.values() for n in names} | sources
        ignore = [re.compile(p) for p in getattr(peft_base(model)[0], "_keys_to_ignore_on_load_unexpected", None)
                  or []]
        nonpersistent = {n for n, _ in model.named_buffers()}
        extra = [k for k in entries if k not in known and k not in nonpersistent
                 and not any(p.search(k) for p in ignore)]
        if extra:
            problems.append(f"load_pretrained: {path} holds {len(extra)} tensor(s) {type(model).__name__} does not "
                            f"have — got {sorted(extra)[:6]}; expected only the model's parameters and buffers. Load "
                            "the folder of this exact model (same config), or pass strict=False to ignore them.")
    if problems:
        raise CheckpointError(problems[:20], api="load_pretrained")
    return params, buffers


@dataclass(frozen=True)
class StackedEntry:
    """A stacked experts' weight read from its experts' own tensors in a folder: ``rows[e]`` expert ``e``'s
    tensors, joined along ``cat`` (transformers' fused gate|up ``[E, 2I, H]`` from each expert's ``w1`` and
    ``w3``: its ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)`` on load)."""

    rows: tuple
    shape: tuple[int, ...]
    dtype: str
    cat: int = 0

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        """``index`` of the stacked tensor: its rows' slices, each from its own tensors."""
        from safetensors import safe_open
        first, rest = index[0], index[1:]
        out = []
        for parts in self.rows[first]:
            got = []
            for e in parts:
                with safe_open(str(e.file), framework="pt") as f:
                    got.append(f.get_slice(e.key)[rest] if rest and len(parts) == 1 else f.get_tensor(e.key))
            out.append(got[0] if len(got) == 1 else torch.cat(got, self.cat)[rest])
        return torch.stack(out)


def _stacked_entry(rows: list[list[str]], entries: dict[str, Entry], cat: int = 0) -> StackedEntry:
    parts = tuple(tuple(entries[n] for n in names) for names in rows)
    first = parts[0]
    inner = list(first[0].shape)
    inner[cat] = sum(e.shape[cat] for e in first)
    return StackedEntry(parts, (len(parts), *inner), first[0].dtype, cat)


def folder_name(name: str) -> str:
    """A PEFT model's name of a base tensor as the base model's folder names it (``base_model.model.`` and
    ``.base_layer`` dropped; a ``modules_to_save`` copy and its original both the module's own)."""
    name = base_name(name, root=True)
    return re.sub(r"\.(original_module|modules_to_save\.[^.]+)\.", ".", name)


def _quantized_in_folder(name: str, entries: dict[str, Entry]) -> str:
    """How the folder says ``name`` is quantized (bitsandbytes' ``<name>.absmax``/``.quant_state...``,
    int8's ``SCB``, torchao's ``qdata``); '' for a plain tensor."""
    stem = name.rsplit(".", 1)[0]
    marks = [k[len(name) + 1:] for k in entries if k.startswith(name + ".")] + \
        [k[len(stem) + 1:] for k in entries if k.startswith(stem + ".") and k.rsplit(".", 1)[-1] in ("SCB",)]
    if any("quant_state" in m or m == "absmax" or m == "quant_map" for m in marks):
        return f"bitsandbytes 4-bit: {', '.join(sorted(marks)[:3])}"
    if marks:
        return f"with {', '.join(sorted(marks)[:3])}"
    return ""


def _entry_problems(path: Path, name: str, e: Entry, shape: tuple[int, ...], dtype: torch.dtype | None,
                    quantized: bool = False) -> list[str]:
    out = []
    if quantized and e.dtype not in FLOATS:
        return [f"load_pretrained: {path}: tensor {name!r} is {e.dtype} — expected a float tensor (F32, F16, BF16) "
                "to quantize: the engine marks it quantized and quantizes its float values on each rank. Load a "
                "folder of float weights (the model as trained, before quantizing)."]
    if tuple(e.shape) != tuple(shape):
        out.append(f"load_pretrained: {path}: tensor {name!r} has shape {list(e.shape)} — expected {list(shape)}. "
                   "Load the folder of a model with this config.")
    floating = dtype is None or dtype.is_floating_point
    if floating and e.dtype not in FLOATS:
        out.append(f"load_pretrained: {path}: tensor {name!r} is {e.dtype} — expected a float dtype (F32, F16, "
                   "BF16). Save the weights as floats (quantized checkpoints are not read here).")
    elif not floating and e.dtype in FLOATS:
        out.append(f"load_pretrained: {path}: buffer {name!r} is {e.dtype} — expected {dtype}. {RELOAD}")
    return out


def _rows(box: Box, i: int, n: int) -> Box:
    """Rows ``[i, i + n)`` of ``box`` (along dim 0), clipped to it."""
    if not box[1]:
        return box
    (s0, *rest), (n0, *sizes) = box
    return (s0 + i, *rest), (min(n, n0 - i), *sizes)


@torch.no_grad()
def load_pretrained(training: TrainingState, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Fill the engine's parameters (and persistent buffers) from a transformers folder, each rank
    reading only its pieces (see the module doc). Checked whole before any value is written."""
    from safetensors import safe_open

    path = Path(path).absolute()
    if training.step_count > 0:
        raise CheckpointError(f"load_pretrained: the engine has taken {training.step_count} step(s) — expected a load "
                              "before the first step (the optimizer's state would belong to other weights). Load "
                              "pretrained weights into a fresh engine, or resume training with "
                              "engine.load(checkpoint).")
    unknown = [s.name for s in training.states if s.plan.quant is not None and s.quant_format is None]
    if unknown:                       # the same on every rank: decided by the model alone
        raise CheckpointError(f"load_pretrained: the engine holds quantized weights of a kind it cannot quantize "
                              f"({', '.join(unknown[:2])}{', ...' if len(unknown) > 2 else ''}) — expected weights "
                              "quantized by sl.quantize (int8, int4, nf4). Mark the meta model with sl.quantize, "
                              "or resume training with engine.load(checkpoint).")
    # ranks may see different files (a folder on one node only): agreed before the collectives below
    mine = None
    try:
        config, entries = read_folder(path)
        entries = renamed(peft_base(training.model)[0], entries)
        params, buffers = _check(training, path, config, entries, strict)
    except CheckpointError as e:
        mine = e
    theirs = [(r, m) for r, m in enumerate(gather_objects(training, None if mine is None else str(mine))) if m]
    if mine is not None:
        raise mine
    if theirs:
        r, why = theirs[0]
        raise CheckpointError(f"load_pretrained: another rank (rank {r}) cannot read {path} — {why} Give every node "
                              "the same folder.")
    pieces, _ = rank_pieces(training)
    # a read holds its bytes about three times (the file's mapped pages, safetensors' buffer, the
    # tensor it returns): reads span at most a quarter of the largest tensor (and _CHUNK)
    chunk = min(_CHUNK, max(1, max(math.prod(entries[n].shape) * DTYPES[entries[n].dtype].itemsize
                                   for n in params.values()) // 4))
    failed = None
    training.needs_load = True                      # until every rank has read all of its pieces
    try:
        for p in pieces:
            if not p.key.startswith("param/") or p.key[len("param/"):] not in params:     # PEFT's adapters
                continue
            name = params[p.key[len("param/"):]]
            e = entries[name]
            row = math.prod(e.shape[1:]) * DTYPES[e.dtype].itemsize
            for box, off in p.boxes:
                dst = p.box_tensor(box, off)
                step = max(1, chunk // row) if box[1] else 1
                for i in range(0, max(box[1][0], 1) if box[1] else 1, step):
                    part = _rows(box, i, step)
                    if isinstance(e, StackedEntry):
                        got = e.read(whole_index(part))
                    else:
                        with safe_open(str(e.file), framework="pt") as f:       # mapped pages let go after
                            got = f.get_slice(e.key)[whole_index(part)]
                    (dst[i:i + step] if box[1] else dst).copy_(got)
                    del got
        by_key = {p.key: p for p in pieces}
        for s in training.states:            # quantized: this rank's float rows, quantized here
            if s.plan.quant is not None:
                fill(training, s, quantized_shard(s, entries[params[s.name]], training.mesh.rank, training.mesh,
                                                  chunk))
        for s in training.states:            # frozen values into what the engine computes with
            if not s.trainable and s.plan.quant is None:
                dst = s.shard if s.shard is not None else s.local_piece(s.param.data)
                dst.copy_(by_key[f"param/{s.name}"].flat.view_as(dst))
        held = persistent_buffers(training.model)
        for name, fname in buffers.items():
            with safe_open(str(entries[fname].file), framework="pt") as f:
                held[name].copy_(f.get_tensor(entries[fname].key))
    except Exception as e:                 # noqa: BLE001 — reported on every rank below
        failed = f"rank {training.mesh.rank}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    try:
        failed = [f for f in gather_objects(training, failed) if f]
    except (RuntimeError, torch.distributed.DistError) as e:     # a rank died mid-load (gloo: connection closed)
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise CheckpointError(f"load_pretrained: reading {path} failed — another rank stopped answering before every "
                              f"rank had read its pieces ({type(e).__name__}: {why}). The engine has no complete "
                              f"values and refuses to step. {RELOAD}") from e
    if failed:
        raise CheckpointError(f"load_pretrained: reading {path} failed — {failed[0]}. The engine has no complete "
                              f"values and refuses to step. {RELOAD}")
    training.publish()
    training.needs_load = False
    training.awaited = frozenset()
