"""The reference GPT's mixture of experts: a router, routed experts stored as fused 3-D weights (as
transformers 5 stores them: ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) and
optional shared experts (Qwen2-MoE, DeepSeek), with the load-balancing loss of Switch/Mixtral.

The experts run on whatever experts their weights hold (the count is read off the weight, as attention
reads its heads): on one process every expert; split over an ``expert`` axis, this rank's, given the rows
routed to them (``top_k_index`` then names local experts). ``Experts.forward`` has transformers' signature
``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, each row's output the
weighted sum of its experts' outputs; an expert no row chose still runs (on zero rows), so every expert
weight gets a gradient, zero or not, at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..algebra.spec import Fused
from ..planner.specs import shard

if TYPE_CHECKING:
    from .gpt import GPTConfig


# each expert's weights are one slice of dim 0, the logical dim ``experts``: rules={"experts": "expert"}
# splits them over an expert axis; each expert's width (``expert_mlp``, transformers' name: gate|up, two
# blocks) may split over tensor, rules={"expert_mlp": "tensor"}, Megatron's tensor-parallel experts
@shard({"gate_up_proj": ("experts", Fused(2, "expert_mlp"), "embed"), "down_proj": ("experts", "embed", "expert_mlp")})
class Experts(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        e, h, i = cfg.n_experts, cfg.d_model, cfg.expert_width
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None].to(y.dtype))
        return out


# one expert as its own module (older families and hand-written models): a list of them, ``ExpertList``, is
# stacked for the expert axis (planner/stacked.py), its weights' dims then ("experts", *these)
@shard({"gate_up.weight": (Fused(2, "expert_mlp"), "embed"), "down.weight": ("embed", "expert_mlp")})
class ExpertMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.expert_width, bias=False)
        self.down = nn.Linear(cfg.expert_width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class ExpertList(nn.ModuleList):
    """The routed experts one module each (``GPTConfig(expert_modules=True)``), with ``Experts``' signature and
    arithmetic: each of its experts runs on the rows routed to it (an expert no row chose on zero rows)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__([ExpertMLP(cfg) for _ in range(cfg.n_experts)])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(len(self)):
            token, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token])
            out.index_add_(0, token, y * top_k_weights[token, slot, None].to(y.dtype))
        return out


# split over tensor as the dense MLP is (rules={"mlp": "tensor"}): gate|up a column of two blocks, down a row
@shard({"gate_up.weight": (Fused(2, "mlp"), "embed"), "down.weight": ("embed", "mlp")})
class SharedExperts(nn.Module):
    """``n`` always-on experts as one SwiGLU MLP of ``n`` experts' width (Qwen2-MoE's and DeepSeek's shared
    experts), added to every token's routed output."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        width = cfg.shared_experts * cfg.expert_width
        self.gate_up = nn.Linear(cfg.d_model, 2 * width, bias=False)
        self.down = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class AttachAux(torch.autograd.Function):
    """``y`` unchanged; in backward the aux loss gets ``scale`` as its gradient (what the training loss's
    backward gives a term it adds with that weight), wherever the loss is computed."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale, ctx.dtype, ctx.device = scale, aux.dtype, aux.device
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=ctx.dtype, device=ctx.device), None


@shard({"gate.weight": (None, "embed")})
class MoE(nn.Module):
    """Route each token to ``top_k`` of ``n_experts`` by a softmax router (renormalized over the chosen ones
    with ``norm_topk``), add the shared experts' output, and keep the layer's load-balancing loss
    ``E · Σ_e f_e · P_e`` (``f_e``: the fraction of the tokens' choices that went to ``e``, ``P_e``: its mean
    router probability) in ``aux_loss`` for the model to add."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk = cfg.n_experts, cfg.top_k, cfg.norm_topk
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)      # the router
        self.experts = ExpertList(cfg) if cfg.expert_modules else Experts(cfg)
        self.shared = SharedExperts(cfg) if cfg.shared_experts else None
        self.aux_loss: torch.Tensor | None = None
        self.aux_weight = cfg.aux_loss      # what the model weighs aux_loss by in its loss (0: not added)
        # a capacity per expert (0: dropless); its order is the whole batch's: ``gather_counts`` (set by the runtime
        # where the batch is split) gives every batch rank's rows per expert, in the batch's order, and this rank's
        # place in it
        self.capacity_factor = cfg.capacity_factor
        self.gather_counts: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None
        self.dropped = 0                    # (token, expert) rows dropped since the engine last read it
        # under a pipe axis (set by the runtime): the aux loss's gradient attached to this layer's output (Megatron's
        # aux-loss scaler), ``aux_weight`` x the factor the step scales each micro-batch's loss by; the model's loss
        # then leaves the term out of its graph (its value is added by the runtime)
        self.inject_aux = False
        self.aux_grad_scale = 1.0
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.scoring, self.n_group, self.topk_group = cfg.scoring, cfg.n_group, cfg.topk_group
        self.routed_scale, self.bias_rate = cfg.routed_scale, cfg.bias_rate
        if cfg.bias_rate:          # aux-loss-free balancing: chooses, never weighs; the step's load behind it
            self.register_buffer("routing_bias", torch.zeros(cfg.n_experts))
            self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(router probabilities [T, E] in fp32, top_k_index [T, k], top_k_weights [T, k])``: softmax scores, or
        DeepSeek-V3's sigmoid scores chosen (with the balancing bias) within the best ``topk_group`` of
        ``n_group`` groups (each group scored by its two best), weighed without the bias, scaled by
        ``routed_scale``."""
        logits = self.gate(flat).float()
        scores = F.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        choice = scores.detach() + self.routing_bias if self.bias_rate else scores.detach()
        if self.n_group > 1:
            grouped = choice.view(choice.shape[0], self.n_group, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1).indices, 1.0)
            choice = (grouped * keep[..., None]).view_as(choice)      # experts of other groups: never chosen
        index = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, index)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        probs = scores if self.scoring == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return probs, index, weights * self.routed_scale

    def balance_loss(self, probs: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Switch's load-balancing loss: ``E · Σ_e f_e · P_e``. Its statistics are the whole batch's where the
        batch is split over ranks: ``reduce_stats`` (set by the runtime: a sum over the batch's axes, whose
        backward sums the cotangents back — Megatron's global aux loss) adds every rank's counts, probability
        sums and tokens; without it, these tokens'."""
        stats = torch.cat([F.one_hot(index, self.n_experts).sum(dim=(0, 1)).float(),
                           torch.tensor([float(index.shape[0])], device=probs.device)])
        sums = probs.sum(dim=0)
        if self.reduce_stats is not None:
            stats, sums = self.reduce_stats(stats.detach()), self.reduce_stats(sums)
        chosen, tokens = stats[:-1], stats[-1]
        return self.n_experts * (chosen / (tokens * self.top_k) * sums / tokens).sum(), chosen

    def drop_overflow(self, index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Each expert keeps the first ``ceil(capacity_factor · T · k / E)`` of the batch's (token, expert) rows in
        token order (``T``: the whole batch's tokens; on a split batch, the ranks before this one in the batch's
        order come first: ``gather_counts``); a dropped row's expert becomes ``E`` (no expert: skipped by the
        experts and the routing) and its weight 0. Returns the index, the weights and the rows dropped in the
        whole batch."""
        e = self.n_experts
        onehot = F.one_hot(index.reshape(-1), e)                     # token-major (token, slot) rows
        mine = torch.cat([onehot.sum(dim=0), onehot.new_tensor([index.shape[0]])])
        every, me = self.gather_counts(mine) if self.gather_counts is not None else (mine[None], 0)
        before = every[:me, :e].sum(dim=0)
        tokens = int(every[:, e].sum())
        capacity = math.ceil(self.capacity_factor * tokens * self.top_k / e)
        position = before[None, :] + onehot.cumsum(dim=0) - 1        # each row's place among its expert's rows
        keep = (position.gather(1, index.reshape(-1, 1)).squeeze(1) < capacity).view_as(index)
        dropped = int((every[:, :e].sum(dim=0) - capacity).clamp(min=0).sum())
        return index.masked_fill(~keep, e), weights.masked_fill(~keep, 0.0), dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs, index, weights = self.route(flat)
        chosen_index = index
        if self.capacity_factor:
            index, weights, dropped = self.drop_overflow(index, weights)
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:   # a training forward, once
                self.dropped += dropped
        y = self.experts(flat, index, weights.to(flat.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)
        self.aux_loss, chosen = self.balance_loss(probs, chosen_index)      # the router's choices, before drops
        if self.inject_aux and self.aux_weight and torch.is_grad_enabled():
            y = AttachAux.apply(y, self.aux_loss, self.aux_weight * self.aux_grad_scale)
        if self.bias_rate and self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            # a training forward (not a shape probe, not a recompute inside backward)
            self.load += chosen.detach()
        return y.view_as(x)

    @torch.no_grad()
    def update_bias(self) -> None:
        """After a step: each expert's routing bias up by ``bias_rate`` if the step's batch gave it fewer rows
        than the mean, down if more (DeepSeek-V3's aux-loss-free balancing); the load starts again at zero.
        The load is the whole batch's (``reduce_stats``), so every rank nudges alike."""
        if self.bias_rate:
            self.routing_bias += self.bias_rate * torch.sign(self.load.mean() - self.load)
            self.load.zero_()
