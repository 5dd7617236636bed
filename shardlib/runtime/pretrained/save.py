"""``engine.save_pretrained(path)``: the sharded model written as a transformers folder
(``config.json`` + safetensors), from rank 0, one tensor at a time.

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

from collections.abc import Callable

import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...algebra.boxes import Box, slices_in
from ..checkpoint.core import from_rank_zero, gather_objects
from ..checkpoint.files import CheckpointError
from ..checkpoint.pieces import rank_pieces
from .files import OutFile, header_bytes, tidy, write_refused
from ...planner.stacked import per_expert_names
from .names import converted, persistent_buffers, saved_names

if TYPE_CHECKING:
    from ..training import TrainingState


def whole_index(box: Box) -> tuple[slice, ...]:
    """Index of ``box`` in the whole tensor."""
    return slices_in(box, ((0,) * len(box[0]), box[1]))


@torch.no_grad()
def save_pretrained(training: TrainingState, path: str | os.PathLike, *, max_shard_size: int | str = "50GB",
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write the model as ``model.save_pretrained(path)`` does in one process (see the module doc); a
    model without a transformers ``config`` gets the safetensors files only. A collective."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from huggingface_hub.serialization._base import parse_size_to_int

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CheckpointError(f"save_pretrained: dtype {dtype} — expected torch.float32, float16 or bfloat16.")
    path = Path(path).absolute()
    model, gplan = training.model, training.global_plan
    names = saved_names(model)
    shapes = {p.name: tuple(p.shape) for p in gplan.params}
    buffers = persistent_buffers(model)
    kinds = {src: (shapes[src], dtype) if src in shapes else
             (tuple(buffers[src].shape), dtype if buffers[src].is_floating_point() else buffers[src].dtype)
             for _, src in names}
    meta = {n: torch.empty(kinds[src][0], dtype=kinds[src][1], device="meta") for n, src in names}
    names, meta, derived = converted(model, names, meta)
    shape_of = {n: tuple(t.shape) for n, t in meta.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=parse_size_to_int(max_shard_size)
                                               if isinstance(max_shard_size, str) else int(max_shard_size))
    del meta
    hf = hasattr(getattr(model, "config", None), "save_pretrained")
    rank0 = training.mesh.rank == 0
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
    problem = gather_objects(training, problem)[0]
    if problem:
        raise CheckpointError(problem)
    sender, src_of = Sender(training), dict(names)
    split_of = Converted(model, sender, derived)
    failed: str | None = None        # rank 0's write failure: it goes on receiving so every send matches
    for fname, tensors in split.filename_to_tensors.items():
        head, offsets = header_bytes([(n, kinds[src_of[n]][1], shape_of[n]) for n in tensors])
        tmp = path / f".{fname}.tmp-{uuid.uuid4().hex[:8]}"
        out = OutFile(tmp, head) if rank0 and failed is None else None
        for n in sorted(tensors, key=lambda n: offsets[n]):
            src = src_of[n]
            t = split_of.tensor(n, src) if n in derived else sender.full(src) if src in shapes else buffers[src]
            if out is not None and out.ok:
                out.write(len(head) + offsets[n], t.detach().to(kinds[src][1]).contiguous().view(-1)
                          .view(torch.uint8).numpy().data)
            del t
        if out is not None:
            failed = out.install(path / fname)
    return on_rank_zero(training, path, lambda: tidy(path, split, sum(p.numel for p in gplan.params), hf), failed)


def on_rank_zero(training: TrainingState, path: Path, write: Callable[[], object], failed: str | None = None) -> Path:
    """``write`` into ``path`` on rank 0 (unless ``failed`` already says why not); every rank learns rank 0's
    verdict (and so waits for the files) and raises it as a ``CheckpointError``. Returns ``path``."""
    if training.mesh.rank == 0 and failed is None:
        try:
            write()
        except OSError as e:
            failed = write_refused(path, e)
    failed = from_rank_zero(training, failed)
    if failed:
        raise CheckpointError(failed)
    return path


class Converted:
    """The tensors a conversion derives from one full parameter (``names.converted``), on rank 0: the source is
    gathered once (``Sender.full``, a collective every rank calls alike) and converted as transformers converts
    it on save; the last source's outputs are kept for its next tensors."""

    def __init__(self, model, sender: Sender, derived: dict[str, str]):
        self.model, self.sender, self.derived = model, sender, derived
        self.src: str | None = None
        self.outputs: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, src: str) -> torch.Tensor | None:
        if self.src != src:
            full = self.sender.full(src)
            self.src = src
            stacks = per_expert_names(self.model)
            if full is None:
                self.outputs = {}
            elif src in stacks:               # stacked experts: each expert's own tensor
                self.outputs = dict(zip(stacks[src], full))
            else:
                from transformers.core_model_loading import revert_weight_conversion
                self.outputs = revert_weight_conversion(self.model, {self.derived[name]: full})
        return self.outputs.get(name)


class Sender:
    """Full parameters on rank 0, one at a time: every rank tells once which boxes it holds; each box of
    each tensor is sent by the lowest rank holding it (replicas send nothing), point to point."""

    def __init__(self, training: TrainingState, *, frozen: bool = True):
        """``frozen=False``: trainable parameters only (a PEFT adapter's save never reads the base)."""
        self.training = training
        self.shapes = {p.name: tuple(p.shape) for p in training.global_plan.params}
        pieces, _ = rank_pieces(training, frozen=frozen)
        self.mine = {p.key[len("param/"):]: p for p in pieces if p.key.startswith("param/")}
        held = {k: [b for b, _ in p.boxes] for k, p in self.mine.items()}
        self.owner: dict[str, list[tuple[int, Box]]] = {}
        for r, got in enumerate(gather_objects(training, held)):
            for k, boxes in got.items():
                have = self.owner.setdefault(k, [])
                for b in boxes:
                    if math.prod(b[1]) and all(b != x for _, x in have):
                        have.append((r, b))

    def full(self, name: str) -> torch.Tensor | None:
        """Parameter ``name``'s full fp32 value on rank 0 (None elsewhere)."""
        e = self.training
        me = e.mesh.rank
        out = torch.zeros(self.shapes[name], dtype=torch.float32) if me == 0 else None
        recvs, sends = [], []
        local = {b: off for b, off in self.mine[name].boxes} if name in self.mine else {}
        for r, box in self.owner.get(name, []):
            if r == me == 0:
                out[whole_index(box)] = self.mine[name].box_tensor(box, local[box])
            elif me == 0:
                buf = torch.empty(box[1], dtype=torch.float32)
                recvs.append((dist.irecv(buf, src=r), box, buf))
            elif r == me:
                sends.append(dist.isend(self.mine[name].box_tensor(box, local[box]).contiguous(), dst=0))
        for w, box, buf in recvs:
            w.wait()
            out[whole_index(box)] = buf
        for w in sends:
            w.wait()
        return out
