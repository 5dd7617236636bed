"""The tensor axis at run time: the boundary redistributions on the modules (``comm/boundaries.py``),
vocab-parallel cross-entropy on the LM head's split logits (``vocab.py``), and the step's scalars
over ``(data, tensor)`` with each value counted once.

The data-parallel engine runs unchanged on the tensor-local plan (``Plan.local``): what it
reduces over ``data`` is each rank's tensor shard. The global gradient norm adds, over
``tensor``, the squares of the split parameters' shards, and counts a parameter replicated over
``tensor`` once (tensor coordinate 0's copy; every coordinate holds the same gradient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .grad_sync import GradSync
from ..comm import core as comm
from ..comm.boundaries import Boundaries
from ..comm.boundary_ops import Ops
from .vocab import ShardedLogits

if TYPE_CHECKING:
    from .engine import Engine


def _split(spec, axis: str) -> bool:
    return any(e == axis or (isinstance(e, tuple) and axis in e) for e in tuple(spec))


class TensorRuntime(GradSync):
    """Installed by the engine when its plan splits parameters over ``tensor``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        plan, mesh = engine.plan, engine.mesh
        tp = plan.tensor
        self.axis, self.mesh = tp.axis, mesh
        self.coord = mesh.coord(mesh.rank, tp.axis)
        self.data_coord = mesh.coord(mesh.rank, plan.data_axis)
        self.ops = Ops(mesh, tp.axis, tp.seq_dim)
        self.logits = ShardedLogits() if tp.has_logits else None
        # the whole model's units (a pipeline stage holds some): the first and last of the stack
        # slice and gather the sequence under SP wherever they run
        self.boundaries = Boundaries(engine.model, tp, self.ops, [u.name for u in engine.global_plan.units],
                                     on_logits=self._mark if self.logits is not None else None,
                                     recomputed=[u.name for u in engine.global_plan.units if u.recompute])
        self.split = [_split(s.plan.spec, tp.axis) for s in engine.states if s.trainable]

    def _mark(self, output: torch.Tensor, site) -> None:
        self.logits.mark(output, mesh=self.mesh, axis=self.axis, vocab_size=site.width)

    def loss(self, batch: Any) -> torch.Tensor:
        """The engine's loss of one micro-batch, with the LM head's split logits routed to
        vocab-parallel cross-entropy."""
        if self.logits is None:
            return self.engine.loss_of(batch)
        try:
            with self.logits:
                return self.engine.loss_of(batch)
        finally:
            self.logits.clear()

    def clear(self) -> None:
        self.boundaries.clear()

    def end_micro(self) -> None:
        self.clear()

    def sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the squared global norm: its split shards in full, the replicated
        parameters on tensor coordinate 0 only; with replicated (DP) gradients on data coordinate
        0 only. Summed over ``(data, tensor)`` it counts each element once."""
        zero = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if self.engine.plan.states.grads is None and self.data_coord != 0:
            return zero.float()          # replicated gradients: data coordinate 0 counts them
        split = sum(((g.double() ** 2).sum() for g, s in zip(grads, self.split) if s), zero)
        rep = sum(((g.double() ** 2).sum() for g, s in zip(grads, self.split) if not s), zero)
        return (split + rep if self.coord == 0 else split).float()

    def reduce(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """All-reduce the step's scalar vector ``[loss, (found_inf), (sumsq), used...]`` over
        ``(data, tensor)``: the loss and the used flags are the same on every tensor coordinate, so
        coordinate 0 alone contributes them (adding zeros is exact)."""
        vec = self.engine.scalar_vector(scalars)
        if self.coord != 0:
            vec[0] = 0.0
            first_flag = len(vec) - len(self.split)
            vec[first_flag:] = 0.0
        plan = self.engine.plan
        return comm.all_reduce(vec, self.mesh, self.mesh.canonical_axes((*plan.dp_axes, self.axis)))
