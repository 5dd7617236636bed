"""The pipe axis in ``explain()``: stages, schedule, idle fraction, point-to-point bytes and
activation memory per stage.

**Activation memory.** What a pipeline stage holds between a micro-batch's forward and its
backward is what autograd saves for backward. ``saved_bytes`` measures it for one call: the call
runs on the meta device (nothing is allocated or computed) under
``torch.autograd.graph.saved_tensors_hooks``; each saved tensor is counted once by its storage
(a tensor saved by two ops, or ``q``, ``k``, ``v`` as views of one projection, hold one buffer),
and a parameter's storage not at all (it is resident anyway: model states, not activations).
``block_saved_bytes`` runs each block of the layer stack that way on the stream of one
micro-batch (its per-rank shape ``PipelinePlan.stream``, known when the plan is given
``batch=``), with the shapes of the parameters on tensor coordinate 0 and the tensor axis's
boundaries installed, as a step runs them (``comm/boundaries.py``: sequence parallelism gathers
the sequence inside a block). A recomputed block (``recompute=``) keeps only its input. Then

    activations of a stage = Σ over its blocks of (saved bytes per micro-batch) × live micro-batches

where *live* is the simulator's ``peak_live`` of the stage's rank: micro-batches whose forward
has run and whose last backward part has not (1F1B: ``p - r`` on rank ``r`` when ``m >= p``;
GPipe: ``m``). With ``v > 1`` a rank's peak is taken over its schedule with each virtual stage's
live micro-batches weighted by that stage's bytes. What ``pipeline_pre`` / ``pipeline_post`` save
(embeddings, logits) is not counted. The meta device runs attention as its math
decomposition, so a fused kernel that saves less (flash attention's log-sum-exp instead of the
probabilities) is overestimated.

The plan is data without the model, so the measurement is made at plan time (``sl.plan(...,
batch=)``) and carried as ``PipelinePlan.block_saved``: bytes per micro-batch of each block, in the
stack's order; ``explain()`` reads it from there.
"""

from __future__ import annotations

import contextlib
import math
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm.core import format_bytes
from ..comm.recompute import FusedOnMeta, SelectiveRecompute
from ..errors import ShardingError
from .functional import functional_call

if TYPE_CHECKING:
    from .pipeline import PipelinePlan
    from .plan import Plan

WIDTH = 150                  # as explain.py wraps
MAX_ACTIONS = 24             # compute actions printed per pipe rank unless explain(full=True)

FORMULAS = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved_1f1b": "(p-1)/(v·m+p-1)",
            "zb_h1": "(p-1)/(3m+p-1)"}


# ---- measuring what autograd saves ---------------------------------------------------------------

def saved_bytes(fn: Callable[..., Any], *args: Any, exclude: Sequence[torch.Tensor] = (), **kwargs: Any) -> int:
    """Bytes autograd saves for backward while ``fn(*args, **kwargs)`` runs: each saved tensor's
    storage counted once (storages of ``exclude``, e.g. the parameters, not at all). Meant for meta
    tensors (nothing is allocated); the result of ``fn`` is dropped."""
    saved: list[torch.Tensor] = []        # kept alive while counting, so no storage is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with FusedOnMeta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    skip = {t.untyped_storage()._cdata for t in exclude}
    sizes: dict[int, int] = {}
    for t in saved:
        s = t.untyped_storage()
        key = s._cdata
        if key not in skip:
            sizes[key] = max(sizes.get(key, 0), s.nbytes())
    del out
    return sum(sizes.values())


def block_saved_bytes(model: nn.Module, plan: Plan, *, rank: int = 0, batch: Any = None) -> tuple[int, ...]:
    """Per block of the layer stack (in order), the bytes autograd saves for backward in that block
    for one micro-batch on ``rank`` (see the module doc). Blocks of one class and parameter shapes
    (and, for a transformers model, the same keyword arguments' shapes) are measured once. Needs
    the stream's shape (``sl.plan(..., batch=)``). A transformers model's blocks are called with
    the keyword arguments its forward gives them (``planner/hf_stages.py``) for a micro-batch of
    ``batch`` (the plan's example batch; without it, tokens of the stream's shape and no mask)."""
    from ..comm.boundaries import Boundaries
    from ..comm.boundary_ops import Ops
    from .hf_stages import CausalLMStages, meta_or_zeros
    from .stack import stage_functions

    pp = plan.pipeline
    if pp is None or pp.stream is None:
        raise ShardingError("block_saved_bytes: the plan does not know the stream between stages — got "
                            f"{'no pipeline' if pp is None else 'stream None'}; expected a pipeline plan made "
                            "with an example batch. Plan with sl.plan(..., rules={'layers': 'pipe'}, batch=...).")
    dtype = plan.compute_dtype
    modules = dict(model.named_modules())
    params = {p.name: p for p in plan.params}
    recomputed = {u.name for u in plan.units if u.recompute}
    selective = {u.name for u in plan.units if u.selective}
    cores = 0
    tp = plan.tensor
    sp = tp is not None and tp.sequence_parallel and tp.size > 1
    body = [u.name for u in plan.units if u.name]
    bounds = None
    if tp is not None and tp.size > 1:
        class MeasureOps(Ops):
            """The step's boundary ops on meta tensors (reshapes only), keeping ``requires_grad``."""

            def _meta_seq(self, x: torch.Tensor, mul: int, div: int, dim: int | None = None) -> torch.Tensor:
                return super()._meta_seq(x, mul, div, dim).requires_grad_(x.requires_grad)

            def coord(self) -> int:
                return plan.mesh.coord(rank, tp.axis)
        bounds = Boundaries(model, tp, MeasureOps(plan.mesh, tp.axis, tp.seq_dim), [u.name for u in plan.units],
                            recomputed=[u.name for u in plan.units if u.recompute])
    memo: dict[tuple, int] = {}
    out = []
    fns = stage_functions(model, pp.stack)
    ctx = None
    if isinstance(fns, CausalLMStages):
        rows, seq = pp.stream[0], pp.stream[1] * (tp.size if sp else 1)
        example = batch if isinstance(batch, dict) else {"input_ids": torch.zeros(rows, seq, dtype=torch.long)}
        ctx = fns.probe(example, rows, dtype)[1]
    index = {f"{pp.stack}.{n}": i for i, (n, _) in enumerate(modules[pp.stack].named_children())}
    try:
        for s in pp.stages:
            for name in s.blocks:
                block = modules[name]
                kwargs = ctx[index[name]] if ctx is not None else {}
                shape = list(pp.stream)
                if sp and body and name == body[0]:     # the first unit's input is the whole sequence
                    shape[tp.seq_dim] *= tp.size
                values = {}
                for n, _ in block.named_parameters():
                    p = params[f"{name}.{n}"]
                    local = tuple(p.compute.local_shape(p.shape, rank)) if p.shape else ()
                    if local and plan.is_expert(p.name):     # run as the whole experts on this rank's tokens: the
                        local = (p.shape[0], *local[1:])     # rows routed to a rank's experts, T·k, at uniform routing
                    values[n] = torch.empty(local, dtype=dtype, device="meta", requires_grad=p.trainable)
                for n, b in block.named_buffers():       # floating buffers in the compute dtype, as a step casts them
                    values[n] = torch.empty(b.shape, dtype=dtype if b.is_floating_point() and plan.mixed else b.dtype,
                                            device="meta")
                key = (type(block), tuple((n, tuple(v.shape)) for n, v in values.items()), tuple(shape),
                       name in recomputed, name in selective, bool(sp and body and name == body[0]),
                       tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else repr(v))
                             for k, v in kwargs.items()))
                if key not in memo:
                    x = torch.empty(shape, dtype=getattr(torch, pp.stream_dtype), device="meta", requires_grad=True)
                    if name in recomputed:           # a checkpoint keeps its input; the rest is recomputed
                        first_sp = bool(sp and body and name == body[0])   # sliced to this rank's chunk before it
                        memo[key] = x.numel() * x.element_size() // (tp.size if first_sp else 1)
                    else:
                        mode = SelectiveRecompute() if name in selective else contextlib.nullcontext()

                        def call(*a, _mode=mode, **k):      # the unit's own mode innermost, as a step runs it
                            with _mode:
                                return functional_call(*a, **k)
                        memo[key] = meta_or_zeros(
                            lambda values, x, kwargs, _call=call, _block=block: saved_bytes(
                                _call, _block, values, (x,), kwargs, exclude=list(values.values()), strict=False),
                            values, x, kwargs)
                        cores += getattr(mode, "calls", 0)
                out.append(memo[key])
    finally:
        if bounds is not None:
            bounds.remove()
    if selective and not cores:
        raise ShardingError(f"plan: recompute='selective' recomputes attention's core, but the blocks of "
                            f"{pp.stack!r} run none (no torch.nn.functional.scaled_dot_product_attention call) — "
                            "expected SDPA attention. A transformers model needs attn_implementation='sdpa'; "
                            "or use recompute='full'.", api="plan")
    return tuple(out)


def stack_saved_bytes(model: nn.Module, plan: Plan, batch: Any
                      ) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """Without a pipe axis (a tensor axis, say): the layer stack's name, each block's saved bytes per
    micro-batch on rank 0 and the stream's shape between blocks (``PipelinePlan.stream``), measured as ``block_saved_bytes`` measures a pipeline's blocks — the stack taken
    as one stage. None where the model has no one stack of identical blocks."""
    from dataclasses import replace

    from .pipeline import PipelinePlan, StagePlan, with_stream
    from .specs import find_stack
    from .stack import auto_stack
    stack = find_stack(model, None)[0] or auto_stack(model)[0]
    if stack is None:
        return None
    blocks = tuple(f"{stack}.{n}" for n, _ in model.get_submodule(stack).named_children())
    pp = PipelinePlan(axis="pipe", size=1, virtual=1, microbatches=plan.grad_accum, schedule="gpipe", stack=stack,
                      stages=(StagePlan(0, 0, blocks, True, True, 0),), split="one stage", pre_params=(),
                      post_params=())
    pp = with_stream(model, pp, plan, batch)
    return stack, block_saved_bytes(model, replace(plan, pipeline=pp), batch=batch), pp.stream


def korthikanti_factor(plan: Plan) -> tuple[float, str]:
    """Korthikanti et al.'s bytes per layer as a multiple of ``s·b·h`` (their Table 2, 16-bit values): with
    sequence parallelism ``34/t`` (selective recompute: the attention core's ``5as/h`` left out; else
    ``34/t + 5as/(h·t)``, not given here), without it ``10 + 24/t``; full recompute ``2`` (``2/t`` with SP).
    Returns the factor and the formula in words."""
    tp = plan.tensor
    t = tp.size if tp is not None else 1
    sp = tp is not None and tp.sequence_parallel and t > 1
    if plan.recompute == "full":
        return (2 / t, "2sbh/t (full recompute, SP)") if sp else (2.0, "2sbh (full recompute)")
    extra = "" if plan.recompute == "selective" else " + 5as²b/t (not counted: no recompute)"
    return (34 / t, f"34sbh/t (SP{', selective recompute' if not extra else ''}){extra}") if sp else \
        (10 + 24 / t, f"sbh(10 + 24/t){extra}")


def activation_lines(plan: Plan) -> list[str]:
    """The measured bytes a block saves per micro-batch as a multiple of ``s·b·h`` beside Korthikanti et al.'s
    formula, and the micro-batches in flight on the first pipe rank: what ``explain()`` says of activations."""
    pp = plan.pipeline
    if pp is not None and pp.block_saved and pp.stream:
        per, stream = pp.block_saved, pp.stream
        weight = {s.index: 1 for s in pp.stages if s.rank == 0}
        live = rank_peak(pp.actions(0), weight)
        mine = [b for s in pp.stages if s.rank == 0 for b in s.blocks]
        index = {b: i for i, b in enumerate(b for s in pp.stages for b in s.blocks)}
        blocks = [per[index[b]] for b in mine]
        where = (f"pipe rank 0's {len(blocks)} block{'s' if len(blocks) != 1 else ''} x {live} micro-batches in "
                 "flight (its schedule's peak)")
        total = rank_activation_bytes(plan, plan.mesh.rank_at([0] * plan.mesh.ndim))
    elif plan.stack_saved is not None:
        _, blocks, stream = plan.stack_saved
        blocks, live = list(blocks), 1
        where = f"{len(blocks)} blocks x 1 micro-batch in flight (micro-batches run in turn)"
        total = sum(blocks)
    else:
        return []
    tp = plan.tensor
    t = tp.size if tp is not None else 1
    sp = tp is not None and tp.sequence_parallel and t > 1
    seq_dim = tp.seq_dim if tp is not None else 1
    sbh = math.prod(stream) * (t if sp else 1)
    itemsize = 2                              # Korthikanti et al. count 16-bit values: bytes = 2 x elements
    factor, formula = korthikanti_factor(plan)
    got = blocks[0] / (sbh * itemsize / 2) if blocks else 0.0
    scale = f"/t (t={t})" if sp else ""
    mult = got * (t if sp else 1)
    return [f"  activations: a block saves {format_bytes(blocks[0])} per micro-batch = {mult:.1f}·sbh{scale} bytes "
            f"(s·b·h = {sbh:,} elements, seq dim {seq_dim}); Korthikanti et al.'s {formula} = "
            f"{format_bytes(int(factor * sbh))}; {where} = {format_bytes(total or 0)}"]


# ---- activation memory per stage and rank ------------------------------------------------------

def stage_saved(pp: PipelinePlan, per_block: Sequence[int]) -> list[int]:
    """Bytes saved per micro-batch by each virtual stage: the sum over its blocks."""
    out, i = [], 0
    for s in pp.stages:
        out.append(sum(per_block[i:i + len(s.blocks)]))
        i += len(s.blocks)
    return out


def rank_peak(actions: Sequence[Any], weight: dict[int, int]) -> int:
    """The most bytes a rank's schedule holds: walking its compute actions in order, a micro-batch's
    ``weight[stage]`` is added at its ``F`` and released at its last backward part (``B`` or ``W``)."""
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += weight.get(a.stage, 0)
            peak = max(peak, live)
        elif a.kind in ("B", "W"):
            live -= weight.get(a.stage, 0)
    return peak


def rank_activation_bytes(plan: Plan, rank: int) -> int | None:
    """The plan's activation memory on ``rank``: its blocks' saved bytes per micro-batch times its
    schedule's peak live micro-batches (``rank_peak``); None where the plan has not measured the
    blocks (no ``batch=``) or has no pipeline. The embeddings' and the head's are not counted."""
    pp = plan.pipeline
    per_block = getattr(pp, "block_saved", None) if pp is not None else None
    if per_block is None:
        return None
    weight = {s.index: b for s, b in zip(pp.stages, stage_saved(pp, per_block))}
    return rank_peak(pp.actions(plan.mesh.coord(rank, pp.axis)), weight)


# ---- the explain() section ---------------------------------------------------------------------

def pipeline_lines(plan: Plan, full: bool = False) -> list[str]:
    """The pipe axis in words (see the module doc): stages, the split, the schedule and each pipe
    rank's compute actions, the simulator's idle fraction beside the formula, point-to-point bytes
    sent per step and rank, and activation memory per stage."""
    from .simulate import bubble_formula, simulate

    pp = plan.pipeline
    p, m, v = pp.size, pp.microbatches, pp.virtual
    blocks = sum(len(s.blocks) for s in pp.stages)
    out = [(f"  pipeline: {pp.axis!r} (p={p}), {pp.num_stages} stages ({v} per rank), layer stack {pp.stack!r} "
            f"of {blocks} blocks; split {pp.split}")]
    if pp.source:
        out.append(f"    before, between and after the blocks: {pp.source}")
    if plan.pipe_coord is not None:
        out.append(f"    this plan holds pipe rank {plan.pipe_coord}'s stages")
    else:
        out.append(f"    per-rank numbers below the pipeline section are pipe rank {plan.pipe_coord_of()}'s "
                   "(plan.local(rank).explain() for another rank's)")
    w = max(len(_blocks_word(s, pp.stack)) for s in pp.stages)
    for s in pp.stages:
        out.append(f"    stage {s.index} -> pipe rank {s.rank}: {_blocks_word(s, pp.stack):<{w}}  {s.numel:>12,} params")

    actions = {r: pp.actions(r) for r in range(p)}
    sim = simulate(actions, p, m, v)
    out.append(f"    schedule {pp.schedule!r}: p={p}, m={m} micro-batches, v={v}; compute actions per pipe rank "
               "(0F3 = stage 0 forward of micro-batch 3):")
    for r in range(p):
        out += _wrap(f"rank {r}{_actions_word(actions[r], full)}", "      ", "        ")
    formula = bubble_formula(pp.schedule, p, m, v)
    text = FORMULAS[pp.schedule] if not (pp.schedule == "zb_h1" and m < p) else "(2p-m-1)/(2p+2m-1) (m < p)"
    idle = ", ".join(f"{x:.3f}" for x in sim.idle)
    out.append(f"    idle fraction (simulator, F=1 B=2 I=W=1): {sim.idle_fraction:.3f} (per rank {idle}); "
               f"formula {text} = {formula:.3f}")

    out.append("    point-to-point per step (bytes sent per rank, stream between stages "
               + (f"{list(pp.stream)} {pp.stream_dtype} per micro-batch):" if pp.stream is not None else "unknown):"))
    for r in _coords(plan):
        out.append(f"      pipe rank {r}: {_p2p_word(plan, r)}")

    out += _activation_lines(plan, sim.peak_live, actions)
    if plan.states.params is not None:
        from .pipeline import GATHER_POLICIES
        out.append(f"    ZeRO-3 gather policy pipe_gather={pp.gather!r}: {GATHER_POLICIES[pp.gather]}; gathered at "
                   f"most {format_bytes(plan.transient_per_rank(plan.mesh.rank_at(_rank_coords(plan)))['gathered'])} "
                   "(parameters and gather buffers)")
    # lines longer than explain's width wrap, continued two spaces deeper
    return [w for line in out for w in ([line] if len(line) <= WIDTH else
                                        _wrap(line.lstrip(), _indent(line), _indent(line) + "  "))]


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _blocks_word(s, stack: str) -> str:
    """``pre + blocks.0..3``: a stage's contiguous blocks as one range, with pre/post."""
    if not s.blocks:
        body = "no blocks"
    elif len(s.blocks) == 1:
        body = s.blocks[0]
    else:
        first, last = (b[len(stack) + 1:] for b in (s.blocks[0], s.blocks[-1]))
        body = f"{stack}.{first}..{last}"
    return " + ".join((["pre"] if s.pre else []) + [body] + (["post"] if s.post else []))


def _actions_word(actions: Sequence[Any], full: bool) -> str:
    """``": 0F0 0F1 0B0 ..."``; a long list as its first and last actions, with how many are left out."""
    words = [str(a) for a in actions]
    if full or len(words) <= MAX_ACTIONS:
        return ": " + " ".join(words)
    head, tail = words[:MAX_ACTIONS - 6], words[-6:]
    return (f" ({len(words)} actions, {len(words) - len(head) - len(tail)} not shown; explain(full=True) lists all): "
            f"{' '.join(head)} ... {' '.join(tail)}")


def _rank_coords(plan: Plan) -> list[int]:
    """Mesh coordinates of the first rank of this plan's pipe coordinate (pipe rank 0 for a whole-mesh plan)."""
    coords = [0] * plan.mesh.ndim
    coords[plan.mesh.axis_index(plan.pipeline.axis)] = plan.pipe_coord or 0
    return coords


def _coords(plan: Plan) -> list[int]:
    """The pipe coordinates whose traffic this plan can tell: all of them, or a stage-local plan's own."""
    return [plan.pipe_coord] if plan.pipe_coord is not None else list(range(plan.pipeline.size))


def _p2p_word(plan: Plan, coord: int) -> str:
    pp = plan.pipeline
    if plan.pipe_coord is not None:
        entries = plan.comm_per_step()
    else:
        coords = [0] * plan.mesh.ndim
        coords[plan.mesh.axis_index(pp.axis)] = coord
        entries = plan.comm_per_step(plan.mesh.rank_at(coords))
    sends = [e for e in entries if e.op == "send"]
    if not sends:
        return "sends nothing"
    if pp.stream is None:
        return (", ".join(f"{e.where} x{e.count}" for e in sends)
                + " sends; bytes unknown without batch= (sl.plan(..., batch=) gives the stream's shape)")
    words = ", ".join(f"{e.where} x{e.count} {format_bytes(e.bytes)}" for e in sends)
    return f"{words} = {format_bytes(sum(e.total for e in sends))}"


def _activation_lines(plan: Plan, peak_live: Sequence[int], actions: dict[int, list[Any]]) -> list[str]:
    pp = plan.pipeline
    head = ("    activations per stage = Σ its blocks' bytes saved for backward per micro-batch (on meta) × live "
            "micro-batches (simulator's peak on its rank):")
    if pp.stream is None:
        return [head, "      unknown without batch= (sl.plan(..., batch=) gives the stream's shape)"]
    per_block = getattr(pp, "block_saved", None)
    if per_block is None:
        return [head, ("      not measured: the plan carries no block_saved (pipeline_report.block_saved_bytes "
                       "measures it from the model)")]
    saved = stage_saved(pp, per_block)
    out = [head]
    i = 0
    for s, b in zip(pp.stages, saved):
        mine = per_block[i:i + len(s.blocks)]
        i += len(s.blocks)
        n = f"{len(mine)} block{'s' if len(mine) != 1 else ''}"
        each = (f"{n} x {format_bytes(mine[0])} = {format_bytes(b)}" if len(set(mine)) == 1
                else f"{n}, {format_bytes(b)}")
        line = f"      stage {s.index} (pipe rank {s.rank}): {each} per micro-batch"
        if pp.virtual == 1:
            live = peak_live[s.rank]
            line += f" x {live} live = {format_bytes(b * live)}"
        out.append(line)
    if pp.virtual > 1:
        weight = {s.index: b for s, b in zip(pp.stages, saved)}
        for r in range(pp.size):
            out.append(f"      pipe rank {r}: peak live {peak_live[r]} micro-batches over its {pp.virtual} stages "
                       f"-> {format_bytes(rank_peak(actions[r], weight))} at the peak")
    out.append(f"      + receive buffers: up to {pp.recv_window} posted ahead per rank x "
               f"{format_bytes(pp.grad_message_bytes)} = {format_bytes(pp.recv_window * pp.grad_message_bytes)}")
    return out


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False) or [first.rstrip()]
