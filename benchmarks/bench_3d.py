"""shardlib's 3D parallelism vs torch's native 3D composition (torchtitan's), side by side in the same processes.

    PYTHONPATH=. python3 benchmarks/bench_3d.py                          # both configs, prints a Markdown table
    PYTHONPATH=. python3 benchmarks/bench_3d.py --steps 10 --json rows.json   # ~4 min on the 2-core machine

One mesh: data 2 x pipe 2 x tensor 2 = 8 gloo processes (1 thread each) on the reference machine's 2 cores.
Model: the reference GPT (``shardlib.models.gpt``) of ``bench_pipeline.py``, 8 blocks, d_model 128, 4 heads,
vocab 512, seq 64 (1.73 M parameters), split 4 | 4 over ``pipe``; global batch 16 = data 2 x 4 micro-batches of
2 sequences; fp32 AdamW (lr 1e-3), the same on both sides and in the single-process reference.

Configs:

* ``3D``     ``sequence_parallel=False`` on both sides;
* ``3D+SP``  ``sequence_parallel=True`` on both sides (torch: ``SequenceParallel`` on the LayerNorms, the
             stream between stages and blocks split on the sequence dim, as shardlib's).

**The shardlib side** (``run_shardlib``)::

    mesh = sl.Mesh({"data": 2, "pipe": 2, "tensor": 2})
    plan = sl.plan(GPT(CFG, seed=0), mesh, zero=3, microbatches=4, schedule="1f1b", stages=[4, 4],
                   rules={"layers": "pipe", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
                   sequence_parallel=sp, batch=example_global_batch)
    engine = sl.parallelize(model, plan, optimizer=AdamW);  loss = engine.step(global_batch)

ZeRO-3 on ``data`` with the default ``pipe_gather="step"`` (a stage gathered once per step, kept through its
micro-batches, its gradients reduce-scattered once after its last backward); Megatron TP on ``tensor`` with a
vocab-parallel embedding, head and cross-entropy; 1F1B on ``pipe``. ``engine.step`` returns the global-batch
mean loss on every rank.

**The torch side** (``run_torch``), torchtitan's composition on
``init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))`` (the same rank -> coordinate map as
shardlib's mesh): every rank builds ``GPT(CFG, seed=0)`` and keeps its pipeline stage (``bench_pipeline``'s
``GPTStage``: ``wte``/``wpe`` on the first stage, blocks ``[4·pp, 4·pp + 4)``, ``ln_f``/``head`` on the last),
then, in torchtitan's order,

1. TP: ``parallelize_module`` on ``mesh["tp"]`` with ``bench_tensor_parallel``'s plans —
   ``ColwiseParallel`` on ``attn.qkv``/``mlp.fc``, ``RowwiseParallel`` on ``attn.proj``/``mlp.out``, a
   vocab-parallel ``wte`` (``RowwiseParallel(input_layouts=Replicate())``) and ``head``
   (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``), the loss under ``loss_parallel()``
   (the whole ``schedule.step`` runs inside the context, so the pipeline's ``loss_fn`` and its backward are
   vocab-parallel: the last stage returns DTensor logits sharded on the vocabulary and never sends them).
   With SP: ``SequenceParallel`` on ``ln1``/``ln2``/``ln_f``, ``PrepareModuleInput`` Shard(1) -> Replicate on
   ``attn``/``mlp``, row outputs Shard(1), ``wte`` output Shard(1), ``wpe`` output sliced to the rank's
   positions, ``head`` input Shard(1); the stage boundary carries each rank's local sequence shard.
2. FSDP2: ``fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)`` per block, then on the stage
   root — ``reshard_after_forward=False`` as torchtitan does under PP (its default policy: reshard only
   without PP), which is shardlib's ``pipe_gather="step"``. ``PipelineStage`` drives FSDP2 as torchtitan
   relies on: no reduce-scatter before the stage's last backward.
3. PP: ``PipelineStage(stage_module, pp_rank, 2, cpu, group=mesh["pp"].get_group())`` and
   ``Schedule1F1B(stage, n_microbatches=4, loss_fn=lm_loss)`` (``scale_grads=True``: gradients divided by
   ``m``, FSDP2 averages over ``dp``). Each dp rank feeds its half of the global batch (rows
   ``[8·dp, 8·dp + 8)``, the first stage only; targets on the last).

torch's schedule returns the micro-batch losses on the last stage only; the global-batch loss is their mean
over micro-batches and dp ranks (equal micro-batches), computed after the timed steps from the gathered
per-rank values — so torch's step has no loss collective, while shardlib's returns the global loss on every rank.

**Timing.** Both sides live in one ``sl.launch`` world (built from the same seed), run ``--warmup`` steps,
then are stepped alternately (A B, B A, ...) on the same global batches, so a change in machine load hits
both alike. A step is everything from the schedule to the optimizer step (AdamW, ``zero_grad``); every rank
notes its start after a barrier and its end (``time.perf_counter``: one clock for all processes on Linux),
and the step's time is the latest end minus the earliest start over the ranks. Reported: median and
p25-p75 over the timed steps, the ratio shardlib / torch. Peak RSS per rank: ``VmHWM`` of each side alone
in a fresh world after ``warmup + 2`` steps (the worst rank; ~230 MB of it is ``import torch`` and the
process group; in brackets the rise over the RSS before building).

**Bytes.** One warm-up step per side is counted (never a timed one). shardlib: ``sl.count_collectives()``,
by axes (``data``, ``pipe`` — the point-to-point sends — ``tensor``, and scalars over the whole mesh), checked
against ``plan.local(rank).comm_bytes_per_step()``. torch: ``bench_tensor_parallel``'s dispatch mode, which
sees every collective DTensor and FSDP2 issue and every ``send`` of the pipeline (receives not counted), filed
under an axis by process group. Both in the ring model of ``shardlib.comm.core``; mean over the 8 ranks.

**Correctness.** One process trains the plain GPT on the whole global batch with the same AdamW and batches
(``reference_losses``); the table gives the largest relative loss difference over every step (warm-up
included), from each side to it and between the sides.

**Hangs and failures.** Every world runs with ``sl.launch(..., threads=1, timeout=120, run_timeout=900)``
(``--timeout``, ``--world-timeout``): a collective or point-to-point wait that exceeds the first fails its
rank, the whole world is bounded by the second. A side that fails is reported as FAILED with the first line
of its error; where both sides ran in the failing world each is then run alone, so one side's failure does
not hide the other's numbers.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from bench_pipeline import GPTStage, lm_loss                        # benchmarks/ is on the path when run
from bench_tensor_parallel import CountCollectives, torch_tp_plan
from harness import (gathered_alternate, gpt_line, max_rel, missing_cells, ms_cell, n_params, pair_cells, print_tables,
                     reference_losses, rss_of, run_configs, run_sides, side_by_side_parser, step_times, write_rows)

import shardlib as sl
from shardlib.comm.core import NETWORK_OPS
from shardlib.models import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_heads=4, n_layers=8)   # 1.73 M parameters
MESH = {"data": 2, "pipe": 2, "tensor": 2}
N = MESH["data"] * MESH["pipe"] * MESH["tensor"]
BATCH, M = 16, 4          # global batch (sequences); 4 micro-batches of 2 per data rank
LR = 1e-3
RULES = {"layers": "pipe", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
# label: (sequence_parallel, torch's composition)
CONFIGS = {
    "3D": (False, "FSDP2 + parallelize_module + Schedule1F1B"),
    "3D+SP": (True, "FSDP2 + parallelize_module + SequenceParallel + Schedule1F1B"),
}
AXES = ("data", "pipe", "tensor")
Batch = tuple[torch.Tensor, torch.Tensor]


def make_optimizer(params) -> torch.optim.Optimizer:
    """The optimizer of both sides and of the single-process reference."""
    return torch.optim.AdamW(params, lr=LR)


@dataclass
class Built:
    """One side, built in a rank: ``step(global_batch)`` runs a training step and returns the loss this rank
    knows (shardlib: the global batch's; torch: the mean of its micro-batch losses on the last stage, None
    elsewhere). ``plan``: shardlib's; ``groups``: torch's process-group names -> mesh axis. What
    ``counted_step`` and ``collect`` read (``bench_hf.py`` and ``bench_peft.py`` build theirs too)."""
    step: Callable[[Any], float | None]
    plan: Any = None
    groups: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The shardlib side
# ---------------------------------------------------------------------------------------------

def run_shardlib(sp: bool) -> Built:
    """shardlib's engine for ``GPT(CFG, seed=0)`` on data 2 x pipe 2 x tensor 2, ZeRO-3, 1F1B over ``M``
    micro-batches, the blocks split 4 | 4 (the torch side's split)."""
    mesh = sl.Mesh(MESH)
    model = GPT(CFG, seed=0)
    p = MESH["pipe"]
    plan = sl.plan(model, mesh, zero=3, rules=RULES, microbatches=M, schedule="1f1b",
                   stages=[CFG.n_layers // p] * p, sequence_parallel=sp, batch=token_batch(CFG, BATCH, 0))
    engine = sl.parallelize(model, plan, optimizer=make_optimizer)
    return Built(lambda batch: float(engine.step(batch)), plan=plan)


# ---------------------------------------------------------------------------------------------
# The torch side
# ---------------------------------------------------------------------------------------------

def run_torch(sp: bool) -> Built:
    """torchtitan's 3D: TP (``parallelize_module``) on ``tp``, FSDP2 on ``dp`` (no reshard after forward),
    ``Schedule1F1B`` on ``pp``, for this rank's ``GPTStage`` of ``GPT(CFG, seed=0)``."""
    from torch.distributed import pipelining as pp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    d, p, t = (MESH[a] for a in AXES)
    mesh = init_device_mesh("cpu", (d, p, t), mesh_dim_names=("dp", "pp", "tp"))
    dp_mesh, pp_mesh, tp_mesh = mesh["dp"], mesh["pp"], mesh["tp"]
    groups = {dp_mesh.get_group().group_name: "data", pp_mesh.get_group().group_name: "pipe",
              tp_mesh.get_group().group_name: "tensor"}
    stage_index, dp_index = pp_mesh.get_local_rank(), dp_mesh.get_local_rank()
    first, last = stage_index == 0, stage_index == p - 1
    per = CFG.n_layers // p
    model = GPT(CFG, seed=0)
    mod = GPTStage(model, stage_index * per, (stage_index + 1) * per, first, last)
    del model   # the other stage's modules go with it

    top, block = torch_tp_plan(sp)
    parallelize_module(mod, tp_mesh, {k: v for k, v in top.items() if hasattr(mod, k)})
    for b in mod.blocks:
        parallelize_module(b, tp_mesh, block)
    for b in mod.blocks:
        fully_shard(b, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(mod, mesh=dp_mesh, reshard_after_forward=False)

    stage = pp.PipelineStage(mod, stage_index, p, torch.device("cpu"), group=pp_mesh.get_group())
    sched = pp.Schedule1F1B(stage, n_microbatches=M, loss_fn=lm_loss)
    opt = make_optimizer(mod.parameters())
    rows = BATCH // d

    def step(batch: Batch) -> float | None:
        idx, targets = (x[dp_index * rows:(dp_index + 1) * rows] for x in batch)
        losses: list = []
        with loss_parallel():
            if first:
                sched.step(idx)
            elif last:
                sched.step(target=targets, losses=losses)
            else:
                sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not last:
            return None
        local = [x.detach().to_local() if isinstance(x, DTensor) else x.detach() for x in losses]
        return float(torch.stack(local).mean())

    return Built(step, groups=groups)


SIDES = {"shardlib": run_shardlib, "torch": run_torch}


# ---------------------------------------------------------------------------------------------
# Counting bytes
# ---------------------------------------------------------------------------------------------

class CountSends(CountCollectives):
    """``bench_tensor_parallel``'s counter, receives left out (a point-to-point message counts once, at its
    sender, as shardlib counts it)."""

    def _record(self, name: str, args) -> None:
        if "recv" not in name:
            super()._record(name, args)


def counted_step(side: str, built: Built, batch: Batch) -> tuple[float | None, dict]:
    """One step with its bytes counted: ``(loss, {"data": b, "pipe": b, "tensor": b, "mesh": b, "total": b,
    "planned": b or None, "ops": {...}})`` for this rank (``mesh``: collectives over several axes)."""
    out = {a: 0 for a in (*AXES, "mesh")}
    if side == "shardlib":
        with sl.count_collectives() as c:
            loss = built.step(batch)
        for r in c.records:
            if r.op in NETWORK_OPS or r.op == "send":   # what ``c.bytes`` counts
                key = r.axes[0] if len(r.axes) == 1 and r.axes[0] in AXES else "mesh"
                out[key] += r.bytes
        out["total"] = c.bytes
        out["planned"] = built.plan.local(dist.get_rank()).comm_bytes_per_step()
        out["ops"] = {f"{op}": list(v) for op, v in c.by_op().items()}
        return loss, out
    mode = CountSends()
    with mode:
        loss = built.step(batch)
    out["ops"] = {}
    for (op, group), (n, b) in mode.by.items():
        axis = built.groups.get(group, "mesh")
        out[axis] += b
        key = f"{op}({axis})"
        prev = out["ops"].get(key, [0, 0])
        out["ops"][key] = [prev[0] + n, prev[1] + b]
    out["total"] = sum(out[a] for a in (*AXES, "mesh"))
    out["planned"] = None
    return loss, out


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------

def rank_main(label: str, sides: list[str], warmup: int, steps: int) -> list[dict]:
    """The sides alive in one world, warmed up (the last warm-up step counted), then stepped alternately;
    every rank's record gathered to every rank."""
    torch.set_num_threads(1)
    sp = CONFIGS[label][0]
    batches = [token_batch(CFG, BATCH, s) for s in range(warmup + steps)]
    built = {side: SIDES[side](sp) for side in sides}
    return gathered_alternate(built, batches, warmup, count=counted_step)


def rss_main(label: str, side: str, steps: int) -> dict:
    """In a fresh world, one side alone: RSS before building and its peak (VmHWM) after ``steps``."""
    return rss_of(lambda: SIDES[side](CONFIGS[label][0]), lambda s: token_batch(CFG, BATCH, s), steps)


# ---------------------------------------------------------------------------------------------
# Driver and table
# ---------------------------------------------------------------------------------------------

def collect(per: list[dict], side: str, steps: int) -> dict:
    """One side's times, global-batch losses and bytes from every rank's record."""
    recs = [r[side] for r in per]
    times = step_times(recs, steps)
    losses = []
    for xs in zip(*(r["losses"] for r in recs)):   # mean over the ranks that know a loss (torch: last stage)
        known = [x for x in xs if x is not None]
        losses.append(sum(known) / len(known))
    n = len(recs)
    by = {k: sum(r["bytes"][k] for r in recs) / n for k in (*AXES, "mesh", "total")}
    planned = [r["bytes"]["planned"] for r in recs]
    by["counted_eq_planned"] = None if planned[0] is None else all(
        r["bytes"]["total"] == r["bytes"]["planned"] for r in recs)
    by["per_rank"] = [{k: r["bytes"][k] for k in (*AXES, "mesh", "total", "planned")} for r in recs]
    by["ops_rank0"] = recs[0]["bytes"]["ops"]
    q = statistics.quantiles(times, n=4)
    return {"times": times, "losses": losses, "bytes": by, "ms": 1e3 * statistics.median(times),
            "p25": 1e3 * q[0], "p75": 1e3 * q[2]}


def run_config(label: str, sides: list[str], warmup: int, steps: int, timeout: tuple[float, float],
               rss: bool) -> dict:
    sp, torch_name = CONFIGS[label]
    row = {"config": label, "form": f"{label} (data 2 x pipe 2 x tensor 2, ZeRO-3, 1F1B m={M})", "sp": sp,
           "baseline": torch_name, "ranks": 8, "results": {}, "failed": {}, "rss": {}, "load": [os.getloadavg()[0]]}
    return run_sides(row, N, rank_main, rss_main, label, sides, warmup, steps, timeout, rss,
                     lambda per, side: collect(per[0], side, steps))


def summarize(row: dict, ref: list[float]) -> dict:
    for side, r in row["results"].items():
        r["dloss"] = max_rel(r["losses"], ref)
        if side in row["rss"]:
            rs = row["rss"][side]
            r["peak_mb"] = max(x["peak"] for x in rs) / 2**20
            r["rise_mb"] = max(x["peak"] - x["before"] for x in rs) / 2**20
    res = row["results"]
    if "torch" in res and "shardlib" in res:
        row["ratio"] = res["shardlib"]["ms"] / res["torch"]["ms"]
        row["dloss_sl_torch"] = max_rel(res["shardlib"]["losses"], res["torch"]["losses"])
        row["shardlib_ms"], row["torch_ms"] = res["shardlib"]["ms"], res["torch"]["ms"]
        row["dloss"] = max(res["shardlib"]["dloss"], res["torch"]["dloss"])
    return row


def _cells(row: dict, side: str) -> list[str]:
    """ms, peak RSS, bytes data / pipe / tensor / mesh, Δloss vs 1 process — or why there is none."""
    missing = missing_cells(row, side, 4)
    if missing is not None:
        return missing
    r, fb = row["results"][side], sl.format_bytes
    rss = f"{r['peak_mb']:.0f} (+{r['rise_mb']:.0f})" if "peak_mb" in r else "–"
    by = r["bytes"]
    eq = {None: "", True: " (= planned)", False: " (≠ planned)"}[by["counted_eq_planned"]]
    bytes_ = " / ".join(fb(int(by[a])) for a in (*AXES, "mesh")) + eq
    return [ms_cell(r), rss, bytes_, f"{r['dloss']:.1e}"]


def table(rows: list[dict]) -> str:
    head = ("| config | torch side | ms torch (p25-p75) | ms shardlib | ratio | peak RSS/rank MB (+ rise) torch "
            "| shardlib | bytes/step per rank data / pipe / tensor / whole mesh: torch | shardlib "
            "| max rel Δloss vs 1 process torch | shardlib | shardlib vs torch | load |\n|" + "---|" * 13)
    lines = [head]
    for r in rows:
        t, s = _cells(r, "torch"), _cells(r, "shardlib")
        ratio, vs, load = pair_cells(r)
        lines.append("| " + " | ".join([r["config"], r["baseline"], t[0], s[0], ratio, t[1], s[1], t[2], s[2],
                                        t[3], s[3], vs, load]) + " |")
    return "\n".join(lines)


def ops_lines(rows: list[dict]) -> str:
    """Counted collectives in one step on rank 0: ``op x count bytes``."""
    lines = []
    for r in rows:
        for side, res in r["results"].items():
            ops = ", ".join(f"{k} x{n} {sl.format_bytes(b)}" for k, (n, b) in sorted(res["bytes"]["ops_rank0"].items()))
            lines.append(f"- {r['config']} {side}: {ops}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = side_by_side_parser(__doc__, CONFIGS, steps=16).parse_args(argv)
    t_start = time.time()
    ref = reference_losses(CFG, BATCH, args.warmup + args.steps, make_optimizer)
    rows = run_configs(args, run_config, lambda row: summarize(row, ref),
                       lambda r: f"{r['ms']:.0f} ms (p25-p75 {r['p25']:.0f}-{r['p75']:.0f}), "
                                 f"Δloss vs 1 process {r['dloss']:.1e}")
    print(f"\n{gpt_line(CFG)} ({n_params(CFG) / 1e6:.2f} M parameters); mesh data {MESH['data']} x pipe {MESH['pipe']} "
          f"x tensor {MESH['tensor']} (8 gloo processes, 1 thread each, {os.cpu_count()} cores); global batch "
          f"{BATCH}, 1F1B over {M} micro-batches per data rank, blocks {CFG.n_layers // 2} | {CFG.n_layers // 2}; "
          f"fp32 AdamW lr {LR}; torch {torch.__version__}. Median of {args.steps} alternating steps after "
          f"{args.warmup} warm-up (p25-p75); step = latest end - earliest start over the ranks. Bytes: sent per rank "
          f"per step (ring model), mean over the ranks, one counted warm-up step. Δloss: relative, every step. "
          f"Load: 1-min load average at the config's start-end. Total {time.time() - t_start:.0f} s.\n")
    print_tables(rows, table, ("Collectives counted in one step (rank 0)", ops_lines))
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
