"""The one gradient-synchronization protocol every part of a step that touches gradients speaks.

A step is: ``begin_step``; for each micro-batch ``begin_micro`` / forward and backward / ``end_micro``;
``finish`` (every reduction done; the reduced gradients, where the part hands them over); the masters'
gradients put in place; ``complete`` (what needs them whole). The engine calls each method on every part
that is on, in order, and never asks which forms those are:

* ``GradBuckets`` (``buckets.py``): data parallel and ZeRO-1/2 — gradients bucketed and all-reduced or
  reduce-scattered on the last micro-batch, overlapped with its backward; ``finish`` hands them over;
* ``UnitRunner`` (``units.py``): ZeRO-3 — each unit's gradient reduce-scattered into this rank's shard as
  backward leaves it, added over micro-batches;
* ``TensorRuntime`` (``tensor.py``): the tensor axis — its boundary state cleared after each backward;
* ``PipelineRuntime`` (``pipeline.py``): the pipe axis — runs the micro-batches by its schedule
  (``MicroBatches.run``) and, once the masters hold their gradients, sums tied weights' over the pipe.

``Accumulate`` runs the micro-batches in turn where there is no pipe. Each part also says how the step's
scalars are summed (``StepReduction``): the engine picks the first part that does at set-up.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from ..errors import ShardingError


class GradSync:
    """The protocol, each method a no-op by default: a part implements the moments it acts at."""

    def begin_step(self) -> None:
        """Before the step's first forward."""

    def begin_micro(self, first: bool, last: bool) -> None:
        """Before a micro-batch's forward: the step's first and/or last."""

    def end_micro(self) -> None:
        """After a micro-batch's backward."""

    def finish(self) -> list[list[torch.Tensor]] | None:
        """After the last backward: every reduction done. The reduced gradients by bucket, where this part
        hands them to the update (the buckets), else None (kept in the states' gradient shards)."""
        return None

    def complete(self, grads: list[torch.Tensor]) -> None:
        """The masters' gradients (``grads``, the trainable states' order) are in place."""


class MicroBatches(Protocol):
    """How a step's micro-batches run: in turn (``Accumulate``) or by a pipeline schedule."""

    def run(self, micro: list[Any], factor: float, loss_sum: torch.Tensor) -> None:
        """Forward and backward of every micro-batch, each loss scaled by ``factor`` before its backward;
        the unscaled losses added into ``loss_sum``."""


class StepReduction(Protocol):
    """How the step's scalars are summed over the mesh and a rank's share of the squared gradient norm
    is taken: over data (``DataReduction``), with the tensor or pipe axis, or riding the last bucket."""

    def sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor: ...

    def reduce(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """``[scalars..., on how many ranks each trainable parameter got a gradient]``, summed."""


class Accumulate:
    """Micro-batches in turn: the parts told where each begins and ends, the gradients reduced on the last
    (overlapped with its backward by the parts that hook it). A freed ZeRO-3 parameter read in a micro-batch
    is named by the part that freed it (``explain``)."""

    def __init__(self, syncs: list[GradSync], loss: Callable[[Any], torch.Tensor],
                 explain: Callable[[RuntimeError], str | None] | None = None):
        self.syncs, self.loss, self.explain = syncs, loss, explain

    def run(self, micro: list[Any], factor: float, loss_sum: torch.Tensor) -> None:
        m = len(micro)
        for i, mb in enumerate(micro):
            for sync in self.syncs:
                sync.begin_micro(first=i == 0, last=i == m - 1)
            try:
                loss = self.loss(mb)
                loss_sum += loss.detach().float()
                (loss.float() * factor).backward()
            except RuntimeError as e:
                if self.explain is not None and (said := self.explain(e)):
                    raise ShardingError(said) from e
                raise
            for sync in self.syncs:
                sync.end_micro()


class DataReduction:
    """No tensor or pipe axis: a rank's gradients are the whole model's (its piece under ZeRO-2/3), and the
    scalars are summed over the data axes in one all-reduce."""

    def __init__(self, mesh, axes: tuple[str, ...], vector: Callable[[list[torch.Tensor]], torch.Tensor]):
        self.mesh, self.axes, self.vector = mesh, axes, vector

    def sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((g.double() ** 2).sum() for g in grads).float() if grads else torch.zeros(())

    def reduce(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        from ..comm import core as comm
        return comm.all_reduce(self.vector(scalars), self.mesh, self.axes)


class Riding:
    """The step's scalars ride the last gradient bucket's all-reduce (``plan.scalars_ride_gradients``): their
    sums are read from the buckets; the norm's share is ``under``'s."""

    def __init__(self, under: StepReduction, buckets: Any):
        self.under, self.buckets = under, buckets

    def sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return self.under.sum_of_squares(grads)

    def reduce(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        return self.buckets.rider_sums
