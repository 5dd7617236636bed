"""The zero-bubble schedules' split backward by deferring the ``nn.Linear`` weight gradients.

``I`` (the input-gradient half of a backward) runs the stage's whole backward except the weight
gradients of its blocks' ``nn.Linear`` layers and the last stage's LM head (``untied_linears``): each
such layer stores its input and its output's gradient instead (``WeightGradStore``); ``W`` computes them
later, one matmul per layer, and adds them into ``.grad`` as autograd would. Everything else (norms,
biases, the input's gradient) is done in ``I``. This is Megatron's and the zero-bubble paper's
``WeightGradStore``, for the layers that hold nearly all of a transformer block's weight-gradient work.

The generic split (torch's ``stage_backward_input`` / ``stage_backward_weight``, which works on any
graph) walks the autograd graph in Python for every micro-batch and runs one engine call per
parameter group: on ``bench_pipeline``'s 4-block stage (d_model 128) I + W took ~1.7x the CPU time of
a whole backward; deferred, ~1.2x, the gradients bit-identical.

A layer computes its weight gradient at once when no split backward is running (``store.key`` is
None): a plain ``backward`` through it is unchanged. Under ``1f1b`` one backward per step is split
(the last stage's last, so that the first stage's last backward starts a ``W`` earlier): the
pipeline then turns ``store.capture`` on for that micro-batch's forward only, and every other
forward runs ``F.linear`` itself, at no cost. Only plain ``nn.Linear`` layers with a trainable
weight are deferred (``defer_linears``); the pipeline uses the generic split where layers are not
plain (the tensor axis's parallel layers).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """The deferred weight gradients of the backward halves run so far, by key (stage, micro-batch)."""

    def __init__(self):
        self.key = None            # set while an ``I`` runs: where its layers' work goes
        self.capture = True        # forwards record through the store (False: plain ``F.linear``)
        self.pending: dict = {}

    @torch.no_grad()
    def flush(self, key) -> None:
        """``W``: each deferred layer's weight gradient, added into ``.grad``."""
        for weight, x, g in self.pending.pop(key, ()):
            dw = g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
            if weight.grad is None:
                weight.grad = dw
            else:
                weight.grad += dw

    def clear(self) -> None:
        self.pending.clear()
        self.key = None


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)   # through the saved-tensor hooks (recompute, offload) as autograd's
        ctx.weight, ctx.store, ctx.has_bias = weight, store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g.matmul(w) if ctx.needs_input_grad[0] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        store = ctx.store
        if store.key is None:              # no split backward running: the weight's gradient now
            return gx, g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])), gb, None
        # detached: the stored input keeps its values to W, not the graph that made it
        store.pending.setdefault(store.key, []).append((ctx.weight, x.detach(), g))
        return gx, None, gb, None


def _forward(self: nn.Linear, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled() or not store.capture:
        return F.linear(x, self.weight, self.bias)
    return _DeferredLinear.apply(x, self.weight, self.bias, store)


def defer_linears(modules: Iterable[nn.Module], store: WeightGradStore) -> int:
    """Route the plain ``nn.Linear`` layers (trainable weight) under ``modules`` through ``store``;
    returns how many."""
    n = 0
    for root in modules:
        for m in root.modules():
            if type(m) is nn.Linear and m.weight.requires_grad and type(m.weight) is nn.Parameter:
                m.forward = functools.partial(_forward, m, store)    # a partial: the model still copies and pickles
                n += 1
    return n


def untied_linears(model: nn.Module, params: Iterable[str]) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers holding the parameters named ``params`` whose weight no other module
    of ``model`` uses (a tied weight's other use adds into the same ``.grad`` inside the backward)."""
    uses: dict[int, int] = {}
    for _, q in model.named_parameters(remove_duplicate=False):
        uses[id(q)] = uses.get(id(q), 0) + 1
    modules = dict(model.named_modules())
    owners = dict.fromkeys(n.rpartition(".")[0] for n in params)
    return [m for m in (modules.get(o) for o in owners if o) if type(m) is nn.Linear and uses.get(id(m.weight), 0) == 1]
