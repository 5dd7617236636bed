"""ZeRO-3 under a pipeline: the two gather policies side by side (``sl.plan(..., pipe_gather=)``).

    PYTHONPATH=. python3 benchmarks/bench_pipe_zero3.py                  # data 2 x pipe 2, GPT 20M, ~4 min
    PYTHONPATH=. python3 benchmarks/bench_pipe_zero3.py --schedules 1f1b --steps 6 --json rows.json

* ``step``: a stage's units gathered once per step, kept through its ``m`` micro-batches, gradients
  accumulated whole and reduce-scattered once after the stage's last backward (torch's UNSHARD/RESHARD
  lowering; torchtitan runs FSDP this way under PP);
* ``microbatch``: each unit gathered for every micro-batch's forward and again for its backward, freed after
  each, gradients reduce-scattered after each backward (ZeRO-3 as without a pipeline; the root once per step).

For each schedule one ``sl.launch`` world (data 2 x pipe 2 = 4 gloo ranks, 1 thread each) builds both engines
from the same seed and steps them alternately on the same global batches (a change of load hits both); a
step is the latest end minus the earliest start over the ranks. Reported per policy: the median step, the
bytes each rank sends per step (counted with ``sl.count_collectives`` = ``plan.comm_per_step``), the most
bytes of gathered parameters and gather buffers a rank held (``engine.peak_gathered_bytes``, equal to
``plan.transient_per_rank``) and, each policy alone in a fresh world, the rise of the peak resident memory
per rank while stepping over the RSS after a warm-up step (``VmHWM`` reset by ``/proc/self/clear_refs``;
the model states are resident before it, so the rise is what a step adds: activations, gathered units,
gradients on their way to a reduce-scatter, the update's temporaries).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from bench_memory import PeakRSS, proc_status  # benchmarks/ is on the path when run as a script

import shardlib as sl
from shardlib.models import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=8192, seq_len=128, d_model=384, n_heads=6, n_layers=8)   # 20.3 M parameters
BATCH, M = 16, 8          # global batch; 8 micro-batches of one sequence per data rank
POLICIES = ("step", "microbatch")
MiB = 2**20


def build(policy: str, schedule: str):
    mesh = sl.Mesh({"data": 2, "pipe": 2})
    model = GPT(CFG, seed=0)
    v = 2 if schedule == "interleaved_1f1b" else 1
    plan = sl.plan(model, mesh, zero=3, rules={"layers": "pipe"}, microbatches=M, schedule=schedule,
                   virtual_stages=v, pipe_gather=policy, batch=token_batch(CFG, BATCH, 0))
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    return plan, engine


def rank_time(schedule: str, warmup: int, steps: int) -> dict:
    """Both policies in this world, stepped alternately; per policy the step spans, one step's counted bytes,
    the planned bytes, the peak gathered bytes and the plan's transient, and the losses."""
    torch.set_num_threads(1)
    built = {pol: build(pol, schedule) for pol in POLICIES}
    out = {pol: {"spans": [], "losses": []} for pol in POLICIES}
    for i in range(warmup + steps):
        batch = token_batch(CFG, BATCH, i)
        for pol in (POLICIES if i % 2 == 0 else POLICIES[::-1]):
            plan, engine = built[pol]
            dist.barrier()
            t0 = time.perf_counter()
            with sl.count_collectives() as c:
                loss = engine.step(batch)
            t1 = time.perf_counter()
            out[pol]["losses"].append(loss)
            if i >= warmup:
                out[pol]["spans"].append((t0, t1))
            out[pol]["counted"] = c.bytes
    for pol, (plan, engine) in built.items():
        rank = dist.get_rank()
        out[pol].update(planned=plan.local(rank).comm_bytes_per_step(), gathered=engine.peak_gathered_bytes,
                        transient=plan.transient_per_rank(rank)["gathered"],
                        states=plan.memory_per_rank(rank)["total"])
    return out


def rank_rss(policy: str, schedule: str, steps: int) -> dict:
    """The peak resident memory while stepping (a warm-up step first), over the RSS after the warm-up:
    what the policy holds in a step, beside the model states already resident (the build, which every
    rank does whole before sharding, is not counted)."""
    torch.set_num_threads(1)
    _, engine = build(policy, schedule)
    engine.step(token_batch(CFG, BATCH, 0))
    before = proc_status("VmRSS")
    peak = PeakRSS()
    peak.start()
    for i in range(steps):
        engine.step(token_batch(CFG, BATCH, i + 1))
    out = {"before": before, "peak": peak.peak(), "exact": peak.exact}
    peak.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b", "interleaved_1f1b"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = sum(p.numel() for p in GPT(CFG, seed=0).parameters())
    rows = []
    for schedule in args.schedules:
        per_rank = sl.launch(rank_time, 4, schedule, args.warmup, args.steps, threads=1)
        for pol in POLICIES:
            res = [r[pol] for r in per_rank]
            spans = list(zip(*(r["spans"] for r in res)))
            times = [max(e for _, e in s) - min(b for b, _ in s) for s in spans]
            assert all(r["counted"] == r["planned"] for r in res), [(r["counted"], r["planned"]) for r in res]
            assert all(r["gathered"] == r["transient"] for r in res)
            rss = sl.launch(rank_rss, 4, pol, schedule, 3, threads=1)
            rows.append({"schedule": schedule, "policy": pol, "ms": 1e3 * statistics.median(times),
                         "p25": 1e3 * statistics.quantiles(times, n=4)[0],
                         "p75": 1e3 * statistics.quantiles(times, n=4)[2],
                         "sent": [r["counted"] for r in res], "gathered": [r["gathered"] for r in res],
                         "states": [r["states"] for r in res], "losses": res[0]["losses"],
                         "rss": [x["peak"] for x in rss], "rise": [x["peak"] - x["before"] for x in rss]})
            print(f"{schedule} {pol}: {rows[-1]['ms']:.0f} ms", flush=True)
    print(f"\nGPT {CFG.n_layers} layers, d_model {CFG.d_model}, vocab {CFG.vocab_size}, seq {CFG.seq_len} "
          f"({n / 1e6:.1f} M parameters), data 2 x pipe 2, ZeRO-3, fp32 AdamW, global batch {BATCH}, m = {M}; "
          f"median of {args.steps} alternating steps (p25-p75). Per rank (pipe rank 0 / 1 of data rank 0).\n")
    print("| schedule | pipe_gather | step ms | sent per step MiB | gathered at most MiB (= planned) | "
          "model states MiB | RSS after warm-up -> peak while stepping MiB | same losses as the other policy |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        other = rows[i ^ 1]
        same = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], other["losses"]))
        pick = (0, 2)     # data rank 0 at pipe rank 0 and 1
        print(f"| {r['schedule']} | {r['policy']} | {r['ms']:.0f} ({r['p25']:.0f}-{r['p75']:.0f}) | "
              + " / ".join(f"{r['sent'][k] / MiB:.1f}" for k in pick) + " | "
              + " / ".join(f"{r['gathered'][k] / MiB:.1f}" for k in pick) + " | "
              + " / ".join(f"{r['states'][k] / MiB:.1f}" for k in pick) + " | "
              + " / ".join(f"{(r['rss'][k] - r['rise'][k]) / MiB:.0f} -> {r['rss'][k] / MiB:.0f}" for k in pick)
              + f" | {same:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
