"""Per-parameter runtime state: the tensors that realize a ``ParamPlan``'s layouts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..planner.plan import ParamPlan
from .flat import RowSharding


@dataclass(eq=False)
class ParamState:
    """One parameter on this rank.

    * ``param`` — the ``nn.Parameter`` the module holds: full shape, compute dtype (under ZeRO-3
      its storage is allocated only while its unit is gathered);
    * ``master`` — what the optimizer sees: fp32, full or this rank's rows (None if frozen);
    * ``shard`` — ZeRO-3: this rank's rows in compute dtype, at rest (the master itself in fp32);
    * ``grad_shard`` — the reduced gradient rows kept between steps (ZeRO-2/3);
    * ``used`` — this step's backward gave the parameter a gradient on this rank.
    """

    index: int
    plan: ParamPlan
    param: nn.Parameter
    rows: RowSharding
    lo: int
    hi: int
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    master: nn.Parameter | None = None
    shard: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    used: bool = False

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def trainable(self) -> bool:
        return self.plan.trainable

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` viewed with the sharding shape (0-d parameters become one row)."""
        return t.view(self.rows.shape)

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full-shaped tensor ``full`` (a view): what ``master``, ``shard`` and
        ``grad_shard`` hold of the parameter. The one place that knows how a parameter is split."""
        return self.flat(full)[self.lo:self.hi]
