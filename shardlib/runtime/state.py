"""Per-parameter runtime state: the tensors that realize a ``ParamPlan``'s layouts; and ``TrainingState``,
what checkpoints, pretrained loading and export read and write of a training run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..planner.flat import FlatSlot
from ..planner.plan import ParamPlan, Plan

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh
    from .scaler import LossScaler


@dataclass(eq=False)
class ParamState:
    """One parameter on this rank.

    * ``param`` — the ``nn.Parameter`` the module holds: full shape, compute dtype (under ZeRO-3
      its storage is allocated only while its unit is gathered);
    * ``master`` — what the optimizer sees: fp32, full or this rank's piece (None if frozen);
    * ``shard`` — ZeRO-3: this rank's piece in compute dtype, at rest (the master itself in fp32);
    * ``grad_shard`` — the reduced gradient piece kept between steps (ZeRO-2/3);
    * ``used`` — this step's backward gave the parameter a gradient on this rank.

    Where ZeRO shards it, a parameter lies at ``slot`` in a flat group (``planner/flat.py``) and
    this rank's piece is elements ``[lo, hi)`` of the flattened parameter (possibly empty); the
    pieces are 1-D. Unsharded: ``slot`` is None and ``[lo, hi)`` is the whole parameter.
    """

    index: int
    plan: ParamPlan
    param: nn.Parameter
    slot: FlatSlot | None
    lo: int
    hi: int
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    master: nn.Parameter | None = None
    shard: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    used: bool = False
    # ZeRO-3, a quantized weight: its packed bytes as compute-dtype elements, whose storage is filled
    # while gathered; ``param`` is the weight rebuilt as views of it (``quant/layout.py``)
    store: torch.Tensor | None = None
    # a quantized weight's format and options (``quant/api.py``): what a load quantizes its slices to
    quant_format: Any = None

    @property
    def storage(self) -> torch.Tensor:
        """The tensor whose storage holds the gathered parameter (ZeRO-3 fills and frees it)."""
        return self.param if self.store is None else self.store

    @property
    def master_shape(self) -> tuple[int, ...]:
        """The master's shape: the parameter's where it is whole, its 1-D piece where ZeRO shards it
        (known while an offloaded master's values are on disk)."""
        return tuple(self.plan.shape) if self.slot is None else (self.hi - self.lo,)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def trainable(self) -> bool:
        return self.plan.trainable

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full-shaped contiguous tensor ``full`` (a 1-D view, elements
        ``[lo, hi)`` of it flattened): what ``master``, ``shard`` and ``grad_shard`` hold of the
        parameter where it is sharded. The one place that knows how a parameter is split."""
        return full.view(-1)[self.lo:self.hi]


class TrainingState(Protocol):
    """What checkpoints (``checkpoint/``), pretrained loading and export (``pretrained/``) take: the states
    and the plan of a run, not its engine. The engine provides exactly these; those modules read nothing
    else from it (``tests/package/test_composition.py``)."""

    model: nn.Module
    mesh: Mesh
    plan: Plan                    # this rank's (its tensor shards' shapes)
    global_plan: Plan             # the whole mesh's (its pipeline stages)
    states: list[ParamState]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    scaler: LossScaler | None
    offload: Any                  # the optimizer's offload to the host or files (``offload/core.py``), or None
    step_count: int
    samples_seen: int
    needs_load: bool | str        # no values yet (init=False), or why it holds no one step's state
    awaited: frozenset[str]       # persistent buffers init=False zeroed: a load must bring them

    def publish(self) -> None:
        """The compute copies brought up to date with the masters."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, full, the same on every rank (a collective)."""
