"""What a rank holds of the global tensors a checkpoint saves: ``rank_pieces`` (parameters, optimizer state,
quantized weights as their components) as boxes of each global tensor. ``checkpoint.py`` writes and reads
them; ``pretrained.py`` and ``runtime/pretrained/peft_export.py`` assemble full tensors from them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ...algebra.boxes import Box, piece_boxes
from ...algebra.layout import Layout
from ...comm import core as comm
from ...quant import formats
from ...quant.layout import QuantSpec, views

if TYPE_CHECKING:
    from ..training import TrainingState
    from ...algebra.mesh import Mesh
    from ...planner.plan import Plan


# ---- what a rank holds ------------------------------------------------------------------------

class Piece:
    """This rank's part of one global tensor: a flat range of its block, as boxes (global
    coordinates) and the 1-D tensor holding it. ``block`` is ``(parts, start)`` per dim
    (``tensor_block``): a fused parameter's block is its chunk of each of the dim's blocks, and a box of
    it may lie strided in the flat piece (``box_tensor`` views it there, writable)."""

    def __init__(self, key: str, shape: tuple[int, ...], block: tuple[tuple[int, ...], tuple[int, ...]],
                 local: tuple[int, ...], lo: int, hi: int, flat: torch.Tensor):
        self.key, self.shape, self.flat = key, shape, flat
        self.refill: Callable[[], None] | None = None     # after a load wrote ``flat``: where it goes
        self.boxes: list[tuple[Box, int]] = []       # (global box, offset in flat)
        self._strides: dict[int, tuple[int, ...]] = {}
        parts, start = block
        for b, off, strides in piece_boxes(shape, parts, start, local, lo, hi):
            self.boxes.append((b, off))
            self._strides[off] = strides
        assert sum(math.prod(b[1]) for b, _ in self.boxes) == flat.numel(), (key, flat.numel())

    def box_tensor(self, box: Box, off: int) -> torch.Tensor:
        return self.flat.as_strided(box[1], self._strides[off], self.flat.storage_offset() + off)


def tensor_block(training: TrainingState, s) -> tuple[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
    """(global shape, ``(parts, start)``) of parameter state ``s``'s tensor-parallel block: per dim,
    the number of fused blocks (1 for a plain dim) and where this rank's chunk of each begins."""
    pp = s.plan
    if pp.full_shape is None:
        return tuple(pp.shape), ((1,) * len(pp.shape), (0,) * len(pp.shape))
    lay = Layout(training.mesh, pp.spec)
    shape = tuple(pp.full_shape)
    first, _ = lay.local_boxes(shape, training.mesh.rank)[0]      # block 0 of each fused dim: its start in it
    fused = lay.fused
    return shape, (tuple(fused.get(d, 1) for d in range(len(shape))), tuple(g.start for g in first))


def rank_pieces(training: TrainingState, *, frozen: bool = True, quantized: bool = False
            ) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    """Every sharded tensor this rank holds (values, optimizer states) and its replicated ones
    (per-parameter optimizer scalars, buffers); ``frozen=False`` leaves frozen parameters out.
    Quantized weights only with ``quantized=True``, as their components (``_quant_pieces``: a
    collective under ZeRO-3, each rank then holding its tensor shards' packed bytes whole)."""
    pieces, whole = [], {}
    opt_state = training.optimizer.state
    specs = {p.name: p.quant for p in training.global_plan.params if p.quant is not None}
    for s in training.states:
        if not frozen and not s.trainable:
            continue
        shape, block = tensor_block(training, s)
        local = tuple(s.plan.shape)

        def add(key: str, t: torch.Tensor) -> None:
            pieces.append(Piece(key, shape, block, local, s.lo, s.hi, t.reshape(-1)))

        if s.plan.quant is not None:
            pieces += _quant_pieces(training, s, specs[s.name]) if quantized else []
        elif s.trainable:
            add(f"param/{s.name}", s.master.detach())
            for k, v in opt_state.get(s.master, {}).items():
                if not isinstance(v, torch.Tensor):
                    continue
                if v.numel() == s.master.numel() and v.dim() > 0:
                    add(f"optim/{k}/{s.name}", v)
                else:
                    whole[f"optim/{k}/{s.name}"] = v
        else:
            src = s.shard if s.shard is not None else s.local_piece(s.param.detach())
            add(f"param/{s.name}", src.detach().float())
    pp, mesh = training.global_plan.pipeline, training.mesh
    mine = ({s.index for s in pp.stages_of(mesh.coord(mesh.rank, pp.axis))}
            if pp is not None and training.global_plan.pipe_size > 1 else None)
    for name, b in training.model.named_buffers():
        if b.is_meta:
            continue
        if mine is not None and name.startswith(pp.stack + ".") and pp.stage_of(name) not in mine:
            continue          # another stage's block: its copy here is stale (a router's balancing bias)
        whole[f"buffer/{name}"] = b
    return pieces, whole


def quant_shard(mesh: Mesh, plan: Plan, s) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A quantized weight's tensor shard on this rank, and under ZeRO-3 the byte buffer its components
    view: the ranks' pieces of its packed bytes summed over the axes ZeRO splits it over (``data``; with an
    expert or context axis, data x that axis for a weight that is not an expert's) into zeros (each byte held
    by one rank: exact). A collective of that group under ZeRO-3."""
    if s.store is None:
        return s.param.detach(), None
    raw = torch.zeros(s.store.numel() * s.store.element_size(), dtype=torch.uint8, device=mesh.device)
    s.local_piece(raw.view(s.store.dtype)).view(torch.uint8).copy_(s.shard.view(torch.uint8))
    comm.all_reduce(raw, mesh, plan.shard_axes(s.name), inplace=True)
    return views(s.param, raw, tuple(s.plan.shape)), raw


def _quant_pieces(training: TrainingState, s, spec: QuantSpec) -> list[Piece]:
    """A quantized frozen weight as its components (``quant/<name>/<component>``: codes, scales, zero
    points), each a global tensor of which this rank's tensor shard holds one box — the entries
    covering the shard's box of the weight, a component kept whole on a dim (a per-row scale under a
    row split) held whole. Saved in their own dtypes: a load on any mesh gets the same codes. ``spec``
    is the whole weight's (a shard's own may see a dim it cuts as one entry spanning it)."""
    q, raw = quant_shard(training.mesh, training.plan, s)
    shape, (_, start) = tensor_block(training, s)
    out, comps = [], formats.components(q)
    for c in spec.components:
        comp = comps[c.name]
        assert comp.is_contiguous(), (s.name, c.name)
        first = tuple(0 if c.whole[d] else start[d] // c.block[d] for d in range(len(shape)))
        p = Piece(f"quant/{s.name}/{c.name}", c.shape(shape), ((1,) * len(shape), first), tuple(comp.shape),
                   0, comp.numel(), comp.view(-1))
        if raw is not None:          # ZeRO-3: the loaded bytes back into this rank's piece of them
            p.refill = lambda s=s, raw=raw: s.shard.view(torch.uint8).copy_(
                s.local_piece(raw.view(s.store.dtype)).view(torch.uint8))
        out.append(p)
    return out


def quantized_names(training: TrainingState) -> list[str]:
    return [p.name for p in training.global_plan.params if p.quant is not None]


def param_of(key: str) -> str:
    """The parameter a piece's key belongs to (``param/<name>``, ``quant/<name>/<component>``)."""
    kind, _, rest = key.partition("/")
    return rest.rpartition("/")[0] if kind == "quant" else rest

