"""A process-free run of a pipeline schedule: per-action costs in, start/end of every action out.

Each rank runs its list strictly in order; an action starts when the rank is free and its inputs
exist:

* ``F(s, i)`` needs ``F(s-1, i)`` (its input activation);
* ``B(s, i)`` / ``I(s, i)`` need ``F(s, i)`` and the input-gradient of ``(s+1, i)`` (``B`` or ``I``);
* ``W(s, i)`` needs ``I(s, i)``.

A dependency on another rank costs ``p2p`` seconds of latency. A lowered list carries it
through its ``SEND``/``RECV`` pairs instead (a ``SEND`` follows its compute action, a ``RECV``
waits for the matching ``SEND`` plus ``p2p``; both cost nothing by default), so a compute-only
list and its lowering give the same times. ``UNSHARD`` precedes every action of its stage,
``REDUCE_GRAD`` and ``RESHARD`` follow them.

**Bubble formulas** (the idle fraction of the step, idle time / makespan, equal stage costs):

* GPipe and 1F1B: each rank idles ``(p-1)·(F+B)`` while filling and draining, out of
  ``(m+p-1)·(F+B)``: ``(p-1)/(m+p-1)`` (Huang et al. 2019; Narayanan et al. 2021 write the same
  bubble as ``(p-1)/m`` of the ideal time).
* Interleaved 1F1B with ``v`` chunks of cost ``F/v``, ``B/v``: the fill and drain shrink to
  ``(p-1)·(F+B)/v``, so ``(p-1)/(v·m+p-1)``.
* ZB-H1 under the paper's assumption ``T_F = T_B = T_W`` (``B`` = the input-gradient part ``I``):
  Qi et al. 2023 give a bubble of ``(p-1)·(T_F+T_B-T_W) = (p-1)·T`` per rank, a third of 1F1B's
  ``(p-1)·3T``, while each rank computes ``3m·T``: ``(p-1)/(3m+p-1)`` of the step — the paper's
  "bubble rate" ``(p-1)/(3m)`` is the same bubble over the ideal time ``3m·T``. We return the
  fraction of the step, like the other three, so the four compare directly. The paper assumes
  ``m >= p``. With fewer microbatches no schedule does better than ``2(p+m)-1``: the first rank
  gets its first input gradient back at ``2p-1`` and still has ``m`` I's and ``m`` W's to run,
  so the fraction is ``(2p-m-1)/(2p+2m-1)`` (equal to the paper's at ``m = p``), which zb_h1 meets.

Simulated with those costs, the four schedules meet these formulas exactly for p in {2,3,4,8} and
m in 1..16 (interleaved: m >= p, v in {2, 4}; tests/planner/test_pipeline_schedules.py); zb_h1 (m >= p) also meets
the paper's ``(p-1)·(T_F+T_B-T_W)`` with unequal costs as long as ``T_W <= min(T_F, T_B)``; with a
longer W the deferred W's no longer fit the drain and the step is longer than that.
"""

from __future__ import annotations

import numbers
from collections import defaultdict, namedtuple
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..validate import is_int
from .schedules import COMM, COMPUTE, PER_STAGE, Action, ScheduleError, as_actions, schedule_problems

Record = namedtuple("Record", "rank action start end")
Record.__doc__ = "One action of one rank: ``action`` prints like torch's ``_Action`` (``'1F0'``); seconds."

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class SimResult:
    """``busy[r]``: seconds rank r computes; ``idle[r] = 1 - busy[r]/makespan``; ``idle_fraction``:
    their mean. ``peak_live[r]``: the most microbatches (counted per virtual stage, summed over the
    rank's stages) whose ``F`` has run and whose last backward part (``B``, or ``W``) has not."""

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    idle_fraction: float
    peak_live: tuple[int, ...]
    records: tuple[Record, ...]


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """The idle fraction of the step that schedule ``name`` has with equal stage costs (see the
    module docstring): ``(p-1)/(m+p-1)`` for gpipe and 1f1b, ``(p-1)/(v·m+p-1)`` interleaved,
    ``(p-1)/(3m+p-1)`` for zb_h1 (F = I = W; ``(2p-m-1)/(2p+2m-1)`` when ``m < p``)."""
    problems = schedule_problems(name, p, m, v)
    if problems:
        raise ScheduleError(problems, api="bubble_formula")
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if m >= p:                                    # zb_h1, the paper's case
        return (p - 1) / (3 * m + p - 1)
    return (2 * p - m - 1) / (2 * p + 2 * m - 1)  # zb_h1 with m < p: the dependency bound


# ---------------------------------------------------------------------------------------------

def _cost_fn(costs) -> Callable[[Action], float]:
    if callable(costs):
        def fn(a: Action) -> float:
            return costs(a) if a.is_compute else 0
        return fn
    table = dict(DEFAULT_COSTS)
    if costs is not None:
        if not isinstance(costs, Mapping):
            raise ScheduleError(f"simulate: costs must be a dict by kind or a callable Action -> seconds — got "
                                f"{type(costs).__name__}; expected e.g. {{'F': 1, 'B': 2}}. Pass a dict or a function.")
        known = COMPUTE + COMM + PER_STAGE
        bad = [f"{k!r}: {c!r}" for k, c in costs.items()
               if k not in known or not isinstance(c, numbers.Real) or isinstance(c, bool) or c < 0]
        if bad:
            raise ScheduleError(f"simulate: bad costs — got {', '.join(bad)}; expected kinds among "
                                f"{', '.join(known)} with costs >= 0. Fix those entries.")
        table.update(costs)
    return lambda a: table.get(a.kind, 0)


Key = tuple  # (stage, kind, mb): the simulator's internal form of an Action (hashing is cheap)


def _name(k: Key) -> str:
    return f"{k[0]}{k[1]}{'' if k[2] is None else k[2]}"


def _validate(lists: dict[int, list[Key]], p: int, m: int, v: int) -> bool:
    """Raise ScheduleError listing every misplaced, missing or duplicate action; return whether
    the lists are lowered (carry SEND/RECV)."""
    n_stages = p * v
    problems = []
    for r in sorted(lists, key=repr):
        if not (isinstance(r, int) and 0 <= r < p):
            problems.append(f"simulate: a schedule for rank {r!r} — expected ranks 0..{p - 1} (p={p}). "
                            "Drop it, or pass the right p.")
    count: dict[Key, int] = defaultdict(int)
    for r, lst in lists.items():
        for k in lst:
            count[k] += 1
            s, _, i = k
            if s >= n_stages or (i is not None and i >= m):
                problems.append(f"simulate: rank {r} holds {_name(k)} — expected stages 0..{n_stages - 1} and "
                                f"microbatches 0..{m - 1} (p={p}, v={v}, m={m}). Drop it, or pass the right p, v, m.")
            elif s % p != r:
                problems.append(f"simulate: {_name(k)} is on rank {r} — expected rank {s % p} (stage % p). "
                                "Move it there.")
    problems += [f"simulate: {_name(k)} appears {n} times — expected once. Drop the copies."
                 for k, n in count.items() if n > 1]
    lowered = any(k[1] in COMM for k in count)
    for s in range(n_stages):
        for i in range(m):
            f, b, ii, w = ((s, k, i) in count for k in COMPUTE)
            if not f:
                problems.append(f"simulate: {s}F{i} is missing — expected one forward of every (stage, microbatch). "
                                f"Add it to rank {s % p}.")
            if not (b or ii or w):
                problems.append(f"simulate: the backward of stage {s}, microbatch {i} is missing — expected "
                                f"{s}B{i}, or {s}I{i} and {s}W{i}. Add it to rank {s % p}.")
            elif b and (ii or w):
                problems.append(f"simulate: stage {s}, microbatch {i} has both {s}B{i} and a split backward (I/W) "
                                "— expected one of the two. Drop one.")
            elif not b and ii != w:
                problems.append(f"simulate: stage {s}, microbatch {i} has {'I' if ii else 'W'} without "
                                f"{'W' if ii else 'I'} — expected both halves of a split backward. Add the other.")
            if lowered:
                problems += _comm_problems(count, p, n_stages, s, i)
    for k in count:
        if k[1] in COMM and k[0] < n_stages and k[2] < m and not _edge(k, p, n_stages):
            problems.append(f"simulate: {_name(k)} sends or receives nothing — expected SEND/RECV only between "
                            "stages on different ranks. Drop it.")
    if problems:
        raise ScheduleError(problems, api="simulate")
    return lowered


def _edge(k: Key, p: int, n_stages: int) -> bool:
    """Whether comm action ``k`` stands for a real cross-rank transfer."""
    s = k[0]
    peer = {"SEND_F": s + 1, "RECV_F": s - 1, "SEND_B": s - 1, "RECV_B": s + 1}[k[1]]
    return 0 <= peer < n_stages and peer % p != s % p


def _comm_problems(count, p: int, n_stages: int, s: int, i: int) -> list[str]:
    out = []
    for kind, prev in (("F", s - 1), ("B", s + 1)):
        if not (0 <= prev < n_stages) or prev % p == s % p:
            continue
        for k in ((prev, f"SEND_{kind}", i), (s, f"RECV_{kind}", i)):
            if k not in count:
                out.append(f"simulate: {_name(k)} is missing — expected a SEND_{kind}/RECV_{kind} pair for every "
                           f"cross-rank transfer of a lowered schedule. Lower with schedules.lower(...).")
    return out


def _deps(key: Key, p: int, n_stages: int, lowered: bool, has: set[Key], stage_compute) -> list[tuple[Key, bool]]:
    """The actions ``key`` waits for, each with whether that wait crosses ranks (costs ``p2p``)."""
    s, k, i = key
    out: list[tuple[Key, bool]] = []

    def grad_of(t: int) -> Key:
        return (t, "B", i) if (t, "B", i) in has else (t, "I", i)

    if k == "F":
        if s > 0:
            if (s - 1) % p == s % p:
                out.append(((s - 1, "F", i), False))
            elif lowered:
                out.append(((s, "RECV_F", i), False))
            else:
                out.append(((s - 1, "F", i), True))
    elif k in ("B", "I"):
        out.append(((s, "F", i), False))
        if s < n_stages - 1:
            if (s + 1) % p == s % p:
                out.append((grad_of(s + 1), False))
            elif lowered:
                out.append(((s, "RECV_B", i), False))
            else:
                out.append((grad_of(s + 1), True))
    elif k == "W":
        out.append(((s, "I", i), False))
    elif k == "SEND_F":
        out.append(((s, "F", i), False))
    elif k == "SEND_B":
        out.append((grad_of(s), False))
    elif k == "RECV_F":
        out.append(((s - 1, "SEND_F", i), True))
    elif k == "RECV_B":
        out.append(((s + 1, "SEND_B", i), True))
    elif k in ("REDUCE_GRAD", "RESHARD"):
        out += [(x, False) for x in stage_compute[s]]
        if k == "RESHARD" and (s, "REDUCE_GRAD", None) in has:
            out.append(((s, "REDUCE_GRAD", None), False))
    if k in COMPUTE and (s, "UNSHARD", None) in has:
        out.append(((s, "UNSHARD", None), False))
    return out


def simulate(actions: Mapping[int, Iterable[Action | str] | str], p: int, m: int, v: int = 1,
             costs: Mapping[str, float] | Callable[[Action], float] | None = None, p2p: float = 0.0) -> SimResult:
    """Run per-rank action lists (compute-only or lowered; ``Action`` or their strings) with
    ``costs`` (seconds by kind, default F=1, B=2, I=1, W=1, everything else 0; or a function of
    the compute ``Action``, everything else 0) and ``p2p`` latency per cross-rank transfer.

    Raises ``ScheduleError`` for actions missing, duplicated, on the wrong rank or out of range,
    and for a deadlock (naming each rank's blocked action and what it waits for)."""
    bad = [f"{k}={x!r}" for k, x in (("p", p), ("m", m), ("v", v)) if not is_int(x) or x < 1]
    if bad:
        raise ScheduleError(f"simulate: sizes must be positive ints — got {', '.join(bad)}; expected p, m, v >= 1. "
                            "Pass the pipe size, microbatches and stages per rank.")
    acts = as_actions(actions)
    for r in range(p):
        acts.setdefault(r, [])
    cost = _cost_fn(costs)
    lists = {r: [(a.stage, a.kind, a.mb) for a in lst] for r, lst in acts.items()}
    lowered = _validate(lists, p, m, v)
    n_stages = p * v
    has = {k for lst in lists.values() for k in lst}
    stage_compute: dict[int, list[Key]] = defaultdict(list)
    for k in has:
        if k[1] in COMPUTE:
            stage_compute[k[0]].append(k)
    deps = {k: _deps(k, p, n_stages, lowered, has, stage_compute) for k in has}
    dur = {r: [cost(a) for a in acts[r]] for r in range(p)}

    end: dict[Key, float] = {}
    free = [0] * p
    pos = [0] * p
    records: list[Record] = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            lst = lists[r]
            while pos[r] < len(lst):
                k = lst[pos[r]]
                start = free[r]
                for d, cross in deps[k]:
                    t = end.get(d)
                    if t is None:
                        break
                    if cross and p2p:
                        t = t + p2p
                    start = max(start, t)
                else:
                    e = start + dur[r][pos[r]]
                    end[k] = free[r] = e
                    records.append(Record(r, _name(k), start, e))
                    pos[r] += 1
                    progress = True
                    continue
                break
    if any(pos[r] < len(lists[r]) for r in range(p)):
        raise ScheduleError(_deadlock(lists, pos, deps, end, p), api="simulate")

    makespan = max((rec.end for rec in records), default=0)
    busy = [0] * p
    for rec in records:
        busy[rec.rank] += rec.end - rec.start
    idle = tuple(1.0 - b / makespan if makespan > 0 else 0.0 for b in busy)
    return SimResult(makespan, tuple(busy), idle, sum(idle) / p, tuple(_peak_live(lists[r]) for r in range(p)),
                     tuple(records))


def _peak_live(lst: list[Key]) -> int:
    """The most microbatches this rank holds: +1 at each F, -1 at each B or W (the last backward part)."""
    live = peak = 0
    for _, kind, _ in lst:
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind in ("B", "W"):
            live -= 1
    return peak


def _deadlock(lists, pos, deps, end, p: int) -> str:
    parts = []
    for r in range(p):
        if pos[r] >= len(lists[r]):
            parts.append(f"rank {r} done")
            continue
        k = lists[r][pos[r]]
        waits = [f"{_name(d)} (rank {d[0] % p}{', later in its own list' if d[0] % p == r else ''})"
                 for d, _ in deps[k] if d not in end]
        parts.append(f"rank {r} blocked at {_name(k)} (position {pos[r]}) waiting for {', '.join(waits)}")
    return ("simulate: the schedule deadlocks — got " + "; ".join(parts) + "; expected each rank's next action to "
            "have its inputs produced earlier on some rank. Reorder the lists (a backward after its own forward, "
            "a rank's forwards in the order the previous stage sends them).")
