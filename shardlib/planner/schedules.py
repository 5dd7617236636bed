"""Pipeline schedules as data: per pipe rank, the ordered list of actions it runs.

An ``Action`` is ``(stage, kind, mb)`` and prints like ``torch.distributed.pipelining``'s
``_Action``: ``0F3`` (stage 0 forward of microbatch 3), ``1B0`` (full backward), ``1I2`` /
``1W2`` (the input-gradient and weight-gradient halves of a split backward), ``0SEND_F3``,
``1RECV_B0``, ``0UNSHARD``. ``stage`` is the *virtual* stage ``0 .. p·v-1``; it runs on pipe rank
``stage % p`` (looped placement, as Megatron and torch interleave).

Generators (``schedule_actions``) give compute actions only; ``lower`` adds the point-to-point
sends and receives, ZeRO-3's gather/free of a stage's parameters and the gradient reduction.
``shardlib.planner.simulate`` runs any of these lists without processes.

The schedules (``p`` ranks, ``m`` microbatches, ``v`` stages per rank):

* ``gpipe`` — all forwards, then all backwards. ``m`` microbatches live at once on every rank.
* ``1f1b`` — rank ``r`` runs ``p-1-r`` warm-up forwards, then alternates one forward and one
  backward, then drains the backwards (Narayanan et al. 2021, PipeDream-Flush): at most
  ``p - r`` microbatches live on rank ``r``. Same bubble as GPipe, ``(p-1)/(m+p-1)`` of the step.
* ``interleaved_1f1b`` — Megatron's interleaved schedule (Narayanan et al. 2021 §2.2): ``v``
  chunks per rank, virtual microbatches taken from a table that walks a group of ``G >= p``
  microbatches through chunk 0, then chunk 1, ...; backwards walk the same table with the chunks
  reversed. Warm-up ``(v-1)·G + 2(p-1-r)`` forwards (Megatron's and torch's count), then 1F1B.
  ``m`` need not divide by ``p``: the ``m // p`` groups take sizes ``ceil``/``floor`` of
  ``m / (m // p)`` (torch's ScheduleInterleaved1F1B asks them to be equal, Megatron asks
  ``m % p == 0`` at its default group size).
* ``zb_h1`` — zero bubble H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism" §2.1; torch's
  ScheduleInterleavedZeroBubble with one stage per rank): 1F1B with the backward split into ``I``
  (input gradient, on the critical path) and ``W`` (weight gradient, off it). Rank ``r`` runs
  its first ``r`` steady steps without ``W`` and one deferred ``W`` per step after that, so every
  rank holds at most ``p`` microbatches (1F1B's first-rank peak) and the ``W``'s fill what was
  the drain bubble.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import ShardingError
from ..validate import is_int, positive_int

COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
PER_STAGE = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
KINDS = COMPUTE + COMM + PER_STAGE
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
INTERLEAVED = ("interleaved_1f1b",)

_ACTION = re.compile(r"(\d+)(" + "|".join(sorted(KINDS, key=len, reverse=True)) + r")(\d*)")


class ScheduleError(ShardingError):
    """A schedule is malformed: missing or duplicate actions, actions on the wrong rank, a deadlock."""


@dataclass(frozen=True)
class Action:
    """One step of one pipe rank: ``stage`` is the virtual stage, ``kind`` one of ``KINDS``,
    ``mb`` the microbatch (``None`` for UNSHARD / RESHARD / REDUCE_GRAD)."""

    stage: int
    kind: str
    mb: int | None = None

    def __post_init__(self) -> None:
        bad = []
        if self.kind not in KINDS:
            bad.append(f"kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if not is_int(self.stage) or self.stage < 0:
            bad.append(f"stage {self.stage!r} (expected an int >= 0)")
        if self.kind in PER_STAGE:
            if self.mb is not None:
                bad.append(f"mb {self.mb!r} (expected None for {self.kind})")
        elif not is_int(self.mb) or self.mb < 0:
            bad.append(f"mb {self.mb!r} (expected an int >= 0 for {self.kind})")
        if bad:
            raise ScheduleError(f"Action: bad fields — got {'; '.join(bad)}. Build it as Action(stage, kind, mb), "
                                "e.g. Action(0, 'F', 3).")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @classmethod
    def parse(cls, text: str) -> Action:
        """``Action.parse("1B0") == Action(1, "B", 0)``; the inverse of ``str``."""
        hit = _ACTION.fullmatch(text.strip()) if isinstance(text, str) else None
        if hit is not None:
            stage, kind, mb = hit.groups()
            if (kind in PER_STAGE) == (mb == ""):
                return cls(int(stage), kind, int(mb) if mb else None)
        raise ScheduleError(f"Action.parse: not an action — got {text!r}; expected <stage><kind><microbatch> "
                            f"with kind one of {', '.join(KINDS)} (no microbatch for the last three), e.g. "
                            "'0F3', '1SEND_B0', '0UNSHARD'. Fix the string.")


def parse_schedule(text: str) -> list[Action]:
    """``parse_schedule("0F0 0F1 0B0")`` -> the actions, in order (whitespace separated)."""
    return [Action.parse(t) for t in text.split()]


def format_schedule(actions: Iterable[Action]) -> str:
    """The compact form, space separated: ``"0F0 0F1 0B0"``; ``parse_schedule`` reads it back."""
    return " ".join(str(a) for a in actions)


def as_actions(actions: Mapping[int, Iterable[Action | str] | str]) -> dict[int, list[Action]]:
    """Per-rank lists of ``Action`` from lists of actions, of strings, or compact strings."""
    out = {}
    for rank, lst in actions.items():
        if isinstance(lst, str):
            out[rank] = parse_schedule(lst)
        else:
            out[rank] = [a if isinstance(a, Action) else Action.parse(a) for a in lst]
    return out


# ---------------------------------------------------------------------------------------------
# generators

def schedule_problems(name: str, p: int, m: int, v: int = 1) -> list[str]:
    """Every reason ``schedule_actions(name, p, m, v)`` cannot build a schedule (plan-time errors)."""
    problems = []
    for label, val in (("pipe size p", p), ("microbatches m", m), ("virtual stages per rank v", v)):
        if problem := positive_int(val, f"plan: {label}"):
            problems.append(f"{problem}; expected an int >= 1. Pass {label.split()[-1]} >= 1.")
    if name not in SCHEDULES:
        problems.append(f"plan: unknown schedule — got {name!r}; expected one of {', '.join(SCHEDULES)}. "
                        f"Pick one of those, e.g. schedule='1f1b'.")
        return problems
    if problems:
        return problems
    if name in INTERLEAVED:
        if v < 2:
            problems.append(f"plan: schedule {name!r} interleaves v stages per rank — got virtual v={v}; expected "
                            f"v >= 2. Pass virtual=2 (or more), or use schedule='1f1b'.")
        if m < p:
            problems.append(f"plan: schedule {name!r} needs at least as many microbatches as pipe ranks — got "
                            f"microbatches m={m} with pipe p={p}; expected m >= p. Use microbatches >= {p}, or "
                            "schedule='1f1b' (any m).")
    elif v != 1:
        problems.append(f"plan: schedule {name!r} runs one stage per rank — got virtual v={v}; expected v=1. "
                        f"Drop virtual, or use schedule='interleaved_1f1b' for v={v} stages per rank.")
    return problems


def schedule_actions(name: str, p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """Per pipe rank, the compute actions of schedule ``name`` in the order that rank runs them."""
    problems = schedule_problems(name, p, m, v)
    if problems:
        raise ScheduleError(problems, api="plan")
    if name == "gpipe":
        return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
                for r in range(p)}
    if name == "1f1b":
        return {r: _one_f_one_b(r, m, min(p - 1 - r, m)) for r in range(p)}
    if name == "zb_h1":
        return {r: _zb_h1(r, p, m) for r in range(p)}
    return _interleaved(p, m, v)


def _one_f_one_b(r: int, m: int, warm: int) -> list[Action]:
    out = [Action(r, "F", i) for i in range(warm)]
    for k in range(m):                       # steady 1F1B, then the drain
        if warm + k < m:
            out.append(Action(r, "F", warm + k))
        out.append(Action(r, "B", k))
    return out


def _zb_h1(r: int, p: int, m: int) -> list[Action]:
    """1F1B's order with B -> I, and W(k - r) after I(k): rank r defers its weight gradients by r
    steps, so that it holds (p-1-r) + r + 1 = p microbatches at most, like 1F1B's first rank."""
    warm = min(p - 1 - r, m)
    out = [Action(r, "F", i) for i in range(warm)]
    for k in range(m):
        if warm + k < m:
            out.append(Action(r, "F", warm + k))
        out.append(Action(r, "I", k))
        if k >= r:
            out.append(Action(r, "W", k - r))
    out += [Action(r, "W", k) for k in range(max(0, m - r), m)]
    return out


def interleaved_groups(p: int, m: int) -> list[int]:
    """Sizes of the microbatch groups that the interleaved schedule walks through its chunks:
    ``m // p`` groups, each of at least ``p`` microbatches, larger ones first."""
    rounds = max(1, m // p)
    return [m // rounds + (1 if i < m % rounds else 0) for i in range(rounds)]


def interleaved_warmup(p: int, m: int, v: int, r: int) -> int:
    """Forwards rank ``r`` runs before its first backward: ``(v-1)·G + 2(p-1-r)`` (Megatron),
    ``G`` the largest group, at most ``v·m``."""
    return min(v * m, (v - 1) * max(interleaved_groups(p, m)) + 2 * (p - 1 - r))


def _interleaved(p: int, m: int, v: int) -> dict[int, list[Action]]:
    table, start = [], 0                     # virtual microbatch -> (microbatch, chunk)
    for g in interleaved_groups(p, m):
        table += [(start + j, c) for c in range(v) for j in range(g)]
        start += g
    out = {}
    for r in range(p):
        fwd = [Action(c * p + r, "F", i) for i, c in table]
        bwd = [Action((v - 1 - c) * p + r, "B", i) for i, c in table]
        warm = interleaved_warmup(p, m, v, r)
        lst = fwd[:warm]
        for k in range(len(table)):
            if warm + k < len(table):
                lst.append(fwd[warm + k])
            lst.append(bwd[k])
        out[r] = lst
    return out


def split_last_backwards(actions: Mapping[int, Iterable[Action | str] | str], stages: Iterable[int]
                         ) -> dict[int, list[Action]]:
    """The compute-only lists with the last ``B`` of each of ``stages`` split into ``I`` then ``W``.

    At the end of a 1F1B, GPipe or interleaved step the previous stage waits for each stage's last
    input gradient, and nothing on this rank needs that backward's weight gradients before the
    optimizer: sending the gradient after ``I`` lets the previous stage start while this one runs
    ``W`` (the drain's critical path loses a ``W`` per hop). One micro-batch per stage is split, so the
    schedule's order and memory stay its own. Lowered, ``I`` takes the ``RECV_B``/``SEND_B`` around it
    and ``REDUCE_GRAD`` follows ``W``."""
    lists = as_actions(actions)
    wanted = set(stages)
    out = {}
    for r, lst in lists.items():
        last = {a.stage: i for i, a in enumerate(lst) if a.kind == "B" and a.stage in wanted}
        res: list[Action] = []
        for i, a in enumerate(lst):
            if last.get(a.stage) == i:
                res += [Action(a.stage, "I", a.mb), Action(a.stage, "W", a.mb)]
            else:
                res.append(a)
        out[r] = res
    return out


# ---------------------------------------------------------------------------------------------
# lowering

def lower(actions: Mapping[int, Iterable[Action | str] | str], p: int, v: int = 1, *, unshard: bool = False,
          reduce_grad: bool = True) -> dict[int, list[Action]]:
    """Add communication and per-stage actions to a compute-only schedule, per rank:

    * ``RECV_F`` before each ``F`` of a stage > 0 whose previous stage is on another rank, and
      ``SEND_F`` after each ``F`` whose next stage is on another rank; ``RECV_B`` before each
      ``B``/``I`` of a stage < S-1, ``SEND_B`` after each ``B``/``I`` of a stage > 0 (same rule).
      ``sSEND_Fi`` on rank ``s % p`` pairs with ``(s+1)RECV_Fi`` on rank ``(s+1) % p``;
      ``sSEND_Bi`` with ``(s-1)RECV_Bi``.
    * ``REDUCE_GRAD`` of a stage after its last ``B`` or ``W`` (``reduce_grad``);
    * with ``unshard`` (ZeRO-3): ``UNSHARD`` of a stage before its first action (ahead of that
      action's receive), ``RESHARD`` after its ``REDUCE_GRAD`` (after its last ``B``/``W`` without
      ``reduce_grad``): a stage's parameters stay gathered across the step's microbatches.
    """
    lists = as_actions(actions)
    n_stages = p * v
    problems = [f"lower: rank {r} holds {a} — expected compute actions only (F, B, I, W). Lower the generator's "
                "output (schedule_actions), not an already lowered schedule."
                for r, lst in sorted(lists.items()) for a in lst if not a.is_compute][:8]
    if problems:
        raise ScheduleError(problems, api="lower")

    def rank(s: int) -> int:
        return s % p

    for r in range(p):
        lists.setdefault(r, [])
    out = {}
    for r, lst in sorted(lists.items()):
        last_bw = {a.stage: i for i, a in enumerate(lst) if a.kind in ("B", "W")}
        seen: set[int] = set()
        res: list[Action] = []
        for i, a in enumerate(lst):
            s, mb = a.stage, a.mb
            if unshard and s not in seen:
                res.append(Action(s, "UNSHARD"))
            seen.add(s)
            if a.kind == "F":
                if s > 0 and rank(s - 1) != r:
                    res.append(Action(s, "RECV_F", mb))
                res.append(a)
                if s < n_stages - 1 and rank(s + 1) != r:
                    res.append(Action(s, "SEND_F", mb))
            elif a.kind in ("B", "I"):
                if s < n_stages - 1 and rank(s + 1) != r:
                    res.append(Action(s, "RECV_B", mb))
                res.append(a)
                if s > 0 and rank(s - 1) != r:
                    res.append(Action(s, "SEND_B", mb))
            else:
                res.append(a)
            if last_bw.get(s) == i:
                if reduce_grad:
                    res.append(Action(s, "REDUCE_GRAD"))
                if unshard:
                    res.append(Action(s, "RESHARD"))
        out[r] = res
    return out
