"""Megatron's asynchronous input-gradient all-reduce for a column-parallel ``nn.Linear``.

Without sequence parallel a column layer's input enters through ``f`` (identity forward, all-reduce
of the input's gradient in backward). As separate autograd nodes, the all-reduce starts only after the
layer's whole backward (input and weight gradients) and the rank then waits for it with nothing to do.
Fused (``_ColumnLinear``), the layer's backward computes the input gradient, starts its all-reduce,
computes the weight and bias gradients while it runs, and waits last — Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``. The bytes are ``f``'s: one all-reduce of the
input's gradient.

``f`` is per input, not per layer: layers that share an input (q, k and v of one hidden state) share
one ``f``, so one all-reduce of their summed gradients. A layer is fused only where it is the only
column layer of its region (the attention or MLP module holding it: GPT's fused qkv, its MLP's fc);
were a fused layer's input shared after all (two regions fed by one tensor), each fused layer would
all-reduce its own part of the gradient — the same sum, more bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import core as comm


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mesh, axes):
        ctx.save_for_backward(x, weight)
        ctx.mesh, ctx.axes, ctx.has_bias = mesh, axes, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        pending = None
        if ctx.needs_input_grad[0]:
            gx = g.matmul(w).contiguous()
            pending = comm.all_reduce(gx, ctx.mesh, ctx.axes, async_op=True, inplace=True)
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gx = pending.wait() if pending is not None else None
        return gx, gw, gb, None, None


def fusable(mod: nn.Module) -> bool:
    """A plain ``nn.Linear`` whose weight is a plain trainable parameter (not LoRA, not quantized)."""
    w = getattr(mod, "weight", None)
    return (type(mod) is nn.Linear and type(w) is nn.Parameter and type(w.data) is torch.Tensor
            and w.requires_grad)


class ColumnFusion:
    """The column layers that run fused (``eligible``: ids of the layers whose forward is ``forward``)."""

    def __init__(self, mesh, axes):
        self.mesh, self.axes = mesh, axes
        self.eligible: set[int] = set()
        # inputs that are already another column's f (a parallel block's attention and MLP read one input):
        # a fusable column reading one runs plainly, so the input's gradient is all-reduced once, by f
        self.shared: set[int] = set()

    def runs_fused(self, mod: nn.Module, x: torch.Tensor) -> bool:
        return (id(mod) in self.eligible and torch.is_grad_enabled() and x.requires_grad
                and id(x) not in self.shared)

    def forward(self, mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.runs_fused(mod, x):
            return _ColumnLinear.apply(x, mod.weight, mod.bias, self.mesh, self.axes)
        return F.linear(x, mod.weight, mod.bias)
