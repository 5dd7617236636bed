"""Pipeline timelines: measured idle fraction per rank, a text table, and a PNG (matplotlib).

Input is any iterable of records with attributes ``rank, action, start, end`` — the executor's and
the simulator's ``Record(rank, action, start, end)`` (seconds). ``action`` prints like torch's
``_Action``: the virtual stage's digits, a kind, then the microbatch where there is one::

    0F3  1B0  1I2  1W2            compute: forward, full backward, input-grad, weight-grad
    0SEND_F3  1RECV_F3  1SEND_B0  0RECV_B0          point-to-point
    0UNSHARD  0RESHARD  0REDUCE_GRAD                ZeRO gathers/frees, gradient reduction

Idle fraction of rank ``r`` (the pipeline "bubble" as measured)::

    span    = max(end) - min(start)          over ALL ranks' records (the step, wall clock)
    busy_r  = |union of rank r's F/B/I/W intervals|
    idle_r  = 1 - busy_r / span

Communication and ZeRO actions count as idle: the bubble is time a rank is not computing. With
equal costs and free p2p, GPipe and 1F1B give ``(p-1)/(m+p-1)`` on every rank, the number the
simulator and the formula report; the measured one adds the executor's send/recv and overheads.

matplotlib is imported inside ``plot_timeline`` only, so importing shardlib never needs it; the
figure is drawn on an Agg canvas without touching pyplot's global backend.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real

from ...errors import Problems, ShardingError, ShardingTypeError

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
STAGE_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")      # once per stage and step: no microbatch
_ACTION = re.compile(r"(\d+)(" + "|".join(sorted(COMPUTE_KINDS + COMM_KINDS + STAGE_KINDS, key=len, reverse=True))
                     + r")(\d*)")
_COLORS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#54a24b"}
_COLORS_ALT = {"F": "#9ecae9", "B": "#ff9d98", "I": "#ffbf79", "W": "#88d27a"}   # odd local chunks (v >= 2)
_GREY = "#8c8c8c"


@dataclass(frozen=True)
class _Box:
    rank: int
    action: str
    stage: int
    kind: str
    mb: int | None
    start: float
    end: float


def _parse(action: str) -> tuple[int, str, int | None] | None:
    m = _ACTION.fullmatch(action)
    if m is None:
        return None
    stage, kind, mb = int(m.group(1)), m.group(2), (int(m.group(3)) if m.group(3) else None)
    if (kind in STAGE_KINDS) != (mb is None):
        return None
    return stage, kind, mb


def _boxes(records: Iterable, api: str) -> list[_Box]:
    """Validates the records (all problems at once) and parses their actions."""
    try:
        recs = list(records)
    except TypeError:
        raise ShardingTypeError(f"{api}: records is not iterable — got {type(records).__name__}; expected an "
                                f"iterable of Record(rank, action, start, end). Pass the executor's or "
                                f"simulator's records.") from None
    if not recs:
        raise ShardingError(f"{api}: no records — got an empty list; expected at least one "
                            f"Record(rank, action, start, end). Record a step before plotting it.")
    boxes: list[_Box] = []
    with Problems(api) as problems:
        for i, r in enumerate(recs):
            missing = [a for a in ("rank", "action", "start", "end") if not hasattr(r, a)]
            if missing:
                problems.add(f"{api}: records[{i}] has no {', '.join(missing)} — got {r!r}; expected attributes "
                             f"rank, action, start, end. Pass Record namedtuples.")
                continue
            rank, action, start, end = r.rank, str(r.action), r.start, r.end
            bad = []
            if not isinstance(rank, Integral) or isinstance(rank, bool) or rank < 0:
                bad.append(f"rank {rank!r} (expected an int >= 0)")
            times_ok = all(isinstance(t, Real) and not isinstance(t, bool) and math.isfinite(t) for t in (start, end))
            if not times_ok:
                bad.append(f"start/end {start!r}/{end!r} (expected finite seconds)")
            elif end < start:
                bad.append(f"end {end!r} < start {start!r} (expected end >= start)")
            parsed = _parse(action)
            if parsed is None:
                bad.append(f"action {action!r} (expected <stage><kind><microbatch> such as '0F3', '1B0', "
                           f"'1W2', '0SEND_F3', or '<stage>UNSHARD'/'RESHARD'/'REDUCE_GRAD' without a "
                           f"microbatch; kinds: {', '.join(COMPUTE_KINDS + COMM_KINDS + STAGE_KINDS)})")
            if bad:
                problems.add(f"{api}: records[{i}] is malformed — got {'; '.join(bad)}. Fix the record.")
                continue
            boxes.append(_Box(int(rank), action, *parsed, float(start), float(end)))
    return boxes


def _busy(boxes: list[_Box]) -> float:
    """Length of the union of the compute intervals (overlaps on one rank count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for b in sorted((b for b in boxes if b.kind in COMPUTE_KINDS), key=lambda b: b.start):
        if cur_e is None or b.start > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = b.start, b.end
        else:
            cur_e = max(cur_e, b.end)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _stats(boxes: list[_Box], api: str) -> tuple[float, float, dict[int, list[_Box]], dict[int, float]]:
    t0 = min(b.start for b in boxes)
    span = max(b.end for b in boxes) - t0
    if span <= 0:
        raise ShardingError(f"{api}: the step has no duration — got every record at t = {t0!r} s; expected "
                            f"max(end) > min(start). Record real start and end times.")
    by_rank: dict[int, list[_Box]] = {}
    for b in boxes:
        by_rank.setdefault(b.rank, []).append(b)
    busy = {r: _busy(bs) for r, bs in sorted(by_rank.items())}
    return t0, span, by_rank, busy


def idle_fractions(records: Iterable) -> dict[int, float]:
    """Per rank: ``1 - busy_r / span``, where ``busy_r`` is the time rank r spends in compute actions
    (F, B, I, W; the union of their intervals) and ``span`` is the step's wall time, earliest start to
    latest end over ALL ranks. Ranks with only comm/ZeRO actions are 1.0 idle."""
    _, span, _, busy = _stats(_boxes(records, "idle_fractions"), "idle_fractions")
    return {r: 1.0 - b / span for r, b in busy.items()}


def idle_fraction(records: Iterable) -> float:
    """The mean over ranks of ``idle_fractions(records)`` (the simulator's ``idle_fraction``)."""
    fr = idle_fractions(records)
    return sum(fr.values()) / len(fr)


def timeline_table(records: Iterable) -> str:
    """A compact text summary for logs: span, mean idle, then per rank busy ms, idle % and its
    actions in start order."""
    boxes = _boxes(records, "timeline_table")
    _, span, by_rank, busy = _stats(boxes, "timeline_table")
    idle = {r: 1.0 - b / span for r, b in busy.items()}
    lines = [(f"timeline: {len(by_rank)} ranks, span {span * 1e3:.3f} ms, "
              f"mean idle {100 * sum(idle.values()) / len(idle):.1f}%"),
             f"{'rank':>4}  {'busy ms':>9}  {'idle':>6}  actions"]
    for r, bs in sorted(by_rank.items()):
        order = " ".join(b.action for b in sorted(bs, key=lambda b: (b.start, b.end)))
        lines.append(f"{r:>4}  {busy[r] * 1e3:>9.3f}  {100 * idle[r]:>5.1f}%  {order}")
    return "\n".join(lines)


def _check_compare(compare: object, api: str) -> dict[str, float]:
    if compare is None:
        return {}
    if not isinstance(compare, Mapping):
        raise ShardingTypeError(f"{api}: compare is not a dict — got {type(compare).__name__}; expected "
                                f"label -> idle fraction, e.g. {{'simulated': 0.27}}. Pass a dict.")
    with Problems(api) as problems:
        for k, v in compare.items():
            if not isinstance(k, str) or not isinstance(v, Real) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
                problems.add(f"{api}: compare[{k!r}] is not a labelled fraction — got {v!r}; expected a str "
                             f"label and a number in [0, 1]. Pass idle fractions, not percentages.")
    return {k: float(v) for k, v in compare.items()}


def plot_timeline(records: Iterable, path: str | os.PathLike, *, title: str | None = None,
                  compare: Mapping[str, float] | None = None) -> dict[int, float]:
    """Writes a PNG timeline to ``path`` and returns the measured idle fraction per rank.

    One row per rank, one box per action (compute coloured by kind, F/B/I/W; a rank's second,
    fourth... local chunk in a lighter shade when interleaved; send/recv and ZeRO actions as thin
    grey boxes under the row), the microbatch written in a box where it fits, time in ms from the
    step's first start. ``compare`` (label -> idle fraction, e.g. the simulator's and the formula
    ``(p-1)/(m+p-1)``) is printed in the title next to the measured mean and per-rank fractions.
    """
    api = "plot_timeline"
    boxes = _boxes(records, api)
    cmp = _check_compare(compare, api)
    t0, span, by_rank, busy = _stats(boxes, api)
    idle = {r: 1.0 - b / span for r, b in busy.items()}
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ModuleNotFoundError(f"{api}: matplotlib is not installed — got {e}; expected it for PNG "
                                  f"timelines. pip install -c constraints.txt 'shardlib[examples]'.") from e

    ranks = sorted(by_rank)
    row = {r: i for i, r in enumerate(ranks)}
    fig = Figure(figsize=(12, 1.2 + 0.55 * len(ranks)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    span_ms = span * 1e3
    ax.set_xlim(0, span_ms)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}\nidle {100 * idle[r]:.0f}%" for r in ranks], fontsize=8)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    kinds = sorted({b.kind for b in boxes if b.kind in COMPUTE_KINDS}, key=COMPUTE_KINDS.index)
    handles = [Patch(color=_COLORS[k], label=k) for k in kinds]
    if any(len({b.stage for b in bs if b.kind in COMPUTE_KINDS}) > 1 for bs in by_rank.values()):
        handles.append(Patch(color=_COLORS_ALT["F"], label="lighter: a rank's\n2nd, 4th... chunk"))
    if any(b.kind not in COMPUTE_KINDS for b in boxes):
        handles.append(Patch(color=_GREY, label="comm / ZeRO"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    mean = sum(idle.values()) / len(idle)
    head = f"measured idle {mean:.3f} (" + ", ".join(f"r{r} {idle[r]:.3f}" for r in ranks) + ")"
    if cmp:
        head += "\n" + " | ".join(f"{k} {v:.3f}" for k, v in cmp.items())
    ax.set_title((f"{title}\n" if title else "") + head, fontsize=9)
    fig.tight_layout()      # title, ticks, legend set: the axes' size (a box's width in pixels) is final
    px_per_ms = ax.get_window_extent().width / span_ms
    char_px = 0.62 * 7 / 72 * fig.dpi                       # a digit at fontsize 7

    for r, bs in by_rank.items():
        stages = sorted({b.stage for b in bs if b.kind in COMPUTE_KINDS})
        chunk = {s: i for i, s in enumerate(stages)}
        y = row[r]
        for b in bs:
            x, w = (b.start - t0) * 1e3, (b.end - b.start) * 1e3
            if b.kind in COMPUTE_KINDS:
                color = (_COLORS_ALT if chunk[b.stage] % 2 else _COLORS)[b.kind]
                ax.barh(y, w, left=x, height=0.7, color=color, edgecolor="black", linewidth=0.4)
                label = str(b.mb)
                if w * px_per_ms >= char_px * len(label) + 2:
                    ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=7)
            else:       # at least 1.5 px wide: a simulator's zero-cost send/recv still shows
                ax.barh(y + 0.42, max(w, 1.5 / px_per_ms), left=x, height=0.1, color=_GREY, linewidth=0)

    fig.savefig(os.fspath(path), format="png")
    return idle
