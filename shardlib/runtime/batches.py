"""A step's batch cut into this rank's micro-batches, and transformers' exact token mean.

``split_batch`` validates the batch (before any collective), takes this rank's rows (dim 0 over
the data ranks, its ``data`` coordinate's chunk; all of them with ``local=True``), cuts them into
``grad_accum`` equal micro-batches and moves them to the mesh's device (floating tensors in the
compute dtype under mixed precision).

**The token mean.** The engine averages the ``data · m`` micro-batch losses, which is the batch's
mean when each is a mean over equally many items. A transformers causal LM's loss is a mean over
the micro-batch's non-ignored tokens (label ``!= -100`` after the shift), and with padding or
``-100`` labels micro-batches hold unequal counts: the mean of their means is not what one process
computes on the whole batch. As HF's Trainer does, the engine then gives every micro-batch
``num_items_in_batch = N / (data · m)`` (a 0-dim fp32 tensor), ``N`` the global batch's count of
non-ignored shifted labels (``(labels[:, 1:] != -100).sum()``, the count ``ForCausalLMLoss``
divides by): each micro-batch's loss is its summed token losses times ``data · m / N``, and the
engine's mean of them is ``sum(token losses) / N`` — ``model(**batch).loss`` of one process.

It applies to a dict batch with ``labels`` (and no ``num_items_in_batch`` of the user's), no
``loss_fn``, and a transformers model whose forward takes loss keywords (``accepts_loss_kwargs``,
else a ``**kwargs``) and whose ``loss_function`` is ``ForCausalLMLoss``; everything else is
unchanged. A global batch is counted on every rank from the whole batch (no collective); a local
batch (``local=True``) counts its rows and sums the count over the data axes with one scalar
all-reduce before the first forward — a collective ``plan.comm_per_step`` does not list (it
describes a step on the global batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..comm import core as comm
from ..errors import ShardingError, ShardingTypeError
from ..planner.hf_loss import causal_lm_loss
from ..planner.context import whole_sequence_inputs
from .context import local_chunk

if TYPE_CHECKING:
    from .engine import Engine

IGNORE = -100          # transformers' ignore index
SEQUENCE_KEYS = ("attention_mask", "position_ids")   # read by the context axis's attention over whole sequences
# flash-attention's form of packed documents (transformers' DataCollatorWithFlattening): offsets over the whole
# flattened sequence, which an SDPA model never reads (its documents come from position_ids): not cut, dropped
FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
CONTEXT_KEY = "_shardlib_context"


def split_batch(engine: Engine, batch: Any, local: bool) -> tuple[list[Any], int]:
    """This rank's micro-batches of ``batch`` and the global batch's rows. With a context axis each row's
    sequence (dim 1) is cut to this rank's zigzag chunks (``runtime/context.py``)."""
    n, m = engine.rows_size, engine.plan.grad_accum
    if engine.context is not None and isinstance(batch, dict):      # (offsets over the whole row: not cut)
        batch = {k: v for k, v in batch.items() if k not in FLASH_KEYS}
    leaves = _leaves(batch)
    if not leaves:
        raise ShardingTypeError("step: the batch holds no tensors — expected a tensor, or a tuple/list/dict of "
                                "tensors with the batch in dim 0.")
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if None in sizes or len(sizes) != 1:
        raise ShardingError(f"step: batch tensors disagree on dim 0 (the batch dim) — got sizes "
                            f"{[tuple(t.shape) for t in leaves]}; expected the same batch size in every tensor.")
    b = sizes.pop()
    need = m if local else n * m
    if b % need:
        what = (f"{m} micro-batches (grad_accum)" if local else
                f"data={n} ranks x {m} micro-batches (grad_accum) = {need}")
        lo, hi = (b // need) * need, (b // need + 1) * need
        use = f"{lo} or {hi}" if lo else f"{hi}"
        fix = "grad_accum" if local else "grad_accum or the data degree"
        raise ShardingError(f"step: a {'local ' if local else ''}batch of {b} does not split evenly over {what} "
                            f"— expected a multiple of {need}. Use a batch of {use}, or change {fix}.")
    rows = b if local else b // n
    start = 0 if local else engine.data_index * rows
    per = rows // m
    device, cdt, mixed = engine.mesh.device, engine.cdt, engine.plan.mixed
    ctx = engine.context
    docs: dict[str, torch.Tensor] = {}
    if ctx is not None:
        batch = whole_sequence_inputs(engine.model, batch)       # labels shifted over the whole sequence
        if isinstance(batch, dict):             # documents and padding: the attention's, not the model's
            docs = {k: batch[k] for k in SEQUENCE_KEYS if isinstance(batch.get(k), torch.Tensor)}
            batch = {k: v for k, v in batch.items() if k not in docs}
        leaves = _leaves(batch)
        seqs = {t.shape[1] if t.dim() > 1 else None for t in leaves}
        if len(seqs) != 1 or None in seqs or next(iter(seqs)) % (2 * ctx.size):
            raise ShardingError(f"step: a context axis of {ctx.size} splits every batch tensor's dim 1 (the sequence) "
                                f"into {2 * ctx.size} chunks — got shapes {[tuple(t.shape) for t in leaves]}; expected "
                                f"[batch, seq, ...] tensors of one sequence length, a multiple of {2 * ctx.size}. Pad "
                                "or cut the sequences.")

    def cut(t: torch.Tensor) -> tuple[torch.Tensor, ...]:      # this rank's rows, moved once, as m views
        t = t[start:start + rows]
        if ctx is not None:
            t = local_chunk(t, ctx.size, ctx.coord)
        if t.device != device:
            t = t.to(device)
        if mixed and t.is_floating_point():
            t = t.to(cdt)
        return t.split(per)

    flat, spec = tree_flatten(batch)
    cuts = [cut(t) if isinstance(t, torch.Tensor) else None for t in flat]
    micro = [tree_unflatten([c[i] if c is not None else x for c, x in zip(cuts, flat)], spec) for i in range(m)]
    if docs:                                    # each micro-batch's rows, whole sequences (Engine.loss_of)
        rowed = {k: t[start:start + rows].to(device).split(per) for k, t in docs.items()}
        micro = [{**mb, CONTEXT_KEY: {k: v[i] for k, v in rowed.items()}} for i, mb in enumerate(micro)]
    if counts_tokens(engine.model, engine.loss_fn, batch):
        labels = batch["labels"]
        count = (labels[:, 1:] != IGNORE).sum().to(device=device, dtype=torch.float64).reshape(1)
        if local and n > 1:      # the global count: this rank's rows summed over the axes of the rows
            count = comm.all_reduce(count, engine.mesh, engine.plan.row_axes)
        share = (count.reshape(()) / (engine.data_size * m)).float()     # (data_size: x context's chunks)
        micro = [{**mb, "num_items_in_batch": share} for mb in micro]
    return micro, b * n if local else b


def counts_tokens(model: nn.Module, loss_fn: Callable | None, batch: Any) -> bool:
    """Whether a step on ``batch`` divides by the global token count (the module doc's rule)."""
    if loss_fn is not None or not isinstance(batch, Mapping) or "labels" not in batch \
            or "num_items_in_batch" in batch or not isinstance(batch["labels"], torch.Tensor) \
            or batch["labels"].dim() < 2:
        return False
    return causal_lm_loss(model)


def _leaves(batch: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
