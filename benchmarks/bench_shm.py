"""Collectives through shared memory (``shardlib/comm/shm.py``) vs gloo's, on one host.

    PYTHONPATH=. python3 benchmarks/bench_shm.py                          # both parts, Markdown tables
    PYTHONPATH=. python3 benchmarks/bench_shm.py --parts steps --steps 20 --ranks 2

``SHARDLIB_SHM`` is read at every call, so one process world runs the same thing both ways, alternated
(A B, B A, ...): a change in machine load hits both alike. With it off, a collective takes what it took
before the channel: gloo's, or for ZeRO's asynchronous reduce-scatters and all-gathers the pairwise
exchanges (``comm/pairwise.py``). gloo ranks of 1 thread each.

* **calls** (2 ranks): ``comm.all_reduce`` (in place, as the tensor axis's row layers and DP's buckets),
  ``comm.reduce_scatter`` (in place, as ZeRO-2's buckets) and ``comm.all_gather`` (into a buffer, as
  ZeRO-3's units), synchronous, after a barrier; median over ``--calls`` of the slower rank's time.
* **steps**: one engine per form (the GPT of ``bench_data_parallel.py`` / ``bench_tensor_parallel.py``,
  AdamW, global batch 8), its steps alternated between the channel on and off; median over
  ``--steps`` of the step time (slowest rank). ``A/A`` rows alternate the channel on with itself: the
  method's noise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import shardlib as sl
from shardlib.comm import core as comm
from shardlib.models import GPT, token_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data_parallel import CFG  # noqa: E402
from bench_gloo_pair import _alternate, messages, parser, run_parts  # noqa: E402

SIZES_MB = (0.0625, 0.5, 2.3, 13.75)
TP = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
FORMS = {"DP": ("data", {"zero": 0}), "ZeRO-2": ("data", {"zero": 2}), "ZeRO-3": ("data", {"zero": 3}),
         "TP": ("tensor", {"rules": TP}), "TP+SP": ("tensor", {"rules": TP, "sequence_parallel": True}),
         "ZeRO-3 (A/A)": ("data", {"zero": 3})}


def calls(reps: int) -> list[dict]:
    rows = []
    for mb, mesh, me, x, c, gathered in messages(SIZES_MB):
        ar = _alternate(lambda i: comm.all_reduce(x, mesh, "data", inplace=True), reps, "SHARDLIB_SHM")
        rs = _alternate(lambda i: comm.reduce_scatter(x, mesh, "data", out=x[me * c:(me + 1) * c]), reps,
                        "SHARDLIB_SHM")
        ag = _alternate(lambda i: comm.all_gather(x[:c], mesh, "data", out=gathered), reps, "SHARDLIB_SHM")
        rows.append({"MB": mb, **{f"{k}_{v}": t[v] for k, t in (("ar", ar), ("rs", rs), ("ag", ag)) for v in "01"}})
    return rows


def steps(reps: int, warmup: int) -> list[dict]:
    n, rows = dist.get_world_size(), []
    for form, (axis, kw) in FORMS.items():
        mesh = sl.Mesh({axis: n})
        model = GPT(CFG, seed=0)
        plan = sl.plan(model, mesh, batch=token_batch(CFG, 8, 0), **kw)
        engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        batches = [token_batch(CFG, 8, s) for s in range(4)]
        local = axis == "data"

        def step(i: int) -> None:
            b = batches[i % 4]
            if local:      # each data rank its slice of the global batch
                r, k = dist.get_rank(), 8 // n
                b = tuple(t[r * k:(r + 1) * k] for t in b)
            engine.step(b, local=local)

        for i in range(warmup):
            step(i)
        if "A/A" in form:
            os.environ["SHARDLIB_SHM"] = "1"
            t = _alternate(step, reps, "SHARDLIB_SHM_UNUSED")
        else:
            t = _alternate(step, reps, "SHARDLIB_SHM")
        rows.append({"form": form, "ranks": n, "off_ms": t["0"], "on_ms": t["1"], "ratio": t["1"] / t["0"]})
        os.environ.pop("SHARDLIB_SHM", None)
    return rows


def rank_main(parts: list[str], n_calls: int, n_steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    return run_parts(parts, n_calls, n_steps, warmup, calls, steps)


def main() -> None:
    args = parser(__doc__, steps=20).parse_args()
    load = os.getloadavg()[0]
    res: dict = {"steps": []}
    for n in args.ranks:
        got = sl.launch(rank_main, n, args.parts, args.calls, args.steps, args.warmup, threads=1)[0]
        res.setdefault("calls", got.get("calls"))
        res["steps"] += got.get("steps", [])
    print(f"torch {torch.__version__}, gloo, ranks of 1 thread on {len(os.sched_getaffinity(0))} cores; "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    if res.get("calls"):
        print("\n| message | all-reduce gloo ms | shm ms | reduce-scatter gloo ms | shm ms | all-gather gloo ms | shm ms |"
              "\n|---|---|---|---|---|---|---|")
        for r in res["calls"]:
            print(f"| {r['MB']} MB | {r['ar_0']:.2f} | {r['ar_1']:.2f} | {r['rs_0']:.2f} | {r['rs_1']:.2f} | "
                  f"{r['ag_0']:.2f} | {r['ag_1']:.2f} |")
    if res["steps"]:
        print("\n| form | ranks | step ms, off | step ms, shared memory | ratio |\n|---|---|---|---|---|")
        for r in res["steps"]:
            print(f"| {r['form']} | {r['ranks']} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | **{r['ratio']:.3f}** |")


if __name__ == "__main__":
    main()
