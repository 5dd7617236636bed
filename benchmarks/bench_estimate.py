"""How close ``python -m shardlib.explain``'s step-time estimate comes to measured step times (CPU meshes).

    PYTHONPATH=. python3 benchmarks/bench_estimate.py                 # 6 layouts, ~3 min
    PYTHONPATH=. python3 benchmarks/bench_estimate.py --steps 10 --json rows.json

For each layout the dry run (``frontend/dryrun.py``) prices a step from the mesh preset's figures (the CPU
meshes' ``device_tflops`` and ``links``, measured once on this machine: see ``meshes/dp2.yaml``), then the
same configuration trains in a process world and its median step time (after 2 warm-up steps; the
slowest rank's wall clock) is set beside the estimate's two bounds: no overlap of communication with
compute (the estimate) and full overlap. The ratio measured / estimate says how far to trust the
estimate on this machine; the estimate is not fitted to these runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from harness import write_rows   # benchmarks/ is on the path when run as a script

from shardlib.cli.compose import check_overrides
from shardlib.frontend.config.run_config import run_config
from shardlib.frontend.dryrun import dry_run

LAYOUTS = [("dp2", "dp"), ("dp4", "zero3"), ("dp2_tp2", "tp"), ("pp2_dp2", "pp_1f1b"), ("hsdp2x2", "hsdp"),
           ("2x2x2", "3d")]


def rank_times(run, steps: int) -> list[float]:
    from shardlib.algebra.mesh import Mesh
    from shardlib.frontend.run import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(run, Mesh(run.mesh.shape))
    out = []
    for i in range(steps + 2):
        if run.mesh.size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        trainer.engine.step(trainer.batch(i))
        out.append(time.perf_counter() - t0)
    return out[2:]


def measured_step(run, n: int, steps: int) -> float:
    """``run`` trained in a world of ``n`` processes: the median over ``steps`` steps (after 2 warm-up steps) of
    the slowest rank's step, seconds."""
    from shardlib.frontend.launch.launcher import launch

    per_rank = launch(rank_times, n, run, steps, threads=1)
    return statistics.median(max(x) for x in zip(*per_rank))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="shared overrides, e.g. model=small")
    args = ap.parse_args(argv)
    rows = []
    for mesh, parallel in LAYOUTS:
        run = run_config(check_overrides([f"mesh={mesh}", f"parallel={parallel}", *args.overrides]))
        est = dry_run(run).estimate
        measured = measured_step(run, run.mesh.size, args.steps)
        rows.append({"mesh": mesh, "parallel": parallel, "ranks": run.mesh.size, "measured_ms": 1e3 * measured,
                     "estimate_ms": 1e3 * est.total_s, "overlapped_ms": 1e3 * est.overlapped_s,
                     "compute_ms": 1e3 * est.compute_with_bubble_s, "comm_ms": 1e3 * sum(est.comm_s.values()),
                     "ratio": measured / est.total_s})
        print(f"{mesh} {parallel}: measured {1e3 * measured:.0f} ms, estimated {1e3 * est.total_s:.0f} ms", flush=True)
    print("\n| mesh | parallel | ranks | measured ms | estimate ms (no overlap) | full overlap ms | compute / comm ms "
          "| measured / estimate |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mesh']} | {r['parallel']} | {r['ranks']} | {r['measured_ms']:.0f} | {r['estimate_ms']:.0f} | "
              f"{r['overlapped_ms']:.0f} | {r['compute_ms']:.0f} / {r['comm_ms']:.0f} | **{r['ratio']:.2f}** |")
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
