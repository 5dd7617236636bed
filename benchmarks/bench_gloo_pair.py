"""Groups on gloo: the direct pairwise exchanges (``shardlib/comm/pairwise.py``) vs gloo's collectives.

    PYTHONPATH=. python3 benchmarks/bench_gloo_pair.py                     # both parts, Markdown tables
    PYTHONPATH=. python3 benchmarks/bench_gloo_pair.py --parts steps --steps 40

``SHARDLIB_GLOO_PAIRWISE`` is read at every call, so one process can run the same thing both ways,
alternated (A B, B A, ...), and a change in machine load hits both alike. gloo ranks of 1 thread each.

* **calls**: ``comm.reduce_scatter`` (in place, as ZeRO-2's buckets call it) and ``comm.all_gather``
  (into a buffer, as ZeRO-3's units), ``async_op=True`` then ``wait()``, after a barrier; median over
  ``--calls`` of the slower rank's time, for each message size; two ranks.
* **steps**: one engine per form (the GPT of ``bench_data_parallel.py``, AdamW), its steps alternated
  between the exchanges on and off; median over ``--steps`` of the step time (slowest rank). The forms:
  ZeRO-2 and ZeRO-3 at data = each of ``--ranks`` (their buckets' and units' collectives are the
  asynchronous ones the exchanges take), and at 2 ranks tensor 2 with sequence parallel, whose
  all-gathers and reduce-scatters are synchronous and stay gloo's: an A/A check of the method's noise.

The shared-memory channel (``comm/shm.py``, ``bench_shm.py``), which takes these collectives first
where a group's ranks share a host, is off here (``SHARDLIB_SHM=0``): the exchanges are what groups
spanning hosts get. Reduce-scatters are exchanged only where the host's ranks fill its cores (``pairwise.cores_filled``, printed
per world); ``--force-rs`` exchanges them anyway, to measure the exchange on a host with cores to spare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardlib as sl
from shardlib.comm import core as comm
from shardlib.models import GPT, token_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data_parallel import CFG  # noqa: E402

SIZES_MB = (0.25, 1.0, 2.3, 13.75)
FORMS = {"ZeRO-2": {"zero": 2}, "ZeRO-3": {"zero": 3},
         "TP2+SP (A/A)": {"rules": {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
                          "sequence_parallel": True}}


def _slowest(t: float) -> float:
    v = torch.tensor([t])
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v.item()


def _alternate(fn, reps: int, var: str = "SHARDLIB_GLOO_PAIRWISE") -> dict[str, float]:
    """``fn(i)`` with ``var`` = "0" and "1" alternated (A B, B A, ...): median ms of the slowest rank, by value."""
    times: dict[str, list[float]] = {"0": [], "1": []}
    for i in range(reps):
        for mode in (("0", "1") if i % 2 == 0 else ("1", "0")):
            os.environ[var] = mode
            dist.barrier()
            start = time.perf_counter()
            fn(i)
            times[mode].append(_slowest(time.perf_counter() - start))
    os.environ.pop(var, None)
    return {m: statistics.median(v) * 1e3 for m, v in times.items()}


def messages(sizes_mb):
    """Per message size, on data = 2: (MB, mesh, this member's index, x, half x's length, a buffer of x's size)."""
    mesh = sl.Mesh({"data": 2})
    me = mesh.group_index(mesh.rank, ("data",))
    for mb in sizes_mb:
        n = int(mb * 1e6 / 4) // 2 * 2
        yield mb, mesh, me, torch.randn(n), n // 2, torch.empty(n)


def calls(reps: int) -> list[dict]:
    rows = []
    for mb, mesh, me, x, c, gathered in messages(SIZES_MB):
        rs = _alternate(lambda i: comm.reduce_scatter(x, mesh, "data", out=x[me * c:(me + 1) * c],
                                                      async_op=True).wait(), reps)
        ag = _alternate(lambda i: comm.all_gather(x[:c], mesh, "data", out=gathered, async_op=True).wait(), reps)
        rows.append({"MB": mb, "rs_gloo": rs["0"], "rs_pair": rs["1"], "ag_gloo": ag["0"], "ag_pair": ag["1"]})
    return rows


def steps(reps: int, warmup: int) -> list[dict]:
    n, rows = dist.get_world_size(), []
    for form, kw in FORMS.items():
        tensor = "rules" in kw
        if tensor and n != 2:
            continue
        mesh = sl.Mesh({"tensor": 2} if tensor else {"data": n})
        model = GPT(CFG, seed=0)
        plan = sl.plan(model, mesh, batch=token_batch(CFG, 8, 0), **kw)
        engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        batches = [token_batch(CFG, 8, s) for s in range(4)]
        for i in range(warmup):
            engine.step(batches[i % 4])
        t = _alternate(lambda i: engine.step(batches[i % 4]), reps)
        rows.append({"form": form, "ranks": n, "gloo_ms": t["0"], "pair_ms": t["1"], "ratio": t["1"] / t["0"]})
    return rows


def rank_main(parts: list[str], n_calls: int, n_steps: int, warmup: int, force_rs: bool) -> dict:
    from shardlib.comm import pairwise
    torch.set_num_threads(1)
    os.environ["SHARDLIB_SHM"] = "0"      # the exchanges are the path where the shared-memory channel is not
    out = {"filled": pairwise.cores_filled()}
    if force_rs:
        pairwise.cores_filled = lambda: True
    return out | run_parts(parts, n_calls, n_steps, warmup, calls, steps)


def run_parts(parts: list[str], n_calls: int, n_steps: int, warmup: int, calls, steps) -> dict:
    """In a rank: the per-call part (2-rank worlds only) and the per-step part, as asked."""
    out = {}
    if "calls" in parts and dist.get_world_size() == 2:
        out["calls"] = calls(n_calls)
    if "steps" in parts:
        out["steps"] = steps(n_steps, warmup)
    return out


def parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The arguments this benchmark and ``bench_shm.py`` share."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--parts", nargs="*", default=["calls", "steps"], choices=["calls", "steps"])
    ap.add_argument("--calls", type=int, default=41)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    return ap


def main() -> None:
    ap = parser(__doc__, steps=30)
    ap.add_argument("--force-rs", action="store_true", help="exchange reduce-scatters even where cores are to spare")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    res: dict = {}
    for n in args.ranks:
        got = sl.launch(rank_main, n, args.parts, args.calls, args.steps, args.warmup, args.force_rs, threads=1)[0]
        print(f"{n} ranks on {len(os.sched_getaffinity(0))} cores: ranks fill the cores: {got['filled']}"
              + (" (reduce-scatters exchanged anyway: --force-rs)" if args.force_rs else ""))
        if got.get("calls"):                 # measured in the 2-rank world only
            res["calls"] = got["calls"]
        res.setdefault("steps", []).extend(got.get("steps", []))
    print(f"torch {torch.__version__}, gloo, ranks of 1 thread; load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    if "calls" in res:
        print("\n| message | reduce-scatter gloo ms | exchange ms | all-gather gloo ms | exchange ms |\n|---|---|---|---|---|")
        for r in res["calls"]:
            print(f"| {r['MB']} MB | {r['rs_gloo']:.2f} | {r['rs_pair']:.2f} | {r['ag_gloo']:.2f} | {r['ag_pair']:.2f} |")
    if "steps" in res:
        print("\n| form | ranks | step ms, gloo | step ms, exchanges | ratio |\n|---|---|---|---|---|")
        for r in res["steps"]:
            print(f"| {r['form']} | {r['ranks']} | {r['gloo_ms']:.1f} | {r['pair_ms']:.1f} | **{r['ratio']:.3f}** |")


if __name__ == "__main__":
    main()
