"""The context axis in the planner: the sequence split over ``context`` (``rules={"seq": "context"}``).

A plan with a context axis traces the model once on the meta device, on one rank's micro-batch (its rows,
``S / C`` of the sequence), to find what the runtime (``runtime/context.py``) acts on and what it costs:

* every ``F.scaled_dot_product_attention`` call — its keys' and values' elements per micro-batch on a rank
  (all-gathered over ``context`` in forward, reduce-scattered in backward: per call ``2·(C-1)·n`` elements
  each way, ``n`` the local keys' — Llama 3's all-gather: ``2·b·s·h_kv·(C-1)/C`` bytes a sequence), and
  the unit it runs in (a recomputed unit gathers again in backward);
* the modules that turn positions into embeddings — a learned position table (an ``nn.Embedding``) or a
  rotary embedding (a module with an ``inv_freq`` buffer: transformers' ``*RotaryEmbedding``) called with
  a sequence's positions (an integer tensor without batch rows, ``[S]`` or ``[1, S]``) — whose positions
  the runtime maps to the global ones.

What cannot run on chunks is refused by name at plan time: a sequence the axis does not divide into ``2·C``
chunks (zigzag), a model whose attention does not go through SDPA (eager attention with a materialized mask:
the fix is SDPA), attention dropout, a position table shorter than the sequence, a pooling over the sequence,
a sliding window under selective recompute.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only


METHODS = ("allgather", "ring", "ulysses")


@dataclass(frozen=True)
class AttentionCall:
    """One SDPA call of a micro-batch's forward on one rank: its keys' (= values') and queries' elements and
    heads, and the unit it runs in."""

    kv_numel: int
    unit: str
    q_numel: int = 0
    heads: int = 1
    kv_heads: int = 1


@dataclass(frozen=True)
class ContextTrace:
    calls: tuple[AttentionCall, ...]
    tables: tuple[str, ...]          # modules holding learned position tables
    problems: tuple[str, ...]


_REDUCTIONS = {torch.mean, torch.sum, torch.amax, torch.amin, torch.max, torch.min, torch.logsumexp, torch.prod,
               torch.Tensor.mean, torch.Tensor.sum, torch.Tensor.amax, torch.Tensor.amin, torch.Tensor.max,
               torch.Tensor.min, torch.Tensor.logsumexp, torch.Tensor.prod}


class _Recorder(TorchFunctionMode):
    def __init__(self, units: list[str], stack: list[str], local_seq: int = 0):
        super().__init__()
        self.units, self.stack, self.local_seq = set(units), stack, local_seq
        self.calls: list[tuple] = []
        self.pooled: list[str] = []        # modules that reduce activations over the sequence

    def _pools(self, func, args, kwargs) -> bool:
        """A reduction over dim 1 of a ``[batch, seq, ...]`` activation: it would see only the rank's chunk."""
        x = args[0] if args else None
        if func not in _REDUCTIONS or not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 3 \
                or x.shape[1] != self.local_seq:
            return False
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim is None:
            return False                   # (a reduction to one number: a loss)
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return any(isinstance(d, int) and d % x.dim() == 1 for d in dims)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._pools(func, args, kwargs):
            self.pooled.append(next((m for m in reversed(self.stack) if m), "the model's forward"))
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            unit = next((m for m in reversed(self.stack) if m in self.units), "")
            self.calls.append((k.numel(), float(dropout or 0.0), unit, q.numel(), q.shape[-3] if q.dim() > 2 else 1,
                               k.shape[-3] if k.dim() > 2 else 1))
        return func(*args, **kwargs)


def _local(batch: Any, rows: int, size: int) -> Any:
    """One rank's micro-batch of ``batch`` (fake tensors): ``rows`` rows, ``1/size`` of dim 1."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[0] = rows
        if len(shape) > 1:
            shape[1] //= size
        return torch.zeros(shape, dtype=t.dtype)
    return tree_map_only(torch.Tensor, cut, batch)


def is_positions(t: Any) -> bool:
    """A sequence's positions: an integer tensor without batch rows (``[S]`` or ``[1, S]``)."""
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() in (1, 2) \
        and (t.dim() == 1 or t.shape[0] == 1)


def positions_in(args: tuple, kwargs: dict, local: int) -> list[tuple[int, ...]]:
    """The shapes of the arguments that are a sequence's positions (``is_positions``) of the local length."""
    return [tuple(t.shape) for t in (*args, *kwargs.values()) if is_positions(t) and t.shape[-1] == local]


@contextmanager
def _unpacked() -> Iterator[None]:
    """While tracing: transformers' packed-document check as it answers on a rank's chunk. It reads the
    positions' values (``position_ids`` jumping back start a new document), which fake tensors do not
    have, and while tracing assumes packing — then builds an explicit mask and expands grouped keys and
    values, as it never does on a rank: its positions are ``arange`` of the chunk (the rotary module maps
    them), so it finds one document a row. The check answers that here too."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    real = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = real


def _reads_positions(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) or any(n == "inv_freq" for n, _ in module.named_buffers(recurse=False))


def context_trace(model: nn.Module, batch: Any, size: int, rows: int, units: list[str],
                  heads_over: int = 1, selective: bool = False) -> ContextTrace:
    """The model's forward on one rank's micro-batch (``rows`` rows, the sequence's ``1/size``), on fake
    tensors: its attention calls and position modules (module doc), and what cannot run on chunks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from .functional import functional_call

    if isinstance(batch, dict):        # (flash-attention's offsets of packed documents: not per token)
        batch = {k: v for k, v in batch.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                             "max_length_k")}
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
    if _sliding_window(model) is not None and selective:
        problems.append(f"plan: {type(model).__name__} attends within a sliding window, and selective recompute replays "
                        "attention where the layer's window is not known — not built yet. Use recompute='full' or "
                        "'none' with the context axis.")
        return ContextTrace((), (), tuple(problems))
    if isinstance(batch, dict):        # documents and padding go to the attention, not the model (runtime/batches.py)
        batch = {k: v for k, v in batch.items() if k not in ("attention_mask", "position_ids", "cu_seq_lens_q",
                                                             "cu_seq_lens_k", "max_length_q", "max_length_k")}
    trace_rows = 2                   # two rows: a position lookup has no batch dim, a token lookup has
    stack: list[str] = []
    looked: set[str] = set()
    names = {m: n for n, m in model.named_modules()}
    local_seq = seq // size

    def enter(mod, args, kwargs):
        stack.append(names.get(mod, "") or type(mod).__name__)          # (the root by its class)
        if _reads_positions(mod) and positions_in(args, kwargs, local_seq):
            looked.add(names.get(mod, ""))

    def leave(mod, args, out):
        stack.pop()

    handles = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in model.modules()] + \
        [m.register_forward_hook(leave) for m in model.modules()]
    recorder = _Recorder(units, stack, local_seq)
    try:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        # (a shape environment: a mixture of experts' routing has data-dependent sizes, unbacked here)
        with FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv()):
            state = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
            state.update({n: torch.empty(b.shape, dtype=b.dtype) for n, b in model.named_buffers()})
            local = _local(batch, trace_rows, size)
            with recorder, torch.no_grad(), _unpacked():
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
    if recorder.pooled:
        where = ", ".join(dict.fromkeys(recorder.pooled))
        problems.append(f"plan: {where} reduces activations over the sequence (a pooling over dim 1) — on a context "
                        "rank it would see only its chunk; expected every op but attention to read its own tokens. "
                        "Pool after gathering the sequence (or compute it in the loss over the whole batch), or drop "
                        "the context axis.")
    # (an explicit mask is seen only when it runs: transformers builds one while tracing, skips it on a batch
    # without padding — runtime/context.py refuses one there)
    for _, dropout, unit, *_ in recorder.calls:
        if dropout:
            problems.append(f"plan: an attention call{f' in {unit}' if unit else ''} passes dropout_p={dropout} to "
                            "SDPA — expected attention without dropout: context-parallel attention draws no dropout "
                            "mask one process would draw. Build the model with attention dropout 0.")
            break
    tables = sorted(looked)
    mods = dict(model.named_modules())
    for name in tables:
        if isinstance(mods[name], nn.Embedding):
            n = mods[name].num_embeddings
            if n < seq:
                problems.append(f"plan: {name} is a learned position table of {n} positions, shorter than the "
                                f"{seq}-token sequence — expected a table at least as long as the sequence. Use a "
                                f"sequence of at most {n} tokens, or a longer table.")
    scale = rows / trace_rows
    t = heads_over            # the heads a tensor axis splits: each rank's calls hold 1/t of them
    calls = tuple(AttentionCall(int(numel * scale) // t, unit, int(qn * scale) // t, h // t, max(1, hkv // t))
                  for numel, _, unit, qn, h, hkv in recorder.calls)
    return ContextTrace(calls, tuple(tables), tuple(problems))


def context_moves(calls: tuple[AttentionCall, ...], size: int, itemsize: int, m: int, recomputed: set[str],
                  method: str = "allgather") -> list[tuple[str, str, int, int, str]]:
    """``(phase, op, bytes each, count, where)`` of the attention calls' collectives over the context axis by
    ``method`` (``comm_per_step``'s entries), per call and micro-batch; a call in a recomputed unit runs its
    forward's again in backward:

    * allgather: the keys' and values' all-gathers forward, their gradients' reduce-scatters backward;
    * ring: ``C-1`` passes of the key/value block forward (one message: both); backward ``C-1`` passes of the
      block and ``C`` of its fp32 gradients' accumulator;
    * ulysses: all-to-alls of the queries, keys, values and output forward, of their gradients backward (keys
      and values repeated to every head where the axis does not divide their heads)."""
    from ..comm import core as comm
    out = []
    for i, c in enumerate(calls):
        where = c.unit or f"attention {i}"
        again = c.unit in recomputed
        if method == "ring":
            block = 2 * c.kv_numel * itemsize
            fwd = [("send_recv", block, (size - 1) * m)]
            bwd = [("send_recv", block, (size - 1) * m), ("send_recv", 2 * c.kv_numel * 4, size * m)]
        elif method == "ulysses":
            kv = c.kv_numel * (1 if c.kv_heads % size == 0 else c.heads // c.kv_heads)
            moves = [("all_to_all", comm_a2a(n, size, itemsize), m) for n in (c.q_numel, kv, kv, c.q_numel)]
            fwd, bwd = moves, moves
        else:
            fwd = [("all_gather", comm.all_gather_bytes(c.kv_numel, size, itemsize), 2 * m)]
            bwd = [("reduce_scatter", comm.reduce_scatter_bytes(c.kv_numel, size, itemsize), 2 * m)]
        out += [("forward", op, n, k, where) for op, n, k in fwd]
        if again:
            out += [("backward", op, n, k, where) for op, n, k in fwd]
        out += [("backward", op, n, k, where) for op, n, k in bwd]
    return out


def comm_a2a(numel: int, size: int, itemsize: int) -> int:
    """Bytes a rank sends in an even all-to-all of ``numel`` elements over ``size`` ranks."""
    return numel // size * (size - 1) * itemsize


def method_costs(calls: tuple[AttentionCall, ...], size: int, itemsize: int, *, bandwidth: float = 25e9,
                 latency: float = 1e-5) -> dict[str, tuple[float, int]]:
    """Each method's ``(seconds of its moves a step, bytes of keys and values a rank holds at once)`` for one
    micro-batch's attention calls, at ``bandwidth`` bytes/s and ``latency`` s a message (a machine's
    figures where known): the planner picks the fastest, the least memory breaking ties. Ulysses needs the
    query heads divisible by the axis."""
    out: dict[str, tuple[float, int]] = {}
    for method in METHODS:
        if method == "ulysses" and any(c.heads % size for c in calls):
            continue
        moves = context_moves(calls, size, itemsize, 1, set(), method)
        t = sum(k * (n / bandwidth + latency * (size - 1 if op != "send_recv" else 1)) for _, op, n, k, _ in moves)
        held = max((c.kv_numel * itemsize * {"allgather": 2 * size, "ring": 4,
                                             "ulysses": 2 * max(1, c.heads // max(c.kv_heads, 1))}[method]
                    for c in calls), default=0)
        out[method] = (t, held)
    return out


def choose_method(calls: tuple[AttentionCall, ...], size: int, itemsize: int, forced: str | None,
                  **figures: float) -> str:
    """``forced``, or the fastest method by ``method_costs`` (ties: the least held, then the simplest)."""
    if forced is not None:
        return forced
    costs = method_costs(calls, size, itemsize, **figures)
    return min(costs, key=lambda k: (round(costs[k][0], 12), costs[k][1], METHODS.index(k)))


def kv_bytes_formula(seq: int, kv_width: int, size: int, itemsize: int) -> float:
    """Llama 3's all-gather of one layer's keys and values for one sequence: ``2·b·s·h_kv·(N-1)/N``."""
    return 2 * itemsize * seq * kv_width * (size - 1) / size


def ring_bytes_formula(seq: int, kv_width: int, size: int, itemsize: int) -> float:
    """The ring's passes of one layer's key/value blocks for one sequence, forward: ``2·(N-1)·b·(s/N)·h_kv``."""
    return 2 * (size - 1) * itemsize * seq / size * kv_width


def ulysses_bytes_formula(seq: int, width: int, size: int, itemsize: int, kv_width: int | None = None) -> float:
    """Ulysses' all-to-alls of one layer for one sequence, forward (queries, keys, values, output):
    ``4·b·(s/N)·h·(N-1)/N`` with keys and values as wide as the queries; with grouped keys and values of
    ``kv_width`` that the axis splits, ``2·b·(s/N)·(h + h_kv)·(N-1)/N``."""
    kv = width if kv_width is None else kv_width
    return 2 * itemsize * seq / size * (width + kv) * (size - 1) / size


FORMULAS = {"allgather": kv_bytes_formula, "ring": ring_bytes_formula, "ulysses": ulysses_bytes_formula}



def whole_sequence_inputs(model: nn.Module, batch: Any) -> Any:
    """``batch`` with what a transformers causal LM derives from the whole sequence given explicitly before
    the sequence is cut: for its own loss, ``shift_labels`` (the labels shifted once over the whole sequence,
    ``-100`` after the last token: each chunk's last token keeps its label from the next chunk). (Positions
    are not passed: transformers would read chunks' jumps as packed documents; the position modules' inputs
    are mapped instead.) Other batches are returned as they are."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        return batch
    from .hf_loss import causal_lm_loss
    out = dict(batch)
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and "shift_labels" not in out and causal_lm_loss(model):
        out["shift_labels"] = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], -100)), 1)
    return out


def context_activations(model: nn.Module, plan: Any, batch: Any) -> int | None:
    """What one micro-batch saves for backward on a rank of a context plan: ``activation_bytes`` of the model on
    the rank's chunk (its rows, ``S / C`` tokens of each; the plan's recompute applied), plus what the method
    keeps beyond the local keys and values: the all-gather's whole keys and values (``C - 1`` more chunks of
    each per call). None where the forward's shapes depend on its data (a mixture of experts)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    from .peak import activation_bytes
    size = plan.context_size
    rows = max(1, _rows(batch) // (plan.dp_size // size * plan.grad_accum))
    local = _local(whole_sequence_inputs(model, batch), rows, size)
    try:
        saved = activation_bytes(model, local, plan=plan)
    except DynamicOutputShapeException:
        return None
    if plan.context_attention == "allgather":
        saved += sum(2 * (size - 1) * c.kv_numel for c in plan.context_calls) * plan.compute_dtype.itemsize
    return int(saved)


def _rows(batch: Any) -> int:
    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return leaves[0].shape[0] if leaves and leaves[0].dim() else 1


def _sliding_window(model: nn.Module) -> int | None:
    """The window of a transformers model whose layers (some of them) attend within one, else None."""
    from .peft import peft_base
    config = getattr(peft_base(model)[0], "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and "sliding_attention" not in kinds:
        return None
    return window
