"""Pretrained weights straight into the shards, and back out: ``engine.load_pretrained(path)`` and
``engine.save_pretrained(path)`` on transformers folders (``config.json`` + safetensors).

**Empty states.** ``sl.parallelize(model, plan, ..., init=False)`` gives each rank zeros of exactly
what it holds (ZeRO-3: its flat piece of each parameter, never a whole tensor even for a moment; a
pipe axis: its stages' parameters only, once — the fp32 master is the parameter), never a full
model; besides, the engine holds what it holds for a model built normally (zero=0: gradient
buckets as large as the parameters, allocated at set-up — on a ``from_pretrained`` model the
parameters are the file's mapped pages, resident only once read, so its set-up RSS shows the
buckets alone). Buffers the file does not carry (rotary ``inv_freq``) are recomputed by the
model's own ``_init_weights``; persistent ones are zeros the load must replace (a folder without
one is refused by name). A step before a load is refused.

**Load.** Every rank reads the safetensors headers (no tensor data) and checks, before writing any
value: the architecture in ``config.json``, every parameter and persistent buffer present (under
any of its tied names), its shape, a floating dtype, and every file whole (a tensor's bytes inside
the file). The ranks agree on the verdict in one gather (ranks of different nodes may see
different files): a rank raises its own problem, the others name it and refuse too.
Then each rank reads only its pieces — the boxes ``checkpoint_pieces._pieces`` gives in global
coordinates — through ``safe_open(...).get_slice(name)[rows]``, cast to fp32 as it is copied in.
A read holds its bytes about three times (the file's mapped pages, safetensors' buffer, the tensor
it returns), so each spans at most a quarter of the largest tensor (and 64 MB), the file reopened
per read so its mapped pages are let go: a load holds at most ~3/4 of the largest tensor beyond the
rank's states (the RSS high-water mark, measured in tests/test_pretrained.py on data 2 x tensor 2
ZeRO-3 and, building included, in tests/test_pretrained_memory.py on pipe 2 and data 2 ZeRO-3).
transformers' checkpoint renamings (GPT-NeoX's ``embed_out`` for ``lm_head``) apply both ways.

**Save.** Rank 0 writes what ``model.save_pretrained`` writes in one process — ``config.json``,
``generation_config.json`` where the model generates, ``model.safetensors`` or shards named by
huggingface_hub's own split (``max_shard_size``) with ``model.safetensors.index.json``, the same
tensor names (a tied weight under the name transformers keeps). Each tensor is assembled on rank 0
from the ranks' boxes (point-to-point, each element sent once) and written into its place in the
file (the header is known up front), then freed: rank 0 holds one tensor at a time. A write rank 0
cannot make (disk full, permission) removes its temporary file and stops its writing, not its
receiving (every send is matched); one broadcast after the last tensor makes every rank raise it.
"""

from __future__ import annotations

import math
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..algebra.boxes import Box, slices_in
from ..errors import ShardingError
from ..planner.peft import is_peft
from .checkpoint import _gather, _one
from .checkpoint_pieces import _pieces
from .checkpoint_files import CheckpointError
from .pretrained_files import (_DTYPES, _FLOATS, _RELOAD, CONFIG, _cannot, _Entry, _header_bytes, _Out, _tidy,
                               read_folder)

if TYPE_CHECKING:
    from .engine import Engine

_CHUNK = 64 << 20            # bytes: the most one read spans in a file


# ---- building without values (sl.parallelize(..., init=False)) ---------------------------------------

class EnginePretrained:
    """Empty states and buffers for ``init=False`` (mixed into ``Engine``). ``_awaited`` names the
    persistent buffers ``_fill_buffers`` zeroed: a load must bring each of them (a successful
    ``load_pretrained`` empties it)."""

    _awaited: frozenset[str] = frozenset()

    def _refuse_before_load(self, api: str) -> None:
        if isinstance(self._needs_load, str):       # a failure left it without one step's state
            raise CheckpointError(f"{api}: {self._needs_load}")
        if self._needs_load:
            raise CheckpointError(f"{api}: the engine was built with init=False and its parameters have no values "
                                  "yet — expected a load first. Call engine.load_pretrained(folder) (or "
                                  "engine.load(checkpoint)) before the first step, or parallelize with init=True.")

    def _build_states_empty(self) -> list:
        """Each parameter's state with zeros for values, each rank allocating only what it holds."""
        self._fill_buffers()
        named, owners = dict(self.model.named_parameters()), self._owners()
        zero3 = self.plan.states.params is not None
        states = []
        for i, pp in enumerate(self.plan.params):
            p = named[pp.name]
            who = owners[id(p)]
            # ZeRO-3 keeps only its piece (cloned from this): one zero seen whole through strides of 0,
            # not a whole tensor allocated for a moment; kept whole, the zeros are the parameter itself
            if pp.quant is not None:         # the codes' own layout (a load overwrites them, never a float)
                if p.is_meta:
                    raise ShardingError(f"parallelize: {pp.name} is a quantized {pp.quant.kind} on the meta device "
                                        "with init=False — got no codes to lay out; expected a quantized weight with "
                                        "values. Build the base, quantize it, then parallelize it.")
                st = self._param_state(i, pp, p, p.detach(), who)
                self._put(st)
                states.append(st)
                continue
            full = torch.zeros((), device=self.mesh.device).expand(pp.shape) if zero3 else \
                torch.zeros(pp.shape, device=self.mesh.device)
            if p.is_meta and self.plan.states.params is None:      # kept whole: a real parameter first
                p = nn.Parameter(full, requires_grad=pp.trainable)
                for mod, attr in who:
                    mod._parameters[attr] = p
            st = self._param_state(i, pp, p, full, who)
            self._put(st)
            states.append(st)
        return states

    @torch.no_grad()
    def _fill_buffers(self) -> None:
        """Meta buffers get values: zeros for persistent ones (the load fills them), and the model's
        own ``_init_weights(module)`` for each module holding one (transformers recomputes rotary
        tables there); a float buffer it leaves unset is refused."""
        init = getattr(self.model, "_init_weights", None)
        unset, awaited = [], set()
        for mname, mod in self.model.named_modules():
            metas = [k for k, b in mod._buffers.items() if b is not None and b.is_meta]
            if not metas:
                continue
            for k in metas:
                b = mod._buffers[k]
                mod._buffers[k] = torch.full(b.shape, float("nan"), dtype=b.dtype) if b.is_floating_point() \
                    else torch.zeros(b.shape, dtype=b.dtype)
            if callable(init):
                init(mod)
            for k in metas:
                if k in mod._non_persistent_buffers_set and (not callable(init) or (
                        mod._buffers[k].is_floating_point() and torch.isnan(mod._buffers[k]).any())):
                    unset.append(f"{mname}.{k}" if mname else k)
                elif k not in mod._non_persistent_buffers_set:
                    mod._buffers[k].zero_()
                    awaited.add(f"{mname}.{k}" if mname else k)
            for k in metas:
                mod._buffers[k] = mod._buffers[k].to(self.mesh.device)
        self._awaited = frozenset(awaited)
        if unset:
            raise CheckpointError(
                f"parallelize: init=False on a meta-device model whose non-persistent buffer(s) {unset[:6]} are not "
                "in any checkpoint and were not computed — expected the model's _init_weights(module) to set them "
                "(transformers models do). Build the model on a real device, or use init=True.")


def _renamings(model: nn.Module) -> list:
    """transformers' renamings of checkpoint keys for ``model`` (GPT-NeoX's ``embed_out`` is ``lm_head``),
    as ``from_pretrained`` applies them; none for other models."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return [c for c in get_model_conversion_mapping(model, add_legacy=True) if isinstance(c, WeightRenaming)]


def _renamed(model: nn.Module, entries: dict[str, _Entry]) -> dict[str, _Entry]:
    """The file's tensors by the model's names (each still knows its name in the file)."""
    renamings, out = _renamings(model), {}
    for key, e in entries.items():
        for r in renamings:
            key, _ = r.rename_source_key(key)
        out.setdefault(key, e)
    return out


def _reverted(model: nn.Module, names: list[tuple[str, str]], meta: dict[str, torch.Tensor]
              ) -> tuple[list[tuple[str, str]], dict[str, torch.Tensor]]:
    """The names transformers' ``save_pretrained`` writes (its renamings reverted, in its order)."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return names, meta
    if not isinstance(model, PreTrainedModel):
        return names, meta
    src_of, by_id = dict(names), {id(t): n for n, t in meta.items()}
    out = revert_weight_conversion(model, dict(meta))
    if any(id(t) not in by_id for t in out.values()):
        raise CheckpointError(f"save_pretrained: transformers converts {type(model).__name__}'s weights on save "
                              "(not only renames them) — expected a model whose checkpoint names map one to one. "
                              "Save engine.full_state_dict() with model.save_pretrained in one process instead.")
    return [(n, src_of[by_id[id(t)]]) for n, t in out.items()], out


# ---- what the model expects -----------------------------------------------------------------------------

def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter, keyed by its first (the plan's) name."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(first.setdefault(id(p), name), []).append(name)
    return out


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` names of the persistent buffers, in ``state_dict`` order (the first name of a shared one)."""
    out, seen = {}, set()
    for mname, mod in model.named_modules(remove_duplicate=False):
        for k, b in mod._buffers.items():
            if b is not None and k not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out[f"{mname}.{k}" if mname else k] = b
    return out


def _check(engine: Engine, path: Path, config: dict | None, entries: dict[str, _Entry], strict: bool
           ) -> tuple[dict[str, str], dict[str, str]]:
    """Every problem with the folder for this model, raised at once; else the file name of each
    parameter (by plan name) and of each persistent buffer found."""
    model, problems = engine.model, []
    mconf = getattr(model, "config", None)
    if config is not None and mconf is not None and hasattr(mconf, "model_type"):
        arch, want = config.get("architectures") or [], type(model).__name__
        if config.get("model_type") != mconf.model_type or (arch and want not in arch):
            problems.append(f"load_pretrained: {path} holds a {config.get('model_type')!r} model ({', '.join(arch)}) "
                            f"— expected {mconf.model_type!r} ({want}). Load the folder of this architecture, or "
                            "build the model from this folder's config.")
    elif config is None and mconf is not None and hasattr(mconf, "model_type") and path.is_dir():
        problems.append(f"load_pretrained: {path} has no {CONFIG} — expected a transformers folder for "
                        f"{type(model).__name__}. Write it with save_pretrained.")
    params: dict[str, str] = {}
    shapes = {p.name: tuple(p.shape) for p in engine.global_plan.params}
    for first, names in _aliases(model).items():
        found = next((n for n in names if n in entries), None)
        if found is None:
            problems.append(f"load_pretrained: {path} holds no tensor {first!r}"
                            + (f" (nor its tied names {names[1:]})" if len(names) > 1 else "")
                            + f" — expected every parameter of {type(model).__name__}. {_RELOAD}")
            continue
        params[first] = found
        problems += _entry_problems(path, found, entries[found], shapes[first], None)
    buffers: dict[str, str] = {}
    for name, b in _persistent_buffers(model).items():
        if name in entries:
            buffers[name] = name
            problems += _entry_problems(path, name, entries[name], tuple(b.shape), b.dtype)
        elif engine._needs_load and name in engine._awaited:     # zeroed by init=False: a load must fill it
            problems.append(f"load_pretrained: {path} holds no buffer {name!r} — expected every persistent buffer "
                            f"of a model built without values (init=False). {_RELOAD}")
    if strict:
        known = {n for names in _aliases(model).values() for n in names} | set(_persistent_buffers(model))
        ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
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


def _entry_problems(path: Path, name: str, e: _Entry, shape: tuple[int, ...], dtype: torch.dtype | None
                    ) -> list[str]:
    out = []
    if tuple(e.shape) != tuple(shape):
        out.append(f"load_pretrained: {path}: tensor {name!r} has shape {list(e.shape)} — expected {list(shape)}. "
                   "Load the folder of a model with this config.")
    floating = dtype is None or dtype.is_floating_point
    if floating and e.dtype not in _FLOATS:
        out.append(f"load_pretrained: {path}: tensor {name!r} is {e.dtype} — expected a float dtype (F32, F16, "
                   "BF16). Save the weights as floats (quantized checkpoints are not read here).")
    elif not floating and e.dtype in _FLOATS:
        out.append(f"load_pretrained: {path}: buffer {name!r} is {e.dtype} — expected {dtype}. {_RELOAD}")
    return out


# ---- load ---------------------------------------------------------------------------------------------

def _whole(box: Box) -> tuple[slice, ...]:
    """Index of ``box`` in the whole tensor."""
    return slices_in(box, ((0,) * len(box[0]), box[1]))


def _rows(box: Box, i: int, n: int) -> Box:
    """Rows ``[i, i + n)`` of ``box`` (along dim 0), clipped to it."""
    if not box[1]:
        return box
    (s0, *rest), (n0, *sizes) = box
    return (s0 + i, *rest), (min(n, n0 - i), *sizes)


@torch.no_grad()
def load_pretrained(engine: Engine, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Fill the engine's parameters (and persistent buffers) from a transformers folder, each rank
    reading only its pieces (see the module doc). Checked whole before any value is written."""
    from safetensors import safe_open

    path = Path(path).absolute()
    if engine.step_count > 0:
        raise CheckpointError(f"load_pretrained: the engine has taken {engine.step_count} step(s) — expected a load "
                              "before the first step (the optimizer's state would belong to other weights). Load "
                              "pretrained weights into a fresh engine, or resume training with "
                              "engine.load(checkpoint).")
    held = [s.name for s in engine.states if s.plan.quant is not None]
    if held or is_peft(engine.model):        # the same on every rank: decided by the model alone
        what = (f"quantized weights ({', '.join(held[:2])}{', ...' if len(held) > 2 else ''})" if held
                else "a PEFT model (its names are base_model.model.*, its adapters in no base folder)")
        raise CheckpointError(f"load_pretrained: the engine holds {what} — expected a plain float model: a folder "
                              "loads into the base model's own parameters. Load the base with from_pretrained, "
                              "quantize it and wrap it with peft.get_peft_model before sl.plan; resume training "
                              "with engine.load(checkpoint).")
    # ranks may see different files (a folder on one node only): agreed before the collectives below
    mine = None
    try:
        config, entries = read_folder(path)
        entries = _renamed(engine.model, entries)
        params, buffers = _check(engine, path, config, entries, strict)
    except CheckpointError as e:
        mine = e
    theirs = [(r, m) for r, m in enumerate(_gather(engine, None if mine is None else str(mine))) if m]
    if mine is not None:
        raise mine
    if theirs:
        r, why = theirs[0]
        raise CheckpointError(f"load_pretrained: another rank (rank {r}) cannot read {path} — {why} Give every node "
                              "the same folder.")
    pieces, _ = _pieces(engine)
    # a read holds its bytes about three times (the file's mapped pages, safetensors' buffer, the
    # tensor it returns): reads span at most a quarter of the largest tensor (and _CHUNK)
    chunk = min(_CHUNK, max(1, max(math.prod(entries[n].shape) * _DTYPES[entries[n].dtype].itemsize
                                   for n in params.values()) // 4))
    failed = None
    engine._needs_load = True                      # until every rank has read all of its pieces
    try:
        for p in pieces:
            if not p.key.startswith("param/"):
                continue
            name = params[p.key[len("param/"):]]
            e = entries[name]
            row = math.prod(e.shape[1:]) * _DTYPES[e.dtype].itemsize
            for box, off in p.boxes:
                dst = p.box_tensor(box, off)
                step = max(1, chunk // row) if box[1] else 1
                for i in range(0, max(box[1][0], 1) if box[1] else 1, step):
                    part = _rows(box, i, step)
                    with safe_open(str(e.file), framework="pt") as f:       # mapped pages let go after
                        got = f.get_slice(e.key)[_whole(part)]
                    (dst[i:i + step] if box[1] else dst).copy_(got)
                    del got
        by_key = {p.key: p for p in pieces}
        for s in engine.states:            # frozen values into what the engine computes with
            if not s.trainable:
                dst = s.shard if s.shard is not None else s.local_piece(s.param.data)
                dst.copy_(by_key[f"param/{s.name}"].flat.view_as(dst))
        held = _persistent_buffers(engine.model)
        for name, fname in buffers.items():
            with safe_open(str(entries[fname].file), framework="pt") as f:
                held[name].copy_(f.get_tensor(entries[fname].key))
    except Exception as e:                 # noqa: BLE001 — reported on every rank below
        failed = f"rank {engine.mesh.rank}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    failed = [f for f in _gather(engine, failed) if f]
    if failed:
        raise CheckpointError(f"load_pretrained: reading {path} failed — {failed[0]}. The engine has no complete "
                              f"values and refuses to step. {_RELOAD}")
    engine._publish()
    engine._needs_load = False
    engine._awaited = frozenset()


# ---- save -----------------------------------------------------------------------------------------------

def _saved_names(model: nn.Module) -> list[tuple[str, str]]:
    """``(name in the file, plan name or buffer name)`` in ``state_dict`` order, one name per tensor:
    of tied names transformers drops those its tied-weight keys match (as ``save_pretrained`` does)."""
    aliases = _aliases(model)
    first = {n: f for f, names in aliases.items() for n in names}
    buffers = _persistent_buffers(model)
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


@torch.no_grad()
def save_pretrained(engine: Engine, path: str | os.PathLike, *, max_shard_size: int | str = "50GB",
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write the model as ``model.save_pretrained(path)`` does in one process (see the module doc); a
    model without a transformers ``config`` gets the safetensors files only. A collective."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from huggingface_hub.serialization._base import parse_size_to_int

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CheckpointError(f"save_pretrained: dtype {dtype} — expected torch.float32, float16 or bfloat16.")
    path = Path(path).absolute()
    model, gplan = engine.model, engine.global_plan
    names = _saved_names(model)
    shapes = {p.name: tuple(p.shape) for p in gplan.params}
    buffers = _persistent_buffers(model)
    kinds = {src: (shapes[src], dtype) if src in shapes else
             (tuple(buffers[src].shape), dtype if buffers[src].is_floating_point() else buffers[src].dtype)
             for _, src in names}
    meta = {n: torch.empty(kinds[src][0], dtype=kinds[src][1], device="meta") for n, src in names}
    names, meta = _reverted(model, names, meta)
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=parse_size_to_int(max_shard_size)
                                               if isinstance(max_shard_size, str) else int(max_shard_size))
    del meta
    hf = hasattr(getattr(model, "config", None), "save_pretrained")
    rank0 = engine.mesh.rank == 0
    if hf:                                # as save_pretrained: the saved dtype and the class in the config
        model.config.dtype = str(dtype).split(".")[1]
        model.config.architectures = [type(model).__name__]
    problem = None
    if rank0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if hf:
                model.config.save_pretrained(path)
                can = getattr(model, "can_generate", None)
                if callable(can) and can() and getattr(model, "generation_config", None) is not None:
                    model.generation_config.save_pretrained(path)
        except OSError as e:
            problem = f"save_pretrained: cannot write {path} ({e.strerror}) — expected a writable folder."
    problem = _gather(engine, problem)[0]
    if problem:
        raise CheckpointError(problem)
    sender, src_of = _Sender(engine), dict(names)
    failed: str | None = None        # rank 0's write failure: it goes on receiving so every send matches
    for fname, tensors in split.filename_to_tensors.items():
        head, offsets = _header_bytes([(n, kinds[src_of[n]][1], kinds[src_of[n]][0]) for n in tensors])
        tmp = path / f".{fname}.tmp-{uuid.uuid4().hex[:8]}"
        out = _Out(tmp, head) if rank0 and failed is None else None
        for n in sorted(tensors, key=lambda n: offsets[n]):
            src = src_of[n]
            t = sender.full(src) if src in shapes else buffers[src]
            if out is not None and out.ok:
                out.write(len(head) + offsets[n], t.detach().to(kinds[src][1]).contiguous().view(-1)
                          .view(torch.uint8).numpy().data)
            del t
        if out is not None:
            failed = out.install(path / fname)
    if rank0 and failed is None:
        try:
            _tidy(path, split, sum(p.numel for p in gplan.params), hf)
        except OSError as e:
            failed = _cannot(path, e)
    failed = _one(engine, failed)          # every rank learns rank 0's verdict (and waits for the files)
    if failed:
        raise CheckpointError(failed)
    return path


class _Sender:
    """Full parameters on rank 0, one at a time: every rank tells once which boxes it holds; each box of
    each tensor is sent by the lowest rank holding it (replicas send nothing), point to point."""

    def __init__(self, engine: Engine, *, frozen: bool = True):
        """``frozen=False``: trainable parameters only (a PEFT adapter's save never reads the base)."""
        self.engine = engine
        self.shapes = {p.name: tuple(p.shape) for p in engine.global_plan.params}
        pieces, _ = _pieces(engine, frozen=frozen)
        self.mine = {p.key[len("param/"):]: p for p in pieces if p.key.startswith("param/")}
        held = {k: [b for b, _ in p.boxes] for k, p in self.mine.items()}
        self.owner: dict[str, list[tuple[int, Box]]] = {}
        for r, got in enumerate(_gather(engine, held)):
            for k, boxes in got.items():
                have = self.owner.setdefault(k, [])
                for b in boxes:
                    if math.prod(b[1]) and all(b != x for _, x in have):
                        have.append((r, b))

    def full(self, name: str) -> torch.Tensor | None:
        """Parameter ``name``'s full fp32 value on rank 0 (None elsewhere)."""
        e = self.engine
        me = e.mesh.rank
        out = torch.zeros(self.shapes[name], dtype=torch.float32) if me == 0 else None
        recvs, sends = [], []
        local = {b: off for b, off in self.mine[name].boxes} if name in self.mine else {}
        for r, box in self.owner.get(name, []):
            if r == me == 0:
                out[_whole(box)] = self.mine[name].box_tensor(box, local[box])
            elif me == 0:
                buf = torch.empty(box[1], dtype=torch.float32)
                recvs.append((dist.irecv(buf, src=r), box, buf))
            elif r == me:
                sends.append(dist.isend(self.mine[name].box_tensor(box, local[box]).contiguous(), dst=0))
        for w, box, buf in recvs:
            w.wait()
            out[_whole(box)] = buf
        for w in sends:
            w.wait()
        return out
