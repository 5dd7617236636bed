"""The expert axis at run time: each experts module runs on this rank's experts, its rows moved to them and
back by the routing redistribution (``comm/experts.py``); the router's load-balancing statistics are the
whole batch's; and the step's norm counts each expert's gradient once.

The experts module is the one holding the weights the plan splits over ``expert`` (``Plan.is_expert``); its
forward keeps transformers' signature ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
(``models/moe.py``, transformers 5's fused ``*Experts``) and runs unchanged on the rows dispatched to it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import core as comm
from ..comm.experts import combine, dispatch, statistics_sum
from ..planner.peft import is_adapter, param_wrappers
from .grad_sync import DataReduction

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh
    from ..planner.plan import Plan
    from .state import ParamState


_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("expert_probe", default=False)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Inside, every experts module on the expert axis returns zeros of its input's shape, routing nothing: a
    shape probe (the pipeline's stream) that must communicate nothing."""
    token = _PROBING.set(True)
    try:
        yield
    finally:
        _PROBING.reset(token)


def route_experts(model: nn.Module, plan: Plan, global_plan: Plan, mesh: Mesh) -> ExpertCounts:
    """Wrap the forward of every module holding expert weights with dispatch and combine over the expert
    axis; returns the step's per-expert token counts they fill (``ExpertCounts``). Under a pipe axis the other
    stages' experts modules are wrapped too, for ``probing`` only (they never run a step here)."""
    modules = dict(model.named_modules())
    mine = [pp for pp in plan.params if plan.is_expert(pp.name) and not is_adapter(pp.name)]
    owners = {pp.name.rpartition(".")[0]: global_plan.param(pp.name).shape[0] for pp in mine}
    local = {pp.name.rpartition(".")[0]: pp.shape[0] for pp in mine}
    for _, m, weight in param_wrappers(model):       # PEFT's LoRA of a routed 3-D weight: its experts, this rank's
        if isinstance(getattr(m, "num_experts", None), int) and weight.rpartition(".")[0] in local:
            m.num_experts = local[weight.rpartition(".")[0]]
    counts = ExpertCounts(sorted(owners), owners, mesh, plan.expert_axis)
    for i, (name, n_experts) in enumerate(sorted(owners.items())):
        module = modules[name]
        if isinstance(getattr(module, "num_experts", None), int):
            module.num_experts = local[name]      # transformers' experts count the experts they hold (grouped_mm)
        module.forward = _routed(module.forward, n_experts, mesh, plan.expert_axis, counts, i)
    for pp in global_plan.params:
        owner = pp.name.rpartition(".")[0]
        if global_plan.is_expert(pp.name) and not is_adapter(pp.name) and owner not in owners \
                and "forward" not in modules[owner].__dict__:
            modules[owner].forward = _probe_only(modules[owner].forward)
    return counts


def _probe_only(forward):
    def probed(hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        return torch.zeros_like(hidden_states) if _PROBING.get() else forward(hidden_states, *args, **kwargs)
    return probed


def _routed(forward, n_experts: int, mesh: Mesh, axis: str, counts: ExpertCounts, layer: int):
    def routed(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, **kwargs: Any):
        if _PROBING.get():
            return torch.zeros_like(hidden_states)
        onehot = top_k_index.dim() == 3           # Switch's routing: a one-hot mask [T, k, E], a row dropped all 0
        index = torch.where(top_k_index.any(-1), top_k_index.argmax(-1), n_experts) if onehot else top_k_index
        rows, local, weights, back = dispatch(hidden_states, index, top_k_weights, n_experts, mesh, axis)
        counts.add(layer, local, back)
        chosen = local[:, None]
        if onehot:
            chosen = torch.nn.functional.one_hot(chosen, n_experts // mesh.axis_size(axis)).to(top_k_index.dtype)
        return combine(forward(rows, chosen, weights[:, None], **kwargs), back, rows, weights)
    return routed


class ExpertCounts:
    """The step's tokens per expert of every experts module: each rank adds the rows its experts received
    (in forward, not in a recompute), at its experts' places; summed over the batch's axes in the step's
    scalar all-reduce (``ExpertReduction``), they are the whole batch's (each token once per chosen expert)."""

    def __init__(self, names: list[str], experts: dict[str, int], mesh: Mesh, axis: str):
        self.names, self.experts = names, [experts[n] for n in names]      # each module's experts in all
        n = mesh.axis_size(axis)
        self.per = [e // n for e in self.experts]                          # a rank's of each
        self.coord = mesh.coord(mesh.rank, axis)
        self.local = torch.zeros(len(names), max(self.experts, default=0), dtype=torch.float32, device=mesh.device)
        self.last: dict[str, list[int]] = {}
        # this rank's rows routed to other ranks' experts and received from other ranks, per module: this step's
        # so far, and the last step's
        self.moved = [[0, 0] for _ in names]
        self.last_moved: dict[str, tuple[int, int]] = {}

    def add(self, layer: int, local_ids: torch.Tensor, routed=None) -> None:
        if torch._C._current_graph_task_id() != -1:        # a recompute inside backward: counted already
            return
        per = self.per[layer]
        self.local[layer, self.coord * per:(self.coord + 1) * per] += torch.bincount(local_ids, minlength=per).float()
        if routed is not None:
            self.moved[layer][0] += sum(routed.in_splits) - routed.in_splits[self.coord]
            self.moved[layer][1] += sum(routed.out_splits) - routed.out_splits[self.coord]

    def settle(self, summed: torch.Tensor) -> None:
        """The summed counts of this step: kept as ``last``; the accumulator starts the next step at zero."""
        rows = summed.view_as(self.local).tolist()
        self.last = {name: [int(round(v)) for v in row[:e]] for name, row, e in zip(self.names, rows, self.experts)}
        self.local.zero_()
        self.last_moved = {name: (m[0], m[1]) for name, m in zip(self.names, self.moved)}
        self.moved = [[0, 0] for _ in self.names]

    def imbalance(self) -> float | None:
        """The most loaded expert's tokens over the mean, the worst module's (1.0: perfectly even)."""
        worst = [max(c) * len(c) / sum(c) for c in self.last.values() if sum(c)]
        return max(worst) if worst else None


def global_statistics(model: nn.Module, mesh: Mesh, axes: tuple[str, ...], tokens_axis: str | None = None) -> int:
    """Give every module with a ``reduce_stats`` slot (a router's load-balancing loss: ``models/moe.py``) the
    sum over the batch's ranks, so its statistics are the whole batch's as one process computes them
    (Megatron's global aux loss), and every module with a ``gather_counts`` slot (a capacity's order) every
    batch rank's counts in the batch's order with this rank's place; returns how many modules. Nothing to do
    where the batch is not split. ``tokens_axis``: an axis the tokens are split over besides the batch's
    (sequence parallelism's tensor axis): the statistics are summed over it too, forward only — its ranks
    compute one loss, each from the whole statistics, so each rank's share of the gradient is its own tokens'
    (the planner refuses a capacity there: its order is the sequence's)."""
    canon = mesh.canonical_axes(axes)
    split = mesh.axis_size(canon) > 1
    if not split and tokens_axis is None:
        return 0
    place = mesh.group_index(mesh.rank, axes)           # this rank's rows' place in the batch (Engine.data_index)

    def gathered(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        every = comm.all_gather(torch.cat([t.reshape(-1), t.new_tensor([place])])[None], mesh, canon)
        return every[torch.argsort(every[:, -1]), :-1], place     # in the batch's order

    found = [m for m in model.modules() if hasattr(m, "reduce_stats") or hasattr(m, "gather_counts")]
    for m in found:
        if hasattr(m, "reduce_stats"):
            m.reduce_stats = lambda t: statistics_sum(t, mesh, axes, tokens_axis)
        if getattr(m, "capacity_factor", 0) and split:
            m.gather_counts = gathered
    return len(found)


def capacity_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE layers with a capacity (``models/moe.py``'s ``capacity_factor``), by name."""
    return {name: m for name, m in model.named_modules() if getattr(m, "capacity_factor", 0)}


def dropped_rows(layers: dict[str, nn.Module]) -> dict[str, int]:
    """The (token, expert) rows each of ``layers`` (``capacity_layers``) dropped since the last call (the whole
    batch's, the same on every rank), read and reset."""
    out = {}
    for name, m in layers.items():
        out[name], m.dropped = int(m.dropped), 0
    return out


class ExpertReduction(DataReduction):
    """The step's scalars with an expert axis (and a tensor axis, if any). A rank counts a gradient's square
    where it is the one copy of those elements: a gradient replicated over an axis counts on that axis's
    first coordinate. Under ZeRO-0 every gradient is replicated over data and a non-expert's over expert too;
    under ZeRO-1/2/3 a rank holds its own pieces of the reduced gradients, disjoint over their shard axes (HSDP's
    replicas zeroed by the engine); a parameter not split over tensor is replicated over it. The loss, the
    used flags and the tokens per expert are the same on every tensor coordinate: coordinate 0 gives them.
    Summed over the batch's axes (and tensor) it counts each element once."""

    def __init__(self, mesh: Mesh, plan: Plan, states: list[ParamState], vector, counts: ExpertCounts):
        tensor = plan.tensor.axis if plan.tensor is not None and plan.tensor_size > 1 else None
        super().__init__(mesh, mesh.canonical_axes((*plan.dp_axes, *((tensor,) if tensor else ()))), vector)
        self.counts = counts
        trainable = [s for s in states if s.trainable]
        self.expert = [plan.is_expert(s.name) for s in trainable]
        others = [a for a in plan.dp_axes if a != plan.expert_axis]
        self.first = all(mesh.coord(mesh.rank, a) == 0 for a in others)
        self.first_expert = mesh.coord(mesh.rank, plan.expert_axis) == 0
        self.first_tensor = tensor is None or mesh.coord(mesh.rank, tensor) == 0
        # sequence parallelism with the experts whole on each tensor rank: each routes its own chunk's tokens
        tp = plan.tensor
        self.own_counts = tensor is not None and tp.sp_axis is not None and not any(s.kind == "experts" for s in tp.sites)
        self.split = [tensor is not None and tensor in s.plan.spec.axes for s in trainable]
        self.pieces = plan.states.optim is not None

    def sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if not self.pieces and not self.first:
            return total.float()
        for g, e, t in zip(grads, self.expert, self.split):
            if (self.pieces or e or self.first_expert) and (t or self.first_tensor):
                total = total + (g.double() ** 2).sum()
        return total.float()

    def settle_counts(self) -> None:
        """The step's tokens per expert summed over the batch's axes (and tensor) on their own: under a pipe
        axis, whose scalars are summed over other axes, and each stage holds its own experts modules."""
        local = self.counts.local.reshape(-1).clone()
        if not self.first_tensor and not self.own_counts:
            local.zero_()
        self.counts.settle(comm.all_reduce(local, self.mesh, self.axes))

    def reduce(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """The scalars, with the step's tokens per expert riding the same all-reduce (no collective more)."""
        vec = torch.cat([self.vector(scalars), self.counts.local.reshape(-1)])
        n = len(vec) - self.counts.local.numel()
        if not self.first_tensor:          # the loss, the flags and the counts: tensor coordinate 0's
            vec[0] = 0.0
            vec[n - len(self.expert):n if self.own_counts else None] = 0.0
        out = comm.all_reduce(vec, self.mesh, self.axes)
        self.counts.settle(out[n:])
        return out[:n]
