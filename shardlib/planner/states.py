"""``StateLayouts``: where each training state lives on the data axis — the ZeRO stages as layouts."""

from __future__ import annotations

from dataclasses import dataclass

from ..algebra.mesh import AbstractMesh
from ..errors import Problems, ShardingError, ShardingTypeError
from ..validate import is_int


@dataclass(frozen=True)
class StateLayouts:
    """Where each training state lives on the data axis. ``None`` = replicated, an axis name =
    dim 0 split over that axis. ``keep_local_grads``: the full local gradient buffers persist
    between steps (DP, ZeRO-1) instead of living only until their bucket is reduced."""

    params: str | None = None
    grads: str | None = None
    optim: str | None = None
    keep_local_grads: bool = True

    @classmethod
    def zero(cls, stage: int, axis: str = "data") -> StateLayouts:
        """The layouts that ZeRO stage ``stage`` (0 = plain data parallel) names."""
        problem = zero_problem(stage)
        if problem is not None:
            kind, message = problem
            raise kind(message)
        return [cls(None, None, None, True), cls(None, axis, axis, True),
                cls(None, axis, axis, False), cls(axis, axis, axis, False)][stage]

    @property
    def stage(self) -> int | None:
        """The ZeRO stage these layouts are, or None for a combination with no stage number."""
        for k in range(4):
            if self == StateLayouts.zero(k, self.optim or self.grads or self.params or "data"):
                return k
        return None

    def validate(self, mesh: AbstractMesh) -> None:
        """Raise every problem of ``problems(mesh)`` at once (``ShardingError``)."""
        with Problems("plan", ShardingError) as p:
            for message in self.problems(mesh):
                p.add(message)

    def problems(self, mesh: AbstractMesh) -> list[str]:
        """What is wrong with these layouts on ``mesh``, one message per problem (empty: none)."""
        out = []
        for name in ("params", "grads", "optim"):
            axis = getattr(self, name)
            if axis is not None and axis not in mesh.axis_names:
                out.append(f"plan: states.{name} = {axis!r} is not an axis of the mesh {mesh.axis_sizes}.")
        if self.params is not None and (self.grads != self.params or self.optim != self.params):
            out.append(f"plan: parameters sharded at rest over {self.params!r} need gradients and optimizer "
                       f"state sharded the same way — got grads={self.grads!r}, optim={self.optim!r}. Use "
                       "zero=3, or keep the parameters replicated.")
        if self.grads is not None and self.optim != self.grads:
            out.append(f"plan: gradients sharded over {self.grads!r} need the optimizer state sharded the same "
                       f"way — got optim={self.optim!r}. A rank can only update what it holds.")
        if self.grads is None and not self.keep_local_grads:
            out.append("plan: keep_local_grads=False frees each local gradient once it is reduced, which saves "
                       "memory only when the reduced gradient is a shard — got grads=None (replicated). Shard the "
                       "gradients (grads='data', i.e. zero=2) or keep the local gradients.")
        if self.params is not None and self.keep_local_grads:
            out.append(f"plan: parameters sharded over {self.params!r} are gathered per unit and their full "
                       "gradients freed once reduce-scattered — got keep_local_grads=True. Use zero=3 "
                       "(keep_local_grads=False).")
        return out


def zero_problem(stage: object) -> tuple[type[Exception], str] | None:
    """What is wrong with ``zero=stage`` as ``(error type, message)``, or None when it is a stage."""
    rule = "0 (data parallel), 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)"
    if not is_int(stage):
        return ShardingTypeError, f"plan: zero must be an int — got {type(stage).__name__} {stage!r}; expected {rule}."
    if stage not in (0, 1, 2, 3):
        return ShardingError, f"plan: zero={stage!r} is out of range — expected {rule}."
    return None
