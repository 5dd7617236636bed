"""A transformers MoE model's router load-balancing loss under a pipe axis.

transformers' causal LMs (Mixtral and the families copying its ``load_balancing_loss_func``) add
``router_aux_loss_coef · E · Σ_e (C_e / N) · (P_e / N)`` to the loss: ``C`` the top-k choices per expert, ``P``
the router probability sums, ``N`` the rows, over every layer's router logits (padding left out by the
attention mask). Under a pipe axis the layers sit on different stages, so no stage sees all the logits. All
three are sums, though, and only ``P`` carries a gradient, whose cotangent ``coef · E · C / N²`` is one vector
per micro-batch. So, per micro-batch:

* each stage records its routers' logits (forward hooks on the modules the model's own ``OutputRecorder``
  names), adds its rows' ``(C, N, P)`` to the sums it received, and sends them on behind the stream
  (``2E + 1`` fp32: ``PipelinePlan.forward_floats``);
* the last stage sums them over the batch's ranks (and sequence parallelism's tensor ranks, each holding a
  chunk of the rows) — one all-reduce, forward only — and runs the model's own loss with the function
  returning that value (``router_loss.valued``), so the loss is one process's;
* the cotangent of ``P`` is worked out there (the formula's own autograd), scaled as the step scales the
  loss, and rides the backward messages back (``E`` fp32); each stage's ``P`` is a second root of the
  stage's backward (``root``), beside its output, wherever that backward runs (whole, or split input /
  weight). The stage's output is left as it is: SP's head edge recognizes the stream it gathered.

Each batch rank's share of the cotangent is the whole batch's (``batch ranks ×``): the data axis's gradient
reduction averages, as the global aux loss's all-reduce both ways does without a pipe (``comm/experts.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm.autograd import Psum
from . import router_loss
from ..planner.hf_router import recorded_routers, router_counts

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh


class PipeRouterLoss:
    """The load-balancing loss of a transformers model across a pipeline's stages (see the module doc)."""

    def __init__(self, model: nn.Module, mesh: Mesh, blocks: Mapping[int, list[nn.Module]],
                 batch_axes: tuple[str, ...], chunks: str | None):
        found = recorded_routers(model)
        if found is None:
            raise ValueError(f"{type(model).__name__} records no router_logits")
        cls, self.index = found
        self.experts, self.top_k, self.coef = router_counts(model)
        self.mesh, self.chunks = mesh, chunks
        over = mesh.canonical_axes((*batch_axes, *((chunks,) if chunks else ())))
        self.sum_over = over if mesh.axis_size(over) > 1 else ()
        # a batch rank's share of the cotangent: the whole batch's (its gradients are averaged over them)
        self.batch_ranks = mesh.axis_size(mesh.canonical_axes(batch_axes))
        self.hooks = [r.register_forward_hook(self._record) for bs in blocks.values() for b in bs
                      for r in b.modules() if isinstance(r, cls)]
        self.captured: list[torch.Tensor] | None = None
        self.sums: dict[tuple[int, int], torch.Tensor] = {}       # (stage, mb) -> [C, N, P] so far
        self.probs: dict[tuple[int, int], torch.Tensor] = {}      # (stage, mb) -> the stage's own P
        self.cotangent: dict[int, torch.Tensor] = {}              # mb -> the probability sums' cotangent
        self.factor = 1.0

    def begin_step(self, factor: float) -> None:
        self.factor = factor
        self.sums, self.probs, self.cotangent = {}, {}, {}

    def _record(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.captured is not None:
            self.captured.append(out[self.index] if isinstance(out, (tuple, list)) else out)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the routers' logits of the blocks run inside (a recomputed forward in backward is not)."""
        self.captured = []
        try:
            yield
        finally:
            self.captured = None

    def after_blocks(self, s: int, i: int, batch: Any, logits: list[torch.Tensor]) -> None:
        """Add stage ``s``'s rows of micro-batch ``i`` (``logits``: its routers', in order) to the sums, and keep
        their probability sums for the stage's backward."""
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        counts, rows, probs = router_loss.local_statistics(logits, self.experts, self.top_k, mask, self.mesh,
                                                           self.chunks)
        mine = torch.cat([counts, rows.reshape(1), probs.detach()])
        before = self.sums.pop((s, i), None)
        self.sums[(s, i)] = mine if before is None else before + mine
        if probs.requires_grad:
            self.probs[(s, i)] = probs

    def root(self, s: int, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Stage ``s``'s probability sums of micro-batch ``i`` and their cotangent, for its backward."""
        probs = self.probs.pop((s, i), None)
        return None if probs is None else (probs, self.cotangent[i])

    def pack_forward(self, s: int, i: int) -> torch.Tensor:
        return self.sums.pop((s, i))

    def unpack_forward(self, s: int, i: int, floats: torch.Tensor) -> None:
        self.sums[(s, i)] = floats

    def pack_backward(self, i: int) -> torch.Tensor:
        return self.cotangent[i]

    def unpack_backward(self, i: int, floats: torch.Tensor) -> None:
        self.cotangent[i] = floats

    @contextlib.contextmanager
    def last_stage(self, s: int, i: int) -> Iterator[None]:
        """Around the last stage's loss of micro-batch ``i``: the sums over every stage made the whole
        batch's, the model's load-balancing function returning their loss, and the cotangent set."""
        stats = self.sums.pop((s, i))
        if self.sum_over:
            stats = Psum.apply(stats, self.mesh, self.sum_over)
        e = self.experts
        p = stats[e + 1:].clone().requires_grad_(True)
        with torch.enable_grad():
            value = router_loss.switch_loss(stats[:e], stats[e], p)
            (grad,) = torch.autograd.grad(value * (self.coef * self.factor * self.batch_ranks), p)
        self.cotangent[i] = grad
        with router_loss.valued(value.detach()):
            yield
