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

**Attention** (``ContextAttention``): every ``F.scaled_dot_product_attention`` call runs by the plan's method
(``plan.context_attention``), each query attending to exactly the keys it attends to in one process:

* ``"allgather"`` (Llama 3's): the keys and values all-gathered over the context axis (backward
  reduce-scatters their gradients), put back in global order, the causal mask from global positions;
* ``"ring"`` (``RingAttention``): each rank's key/value block passed around the ring, the next block's
  transfer in flight while the current one is computed, partial results merged by their log-sum-exp
  (online softmax); backward passes the blocks again with their gradients' accumulators, recomputing each
  block's scores (nothing of size ``S x S`` is kept);
* ``"ulysses"`` (DeepSpeed's): an all-to-all trades the sequence split for a head split, so each rank runs
  the model's own causal attention on whole sequences for ``H / C`` heads, and a second all-to-all trades
  back.
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

from ..comm import core as comm
from ..comm.autograd import AllGather, AllToAll
from ..errors import ShardingError

METHODS = ("allgather", "ring", "ulysses")
_NEG = -1.0e30          # a masked score: finite, so no -inf - -inf makes a NaN in the merge or its gradient


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

    def __init__(self, mesh, axis: str, method: str = "allgather"):
        super().__init__()
        self.mesh, self.axes, self.method = mesh, (axis,), method
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
        if self.method == "ring":
            return RingAttention.apply(q, k, v, self, bool(is_causal), scale)
        if self.method == "ulysses":
            return self.ulysses(q, k, v, is_causal, scale, enable_gqa)
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


    # -- Ulysses: sequence <-> heads ------------------------------------------------------------------

    def ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                enable_gqa: bool) -> torch.Tensor:
        n, heads, kv_heads = self.size, q.shape[-3], k.shape[-3]
        if kv_heads % n:                 # too few key/value heads to split: each query head's own copy
            k, v = (t.repeat_interleave(heads // kv_heads, dim=-3) for t in (k, v))
            enable_gqa = False
        seq = q.shape[-2] * n
        order = gathered_order(seq, n).to(q.device)
        back = torch.argsort(order)

        def to_heads(t: torch.Tensor) -> torch.Tensor:     # [.., H, S/n, D] -> [.., H/n, S, D], global order
            t = AllToAll.apply(t.contiguous(), self.mesh, self.axes, t.dim() - 3, t.dim() - 2)
            return t.index_select(-2, order)

        out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=bool(is_causal),
                                             scale=scale, **({"enable_gqa": True} if enable_gqa else {}))
        out = out.index_select(-2, back).contiguous()
        return AllToAll.apply(out, self.mesh, self.axes, out.dim() - 2, out.dim() - 3)

    # -- the ring's moves --------------------------------------------------------------------------------

    def pass_on(self, t: torch.Tensor) -> comm.Pending:
        """Send ``t`` to the next rank of the ring, receive the previous rank's (in flight until waited)."""
        pairs = [(i, (i + 1) % self.size) for i in range(self.size)]
        return comm.send_recv(t.contiguous(), self.mesh, self.axes, pairs, async_op=True)


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key/value block's scores' log-sum-exp, probabilities (against that lse) and output, in fp32."""
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, _NEG)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return lse, p, p @ v


class RingAttention(torch.autograd.Function):
    """Ring attention over the context axis (module doc): forward and backward written out, the next
    block's transfer overlapping the current block's compute."""

    @staticmethod
    def forward(ctx, q, k, v, mode: ContextAttention, causal: bool, scale: float | None):
        n, me = mode.size, mode.coord
        groups = q.shape[-3] // k.shape[-3]
        seq = q.shape[-2] * n
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        qpos = zigzag_positions(seq, n, me, q.device)
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], _NEG, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        for step in range(n):
            src = (me - step) % n
            pending = mode.pass_on(kv) if step < n - 1 else None
            kb, vb = (t.float().repeat_interleave(groups, dim=-3) for t in kv)
            mask = _mask(qpos, zigzag_positions(seq, n, src, q.device)) if causal else None
            lse_b, _, out_b = _block(qf, kb, vb, mask, scale)
            new = torch.logaddexp(lse, lse_b)
            out = out * torch.exp(lse - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None]
            lse = new
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mode, ctx.causal, ctx.scale, ctx.groups = mode, causal, scale, groups
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mode, causal, scale, groups = ctx.mode, ctx.causal, ctx.scale, ctx.groups
        n, me = mode.size, mode.coord
        seq = q.shape[-2] * n
        qpos = zigzag_positions(seq, n, me, q.device)
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1)                               # softmax's backward: rowsum(dO * O)
        dq = torch.zeros_like(qf)
        kv = torch.stack((k, v))
        acc = None                                               # the held block's dK, dV accumulator, in flight
        for step in range(n):
            src = (me - step) % n
            pending = mode.pass_on(kv) if step < n - 1 else None
            kb, vb = (t.float().repeat_interleave(groups, dim=-3) for t in kv)
            mask = _mask(qpos, zigzag_positions(seq, n, src, q.device)) if causal else None
            s = (qf @ kb.transpose(-1, -2)) * scale
            if mask is not None:
                s = s.masked_fill(~mask, _NEG)
            p = torch.exp(s - lse[..., None])
            dv = p.transpose(-1, -2) @ do
            ds = p * (do @ vb.transpose(-1, -2) - delta[..., None])
            dq += (ds @ kb) * scale
            dk = (ds.transpose(-1, -2) @ qf) * scale
            mine = torch.stack((dk, dv))
            if groups > 1:                                       # each key/value head served `groups` query heads
                mine = mine.unflatten(-3, (-1, groups)).sum(-3)
            if acc is not None:
                mine = mine + acc.wait()
            acc = mode.pass_on(mine)                             # to the rank that holds this block next
            if pending is not None:
                kv = pending.wait()
        dk, dv = acc.wait().to(k.dtype).unbind(0)               # the last pass brings this rank's own block home
        return dq.to(q.dtype), dk, dv, None, None, None


def _mask(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    return kpos[None, :] <= qpos[:, None]


class ContextRuntime:
    """The context axis's runtime state: the attention mode, and the position tables' hooks (``tables``:
    the names of the modules holding them, ``plan.position_tables``)."""

    def __init__(self, model: nn.Module, mesh, axis: str, tables: tuple[str, ...], method: str = "allgather"):
        self.mesh, self.axis = mesh, axis
        self.size, self.coord = mesh.axis_size(axis), mesh.coord(mesh.rank, axis)
        self.attention = ContextAttention(mesh, axis, method)
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
