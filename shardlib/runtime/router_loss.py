"""A transformers MoE model's router load-balancing loss with the whole batch's statistics.

transformers' MoE causal LMs (Mixtral and the families that copy its ``load_balancing_loss_func``: Qwen2-MoE,
Qwen3-MoE, OLMoE, Jamba, GraniteMoE, PhiMoE, GPT-OSS, ...) add ``router_aux_loss_coef`` times Switch's loss
``E · Σ_e f_e · P_e`` when ``config.output_router_logits`` is set: ``f_e`` the share of the top-k choices that
went to expert ``e`` and ``P_e`` its mean router probability, over every layer's rows (padding excluded by the
attention mask). The function takes those over the rows it is given: on a split batch each rank's, not the
batch's. Here its counts, probability sums and rows are summed over the batch's ranks — and under sequence
parallelism over the tensor ranks holding the sequence's chunks (``comm/experts.statistics_sum``: the probability
sums all-reduced forward and backward over the batch's ranks, Megatron's global aux loss; forward only over the
chunks) — so the loss and its gradients are one process's.

The function is replaced only where its body is the formula reimplemented here (``FINGERPRINTS``: its AST,
docstring aside, as transformers 5 writes it); another body is refused at plan time by name
(``planner/experts.aux_loss_problems``, ``planner/hf_router.py``). The replacement is installed once per modeling module and runs the
global form only inside an engine's forward (``active``); anywhere else it is the original.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm.experts import statistics_sum
from ..planner.hf_router import NAME, adds_router_loss, known, modeling_module

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh

_ACTIVE: contextvars.ContextVar[tuple[Any, tuple[str, ...], str | None] | torch.Tensor | None] = contextvars.ContextVar(
    "router_loss", default=None)


def install(model: nn.Module) -> bool:
    """Replace the modeling module's function (once) by one that takes the whole batch's statistics inside
    ``active``; True where ``model`` adds a router loss of the known formula."""
    if not adds_router_loss(model) or not known(model)[0]:
        return False
    mod = modeling_module(model)
    fn = getattr(mod, NAME)
    if getattr(fn, "__wrapped__", None) is None:
        def dispatch(*args, **kwargs):
            state = _ACTIVE.get()
            if isinstance(state, torch.Tensor):        # ``valued``: the loss worked out across a pipe
                return state
            return (fn if state is None else global_load_balancing)(*args, **kwargs)
        dispatch.__wrapped__ = fn
        setattr(mod, NAME, dispatch)
    return True


@contextlib.contextmanager
def active(mesh: Mesh, axes: tuple[str, ...], tokens_axis: str | None = None) -> Iterator[None]:
    """Inside, the installed functions sum their statistics over ``axes`` (the batch's) of ``mesh``, and over
    ``tokens_axis`` (sequence parallelism's tensor axis: each rank's router logits are its chunk of the
    sequence) forward only — its ranks compute one loss from the whole statistics."""
    token = _ACTIVE.set((mesh, axes, tokens_axis))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def valued(value: torch.Tensor) -> Iterator[None]:
    """Inside, the installed functions return ``value``: the last pipeline stage's model forward meets no
    router logits (its blocks ran on earlier stages); ``runtime/pipe_router.py`` gathered their statistics."""
    token = _ACTIVE.set(value)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def local_statistics(gate_logits, num_experts: int, top_k: int, attention_mask: torch.Tensor | None,
                     mesh: Mesh, chunked: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts [E], rows, probability sums [E])`` of this rank's router logits ``gate_logits`` (one per layer),
    padding left out by ``attention_mask`` — under sequence parallelism over ``chunked`` this rank's chunk of
    each row's positions — as transformers' function sums them; only the probability sums carry a gradient."""
    device = gate_logits[0].device
    if chunked is not None and attention_mask is not None:       # this rank's chunk of each row's positions
        t, i = mesh.axis_size((chunked,)), mesh.group_index(mesh.rank, (chunked,))
        attention_mask = attention_mask.chunk(t, dim=1)[i]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32) if attention_mask is not None else None
    for layer in gate_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        if mask is None:
            counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return counts, rows, probs


def switch_loss(counts: torch.Tensor, rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``E · Σ (C / N) · (P / N)``, as transformers writes it."""
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * counts.numel()


def global_load_balancing(gate_logits, num_experts: int | None = None, top_k: int = 2,
                          attention_mask: torch.Tensor | None = None):
    """transformers' ``load_balancing_loss_func`` with every sum over the batch's ranks (``active``)."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    mesh, axes, chunked = _ACTIVE.get()
    counts, rows, probs = local_statistics(gate_logits, num_experts, top_k, attention_mask, mesh, chunked)
    stats = statistics_sum(torch.cat([counts, rows.reshape(1)]).detach(), mesh, axes, chunked)
    probs = statistics_sum(probs, mesh, axes, chunked)
    return switch_loss(stats[:-1], stats[-1], probs)
