"""Printing a ``Plan``: ``explain(plan)``, a function of the plan beside it (``Plan.explain`` calls it).

A large plan reads in one screen: what repeats is printed once with a count. Names are grouped
by their pattern, each number between dots a wildcard (``blocks.17.attn.qkv.weight`` ->
``blocks.*.attn.qkv.weight``); where the wildcard takes a contiguous range it is printed as one
(``blocks.0..999``). The gather schedule is printed as its repeating pattern (``[G(blocks.i+1)
W(blocks.i) F(blocks.i)] x998 (i = 0..997)``). ``explain(full=True)`` lists everything one by one.
Every number is computed from the whole plan either way. Linear in the number of parameters.
"""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING

import torch

from ..algebra.spec import Fused
from ..comm.core import format_bytes

if TYPE_CHECKING:
    from .plan import Plan

WIDTH = 150          # lines are wrapped at this width (a parameter name longer than a line is kept whole)
MAX_GROUPS = 24      # collective groups printed by default (the totals count every collective)
_DIGITS = re.compile(r"(?<![^.\s])\d+(?![^.\s])")    # a number between dots or spaces: blocks.12, bucket 3


def explain(plan: Plan, max_params: int | None = None, *, full: bool = False) -> str:
    """The plan in words: state layouts, the tensor and pipe axes (stages, schedule, idle
    fraction, point-to-point bytes, activations per stage: ``pipeline_report.py``), units, a row
    per parameter, model states per rank (with the ZeRO formula), ZeRO-3's gather schedule, the
    collectives of a step and their total against the ring minimum. By default repeated
    parameters, units and collectives are grouped (at most ``max_params`` rows of parameters, 40
    unless given); ``full=True`` lists each of them (every parameter unless ``max_params`` is
    given)."""
    if max_params is None:
        max_params = len(plan.params) if full else 40
    n = plan.data_size
    stage = f"ZeRO-{plan.zero}" if plan.zero else ("data parallel" if plan.zero == 0 else "custom")
    hsdp = (f", replicated over {plan.replica_axis!r} (R={plan.replica_size}, HSDP)"
            if plan.replica_axis is not None else "")
    lines = [f"Plan: {stage} over {plan.data_axis!r} (N={n}){hsdp} on mesh {plan.mesh.axis_sizes}; "
             f"{plan.precision} compute, {str(plan.reduce_dtype).replace('torch.', '')} reduction, "
             f"grad_accum={plan.grad_accum}, clip={plan.clip_grad_norm}",
             f"  states: params at rest {_spec(plan.states.params)}, grads {_spec(plan.states.grads)}, "
             f"optimizer {_spec(plan.states.optim)}, local grads "
             f"{'kept' if plan.states.keep_local_grads else 'freed after reduction'}",
             f"  batch: {plan.batch.spec} (dim 0 over {' x '.join(repr(a) for a in plan.row_axes)}"
             + (f", dim 1 over {plan.context_axis!r})" if plan.context_size > 1 else ")")]
    if plan.expert_size > 1:
        lines += _expert_lines(plan)
    if plan.context_size > 1:
        lines += _context_lines(plan)
    if plan.tensor is not None:
        lines += _tensor_lines(plan, full)
    if plan.pipeline is not None:
        from .pipeline_report import pipeline_lines
        lines += pipeline_lines(plan, full)
    from .pipeline_report import activation_lines
    lines += [w for line in activation_lines(plan) for w in _wrap(line.strip(), "  ", "    ")]
    lines += _frozen_lines(plan, full)
    lines += _wrap("units: " + ", ".join(_unit_words(plan, full))
                   + ("   (* = recomputed in backward)" if any(u.recompute for u in plan.units) else "")
                   + ("   (s = attention's core recomputed in backward)" if any(u.selective for u in plan.units)
                      else ""),
                   "  ", "    ")
    lines += ["", *_param_table(plan, max_params, full)]
    mem, formula = plan.memory_per_rank(kind="all"), plan.zero_formula()
    lines += ["", f"  model states per rank (Ψ = {plan.num_params:,} parameters):"]
    for k in ("params", "grads", "optimizer", "total"):
        lines.append(f"    {k:<10} {format_bytes(mem[k]):>10}   (ZeRO formula {format_bytes(formula[k])})")
    lines += _offload_lines(plan)
    pk = plan.peak_per_rank()
    lines.append(f"    peak       {format_bytes(pk['peak']):>10}   (states + largest transient "
                 f"{format_bytes(pk['transient'])}, at the {max(('build', 'backward', 'update', 'publish'), key=pk.get)}; "
                 "+ activations: peak_per_rank(activation_bytes=...))")
    if plan.states.params is not None:
        lines.append(f"    gathered   {format_bytes(plan.transient_per_rank()['gathered']):>10}   "
                     "(transient peak of gathered units and gather buffers, in this order:)")
        schedule = plan.gather_schedule()
        lines += _wrap(" ".join(schedule if full else _fold(schedule)), "      ", "      ")
    lines += ["", "  collectives per step (bytes sent per rank):"]
    entries = plan.comm_per_step()
    rows = [str(e) for e in entries] if full else _comm_rows(entries)
    if len(rows) > MAX_GROUPS and not full:
        rows = rows[:MAX_GROUPS] + [f"... and {len(rows) - MAX_GROUPS} more kinds (explain(full=True) lists "
                                    "every collective)"]
    lines += [f"    {r}" for r in rows] or ["    none (one rank)"]
    lines.append(f"    total {format_bytes(plan.comm_bytes_per_step())}; params+grads "
                 f"{format_bytes(plan.comm_bytes_per_step('params') + plan.comm_bytes_per_step('grads'))} "
                 f"vs ring minimum {format_bytes(plan.ring_minimum())}")
    return "\n".join(lines)

def _tensor_lines(plan: Plan, full: bool) -> list[str]:
    """The tensor axis: split modules by kind, the residual stream's layout at the unit
    boundaries, and the activation collectives of one micro-step per unit."""
    tp = plan.tensor
    kinds: dict[str, list[str]] = {}
    for site in tp.sites:
        kinds.setdefault(site.kind, []).append(site.module)
    words = [f"{k} {_collapse(v) if not full else ', '.join(v)} ({len(v)})" for k, v in kinds.items()]
    d, t = plan.data_axis, tp.axis
    stream = (f"P({d!r}, {t!r}, None): batch over {d!r}, sequence over {t!r} (sequence parallel)"
              if tp.sequence_parallel else f"P({d!r}, None, None): replicated over {t!r}")
    out = [f"  tensor: {t!r} (t={tp.size}), sequence_parallel={tp.sequence_parallel}"]
    if tp.dims_from:
        out += _wrap(f"dims from {tp.dims_from}", "    ", "      ")
    out += _wrap("split modules: " + ("; ".join(words) or f"none (no parameter's spec names {t!r}: give sl.plan "
                                                         "rules= or sl.shard specs)"), "    ", "      ")
    out.append(f"    residual stream at every unit boundary: {stream}; outside the units "
               f"P({d!r}, None, None)")
    if tp.partial_modules:
        out += _wrap("partial gradients (replicated over "
                     f"{t!r}, they meet split values; their parameters enter through f, all-reduced in backward): "
                     + (_collapse(list(tp.partial_modules)) if not full else ", ".join(tp.partial_modules)),
                     "    ", "      ")
    entries = plan.activation_entries()
    if not entries:
        out.append("    activation collectives: pass batch= to sl.plan to trace them")
        return out
    out.append(f"    activation collectives per micro-step (tensor coordinate {plan.tensor_coord()}, bytes "
               "sent per rank), per unit:")
    by_unit = _group(entries, lambda e: e.where)
    if full:
        rows = [f"{u[0].where}: " + ", ".join(f"{e.phase[:3]} {e.op}{'(' + e.what + ')' if e.what != 'activations' else ''}"
                                             f" {format_bytes(e.bytes)}" for e in u) for u in by_unit]
    else:
        rows = []
        for same in _group(by_unit, lambda u: (_pattern(u[0].where),
                                               tuple((e.phase, e.op, e.what, e.bytes) for e in u))):
            u = same[0]
            words = ", ".join(f"{e.phase[:3]} {e.op}{'(' + e.what + ')' if e.what != 'activations' else ''} "
                              f"{format_bytes(e.bytes)}" for e in u)
            rows.append(f"{_collapse([x[0].where for x in same])}: {words}")
    out += [f"      {r}" for r in rows]
    return out

def _unit_words(plan: Plan, full: bool) -> list[str]:
    """``name(params)`` per unit, ``*`` when recomputed; by default units of one name pattern,
    parameter count and policy are one entry: ``blocks.0..999 (1000 units x 12 params)*``."""
    def star(u) -> str:
        return "*" if u.recompute else "s" if u.selective else ""
    if full:
        return [f"{u.name or '<root>'}({len(u.params)}){star(u)}" for u in plan.units]
    groups = _group(plan.units, lambda u: (_pattern(u.name), len(u.params), u.recompute, u.selective,
                                           u.reshard_after_forward))
    words = []
    for us in groups:
        u = us[0]
        if len(us) == 1:
            words.append(f"{u.name or '<root>'}({len(u.params)}){star(u)}")
        else:
            words.append(f"{_collapse([v.name for v in us])} ({len(us)} units x {len(u.params)} params)"
                         f"{star(u)}")
    return words

def _offload_lines(plan: Plan) -> list[str]:
    """Memory kinds (``planner/offload.py``): what each kind holds of this rank's model states."""
    if not plan.offload:
        return []
    kinds = {k: plan.memory_per_rank(kind=k) for k in ("device", "host", "disk")}
    where = ", ".join(f"{s} -> {k}" for s, k in plan.offload)
    disk = f" (files under {plan.offload_dir!r})" if plan.offload_dir else ""
    copies = plan.copy_bytes_per_step()
    moved = ", ".join(f"{op} {format_bytes(b)}" for op, b in copies.items() if b)
    cpu = getattr(plan.mesh, "device", None)
    same = (" — on this machine (no accelerator) 'host' is the same memory as 'device': the copies run, "
            "nothing is saved" if cpu is not None and torch.device(cpu).type == "cpu" else "")
    delayed = []
    if plan.delayed:
        from .memory import delayed_copy_bytes
        extra = delayed_copy_bytes(plan)
        delayed = ["    delayed update: the host update of step t runs beside step t+1's forward and backward, which "
                   "compute with the parameters of update t-1 (DeepSpeed's delayed parameter update: the numerics "
                   "differ)" + (f"; it reads its own fp32 copy of the gradients ({format_bytes(extra)} more on the "
                                "host, counted in its grads, from one backward to the next)" if extra else "")]
    return [f"    by memory kind ({where}{disk}): "
            + ", ".join(f"{k} {format_bytes(v['total'])}" for k, v in kinds.items()),
            f"    copies per step between kinds: {moved or 'none'}"
            + (f"; offload_dir holds {format_bytes(plan.disk_bytes())} (two generations, every rank)"
               if kinds["disk"]["total"] else "") + same] + delayed

def _frozen_lines(plan: Plan, full: bool) -> list[str]:
    """Frozen and quantized parameters, and each LoRA adapter's layout next to its base weight's."""
    frozen = [p for p in plan.params if not p.trainable]
    if not frozen:
        return []
    quant = [p for p in frozen if p.quant is not None]
    c = plan.compute_dtype.itemsize
    lines = [f"  frozen: {len(frozen)} parameters ({sum(p.numel for p in frozen):,} elements): no gradient, "
             "optimizer state or master copy"
             + (f"; {len(quant)} quantized ({', '.join(sorted({_quant_word(p.quant) for p in quant}))}), held "
                f"packed: {format_bytes(sum(p.quant.packed_bytes(p.shape) for p in quant))} for "
                f"{format_bytes(sum(p.numel for p in quant) * c)} in {plan.precision}" if quant else "")]
    by_name = {p.name: p for p in plan.params}
    rows: dict[tuple, list[str]] = {}
    for p in plan.params:
        if ".lora_A." not in p.name or not p.name.endswith(".weight"):
            continue
        layer = p.name[:p.name.index(".lora_A.")]
        adapter = p.name[len(layer) + len(".lora_A."):-len(".weight")]
        base = by_name.get(f"{layer}.base_layer.weight")
        b = by_name.get(f"{layer}.lora_B.{adapter}.weight")
        key = (_dims(base.spec) if base is not None else "?", _dims(p.spec), _dims(b.spec) if b else "?")
        rows.setdefault(key, []).append(layer)
    for (base, a, b), layers in rows.items():
        where = ", ".join(layers) if full else _collapse(layers, ranges=False)
        lines += _wrap(f"LoRA {where}: base {base} -> lora_A {a}, lora_B {b}", "  ", "    ")
    return lines

def _param_table(plan: Plan, max_rows: int, full: bool) -> list[str]:
    """A row per parameter (``full``) or per group of parameters of one name pattern, shape,
    unit pattern and layouts, with their count."""
    shorts: dict[int, str] = {}        # id(layout) -> its short form: parameters share a few layouts
    unit_patterns = {u.name: _pattern(u.name) for u in plan.units}

    def short(layout) -> str:
        s = shorts.get(id(layout))
        if s is None:
            s = shorts[id(layout)] = _dims(layout.spec) if plan.tensor is not None else layout.short()
        return s

    def cells(p) -> tuple[str, ...]:
        shape = str(list(p.shape)) + (f" {_quant_word(p.quant)}" if p.quant is not None else "")
        if not p.trainable:          # no gradient, no optimizer state, no master: ``frozen``
            return (shape, short(p.rest), short(p.compute), "frozen", "frozen")
        return (shape, short(p.rest), short(p.compute), short(p.grad), short(p.optim))
    if full:
        rows = [(p.name, p.unit or "<root>", cells(p), 1) for p in plan.params]
    else:
        groups = _group(plan.params, lambda p: (_pattern(p.name), unit_patterns.get(p.unit) or _pattern(p.unit),
                                               cells(p)))
        rows = [(_collapse([p.name for p in ps], ranges=False),
                 _collapse([p.unit for p in ps], ranges=False) or "<root>", cells(ps[0]), len(ps))
                for ps in groups]
    shown = rows[:max_rows]
    w = max(32, min(64, max((len(r[0]) for r in shown), default=0)))
    wu = max(10, min(32, max((len(r[1]) for r in shown), default=0)))
    ws = max(14, min(32, max((len(r[2][0]) for r in shown), default=0)))
    # the layout columns as wide as their widest cell (tensor·data,- is wider than a header)
    wl = [max(m, *(len(r[2][k]) for r in shown)) if shown else m for k, m in enumerate((0, 6, 8, 6, 6))]
    out = [f"  {'parameter':<{w}} {'shape':<{ws}} {'unit':<{wu}} {'rest':<{wl[1]}} {'compute':<{wl[2]}} "
           f"{'grad':<{wl[3]}} {'optim':<{wl[4]}}" + ("" if full else " count")]
    for name, unit, (shape, rest, compute, grad, optim), count in shown:
        out.append(f"  {name:<{w}} {shape:<{ws}} {unit:<{wu}} {rest:<{wl[1]}} {compute:<{wl[2]}} {grad:<{wl[3]}} "
                   f"{optim:<{wl[4]}}" + ("" if full else f" {count:>5}"))
    if len(rows) > max_rows:
        what = "parameters" if full else f"rows ({sum(r[3] for r in rows[max_rows:])} parameters)"
        out.append(f"  ... and {len(rows) - max_rows} more {what}")
    return out


# ---- grouping ----------------------------------------------------------------------------------

def _quant_word(q) -> str:
    """``int8`` for torchao's ``Int8Tensor``, ``int4`` for ``Int4Tensor``: the type's name, lowered."""
    return q.kind.lower().removesuffix("tensor")


def _pattern(name: str) -> str:
    """``name`` with each number between dots (or spaces) a wildcard: ``blocks.17.ln1`` -> ``blocks.*.ln1``."""
    return _DIGITS.sub("*", name)


def _group(items, key) -> list[list]:
    """``items`` grouped by ``key``, groups in order of first appearance."""
    groups: dict = {}
    for x in items:
        groups.setdefault(key(x), []).append(x)
    return list(groups.values())


def _collapse(names: list[str], ranges: bool = True) -> str:
    """One name for names of one pattern: digits equal in all of them are kept; digits that differ
    are ``*``, or (``ranges``) ``a..b`` where they take each value of a contiguous range once.
    Names of several patterns are collapsed per pattern and joined with commas."""
    by_pattern = _group(names, _pattern)
    if len(by_pattern) > 1:
        return ", ".join(_collapse(g, ranges) for g in by_pattern)
    texts = _DIGITS.split(names[0])
    digits = [_DIGITS.findall(n) for n in names]
    out = [texts[0]]
    for k in range(len(digits[0])):
        column = [d[k] for d in digits]
        if all(c == column[0] for c in column):
            out.append(column[0])
        else:
            values = [int(c) for c in column]
            lo, hi = min(values), max(values)
            contiguous = ranges and len(set(values)) == len(values) == hi - lo + 1
            out.append(f"{lo}..{hi}" if contiguous else "*")
        out.append(texts[k + 1])
    return "".join(out)


def _comm_rows(entries) -> list[str]:
    """Collectives of one phase, kind, op, axes, bytes and count as one row: ``x1000`` of them, with
    the units or buckets they serve."""
    rows = []
    for es in _group(entries, lambda e: (e.phase, e.what, e.op, e.axes, e.bytes, e.count, e.riders)):
        if len(es) == 1:
            rows.append(str(es[0]))
            continue
        e = es[0]
        times = f" x{e.count}" if e.count > 1 else ""
        where = _collapse([x.where for x in es if x.where])
        rows.append(f"{e.phase:<8} {e.what:<7} {e.op}({', '.join(e.axes)}){times} {format_bytes(e.total)} "
                    f"(x{len(es)}) = {format_bytes(e.total * len(es))}" + (f"  [{where}]" if where else ""))
    return rows


# ---- the gather schedule as its pattern --------------------------------------------------------

_EVENT = re.compile(r"^(\w)\((.*)\)$")


def _fold(events: tuple[str, ...], min_repeats: int = 3, max_period: int = 6) -> list[str]:
    """The events with each run of a repeating block folded into ``[block] xK (i = a..b)``: a block of
    ``p`` events repeats when each event recurs ``p`` later with its unit's number moved by the same
    step ``d`` (``(i = a..b step d)`` unless 1 or -1; 0: the same events again). Numbers are written
    relative to ``i``, the block's most common number. Linear: each event starts at most
    ``max_period`` trials, and a folded run is skipped whole."""
    parsed = [_parse(e) for e in events]
    out: list[str] = []
    j = 0
    while j < len(events):
        best = None                                       # (covered, period, d, repeats)
        for p in range(1, min(max_period, (len(events) - j) // min_repeats) + 1):
            a, b = parsed[j], parsed[j + p]
            d = b[2] - a[2] if a[2] is not None and b[2] is not None else 0
            k = 1
            while j + (k + 1) * p <= len(events) and all(
                    _shifted(parsed[j + q], parsed[j + k * p + q], k * d) for q in range(p)):
                k += 1
            if k >= min_repeats and (best is None or k * p > best[0]):
                best = (k * p, p, d, k)
        if best is None:
            out.append(events[j])
            j += 1
            continue
        _, p, d, k = best
        block = parsed[j:j + p]
        numbers = [num for _, _, num in block if num is not None]
        if numbers and d:
            base = max(numbers, key=numbers.count)
            step = "" if abs(d) == 1 else f" step {d}"
            words, where = [_relative(ev, base) for ev in block], f" (i = {base}..{base + (k - 1) * d}{step})"
        else:                                             # the same events again and again
            words, where = list(events[j:j + p]), ""
        out.append(f"[{' '.join(words)}] x{k}{where}")
        j += k * p
    return out


def _parse(event: str) -> tuple[str, str, int | None]:
    """``G(blocks.12)`` -> ``("G", "blocks.*", 12)``; names without exactly one number keep it: ``None``."""
    m = _EVENT.match(event)
    if m is None:
        return event, "", None
    op, name = m.groups()
    numbers = _DIGITS.findall(name)
    if len(numbers) != 1:
        return op, name, None
    return op, _pattern(name), int(numbers[0])


def _shifted(a, b, d: int) -> bool:
    """``b`` is ``a`` with its number moved by ``d`` (equal when it has none)."""
    if a[0] != b[0] or a[1] != b[1]:
        return False
    return a[2] == b[2] if a[2] is None else b[2] == a[2] + d


def _relative(event, base: int | None) -> str:
    op, pattern, num = event
    if num is None:
        return f"{op}({pattern})" if pattern else op
    off = num - base
    return f"{op}({pattern.replace('*', 'i' if off == 0 else f'i{off:+d}')})"


# ---- printing ----------------------------------------------------------------------------------

def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False) or [first.rstrip()]


def _dims(spec) -> str:
    """A spec per dim, axes of a dim joined by ``·`` (major first), ``-`` = not split:
    ``P(("tensor", "data"), None)`` -> ``tensor·data,-``; ``P()`` -> ``-``."""
    entries = tuple(spec)
    if not any(e is not None for e in entries):
        return "-"
    return ",".join("-" if e is None else f"{'·'.join(e)}x{e.parts}" if isinstance(e, Fused)
                    else "·".join(e) if isinstance(e, tuple) else e for e in entries)


def _spec(axis: str | None) -> str:
    return f"S({axis})" if axis else "R"


def _expert_lines(plan) -> list[str]:
    """The expert axis: experts per rank, the gradients' axes, and the routing's all-to-all bytes on the busiest
    rank for the stated routing (uniform unless ``plan.with_routing``), with that rank's share of the rows."""
    from .traffic import expert_coordinate, expert_shares
    n, layers = plan.expert_size, plan.expert_layers
    names = ", ".join(layer.name for layer in layers[:3]) + (" ..." if len(layers) > 3 else "")
    per = sorted({layer.experts // n for layer in layers})
    out = [f"  experts: split over {plan.expert_axis!r} (E={n}): {'/'.join(map(str, per))} of "
           f"{'/'.join(map(str, sorted({layer.experts for layer in layers})))} experts per rank in {len(layers)} "
           f"module(s) ({names}); tokens routed by a ragged all-to-all; an expert's gradients summed over "
           f"{' x '.join(repr(a) for a in plan.dp_axes if a != plan.expert_axis) or 'nothing'}, the rest's over the "
           "batch's axes"]
    if not layers or layers[0].tokens is None:
        return out + ["    routing: not priced (plan with batch= to count the rows each all-to-all moves)"]
    coord = expert_coordinate(plan, None)
    shares = [sum(expert_shares(layer, n, dict(plan.routing))[j] for layer in layers) / len(layers) for j in range(n)]
    mine = [e for e in plan.comm_per_step(plan.mesh.rank_at([coord if a == plan.expert_axis else 0
                                                              for a in plan.mesh.axis_names]))
            if e.what in ("routing", "recompute") and e.op == "all_to_all"]
    kind = "the stated routing (with_routing)" if plan.routing else "uniform routing"
    return out + [f"    routing ({kind}): the busiest rank (expert coordinate {coord}) gets {shares[coord]:.0%} of the "
                  f"rows ({shares[coord] * n:.2f}x the mean) and sends {format_bytes(sum(e.total for e in mine))} "
                  "in all-to-alls per step"]


def _context_lines(plan) -> list[str]:
    """The context axis: the layout, the attention method and why, and each method's moves per step."""
    from .context import method_costs
    n, calls = plan.context_size, plan.context_calls
    c = plan.compute_dtype.itemsize
    costs = method_costs(calls, n, c)
    rank = getattr(plan.mesh, "rank", None)
    mine = sum(e.total for e in plan.comm_per_step(0 if rank is None else rank) if e.what == "activations")
    why = ", ".join(f"{m} {1e3 * t:.3g} ms / holds {format_bytes(h)}" for m, (t, h) in costs.items())
    return [f"  context: the sequence split over {plan.context_axis!r} (C={n}) in {2 * n} zigzag chunks (rank c: "
            f"chunks c and {2 * n - 1}-c); positions made global in {', '.join(plan.position_tables) or 'no module'}; "
            f"gradients and ZeRO's shards over {' x '.join(repr(a) for a in plan.dp_axes)}",
            f"    attention: {plan.context_attention} in {len(calls)} call(s) a micro-batch, "
            f"{format_bytes(mine)} moved per step; the methods' moves at 25 GB/s and 10 us a message: {why}"]
