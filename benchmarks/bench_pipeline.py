"""shardlib's pipe axis vs ``torch.distributed.pipelining``, side by side in the same processes.

    PYTHONPATH=. python3 benchmarks/bench_pipeline.py                 # every config, prints two Markdown tables
    PYTHONPATH=. python3 benchmarks/bench_pipeline.py --configs 1f1b-p4 zb1-p4 --steps 10 --png /tmp/tl --json rows.json

Configs (``p`` pipe ranks = processes, ``m`` microbatches, ``v`` stages per rank; torch's class, shardlib's
schedule name):

* ``gpipe-p{2,4}``        v = 1   ``ScheduleGPipe``                  ``"gpipe"``
* ``1f1b-p{2,4}``         v = 1   ``Schedule1F1B``                   ``"1f1b"``
* ``interleaved-p{2,4}``  v = 2   ``ScheduleInterleaved1F1B``        ``"interleaved_1f1b"``
* ``zb1-p{2,4}``          v = 1   ``ScheduleInterleavedZeroBubble``  ``"zb_h1"`` (torch's ZB1P on one stage per
                                  rank: the zero-bubble schedule shardlib's ``zb_h1`` is)
* ``zb-p{2,4}``           v = 2   ``ScheduleInterleavedZeroBubble``  torch only: shardlib's ``zb_h1`` is v = 1

m = 8 everywhere. The zero-bubble schedules split each backward into I (input gradient) and W (weight
gradient); torch does the split on the autograd graph (``stage_backward_input``/``stage_backward_weight``).

**The torch side** is built by hand, as torchtitan builds its pipeline stages: every rank builds the whole
``GPT(CFG, seed=0)`` (so its weights equal the single-process model's), keeps the stages it owns and drops the
rest. The ``p·v`` stages cut the 8 blocks into equal contiguous slices; stage ``s`` lives on rank ``s % p``
(torch's looped placement, as in shardlib's design). A stage (``GPTStage``) holds ``wte``/``wpe`` when it is
the first, its blocks, ``ln_f``/``head`` when it is the last, and computes exactly ``GPT.forward``'s math::

    first:  x = wte(idx) + wpe(arange(s));  x = blocks(x)          (tokens -> activations)
    middle: x = blocks(x)                                          (activations -> activations)
    last:   x = blocks(x);  logits = head(ln_f(x))                 (activations -> logits)
    loss_fn(logits, targets) = cross_entropy(logits as (b·s, vocab), targets as (b·s,))   (mean)

Each stage is a ``PipelineStage`` on the world group (gloo); the schedule gets ``loss_fn`` and its default
``scale_grads=True`` (gradients divided by ``m``), so with equal microbatches the gradient is the one of the
global batch's mean loss and the reported loss, the mean of the ``m`` microbatch losses, is the global-batch
loss. The optimizer is SGD (lr ``LR``) on each rank's parameters, stepped after the schedule.

**The shardlib side** is ``sl.plan(GPT(CFG, seed=0), sl.Mesh({"data": 1, "pipe": p}), rules={"layers": "pipe"},
microbatches=m, schedule=name, virtual_stages=v, stages=[8 / (p·v)] * (p·v), batch=example)`` and
``sl.parallelize(model, plan, optimizer=SGD)``; ``engine.step(global_batch)``. ``stages=`` gives it the torch
side's split (the default balances by parameter count: the embedding and head would move blocks).

**Timing.** For each config one ``sl.launch`` world (``p`` gloo ranks, 1 thread each) builds both sides from
the same seed, warms them up, then steps them alternately (A B, B A, ...) on the same global batches, so a
change in machine load hits both alike. A step is the schedule (forward + backward of all microbatches) plus
the optimizer step; every rank notes its start (after a barrier) and end (``time.perf_counter``, one clock
for all processes on Linux), and the step's time is the latest end minus the earliest start over the ranks. Peak RSS per rank (``VmHWM``)
is measured apart, each side alone in a fresh world.

**Idle fraction (the measured bubble).** The torch side's stage methods ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` are wrapped to note their start and end as
``Record(rank, action, start, end)`` (actions spelled like torch's ``_Action``: ``0F3``, ``1B0``, ``1I2``,
``1W2``; the last stage's loss is part of its F), two clock reads per action; torch waits for its receives
before calling them. shardlib's records are ``engine.timeline`` (every action; a compute action's receive
is waited for before its timer starts and recorded as that RECV). Over one step, on both sides::

    span    = max(end) - min(start)        over all ranks' compute records (F, B, I, W)
    busy_r  = |union of rank r's compute intervals|
    idle_r  = 1 - busy_r / span            (shardlib.frontend.plots.timeline.idle_fractions' measure)

reported as the median over the timed steps of the mean over ranks. Beside it: **simulated**, shardlib's
simulator (``planner/simulate.py``) on the schedule's compute actions (shardlib's ``plan.pipeline.actions``;
torch's own ``pipeline_order`` for its runtime schedules, the textbook order for GPipe and 1F1B) with this
run's median duration of each (virtual stage, kind) and free p2p; and the **formula**
(``bubble_formula``): ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v·m+p-1)`` interleaved, ``(p-1)/(3m+p-1)``
for ZB-H1 (F = I = W; the paper's ``(p-1)/(3m)`` over the ideal time). On the 2-core reference machine 4
ranks share 2 cores, so at p = 4 a rank's compute is stretched by its neighbours' and the measured idle is
not the schedule's bubble alone. ``--png DIR`` draws each side's median step (``plot_timeline``) with the simulated and formula fractions in the title.

**Correctness.** One process trains the whole model on the whole batch with the same optimizer and batches
(``reference_losses``); the table gives the largest relative loss difference over every step, from each side
to it and between the sides.

**Hangs.** gloo point-to-point under torch's pipelining has hung before (pytorch/pytorch#132644: a batch of
p2p ops returned several ``Work``s on gloo and only one was waited on; fixed upstream by waiting on all). Every
world runs under a collective timeout (``--timeout``; it bounds gloo's point-to-point waits too) and a
whole-world timeout (``--world-timeout``); a config that fails or hangs is reported as FAILED with the first
line of the error, and where both sides ran in it each side is then run alone, so that one side's failure
does not hide the other's numbers.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import (gathered_alternate, gpt_line, max_rel, missing_cells, ms_cell,  # benchmarks/ is on the path
                     n_params, pair_cells, print_tables, reference_losses, rss_of, run_configs, run_sides,
                     side_by_side_parser, step_times, write_rows)
from torch import nn

import shardlib as sl
from shardlib.frontend.plots.timeline import plot_timeline
from shardlib.models import GPT, GPTConfig, token_batch
from shardlib.planner.schedules import schedule_actions
from shardlib.planner.simulate import Record, bubble_formula, simulate

CFG = GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_heads=4, n_layers=8)   # 1.73 M parameters
BATCH = 16   # global batch (sequences): m = 8 microbatches of 2
LR = 0.1
# label: (shardlib schedule name, p, m, v for torch, v for shardlib — None: no shardlib counterpart)
CONFIGS = {
    "gpipe-p2": ("gpipe", 2, 8, 1, 1),
    "1f1b-p2": ("1f1b", 2, 8, 1, 1),
    "interleaved-p2": ("interleaved_1f1b", 2, 8, 2, 2),
    "zb1-p2": ("zb_h1", 2, 8, 1, 1),
    "zb-p2": ("zb_h1", 2, 8, 2, None),
    "gpipe-p4": ("gpipe", 4, 8, 1, 1),
    "1f1b-p4": ("1f1b", 4, 8, 1, 1),
    "interleaved-p4": ("interleaved_1f1b", 4, 8, 2, 2),
    "zb1-p4": ("zb_h1", 4, 8, 1, 1),
    "zb-p4": ("zb_h1", 4, 8, 2, None),
}
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved_1f1b": "ScheduleInterleaved1F1B", "zb_h1": "ScheduleInterleavedZeroBubble"}
Batch = tuple[torch.Tensor, torch.Tensor]


def make_optimizer(params) -> torch.optim.Optimizer:
    """The optimizer of every side and of the single-process reference."""
    return torch.optim.SGD(params, lr=LR)


@dataclass
class Built:
    """One side, built in a rank. ``step(global_batch)`` runs one training step and returns the
    global-batch loss where this rank knows it (None elsewhere); after it, ``records()`` gives the step's
    ``(rank, action, start, end)`` records, ``actions`` the compute actions of each pipe rank in order
    (shardlib's schedule, for the simulator)."""
    step: Callable[[Batch], float | None]
    records: Callable[[], list] = field(default=list)
    actions: dict | None = None


# ---------------------------------------------------------------------------------------------
# The shardlib side
# ---------------------------------------------------------------------------------------------

def run_shardlib(schedule: str, p: int, m: int, v: int, cfg: GPTConfig = CFG) -> Built:
    """shardlib's pipeline engine for ``GPT(cfg, seed=0)`` in this rank of a world of ``p`` ranks, on the torch
    side's split (``stages=``: ``n_layers / (p·v)`` blocks per stage, not the default balance by parameter
    count). ``engine.timeline`` gives the records."""
    n_stages = p * v
    mesh = sl.Mesh({"data": 1, "pipe": p})
    model = GPT(cfg, seed=0)
    plan = sl.plan(model, mesh, rules={"layers": "pipe"}, microbatches=m, schedule=schedule, virtual_stages=v,
                   stages=[cfg.n_layers // n_stages] * n_stages, batch=token_batch(cfg, BATCH, 0))
    engine = sl.parallelize(model, plan, optimizer=make_optimizer)

    def step(batch: Batch) -> float:
        return float(engine.step(batch))

    return Built(step, lambda: [tuple(r) for r in engine.timeline],
                 {c: [str(a) for a in plan.pipeline.actions(c)] for c in range(p)})


# ---------------------------------------------------------------------------------------------
# The torch side
# ---------------------------------------------------------------------------------------------

class GPTStage(nn.Module):
    """Blocks ``[lo, hi)`` of a ``GPT``, with its embeddings when ``first`` and its final norm and head
    when ``last`` (the modules are the model's own, not copies). ``forward`` is ``GPT.forward``'s math
    for that slice: tokens -> activations on the first stage, activations -> logits on the last."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``GPT.forward``'s loss: mean cross-entropy over the ``b·s`` tokens of a microbatch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _record_stage(stage, rank: int, out: list) -> None:
    """Wrap the stage's compute methods so each call appends ``Record(rank, "<stage><kind><mb>", t0, t1)``."""
    s = stage.stage_index
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(mb, *args, **kwargs):
        t0 = time.perf_counter()
        y = fwd(mb, *args, **kwargs)
        out.append(Record(rank, f"{s}F{mb}", t0, time.perf_counter()))
        return y

    def backward_one_chunk(mb, loss=None, full_backward=True, last_backward=False):
        t0 = time.perf_counter()
        y = bwd(mb, loss=loss, full_backward=full_backward, last_backward=last_backward)
        out.append(Record(rank, f"{s}{'B' if full_backward else 'I'}{mb}", t0, time.perf_counter()))
        return y

    def backward_weight_one_chunk(mb, last_backward=False):
        t0 = time.perf_counter()
        y = wgt(mb, last_backward=last_backward)
        out.append(Record(rank, f"{s}W{mb}", t0, time.perf_counter()))
        return y

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def run_torch(schedule: str, p: int, m: int, v: int, cfg: GPTConfig = CFG) -> Built:
    """``torch.distributed.pipelining`` on ``GPT(cfg, seed=0)`` in this rank of a world of ``p`` ranks:
    ``p·v`` hand-built ``GPTStage``s (stage ``s`` on rank ``s % p``), torch's schedule for ``schedule``
    (GPipe and 1F1B take the rank's one stage; the runtime schedules, zero-bubble too, a list of them)."""
    from torch.distributed import pipelining as pp

    rank, n_stages = dist.get_rank(), p * v
    if dist.get_world_size() != p or cfg.n_layers % n_stages:
        raise ValueError(f"run_torch: {cfg.n_layers} blocks on {n_stages} stages in a world of "
                         f"{dist.get_world_size()} — expected world p = {p} and p·v dividing the blocks.")
    per = cfg.n_layers // n_stages
    model = GPT(cfg, seed=0)
    mods = [GPTStage(model, s * per, (s + 1) * per, s == 0, s == n_stages - 1) for s in range(rank, n_stages, p)]
    del model   # the other ranks' blocks go with it
    stages = [pp.PipelineStage(mod, s, n_stages, torch.device("cpu"))
              for mod, s in zip(mods, range(rank, n_stages, p))]
    records: list = []
    for st in stages:
        _record_stage(st, rank, records)
    cls = getattr(pp, TORCH_SCHEDULES[schedule])
    sched = cls(stages[0] if v == 1 and schedule in ("gpipe", "1f1b") else stages, n_microbatches=m, loss_fn=lm_loss)
    compute_loss = sched._compute_loss

    def timed_loss(output, target, loss_kwargs=None):
        y = compute_loss(output, target, loss_kwargs)
        records[-1] = records[-1]._replace(end=time.perf_counter())   # the loss belongs to the last F
        return y

    sched._compute_loss = timed_loss
    opt = make_optimizer([q for mod in mods for q in mod.parameters()])
    has_first, has_last = rank == 0, (n_stages - 1) % p == rank

    def step(batch: Batch) -> float | None:
        idx, targets = batch
        records.clear()
        losses: list = []
        args = (idx,) if has_first else ()
        kwargs = {"target": targets, "losses": losses} if has_last else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if has_last else None

    if isinstance(sched, pp.schedules.PipelineScheduleMulti):   # runs its own action lists: those
        actions = {r: [str(a) for a in acts if a is not None and a.computation_type.value in COMPUTE]
                   for r, acts in sched.pipeline_order.items()}
    else:   # GPipe and 1F1B run the textbook orders, as shardlib writes them
        actions = {r: [str(a) for a in acts] for r, acts in schedule_actions(schedule, p, m, v).items()}
    return Built(step, lambda: [tuple(r) for r in records], actions=actions)


SIDES = {"torch": run_torch, "shardlib": run_shardlib}


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------

def rank_main(label: str, sides: list[str], warmup: int, steps: int) -> dict:
    """The sides alive in one world, warmed up, then stepped alternately; gathered to every rank."""
    torch.set_num_threads(1)
    schedule, p, m, vt, vs = CONFIGS[label]
    v = {"torch": vt, "shardlib": vs}
    batches = [token_batch(CFG, BATCH, s) for s in range(warmup + steps)]
    built = {side: SIDES[side](schedule, p, m, v[side]) for side in sides}
    everyone = gathered_alternate(built, batches, warmup, record=lambda b: b.records())
    res = {}
    for side, b in built.items():
        per = [e[side] for e in everyone]
        res[side] = {
            "times": step_times(per, steps),
            "losses": [next(x for x in xs if x is not None) for xs in zip(*(r["losses"] for r in per))],
            "records": [[rec for r in per for rec in r["records"][k]] for k in range(steps)],
            "actions": b.actions}
    return res


def rss_main(label: str, side: str, steps: int) -> dict:
    """In a fresh world, one side alone: RSS before building and its peak (VmHWM) after ``steps``."""
    schedule, p, m, vt, vs = CONFIGS[label]
    return rss_of(lambda: SIDES[side](schedule, p, m, vt if side == "torch" else vs),
                  lambda s: token_batch(CFG, BATCH, s), steps)


# ---------------------------------------------------------------------------------------------
# Records: idle fraction, per-action costs, the simulator
# ---------------------------------------------------------------------------------------------

_ACTION = re.compile(r"(\d+)([A-Z_]+?)(\d*)")
COMPUTE = ("F", "B", "I", "W")


def _merge(iv) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


def idle_of(records: list) -> dict[int, float]:
    """``1 - busy_r / span`` per rank over the compute records (``frontend/plots/timeline.py``'s measure, with the
    span taken over compute records only on both sides: torch's records hold nothing else)."""
    comp = [r for r in map(Record._make, records) if _ACTION.fullmatch(r.action).group(2) in COMPUTE]
    span = max(r.end for r in comp) - min(r.start for r in comp)
    ranks = sorted({r.rank for r in comp})
    busy = {k: sum(e - s for s, e in _merge((r.start, r.end) for r in comp if r.rank == k)) for k in ranks}
    return {k: 1.0 - busy[k] / span for k in ranks}


def durations(steps_records: list[list]) -> dict[tuple[int, str], float]:
    """Median seconds of each (virtual stage, kind) over the steps and ranks (what the simulator is given)."""
    got: dict[tuple[int, str], list[float]] = {}
    for recs in steps_records:
        for r in recs:
            mt = _ACTION.fullmatch(r.action)
            got.setdefault((int(mt.group(1)), mt.group(2)), []).append(r.end - r.start)
    return {k: statistics.median(x) for k, x in got.items()}


def simulated_idle(actions: dict | None, p: int, m: int, v: int, cost: dict) -> float | None:
    """The simulator's idle fraction of ``actions`` with the measured per-(stage, kind) medians, free p2p."""
    if actions is None:
        return None
    return simulate(actions, p, m, v, costs=lambda a: cost.get((a.stage, a.kind), 0.0)).idle_fraction


def formula_idle(schedule: str, p: int, m: int, v: int | None) -> float | None:
    """``bubble_formula``: equal costs, free p2p (None: torch's zero bubble at v = 2, no formula stated)."""
    if v is None or (schedule == "zb_h1" and v != 1):
        return None
    return bubble_formula(schedule, p, m, v)


# ---------------------------------------------------------------------------------------------
# Driver and table
# ---------------------------------------------------------------------------------------------

def run_config(label: str, sides: list[str], warmup: int, steps: int, timeout: tuple[float, float],
               rss: bool) -> dict:
    schedule, p, m, vt, vs = CONFIGS[label]
    row = {"config": label, "schedule": schedule, "torch_class": TORCH_SCHEDULES[schedule], "p": p, "m": m,
           "v": {"torch": vt, "shardlib": vs}, "results": {}, "failed": {}, "rss": {}, "load": [os.getloadavg()[0]]}
    sides = [s for s in sides if row["v"][s] is not None]
    if not sides:
        return row
    return run_sides(row, p, rank_main, rss_main, label, sides, warmup, steps, timeout, rss,
                     lambda per, side: per[0][side])


def summarize(row: dict, ref: list[float]) -> dict:
    """Medians, ratio, idle (measured, simulated, formula), per-kind costs, RSS and loss gaps of a row."""
    schedule, p, m = row["schedule"], row["p"], row["m"]
    for side, r in row["results"].items():
        t, q = r["times"], statistics.quantiles(r["times"], n=4)
        r["ms"], r["p25"], r["p75"] = 1e3 * statistics.median(t), 1e3 * q[0], 1e3 * q[2]
        r["dloss"] = max_rel(r["losses"], ref)
        net = [[Record._make(x) for x in recs] for recs in r["records"]]
        idle = [idle_of(x) for x in net]
        r["idle_median"] = statistics.median(sum(f.values()) / len(f) for f in idle)
        r["idle_per_rank"] = {k: statistics.median(f[k] for f in idle) for k in idle[0]}
        cost = durations([[x for x in recs if _ACTION.fullmatch(x.action).group(2) in COMPUTE] for recs in net])
        r["cost_ms"] = {f"{s}{k}": 1e3 * c for (s, k), c in sorted(cost.items())}
        r["simulated"] = simulated_idle(r["actions"], p, m, row["v"][side], cost)
        r["formula"] = formula_idle(schedule, p, m, row["v"][side])
        kinds: dict[str, list[float]] = {}      # per step: seconds in each kind, summed over the ranks
        for recs in net:
            step: dict[str, float] = {}
            for x in recs:
                k = _ACTION.fullmatch(x.action).group(2)
                step[k] = step.get(k, 0.0) + x.end - x.start
            for k, x in step.items():
                kinds.setdefault(k, []).append(x)
        r["per_step_ms"] = {k: 1e3 * statistics.median(x) / p for k, x in kinds.items() if any(x)}   # per rank
        r["per_step_ms"]["outside"] = 1e3 * statistics.median(   # the step less its records' span
            t[k] - max(x[3] for x in recs) + min(x[2] for x in recs) for k, recs in enumerate(r["records"]))
        k = min(range(len(t)), key=lambda i: abs(t[i] - statistics.median(t)))
        r["example"] = {"records": r["records"][k], "idle": sum(idle[k].values()) / p}
        del r["records"]
        if side in row["rss"]:
            rs = row["rss"][side]
            r["peak_mb"] = [x["peak"] / 2**20 for x in rs]
            r["rise_mb"] = [(x["peak"] - x["before"]) / 2**20 for x in rs]
    if "torch" in row["results"] and "shardlib" in row["results"]:
        ts, ss = row["results"]["torch"], row["results"]["shardlib"]
        row["ratio"] = ss["ms"] / ts["ms"]
        row["dloss_sl_torch"] = max_rel(ss["losses"], ts["losses"])
    return row


def plot(row: dict, side: str, path: str) -> None:
    """PNG of the median step of ``side``."""
    r = row["results"][side]
    recs = [Record._make(x) for x in r["example"]["records"]]
    cmp = {k: r[k] for k in ("simulated", "formula") if r[k] is not None}
    name = row["schedule"] if side == "shardlib" else row["torch_class"]
    plot_timeline(recs, path, compare=cmp, title=f"{side} {name} p={row['p']} m={row['m']} "
                  f"v={row['v'][side]}: a median step ({r['example']['idle']:.2f} idle), {r['ms']:.0f} ms median")


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _cells(row: dict, side: str) -> list[str]:
    """ms, RSS per rank, idle measured / simulated, Δloss — or why there is no number."""
    missing = missing_cells(row, side, 4, "no counterpart" if row["v"][side] is None else "–")
    if missing is not None:
        return missing
    r = row["results"][side]
    rss = "/".join(f"{x:.0f}" for x in r["peak_mb"]) + " (+" + "/".join(f"{x:.0f}" for x in r["rise_mb"]) + ")" \
        if "peak_mb" in r else "–"
    idle = f"{r['idle_median']:.2f} / {_f(r['simulated'])}"
    return [ms_cell(r), rss, idle, f"{r['dloss']:.1e}"]


def table(rows: list[dict]) -> str:
    head = ("| config | p | m | v torch/shardlib | torch class | ms torch | ms shardlib | ratio "
            "| peak RSS MB per rank (+ rise) torch | shardlib | idle measured / simulated torch | shardlib "
            "| formula | max rel Δloss vs 1 process torch | shardlib | shardlib vs torch | load |\n|" + "---|" * 17)
    lines = [head]
    for r in rows:
        t, s = _cells(r, "torch"), _cells(r, "shardlib")
        formula = _f(r["results"]["shardlib"]["formula"] if "shardlib" in r["results"] else
                     formula_idle(r["schedule"], r["p"], r["m"], r["v"]["shardlib"]))
        ratio, vs, load = pair_cells(r)
        lines.append("| " + " | ".join([r["config"], str(r["p"]), str(r["m"]), f"{r['v']['torch']}/{r['v']['shardlib'] or '–'}",
                                        r["torch_class"], t[0], s[0], ratio, t[1], s[1], t[2], s[2], formula,
                                        t[3], s[3], vs, load]) + " |")
    return "\n".join(lines)


def kinds_table(rows: list[dict]) -> str:
    """Where a step's time goes: per rank, ms in each action kind summed over a step (the median over the
    timed steps of the mean over ranks); shardlib's receive waits are its RECV_F / RECV_B;
    ``outside``: the step less the span of its records (before and after the schedule: the optimizer, and
    shardlib's gradient buckets and whole-mesh scalar all-reduce)."""
    kinds = ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "outside"]
    lines = ["| config | side | step ms | " + " | ".join(kinds) + " |", "|" + "---|" * (3 + len(kinds))]
    for row in rows:
        for side, r in row["results"].items():
            ks = r["per_step_ms"]
            lines.append(f"| {row['config']} | {side} | {r['ms']:.0f} | " +
                         " | ".join(f"{ks[k]:.1f}" if k in ks else "–" for k in kinds) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = side_by_side_parser(__doc__, CONFIGS, steps=15)
    ap.add_argument("--png", default=None, help="write each config's median-step timelines (PNG) into this folder")
    args = ap.parse_args(argv)
    ref = reference_losses(CFG, BATCH, args.warmup + args.steps, make_optimizer)

    def png(label: str, row: dict, side: str) -> None:
        if args.png:
            os.makedirs(args.png, exist_ok=True)
            plot(row, side, os.path.join(args.png, f"timeline_{label}_{side}.png"))

    rows = run_configs(args, run_config, lambda row: summarize(row, ref),
                       lambda r: f"{r['ms']:.0f} ms, idle {r['idle_median']:.2f} (simulated {_f(r['simulated'])}); "
                                 f"median ms per action: {' '.join(f'{k} {c:.1f}' for k, c in r['cost_ms'].items())}",
                       png)
    print(f"\n{gpt_line(CFG)} ({n_params(CFG) / 1e6:.2f} M parameters), global batch {BATCH}, fp32 SGD lr {LR}; "
          f"torch {torch.__version__}, gloo, 1 thread per rank, {os.cpu_count()} cores; median of {args.steps} "
          f"steps each (p25-p75), step = latest end - earliest start over the ranks. Idle: median over steps of "
          f"the mean over ranks; simulated: "
          f"the schedule with the run's median F/B/I/W per stage. Δloss: relative, every step. Load: 1-min "
          f"load average at the config's start-end.\n")
    print_tables(rows, table, ("Per rank, ms per step in each action kind", kinds_table))
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
