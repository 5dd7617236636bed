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
  reduce-scatters their gradients); the rank's two query chunks meet the gathered chunks pair by pair
  (``GatheredAttention``: the earlier chunks whole, its own chunk's lower triangle);
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
from ..planner.context import is_positions

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


class Documents:
    """A micro-batch's documents or padding over its whole sequences (global order): which keys each query may
    see beyond causality, as transformers decides it in one process — with an ``attention_mask``, its
    non-padding keys; without one, ``position_ids`` that restart mark packed documents, and a query sees its
    own document's keys. A query that sees no key at all (a left pad) gets zeros and no gradient, as SDPA
    gives it."""

    def __init__(self, valid: torch.Tensor | None, positions: torch.Tensor | None, rows: int, seq: int,
                 device: Any):
        self.valid = (valid.bool() if valid is not None else torch.ones(rows, seq, dtype=torch.bool)).to(device)
        self.doc = torch.zeros(rows, seq, dtype=torch.long, device=device)
        if positions is not None and valid is None:       # (transformers reads packing only without a mask)
            positions = positions.to(device)
            starts = torch.ones_like(positions, dtype=torch.bool)
            starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
            self.doc = starts.long().cumsum(-1)

    def allowed(self, qs: slice, ks: slice) -> torch.Tensor:
        """``[rows, queries, keys]``: the queries at global indices ``qs`` against the keys at ``ks`` — the same
        document, not padding (causality and windows: ``_visible``)."""
        return (self.doc[:, qs, None] == self.doc[:, None, ks]) & self.valid[:, None, ks]


def _visible(qi: torch.Tensor, ki: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor | None:
    """``[queries, keys]``: which keys (global indices ``ki``) the queries at ``qi`` see by causality and a
    sliding window (transformers': ``q - w < k``); None where both are off."""
    out = ki[None, :] <= qi[:, None] if causal else None
    if window is not None:
        near = qi[:, None] - ki[None, :] < window
        out = near if out is None else out & near
    return out


class ContextAttention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs as context-parallel attention over ``axis``:
    the local queries against every rank's keys and values (module doc)."""

    def __init__(self, mesh, axis: str, method: str = "allgather"):
        super().__init__()
        self.mesh, self.axes, self.method = mesh, (axis,), method
        self.size = mesh.axis_size(axis)
        self.coord = mesh.coord(mesh.rank, axis)
        self.calls = 0
        self.docs: Documents | None = None       # the running micro-batch's (ContextRuntime.use)
        self.window: int | None = None           # the running layer's sliding window (ContextRuntime.windows)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attend(*args, **kwargs)
        return func(*args, **kwargs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None and self._own_chunk_mask(attn_mask, q.shape[-2]):
            attn_mask, is_causal = None, True       # the model's causal (windowed) mask of its chunk: made global here
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
        k = AllGather.apply(k.contiguous(), self.mesh, self.axes, k.dim() - 2)      # every rank's, rank-major
        v = AllGather.apply(v.contiguous(), self.mesh, self.axes, v.dim() - 2)
        return GatheredAttention.apply(q, k, v, self, bool(is_causal), scale)


    def _own_chunk_mask(self, mask: torch.Tensor, local: int) -> bool:
        """Whether ``mask`` is what a transformers model builds of its own chunk when given no mask (the engine
        gives the batch's documents and padding to this attention instead): causal, within the layer's sliding
        window, by the chunk's indices. This attention applies both over the whole sequence."""
        if mask.shape[-2:] != (local, local):
            return False
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        idx = torch.arange(local, device=mask.device)
        return bool((allowed == _visible(idx, idx, True, self.window)).all())

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

        extra = {"enable_gqa": True} if enable_gqa else {}
        if self.docs is None and self.window is None:
            out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=bool(is_causal),
                                                 scale=scale, **extra)
        else:                                   # whole sequences: one mask of documents, causality and window
            idx = torch.arange(seq, device=q.device)
            mask = _visible(idx, idx, bool(is_causal), self.window)
            if self.docs is not None:
                docs = self.docs.allowed(slice(None), slice(None))
                mask = docs if mask is None else docs & mask
            if mask is not None:                # [rows or 1, heads 1, S, S]
                mask = mask[:, None] if mask.dim() == 3 else mask[None, None]
            out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), attn_mask=mask, scale=scale,
                                                 **extra)
        out = out.index_select(-2, back).contiguous()
        return AllToAll.apply(out, self.mesh, self.axes, out.dim() - 2, out.dim() - 3)

    # -- the ring's moves --------------------------------------------------------------------------------

    def pass_on(self, t: torch.Tensor) -> comm.Pending:
        """Send ``t`` to the next rank of the ring, receive the previous rank's (in flight until waited)."""
        pairs = [(i, (i + 1) % self.size) for i in range(self.size)]
        return comm.send_recv(t.contiguous(), self.mesh, self.axes, pairs, async_op=True)


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of queries against one chunk of keys — the whole of it, or (``causal``: the same chunk) its
    lower triangle: the output and the scores' log-sum-exp, fp32. On the CPU by its fused attention kernel
    (no scores kept), elsewhere written out."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale)
        return out.float(), lse.float()
    s = _scores(q, k, causal, scale, allowed)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v.float(), lse


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float, allowed: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk pair's share of the gradients of attention whose whole output and log-sum-exp (over every
    chunk of keys) are ``out`` and ``lse``: ``P = exp(S - lse)`` is this pair's part of the global softmax
    (flash attention's backward)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale)
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    p = torch.exp(_scores(q, k, causal, scale, allowed) - lse[..., None])
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * out.float()).sum(-1, keepdim=True))
    return (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale, p.transpose(-1, -2) @ dof


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), _NEG)
    if allowed is not None:
        s = s.masked_fill(~allowed, _NEG)
    return s


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean ``allowed`` as the fused kernel's additive mask: 0, or the dtype's most negative half (finite:
    no ``-inf - -inf``)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                   torch.finfo(dtype).min / 2)


def _pairs(q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], causal: bool):
    """``(i, j, square)`` for each query chunk ``i`` (global chunk ``q_chunks[i]``) and key chunk ``j`` it
    attends to: every one without causality; with it, the earlier chunks whole and its own chunk's lower
    triangle (``square``)."""
    for i, a in enumerate(q_chunks):
        for j, b in enumerate(k_chunks):
            if not causal or b < a:
                yield i, j, False
            elif b == a:
                yield i, j, True


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None], new


class _Chunks:
    """A rank's queries as its two zigzag chunks, and key/value blocks as chunks, for chunk-pair attention."""

    def __init__(self, mode: ContextAttention, q: torch.Tensor, groups: int, causal: bool, scale: float | None):
        self.n, self.me, self.groups, self.causal = mode.size, mode.coord, groups, causal
        self.docs, self.window = mode.docs, mode.window
        self.scale = scale if scale is not None else q.shape[-1] ** -0.5
        self.length = q.shape[-2] // 2
        self.mine = (self.me, 2 * self.n - 1 - self.me)          # this rank's chunks, in the order it holds them

    def held(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.n - 1 - rank

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return t.split(self.length, dim=-2)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.groups, dim=-3) if self.groups > 1 else t

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        """A key/value gradient over every query head back to its key/value heads."""
        return t.unflatten(-3, (-1, self.groups)).sum(-3) if self.groups > 1 else t

    def masked(self, a: int, b: int) -> tuple[bool, torch.Tensor | None]:
        """The batch's documents and padding (``Documents``) and the layer's sliding window on query chunk ``a``
        x key chunk ``b``: ``(skip, allowed)`` — a pair no query may see is skipped; one every query sees whole
        needs no mask."""
        if self.docs is None and self.window is None:
            return False, None
        n = self.length
        idx = torch.arange(n)
        allowed = _visible(a * n + idx, b * n + idx, self.causal, self.window)      # (an earlier chunk: all causal)
        if self.docs is not None:
            docs = self.docs.allowed(slice(a * n, (a + 1) * n), slice(b * n, (b + 1) * n))
            allowed = docs if allowed is None else docs & allowed.to(docs.device)
        if allowed is None:
            return False, None
        if allowed.dim() == 2:
            allowed = allowed[None]
        if not bool(allowed.any()):
            return True, None
        return False, None if bool(allowed.all()) else allowed[:, None]

    def forward(self, qs, ks, vs, k_chunks, out, lse):
        """``out``/``lse`` (per query chunk) merged with the pairs against these key chunks."""
        for i, j, square in _pairs(self.mine, k_chunks, self.causal):
            skip, allowed = self.masked(self.mine[i], k_chunks[j])
            if skip:
                continue
            out_b, lse_b = _block_forward(qs[i], self.heads(ks[j]), self.heads(vs[j]), square and allowed is None,
                                          self.scale, allowed)
            out[i], lse[i] = _merge(out[i], lse[i], out_b, lse_b)

    def backward(self, dos, qs, ks, vs, outs, lses, k_chunks, dq, dk, dv):
        for i, j, square in _pairs(self.mine, k_chunks, self.causal):
            skip, allowed = self.masked(self.mine[i], k_chunks[j])
            if skip:
                continue
            a, b, c = _block_backward(dos[i], qs[i], self.heads(ks[j]), self.heads(vs[j]), outs[i], lses[i],
                                      square and allowed is None, self.scale, allowed)
            dq[i] += a.float()
            dk[j] += self.fold(b.float())
            dv[j] += self.fold(c.float())


def _saved(ctx, ch: _Chunks, q, k, v, out: list[torch.Tensor], lse: list[torch.Tensor]) -> torch.Tensor:
    """The merged chunks' output (in the queries' dtype), saved for backward with the log-sum-exp."""
    out_t = torch.cat(out, -2).to(q.dtype)
    ctx.save_for_backward(q, k, v, out_t, torch.cat(lse, -1))
    ctx.ch = ch
    return out_t


def _start(q: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    half = q.shape[-2] // 2
    shape = (*q.shape[:-2], half, q.shape[-1])
    return ([torch.zeros(shape, dtype=torch.float32, device=q.device) for _ in range(2)],
            [torch.full(shape[:-1], _NEG, dtype=torch.float32, device=q.device) for _ in range(2)])


class GatheredAttention(torch.autograd.Function):
    """The all-gather method's attention: this rank's two query chunks against every rank's keys and values
    (gathered rank-major), by chunk pairs — the earlier chunks whole, its own chunk's lower triangle —
    merged by log-sum-exp. No mask and no scores are held; backward is flash attention's, pair by pair."""

    @staticmethod
    def forward(ctx, q, k, v, mode: ContextAttention, causal: bool, scale: float | None):
        ch = _Chunks(mode, q, q.shape[-3] // k.shape[-3], causal, scale)
        k_chunks = tuple(c for r in range(ch.n) for c in ch.held(r))     # the gather's order: rank-major
        out, lse = _start(q)
        ch.forward(ch.split(q), ch.split(k), ch.split(v), k_chunks, out, lse)
        ctx.k_chunks = k_chunks
        return _saved(ctx, ch, q, k, v, out, lse)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ch = ctx.ch
        dq = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ch.split(q)]
        dk = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ch.split(k)]
        dv = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ch.split(v)]
        ch.backward(ch.split(dout.contiguous()), ch.split(q), ch.split(k), ch.split(v), ch.split(out),
                    lse.split(ch.length, -1), ctx.k_chunks, dq, dk, dv)
        return (torch.cat(dq, -2).to(q.dtype), torch.cat(dk, -2).to(k.dtype), torch.cat(dv, -2).to(v.dtype),
                None, None, None)


class RingAttention(torch.autograd.Function):
    """Ring attention over the context axis (module doc): each step this rank's query chunks meet the
    key/value block it holds (two chunks) by chunk pairs, while the next block is in flight; partial results
    merged by log-sum-exp. Backward passes the blocks again with their gradients' accumulators."""

    @staticmethod
    def forward(ctx, q, k, v, mode: ContextAttention, causal: bool, scale: float | None):
        ch = _Chunks(mode, q, q.shape[-3] // k.shape[-3], causal, scale)
        qs = ch.split(q)
        out, lse = _start(q)
        kv = torch.stack((k, v))
        for step in range(ch.n):
            src = (ch.me - step) % ch.n
            pending = mode.pass_on(kv) if step < ch.n - 1 else None
            ch.forward(qs, ch.split(kv[0]), ch.split(kv[1]), ch.held(src), out, lse)
            if pending is not None:
                kv = pending.wait()
        ctx.mode = mode
        return _saved(ctx, ch, q, k, v, out, lse)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ch, mode = ctx.ch, ctx.mode
        qs, dos, outs, lses = ch.split(q), ch.split(dout.contiguous()), ch.split(out), lse.split(ch.length, -1)
        dq = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in qs]
        kv = torch.stack((k, v))
        acc = None                                               # the held block's dK, dV accumulator, in flight
        for step in range(ch.n):
            src = (ch.me - step) % ch.n
            pending = mode.pass_on(kv) if step < ch.n - 1 else None
            dk = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ch.split(k)]
            dv = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ch.split(v)]
            ch.backward(dos, qs, ch.split(kv[0]), ch.split(kv[1]), outs, lses, ch.held(src), dq, dk, dv)
            mine = torch.stack((torch.cat(dk, -2), torch.cat(dv, -2)))
            if acc is not None:
                mine = mine + acc.wait()
            acc = mode.pass_on(mine)                             # to the rank that holds this block next
            if pending is not None:
                kv = pending.wait()
        dk, dv = acc.wait().to(k.dtype).unbind(0)               # the last pass brings this rank's own block home
        return torch.cat(dq, -2).to(q.dtype), dk, dv, None, None, None


def sliding_window(module: nn.Module) -> int | None:
    """The sliding window a transformers attention module attends within: its own ``sliding_window`` (Qwen2's,
    per layer type), or its config's where the module is an attention that reads it (Mistral's); else None."""
    if not type(module).__name__.endswith("Attention"):
        return None
    own = getattr(module, "sliding_window", "absent")
    if own != "absent":
        return own if isinstance(own, int) else None
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and getattr(config, "use_sliding_window", True) is not False \
            and not getattr(config, "layer_types", None):
        return window
    return None


class ContextRuntime:
    """The context axis's runtime state: the attention mode, and the position tables' hooks (``tables``:
    the names of the modules holding them, ``plan.position_tables``)."""

    def __init__(self, model: nn.Module, mesh, axis: str, tables: tuple[str, ...], method: str = "allgather"):
        self.mesh, self.axis = mesh, axis
        self.size, self.coord = mesh.axis_size(axis), mesh.coord(mesh.rank, axis)
        self.attention = ContextAttention(mesh, axis, method)
        self.positions: torch.Tensor | None = None      # the running micro-batch's own, this rank's chunks
        # transformers reads packed documents from position_ids only without a cache (a model whose config says
        # use_cache makes one in training too, and then attends across the documents: so here as well)
        from ..planner.peft import peft_base
        self.packs = not getattr(getattr(peft_base(model)[0], "config", None), "use_cache", False)
        self.hooks = [model.get_submodule(t).register_forward_pre_hook(self._global_positions, with_kwargs=True)
                      for t in tables]
        for m in model.modules():                     # layers attending within a sliding window
            if sliding_window(m) is not None:
                self.hooks += [m.register_forward_pre_hook(self._enter_window),
                               m.register_forward_hook(self._leave_window)]

    def _enter_window(self, module: nn.Module, args: tuple) -> None:
        self.attention.window = sliding_window(module)

    def _leave_window(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.attention.window = None

    def use(self, info: dict | None) -> None:
        """The running micro-batch's documents and padding (its rows' whole ``attention_mask`` and
        ``position_ids``, taken out of the model's inputs by ``runtime/batches.split_batch``), or None."""
        self.positions = None
        self.attention.docs = None
        if not info:
            return
        valid, positions = info.get("attention_mask"), info.get("position_ids")
        rows, seq = (valid if valid is not None else positions).shape
        self.attention.docs = Documents(valid, positions if self.packs else None, rows, seq,
                                        (valid if valid is not None else positions).device)
        if positions is not None:
            self.positions = local_chunk(positions, self.size, self.coord)

    def _global_positions(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        """A position module's positions (``planner/context.is_positions``) mapped to this rank's global ones —
        the batch's ``position_ids`` where it gave them (packed documents: each row's own), else the zigzag
        positions."""
        def mapped(t: Any) -> Any:
            if not is_positions(t):
                return t
            if self.positions is not None:
                return self.positions.to(t.device)[:, t.reshape(-1)]
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
