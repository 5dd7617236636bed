"""The context axis in the planner: the sequence split over ``context`` (``rules={"seq": "context"}``).

A plan with a context axis traces the model once on the meta device, on one rank's micro-batch (its rows,
``S / C`` of the sequence), to find what the runtime (``runtime/context.py``) acts on and what it costs:

* every ``F.scaled_dot_product_attention`` call — its keys' and values' elements per micro-batch on a rank
  (all-gathered over ``context`` in forward, reduce-scattered in backward: per call ``2·(C-1)·n`` elements
  each way, ``n`` the local keys' — Llama 3's all-gather: ``2·b·s·h_kv·(C-1)/C`` bytes a sequence), and
  the unit it runs in (a recomputed unit gathers again in backward);
* the learned position tables — an ``nn.Embedding`` asked for a sequence's positions (its input has no
  batch dim), whose lookups the runtime maps to global positions.

What cannot run on chunks is refused by name at plan time: a sequence the axis does not divide into ``2·C``
chunks (zigzag), a model whose attention does not go through SDPA (eager attention with a materialized mask:
the fix is SDPA), an SDPA with an explicit mask or dropout, a position table shorter than the sequence, and
what this first version does not compose with yet (tensor, pipe and expert axes; offloaded activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only


@dataclass(frozen=True)
class AttentionCall:
    """One SDPA call of a micro-batch's forward on one rank: its keys' (= values') elements, whether its
    mask is causal, the unit it runs in."""

    kv_numel: int
    causal: bool
    unit: str


@dataclass(frozen=True)
class ContextTrace:
    calls: tuple[AttentionCall, ...]
    tables: tuple[str, ...]          # modules holding learned position tables
    problems: tuple[str, ...]


class _Recorder(TorchFunctionMode):
    def __init__(self, units: list[str], stack: list[str]):
        super().__init__()
        self.units, self.stack = set(units), stack
        self.calls: list[tuple[int, bool, bool, float, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            k = args[1]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
            unit = next((m for m in reversed(self.stack) if m in self.units), "")
            self.calls.append((k.numel(), bool(causal), mask is not None, float(dropout or 0.0), unit))
        return func(*args, **kwargs)


def _local(batch: Any, rows: int, size: int) -> Any:
    """One rank's micro-batch of ``batch`` on the meta device: ``rows`` rows, ``1/size`` of dim 1."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[0] = rows
        if len(shape) > 1:
            shape[1] //= size
        return torch.zeros(shape, dtype=t.dtype, device="meta")
    return tree_map_only(torch.Tensor, cut, batch)


def context_trace(model: nn.Module, batch: Any, size: int, rows: int, units: list[str]) -> ContextTrace:
    """The model's forward on one rank's micro-batch (``rows`` rows, the sequence's ``1/size``), on the meta
    device: its attention calls and learned position tables (module doc), and what cannot run on chunks."""
    from torch.func import functional_call

    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    seq = leaves[0].shape[1] if leaves and leaves[0].dim() > 1 else 0
    problems: list[str] = []
    bad = [tuple(t.shape) for t in leaves if t.dim() < 2 or t.shape[1] != seq]
    if not seq or bad:
        return ContextTrace((), (), (f"plan: a context axis splits the batch's dim 1 (the sequence) — got batch tensors "
                                     f"of shapes {[tuple(t.shape) for t in leaves]}; expected every tensor [batch, "
                                     "seq, ...] with one sequence length. Pass a batch of token tensors.",))
    if seq % (2 * size):
        lo, hi = seq // (2 * size) * 2 * size, (seq // (2 * size) + 1) * 2 * size
        problems.append(f"plan: a sequence of {seq} tokens does not split over context={size} — expected a multiple "
                        f"of 2 x {size} = {2 * size} (each rank holds two chunks, zigzag, so every rank's causal "
                        f"attention does the same work). Pad or cut the sequence to {lo or hi}{f' or {hi}' if lo else ''}.")
        return ContextTrace((), (), tuple(problems))
    trace_rows = 2                   # two rows: a position lookup has no batch dim, a token lookup has
    stack: list[str] = []
    looked: dict[str, tuple[int, ...]] = {}
    names = {m: n for n, m in model.named_modules()}

    def enter(mod, args):
        stack.append(names.get(mod, ""))
        if isinstance(mod, nn.Embedding) and args and isinstance(args[0], torch.Tensor):
            looked[names.get(mod, "")] = tuple(args[0].shape)

    def leave(mod, args, out):
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()] + \
        [m.register_forward_hook(leave) for m in model.modules()]
    recorder = _Recorder(units, stack)
    state = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in model.named_parameters()}
    state.update({n: torch.empty(b.shape, dtype=b.dtype, device="meta") for n, b in model.named_buffers()})
    local = _local(batch, trace_rows, size)
    try:
        with recorder, torch.no_grad():
            if isinstance(local, dict):
                functional_call(model, state, (), local)
            elif isinstance(local, (tuple, list)):
                functional_call(model, state, tuple(local))
            else:
                functional_call(model, state, (local,))
    finally:
        for h in handles:
            h.remove()
    if not recorder.calls:
        problems.append(f"plan: {type(model).__name__} computes no attention through "
                        "torch.nn.functional.scaled_dot_product_attention — a context axis runs attention on "
                        "chunks of the sequence by intercepting SDPA; an attention written out (eager, with a "
                        "materialized mask) cannot run on chunks. Use SDPA (transformers: attn_implementation="
                        "'sdpa').")
    for numel, causal, masked, dropout, unit in recorder.calls:
        if masked or dropout:
            problems.append(f"plan: an attention call{f' in {unit}' if unit else ''} passes "
                            f"{'an explicit attn_mask' if masked else f'dropout_p={dropout}'} to SDPA — expected a "
                            "causal (is_causal=True) or full attention without dropout: the forms context-parallel "
                            "attention runs on chunks. Drop attention dropout, and leave the causal mask to is_causal "
                            "(transformers: no padding; pack documents instead).")
            break
    tables = []
    mods = dict(model.named_modules())
    for name, shape in looked.items():
        if len(shape) == 1 or (len(shape) >= 2 and shape[0] == 1):       # no batch dim: positions
            tables.append(name)
            n = mods[name].num_embeddings
            if n < seq:
                problems.append(f"plan: {name} is a learned position table of {n} positions, shorter than the "
                                f"{seq}-token sequence — expected a table at least as long as the sequence. Use a "
                                f"sequence of at most {n} tokens, or a longer table.")
    scale = rows / trace_rows
    calls = tuple(AttentionCall(int(numel * scale), causal, unit) for numel, causal, _, _, unit in recorder.calls)
    return ContextTrace(calls, tuple(tables), tuple(problems))


def composition_problems(mesh: Any, axis: str, roles: Any, offload: tuple) -> list[str]:
    """What this first version of the context axis does not run beside it, named."""
    sizes = mesh.axis_sizes
    out = []
    for role, name in (("tensor", roles.tensor or "tensor"), ("pipe", roles.pipe or "pipe"),
                       ("expert", roles.expert_of(mesh))):
        if name and sizes.get(name, 1) > 1:
            out.append(f"plan: context={sizes[axis]} beside {role}={sizes[name]} — expected the context axis with "
                       "data (and HSDP's replica) only in this version; context x tensor, x pipe and x expert are "
                       f"not built yet. Plan the long sequence on data x context, or drop {name!r}.")
    kinds = dict(offload)
    if kinds.get("activations") or kinds.get("params"):
        out.append("plan: a context axis with parameters or activations offloaded — not built yet. Offload only "
                   "the optimizer, or drop the context axis.")
    return out


def context_moves(calls: tuple[AttentionCall, ...], size: int, itemsize: int, m: int,
                  recomputed: set[str]) -> list[tuple[str, str, int, int, str]]:
    """``(phase, op, bytes each, count, where)`` of the attention calls' collectives over the context axis
    (``comm_per_step``'s entries): per call and micro-batch, the keys' and values' all-gathers forward (again
    in backward where its unit is recomputed) and their gradients' reduce-scatters backward."""
    from ..comm import core as comm
    out = []
    for i, c in enumerate(calls):
        each = comm.all_gather_bytes(c.kv_numel, size, itemsize)
        where = c.unit or f"attention {i}"
        out.append(("forward", "all_gather", each, 2 * m, where))
        if c.unit in recomputed:
            out.append(("backward", "all_gather", each, 2 * m, where))
        out.append(("backward", "reduce_scatter", comm.reduce_scatter_bytes(c.kv_numel, size, itemsize), 2 * m, where))
    return out


def kv_bytes_formula(seq: int, kv_width: int, size: int, itemsize: int) -> float:
    """Llama 3's all-gather of one layer's keys and values for one sequence: ``2·b·s·h_kv·(N-1)/N``."""
    return 2 * itemsize * seq * kv_width * (size - 1) / size


def tokens_per_rank(seq: int, size: int) -> int:
    return math.ceil(seq / size)


def labels_problems(model: nn.Module, batch: Any) -> list[str]:
    """A transformers causal LM given ``labels`` shifts them inside its loss, across what would be a chunk's
    edge on a context rank: not run yet, named."""
    from .hf_loss import causal_lm_loss
    if isinstance(batch, dict) and "labels" in batch and causal_lm_loss(model):
        return [f"plan: {type(model).__name__} shifts its labels inside its loss (labels[:, 1:]), which on a chunk of "
                "the sequence would pair each chunk's last token with no label — expected labels the context axis "
                "can split: not built yet for transformers' own loss. Pass loss_fn= computing the loss on "
                "pre-shifted labels, or drop the context axis."]
    return []
