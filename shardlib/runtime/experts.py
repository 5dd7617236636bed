"""The expert axis at run time: each experts module runs on this rank's experts, its rows moved to them and
back by the routing redistribution (``comm/experts.py``); the router's load-balancing statistics are the
whole batch's; and the step's norm counts each expert's gradient once.

The experts module is the one holding the weights the plan splits over ``expert`` (``Plan.is_expert``); its
forward keeps transformers' signature ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
(``models/moe.py``, transformers 5's fused ``*Experts``) and runs unchanged on the rows dispatched to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm.experts import batch_sum, combine, dispatch
from .grad_sync import DataReduction

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh
    from ..planner.plan import Plan
    from .state import ParamState


def route_experts(model: nn.Module, plan: Plan, global_plan: Plan, mesh: Mesh) -> list[str]:
    """Wrap the forward of every module holding expert weights with dispatch and combine over the expert
    axis; returns their names."""
    modules = dict(model.named_modules())
    owners: dict[str, int] = {}
    for pp in plan.params:
        if plan.is_expert(pp.name):
            owners[pp.name.rpartition(".")[0]] = global_plan.param(pp.name).shape[0]
    local = {pp.name.rpartition(".")[0]: pp.shape[0] for pp in plan.params if plan.is_expert(pp.name)}
    for name, n_experts in owners.items():
        module = modules[name]
        if isinstance(getattr(module, "num_experts", None), int):
            module.num_experts = local[name]      # transformers' experts count the experts they hold (grouped_mm)
        module.forward = _routed(module.forward, n_experts, mesh, plan.expert_axis)
    return sorted(owners)


def _routed(forward, n_experts: int, mesh: Mesh, axis: str):
    def routed(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, **kwargs: Any):
        rows, local, weights, back = dispatch(hidden_states, top_k_index, top_k_weights, n_experts, mesh, axis)
        return combine(forward(rows, local[:, None], weights[:, None], **kwargs), back)
    return routed


def global_statistics(model: nn.Module, mesh: Mesh, axes: tuple[str, ...]) -> int:
    """Give every module with a ``reduce_stats`` slot (a router's load-balancing loss: ``models/moe.py``) the
    sum over the batch's ranks, so its statistics are the whole batch's as one process computes them
    (Megatron's global aux loss); returns how many. Nothing to do where the batch is not split."""
    if mesh.axis_size(mesh.canonical_axes(axes)) == 1:
        return 0
    found = [m for m in model.modules() if hasattr(m, "reduce_stats")]
    for m in found:
        m.reduce_stats = lambda t: batch_sum(t, mesh, axes)
    return len(found)


class ExpertReduction(DataReduction):
    """The step's scalars with an expert axis (ZeRO-0): every gradient is replicated over data, and a
    non-expert's over expert too, so a rank's share of the squared norm is its experts' gradients (on the
    first data coordinate) and the rest on the first data and expert coordinates; summed over the batch's
    axes it counts each element once."""

    def __init__(self, mesh: Mesh, plan: Plan, states: list[ParamState], vector):
        super().__init__(mesh, plan.dp_axes, vector)
        self.expert = [plan.is_expert(s.name) for s in states if s.trainable]
        others = [a for a in plan.dp_axes if a != plan.expert_axis]
        self.first = all(mesh.coord(mesh.rank, a) == 0 for a in others)
        self.first_expert = mesh.coord(mesh.rank, plan.expert_axis) == 0

    def sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if not self.first:
            return total.float()
        for g, e in zip(grads, self.expert):
            if e or self.first_expert:
                total = total + (g.double() ** 2).sum()
        return total.float()
