"""Context parallel in the engine: the sequence split over a ``context`` axis (``rules={"seq": "context"}``).

**The layout.** The batch's dim 1 (the sequence) is cut into ``2·C`` equal chunks and context rank ``c``
holds chunks ``c`` and ``2C-1-c`` (zigzag, or head-tail: Megatron's and torchtitan's load balance for causal
attention — every rank then holds as many early as late tokens, so every rank's attention does the same
work). ``zigzag_positions`` are the global positions of a rank's tokens, in the order it holds them.

**Token-wise ops** (embeddings, norms, MLPs, the head, the loss) run on the local chunk unchanged. The loss
is each rank's mean over its tokens; every rank holds as many, so the mean of the ranks' means over
data x context is the global batch's (the engine averages over ``plan.dp_axes``, which include the
context axis; gradients are summed over them as over any data axis).

**Positions.** A module that embeds positions — a learned table (the reference GPT's ``wpe``, GPT-2's) or a
rotary embedding (transformers' ``*RotaryEmbedding``) — is asked for ``arange(local length)``: a forward
pre-hook maps those to the rank's global positions (``plan.position_tables`` names them).

**Attention** (``ContextAttention``): ``F.scaled_dot_product_attention`` on the local queries, with the
keys and values all-gathered over the context axis (Llama 3's choice; backward reduce-scatters their
gradients), put back in global order, and the causal mask taken from global positions — so each query
attends to exactly the keys it attends to in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..comm.autograd import AllGather
from ..errors import ShardingError


@functools.lru_cache(maxsize=64)
def _positions(seq: int, size: int, coord: int) -> tuple[int, ...]:
    chunk = seq // (2 * size)
    late = 2 * size - 1 - coord
    return (*range(coord * chunk, (coord + 1) * chunk), *range(late * chunk, (late + 1) * chunk))


def zigzag_positions(seq: int, size: int, coord: int, device: Any = None) -> torch.Tensor:
    """The global positions of context rank ``coord``'s tokens of a ``seq``-long sequence split over ``size``
    ranks: chunks ``coord`` and ``2·size-1-coord`` of ``2·size`` (``seq`` a multiple of ``2·size``)."""
    return torch.tensor(_positions(seq, size, coord), dtype=torch.long, device=device)


def gathered_order(seq: int, size: int) -> torch.Tensor:
    """Where each global position sits in the all-gather of every rank's chunks (rank-major): indexing the
    gathered sequence with it gives the sequence in global order."""
    held = [p for c in range(size) for p in _positions(seq, size, c)]
    where = [0] * seq
    for i, p in enumerate(held):
        where[p] = i
    return torch.tensor(where, dtype=torch.long)


def local_chunk(t: torch.Tensor, size: int, coord: int, dim: int = 1) -> torch.Tensor:
    """Rank ``coord``'s tokens of ``t`` along ``dim`` (zigzag), contiguous."""
    n = t.shape[dim]
    chunk = n // (2 * size)
    late = 2 * size - 1 - coord
    return torch.cat((t.narrow(dim, coord * chunk, chunk), t.narrow(dim, late * chunk, chunk)), dim).contiguous()


class ContextAttention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs as context-parallel attention over ``axis``:
    the local queries against every rank's keys and values (module doc)."""

    def __init__(self, mesh, axis: str):
        super().__init__()
        self.mesh, self.axes = mesh, (axis,)
        self.size = mesh.axis_size(axis)
        self.coord = mesh.coord(mesh.rank, axis)
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attend(*args, **kwargs)
        return func(*args, **kwargs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None or dropout_p:
            what = "an explicit attn_mask" if attn_mask is not None else f"dropout_p={dropout_p}"
            raise ShardingError(f"context parallel: scaled_dot_product_attention got {what} — expected a causal "
                                "(is_causal=True) or full attention without dropout, the forms context-parallel "
                                "attention runs on chunks. Build the model without attention dropout, and leave the "
                                "mask to is_causal (transformers: no padding in the batch).", api="step")
        self.calls += 1
        local = q.shape[-2]
        seq = local * self.size
        order = gathered_order(seq, self.size).to(k.device)
        k = AllGather.apply(k.contiguous(), self.mesh, self.axes, k.dim() - 2).index_select(-2, order)
        v = AllGather.apply(v.contiguous(), self.mesh, self.axes, v.dim() - 2).index_select(-2, order)
        mask = None
        if is_causal:
            qpos = zigzag_positions(seq, self.size, self.coord, q.device)
            mask = torch.arange(seq, device=q.device)[None, :] <= qpos[:, None]
        extra = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **extra)


class ContextRuntime:
    """The context axis's runtime state: the attention mode, and the position tables' hooks (``tables``:
    the names of the modules holding them, ``plan.position_tables``)."""

    def __init__(self, model: nn.Module, mesh, axis: str, tables: tuple[str, ...]):
        self.mesh, self.axis = mesh, axis
        self.size, self.coord = mesh.axis_size(axis), mesh.coord(mesh.rank, axis)
        self.attention = ContextAttention(mesh, axis)
        self.hooks = [model.get_submodule(t).register_forward_pre_hook(self._global_positions, with_kwargs=True)
                      for t in tables]

    def _global_positions(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        """A position module's positions (integer tensors without batch rows: ``planner/context.positions_in``)
        mapped to this rank's global ones."""
        def mapped(t: Any) -> Any:
            if not (isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() in (1, 2)
                    and (t.dim() == 1 or t.shape[0] == 1)):
                return t
            seq = t.shape[-1] * self.size
            return zigzag_positions(seq, self.size, self.coord, t.device)[t]
        return tuple(mapped(a) for a in args), {k: mapped(v) for k, v in kwargs.items()}

    @contextmanager
    def active(self) -> Iterator[None]:
        """Context-parallel attention for what runs inside (a step's forwards and backwards: recompute
        replays attention in backward)."""
        with self.attention:
            yield

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
