"""``engine.save(path)`` / ``engine.load(path)``: the whole training state, saved on one mesh, loaded on any.

**What is saved.** On ``torch.distributed.checkpoint`` (DCP), every rank writing only its own pieces,
in parallel: each parameter's fp32 value (the masters; frozen parameters' values), each optimizer
state tensor shaped like its parameter (Adam's moments, momentum), per-parameter scalars (step
counts), the buffers, and every rank's RNG states (torch CPU, CUDA where there is one). Beside them a
``manifest.json`` (JSON: nothing is unpickled to read it) with the format version, the shardlib and
torch versions, the mesh and a plan summary, the model's parameters and shapes, every saved
tensor's shape by its name, the optimizer's class and hyper-parameters, the LR scheduler's
state, the fp16 loss scale, the step, the samples consumed, the caller's ``extra`` (e.g. a data
loader's position) and a hash of every file (XXH3-128; SHA-256 without ``xxhash``).

**Any mesh.** A rank's piece of a tensor is a flat range of its tensor-parallel block, and the block
a box of the global tensor; ``algebra/boxes.py`` turns it into a few boxes in global coordinates,
each written as one chunk of the tensor's key. An engine on another mesh, ZeRO stage, tensor or pipe
split reads the saved chunks that overlap its own boxes straight into them (DCP's resharding) —
ZeRO-3 on 2x2x2 to ZeRO-1 on data 4 to one process. Replicated pieces are written once.

**DCP's standard names** (``runtime/checkpoint/dcp.py``): each parameter under its model name (every name of
a tied one), persistent buffers under theirs, optimizer state under ``optimizer.state.<name>.<key>``
— the keys torchtitan writes. So ``dcp_to_torch_save`` gives the full state dict by name, FSDP2 loads
an engine's checkpoint with ``dcp.load``, and ``load`` takes an FSDP2 or torchtitan checkpoint (no
manifest: weights, optimizer state and step count from it; RNG and schedule the engine's).

**Nothing lost.** A save writes into a temporary folder beside ``path`` and moves it into place only
after every rank has written and the manifest is complete; a process killed at any point leaves the
previous checkpoint at ``path`` (``save_step``/``latest`` keep a series, the pointer replaced
atomically). ``load`` checks the manifest and the files' hashes before DCP reads anything (DCP
unpickles its own ``.metadata``: only a file whose hash the manifest vouches for is read), and
refuses a checkpoint of another model naming every missing or mis-shaped parameter.

**Quantized frozen weights** (``quant/layout.py``) are saved as their components — codes, scales, zero
points, each in its own dtype as a global tensor (``quant/<name>/<component>``) of which a tensor shard
holds the box its block covers — so a load on another mesh or tensor degree gets the same codes; under
ZeRO-3 a rank first rebuilds its tensor shards' packed bytes from the data group's pieces (one
all-reduce each), and a load into ZeRO-3 puts each rank's piece of the bytes back.

**Frozen weights left out.** ``save(path, frozen=False)`` writes no frozen parameter (a QLoRA job's
base never changes: it is not rewritten every save); the manifest's ``absent`` lists them. ``load``
of such a checkpoint restores everything else — trainable values, optimizer state, step, RNG — on
any mesh, and keeps the frozen values the engine holds (from ``load_pretrained`` or its own
initialisation). It is refused, naming the parameters, where the engine has no frozen values yet
(``init=False`` and nothing loaded) or where a parameter absent from it is trainable here.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...validate import flag
from .files import (FORMAT, LATEST, MANIFEST, VERSION, CheckpointError, dcp_error, dcp_failure, default_hash, file_hash,
                    fsync_dir, hasher, hashing_writer, install, params_problems, read_manifest, resolve, safe_reader,
                    writable)
from .files import clean_partial as clean_partial, latest as latest   # the series' users import them here
from .pieces import Piece, param_of, quantized_names, rank_pieces, tensor_block

if TYPE_CHECKING:
    from ..training import TrainingState


# ---- collective helpers -------------------------------------------------------------------------

def _world(training: TrainingState) -> int:
    return training.mesh.size


def gather_objects(training: TrainingState, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if _world(training) == 1:
        return [obj]
    out: list[Any] = [None] * _world(training)
    dist.all_gather_object(out, obj)
    return out


def from_rank_zero(training: TrainingState, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if _world(training) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_zero(training: TrainingState) -> bool:
    return training.mesh.rank == 0


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items() if _json_safe(v) is not _DROP}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return _DROP


_DROP = object()


# ---- save ---------------------------------------------------------------------------------------

def save(training: TrainingState, path: str | os.PathLike, *, extra: dict | None = None, frozen: bool = True) -> Path:
    """Write the engine's whole training state to the folder ``path`` (see the module doc);
    ``frozen=False`` leaves the frozen parameters' values out. A collective: every rank calls it
    with the same ``path``. Returns ``path``."""
    import torch.distributed.checkpoint as dcp

    path = Path(path).absolute()
    try:
        json.dumps(extra or {})
    except TypeError as e:
        raise CheckpointError(f"save: extra must be JSON data (ints, floats, strings, lists, dicts) — {e}.") from None
    if problem := flag(frozen, "save: frozen"):
        raise CheckpointError(f"{problem}; expected True (write the frozen "
                              "parameters too) or False (leave them out).")
    # rank 0's temporary name, hash and verdict on the folder, on every rank (one broadcast)
    token, algo, problem = from_rank_zero(training, (uuid.uuid4().hex[:12], default_hash(),
                                         writable(path.parent) if training.mesh.rank == 0 else None))
    tmp = path.parent / f".{path.name}.tmp-{token}"
    if problem:
        raise CheckpointError(problem)
    if rank_zero(training):           # a save killed earlier left its temporary folder: clear it
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    planner = _save_planner(training, frozen)
    rank = training.mesh.rank
    failed, hashes = None, {}
    try:
        writer = hashing_writer(tmp, algo)
        with _no_zip_crc():
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=_world(training) == 1)
        hashes = writer.hashes()                    # hashed as written (DCP fsynced the files)
    except (Exception, dcp_error()) as e:      # DCP raises on every rank when any rank's write failed
        failed = dcp_failure(e)
    got = gather_objects(training, (failed, hashes))         # one exchange: every rank's failure and hashes
    failed = [f for f, _ in got if f]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"save: writing {path} failed — {failed[0]}. The previous checkpoint (if any) "
                              "is untouched. Free disk space or fix the permissions, then save again.")
    if rank == 0:
        files = {k: v for _, h in got for k, v in h.items()}
        for f in tmp.iterdir():
            if f.name not in files:
                files[f.name] = file_hash(f, algo)
        merged = {k: list(m.size) for k, m in planner.metadata.state_dict_metadata.items() if hasattr(m, "size")}
        manifest = _manifest(training, merged, files, extra, frozen)
        manifest["hash"] = algo
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync_dir(tmp, (MANIFEST,))
        install(tmp, path)
    if _world(training) > 1:
        dist.barrier()
    return path


@contextmanager
def _no_zip_crc():
    """``torch.save`` without its zip records' CRC-32 (nothing reading a checkpoint checks it —
    ``torch.load`` does not; the manifest's hash of every file does): a third of what hashing the
    files costs, saved."""
    from torch import serialization as ser

    prev = ser.get_crc32_options() if hasattr(ser, "get_crc32_options") else None
    if prev is not None:
        ser.set_crc32_options(False)
    try:
        yield
    finally:
        if prev is not None:
            ser.set_crc32_options(prev)


def _save_planner(training: TrainingState, frozen: bool):
    """What this rank writes (``checkpoint_dcp``'s names): its boxes of every sharded tensor, its
    replicated tensors whole, the group hyper-parameters and its RNG states."""
    from .dcp import BoxSavePlanner, Chunked, Names, param_group_entries

    names = Names.of(training)
    pieces, whole = rank_pieces(training, frozen=frozen, quantized=frozen)
    pp = training.global_plan.pipeline
    mesh = training.mesh
    if pp is not None and pp.tied and training.global_plan.pipe_size > 1 and \
            0 not in {s.index for s in pp.stages_of(mesh.coord(mesh.rank, pp.axis))}:
        # a weight tied across the first and last stage is written once, by the first stage's ranks
        pieces = [p for p in pieces if param_of(p.key) not in pp.tied]
        whole = {k: v for k, v in whole.items() if k.rpartition("/")[2] not in pp.tied}
    chunked: dict[str, Chunked] = {}
    for p in pieces:
        for name in names.saved(p.key):
            c = chunked.setdefault(name, Chunked(tuple(p.shape), p.flat.dtype, {}))
            for box, off in p.boxes:
                c.chunks[tuple(box[0])] = (tuple(box[1]), lambda p=p, box=box, off=off: p.box_tensor(box, off).detach())
    out: dict = {names.saved(k)[0]: v.detach() for k, v in whole.items()}
    if any(s.trainable for s in training.states):
        out.update(param_group_entries(training))
    rank = training.mesh.rank
    out[names.read(f"rng/cpu/{rank}")[0]] = torch.get_rng_state()
    if torch.cuda.is_available():
        out[names.read(f"rng/cuda/{rank}")[0]] = torch.cuda.get_rng_state()
    return BoxSavePlanner(chunked, out)


def _manifest(training: TrainingState, index: dict, files: dict, extra: dict | None, frozen: bool) -> dict:
    gplan, opt = training.global_plan, training.optimizer
    groups = [{k: _json_safe(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    sched = training.lr_scheduler
    scaler = training.scaler
    return {
        "format": FORMAT, "version": VERSION, "shardlib": _version(), "torch": torch.__version__,
        "mesh": gplan.mesh.axis_sizes, "world": training.mesh.size,
        "plan": {"zero": gplan.zero, "precision": gplan.precision, "pipe": gplan.pipe_size,
                 "tensor": gplan.tensor_size, "replica": gplan.replica_size},
        "params": {p.name: {"shape": list(p.shape), "trainable": p.trainable} for p in gplan.params},
        "absent": [] if frozen else [p.name for p in gplan.params if not p.trainable],
        "tensors": index, "files": files,
        "optimizer": {"class": type(opt).__name__, "param_groups": groups},
        "scheduler": None if sched is None else {"class": type(sched).__name__,
                                                 "state": _json_safe(sched.state_dict())},
        "scaler": None if not scaler else {k: getattr(scaler, k) for k in ("scale", "good_steps", "skipped_steps")},
        "step": training.step_count, "samples": training.samples_seen, "extra": extra or {},
    }


def _version() -> str:
    from ... import __version__
    return __version__


# ---- series: step folders and a `latest` pointer ---------------------------------------------

def save_step(training: TrainingState, folder: str | os.PathLike, step: int, *, extra: dict | None = None, keep: int = 2,
              frozen: bool = True) -> Path:
    """``folder/step-000123``, then ``folder/latest`` pointing at it (replaced atomically), then all
    but the newest ``keep`` step folders removed. ``frozen=False``: as ``save``'s (the base left out)."""
    folder = Path(folder)
    path = save(training, folder / f"step-{step:06d}", extra=extra, frozen=frozen)
    if training.mesh.rank == 0:
        tmp = folder / f".{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, folder / LATEST)
        steps = sorted(p for p in folder.glob("step-*") if p.is_dir())
        for old in steps[:-keep] if keep > 0 else []:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    if _world(training) > 1:
        dist.barrier()
    return path


# ---- load ---------------------------------------------------------------------------------------

def check_files(training: TrainingState, path: Path, manifest: dict) -> None:
    """Every file the manifest names is there, whole (its hash: the manifest's ``hash``, SHA-256 where it
    names none), checked over the ranks (rank r hashes files r, r + world, ...); and no data file it does
    not name."""
    names = sorted(manifest["files"])
    algo = manifest.get("hash", "sha256")
    hasher(algo)         # an unknown hash (or xxhash missing) refused on every rank, before any collective
    bad = []
    for i, name in enumerate(names):
        if i % _world(training) != training.mesh.rank:
            continue
        f = path / name
        if not f.is_file():
            bad.append(f"{name} is missing")
        elif file_hash(f, algo) != manifest["files"][name]:
            bad.append(f"{name} is corrupt (its {algo} hash differs from the manifest's)")
    if training.mesh.rank == 0:
        extra = sorted(f.name for f in path.glob("*.distcp") if f.name not in manifest["files"])
        bad += [f"{n} is not part of the checkpoint" for n in extra[:5]]
    bad = sorted({b for got in gather_objects(training, bad) for b in got})
    if bad:
        raise CheckpointError([f"load: {path}: {b} — the checkpoint is truncated or corrupt; load an earlier one."
                               for b in bad[:10]], api="load")


def check_model(training: TrainingState, manifest: dict, path: Path) -> None:
    problems = params_problems(manifest, {p.name: tuple(p.shape) for p in training.global_plan.params}, path)
    opt = manifest["optimizer"]["class"]
    if opt != type(training.optimizer).__name__:
        problems.append(f"load: {path} was saved with optimizer {opt}, this engine uses "
                        f"{type(training.optimizer).__name__} — expected the same optimizer class.")
    absent = manifest.get("absent", [])
    trainable = sorted(p.name for p in training.global_plan.params if p.trainable and p.name in absent)
    if trainable:
        problems.append(f"load: {path} was saved without its frozen parameters, and {len(trainable)} of them are "
                        f"trainable in this engine — got {trainable[:4]}; expected their values in the checkpoint. "
                        "Freeze them as when saving, or resume from a checkpoint saved with frozen=True.")
    if absent and training.needs_load:
        problems.append(f"load: {path} holds no frozen parameters ({len(absent)} left out, e.g. {absent[:3]}), and "
                        "this engine was built with init=False and has no values for them — expected them set "
                        "first. Call engine.load_pretrained(base_folder) before engine.load, or build with init=True.")
    if problems:
        raise CheckpointError(problems[:20], api="load")


@torch.no_grad()
def load(training: TrainingState, path: str | os.PathLike) -> dict:
    """Restore the engine's whole training state from ``path`` (or the checkpoint its ``latest``
    names), saved on any mesh; returns the ``extra`` given to ``save``. A collective.

    A DCP checkpoint without shardlib's manifest (FSDP2's, torchtitan's: ``checkpoint_dcp``'s names)
    gives the parameters and the optimizer state found under their names (the step count from the
    optimizer's ``step``); the RNG, scheduler and loss scale stay the engine's."""
    from .dcp import Names

    path = resolve(Path(path).absolute())
    manifest = from_rank_zero(training, _try(_manifest_or_foreign, path))
    if isinstance(manifest, CheckpointError):
        raise manifest
    foreign = manifest is None
    if not foreign:
        check_model(training, manifest, path)
        check_files(training, path, manifest)
    reader = safe_reader(path)
    try:
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"load: {path}'s DCP metadata cannot be read — {dcp_failure(e)}.") from None
    saved = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    names = Names.of(training)
    kept = set(manifest.get("absent", [])) if manifest else set()       # frozen values the engine keeps
    pieces, whole = rank_pieces(training, quantized=not any(n in kept for n in quantized_names(training)))
    pieces = [p for p in pieces if p.key.startswith("optim/") or param_of(p.key) not in kept]
    by_key = {p.key: p for p in pieces}
    fresh = _fresh_states(training, names, saved, by_key, whole, pieces)
    boxes: dict[str, list] = {}
    request: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[str, torch.Tensor]] = {}
    for p in pieces:
        name = next((n for n in names.read(p.key) if n in saved), None)
        if name is None:
            _missing(path, p.key, saved, foreign, names)
            continue
        if saved[name] != tuple(p.shape):
            raise CheckpointError(f"load: {name!r} is {saved[name]} in {path} but {tuple(p.shape)} in this engine — "
                                  "expected the model the checkpoint was saved from.")
        boxes[name] = [(box, p.box_tensor(box, off)) for box, off in p.boxes]
    for k, t in whole.items():
        name = next((n for n in names.read(k) if n in saved), None)
        if name is not None:
            request[name] = torch.empty(saved[name], dtype=t.dtype)
            where[name] = (k, t)
    rank_saved = training.mesh.rank % manifest["world"] if manifest else None
    rng = {}
    if manifest:
        rng["cpu"] = names.read(f"rng/cpu/{rank_saved}")[0]
        request[rng["cpu"]] = torch.empty_like(torch.get_rng_state())
        cuda = names.read(f"rng/cuda/{rank_saved}")[0]
        if torch.cuda.is_available() and cuda in saved:
            rng["cuda"] = cuda
            request[cuda] = torch.empty_like(torch.cuda.get_rng_state())
    planner = _read(training, path, reader, boxes, request)
    short = sorted({n for n, bs in boxes.items() for box, t in bs
                    if planner.covered.get((n, tuple(box[0])), 0) != t.numel()})
    if short:
        raise CheckpointError(f"load: {path} does not cover every element of {short[:3]} — the checkpoint is incomplete.")
    for name, (k, t) in where.items():
        t.copy_(request[name])
    for p in pieces:
        if p.refill is not None:
            p.refill()
    _restore_optimizer(training, manifest, fresh)
    for s in training.states:          # frozen values go back into what the engine computes with
        if not s.trainable and f"param/{s.name}" in by_key:
            src = s.shard if s.shard is not None else s.local_piece(s.param.data)
            src.copy_(by_key[f"param/{s.name}"].flat.view_as(src))
    if foreign:
        steps = [t for k, (_, t) in where.items() if k.endswith(".step") and t.numel() == 1]
        training.step_count = int(steps[0].item()) if steps else training.step_count
        training.publish()
        return {}
    torch.set_rng_state(request[rng["cpu"]])
    if "cuda" in rng:
        torch.cuda.set_rng_state(request[rng["cuda"]])
    sched = training.lr_scheduler
    if sched is not None and manifest["scheduler"] is not None:
        sched.load_state_dict({**sched.state_dict(), **manifest["scheduler"]["state"]})
    if training.scaler and manifest["scaler"]:
        for k, v in manifest["scaler"].items():
            setattr(training.scaler, k, v)
    training.step_count, training.samples_seen = manifest["step"], manifest["samples"]
    training.publish()                  # the compute copies (and ZeRO-1/2's full parameters) from the masters
    return manifest["extra"]


def _manifest_or_foreign(path: Path) -> dict | None:
    """The manifest; ``None`` for a DCP checkpoint another trainer wrote (a ``.metadata``, no manifest,
    none of the names only ``engine.save`` writes: one of its checkpoints without its manifest is refused)."""
    from .dcp import OWN

    if path.is_dir() and not (path / MANIFEST).exists() and (path / ".metadata").is_file():
        keys = safe_reader(path).read_metadata().state_dict_metadata
        if not any(k.startswith(OWN) for k in keys):
            return None
    return read_manifest(path)


def _missing(path: Path, key: str, saved: dict, foreign: bool, names) -> None:
    """Refuse a load that lacks ``key``'s values (optimizer state the checkpoint did not have, e.g.
    saved before any step, is no error)."""
    if key.startswith("param/"):
        q = any(k.startswith(names.read(f"quant/{key[6:]}/x")[0][:-1]) for k in saved)
        raise CheckpointError(f"load: {path} holds no values for {key[6:]!r}"
                              + (" (it holds it quantized; this engine's is not)." if q else
                                 f" — looked for {names.read(key)[:2]}." if foreign else "."))
    if key.startswith("quant/"):
        raise CheckpointError(f"load: {path} holds no {key.rpartition('/')[2]!r} of quantized weight "
                              f"{param_of(key)!r} — expected the checkpoint of a model quantized as this one is. "
                              "Quantize the model as when saving, or load a checkpoint saved from it.")


def _fresh_states(training: TrainingState, names, saved: dict, by_key: dict, whole: dict, pieces: list) -> dict:
    """Optimizer state the checkpoint holds and this engine has not created yet (no step taken),
    allocated like the masters (on disk where the states are offloaded there) and added to what is read."""
    fresh: dict[str, dict[str, torch.Tensor]] = {}
    by_param: dict[str, list[tuple[str, str]]] = {}       # parameter -> [(its state's key, saved name)]
    for name in saved:
        for prefix in ("optimizer.state.", "optim.state."):
            if name.startswith(prefix):
                pname, _, k = name[len(prefix):].rpartition(".")
                by_param.setdefault(pname, []).append((k, name))
    for s in training.states:
        if not s.trainable or s.name not in by_param:
            continue
        shape, block = tensor_block(training, s)
        for k, name in by_param[s.name]:
            key = f"optim/{k}/{s.name}"
            if key in by_key or key in whole or k in fresh.get(s.name, {}):
                continue
            if saved[name] == tuple(shape) and len(shape) > 0:
                t = training.offload.fresh(s, k) if training.offload is not None else None
                t = torch.zeros_like(s.master, dtype=torch.float32) if t is None else t
                fresh.setdefault(s.name, {})[k] = t
                p = Piece(key, shape, block, tuple(s.plan.shape), s.lo, s.hi, t.reshape(-1))
                pieces.append(p)
                by_key[key] = p
            else:
                t = torch.zeros(saved[name], dtype=torch.float32)
                fresh.setdefault(s.name, {})[k] = t
                whole[key] = t
    return fresh


def _read(training: TrainingState, path: Path, reader, boxes: dict, request: dict):
    """DCP reads the chunks overlapping ``boxes`` into their views and ``request`` whole."""
    import torch.distributed.checkpoint as dcp

    from .dcp import BoxLoadPlanner

    planner = BoxLoadPlanner(boxes, request)
    try:
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=_world(training) == 1)
    except (Exception, dcp_error()) as e:
        if reader.refused is not None:       # the metadata asked for code: say so, whatever DCP made of it
            raise reader.refused from None
        raise CheckpointError(f"load: reading {path} failed — {dcp_failure(e)}.") from None
    return planner


def _restore_optimizer(training: TrainingState, manifest: dict, fresh: dict[str, dict[str, torch.Tensor]]) -> None:
    opt = training.optimizer
    for g, saved in zip(opt.param_groups, manifest["optimizer"]["param_groups"] if manifest else []):
        for k, v in saved.items():
            if k in g and not isinstance(g[k], torch.Tensor):
                g[k] = tuple(v) if isinstance(g[k], tuple) else v
    masters = {s.name: s.master for s in training.states if s.trainable}
    for name, state in fresh.items():
        st = opt.state[masters[name]]
        for k, t in state.items():
            st[k] = t.view_as(masters[name]) if t.numel() == masters[name].numel() and t.dim() > 0 else t


def _try(fn, *args):
    try:
        return fn(*args)
    except CheckpointError as e:
        return e


# ---- export ---------------------------------------------------------------------------------------

def export(training: TrainingState, path: str | os.PathLike) -> Path | None:
    """``engine.full_state_dict()`` written by rank 0 as one ``safetensors`` file (tensors only, tied
    parameters stored once per name), loadable into a plain single-process model. A collective."""
    from safetensors.torch import save_file

    full = training.full_state_dict()
    path = Path(path)
    if training.mesh.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
        save_file({k: v.detach().contiguous().clone() for k, v in full.items() if isinstance(v, torch.Tensor)},
                  str(tmp), metadata={"format": "pt", "producer": f"shardlib {_version()}"})
        os.replace(tmp, path)
    if _world(training) > 1:
        dist.barrier()
    return path
