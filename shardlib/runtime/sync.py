"""Keeping replicas equal: rank 0's parameters and buffers broadcast over the data axis.

* At set-up (``Engine.__init__``, before any state is built): every parameter (frozen ones too)
  and every buffer, so ranks that built the model with different seeds train one model — as
  ``DistributedDataParallel`` does at construction. ``Plan.comm_setup()`` lists it.
* Before each step's forward (``broadcast_buffers=True``, the default): every buffer (BatchNorm's
  running statistics), as DDP does before a forward. With gradient accumulation DDP's usual
  pattern (``no_sync`` on all micro-batches but the last) broadcasts before the first micro-batch
  only, and so does the engine: once per step. ``Plan.comm_per_step()`` lists it.

Both are fused: the tensors are packed into one flat buffer per dtype (in the order of first
appearance), broadcast once per dtype, and copied back (``broadcast_coalesced``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..algebra.mesh import Mesh
from ..comm import core as comm
from ..quant.layout import inner_tensors


def by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """``tensors`` grouped by dtype, groups in order of first appearance (as the plan counts them)."""
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], mesh: Mesh, axes: str | Sequence[str], *,
                        tag: str = "") -> None:
    """Overwrite ``tensors`` (in place) with group member 0's values: one broadcast per dtype."""
    if comm.group_size(mesh, axes) == 1:
        return
    source = mesh.group_index(mesh.rank, mesh.canonical_axes(axes)) == 0
    for group in by_dtype(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        flat = comm.broadcast(flat, mesh, axes, src=0, inplace=True, tag=tag)
        if source:
            continue
        for t, v in zip(group, flat.split([t.numel() for t in group])):
            # version counters stay: a broadcast is not an edit autograd must know about (as DDP's)
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.detach().copy_(v.view(t.shape))


def module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter (frozen too, tied ones once), then every buffer: what set-up broadcasts."""
    return inner_tensors([p for p in model.parameters()]) + list(model.buffers())   # quantized: their bytes


def broadcast_module(model: nn.Module, mesh: Mesh, axis: str) -> None:
    """Set-up: every rank takes rank 0's parameters and buffers (the ranks of ``axis`` hold replicas)."""
    # a pipeline stage holds only its own tensors: the others are meta (nothing to send)
    broadcast_coalesced([t for t in module_tensors(model) if not t.is_meta], mesh, axis, tag="setup")


def broadcast_buffers(model: nn.Module, mesh: Mesh, axis: str) -> None:
    """Before a step's forward: every rank takes rank 0's buffers (DDP's ``broadcast_buffers``)."""
    bufs = list(model.buffers())
    if bufs:
        broadcast_coalesced(bufs, mesh, axis)


@torch.no_grad()
def cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Mixed precision: floating buffers (BatchNorm's running statistics) in the compute dtype, as
    ``model.to(dtype)`` casts them — the compute layer needs them in its input's dtype. A buffer
    held by several modules stays one tensor."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = done.setdefault(id(b), b.to(dtype))
