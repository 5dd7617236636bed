"""``python -m shardlib.explain [overrides] [--plan | --full]``: plan a configuration at any scale, no process.

    python -m shardlib.explain model=70b mesh=h100_1024 parallel=3d train.batch=1024
    python -m shardlib.explain model=1t mesh=h100_16384 parallel=3d train.batch=2048 parallel.microbatches=16
    python -m shardlib.explain mesh=2x2x2 --plan          # also print plan.explain()
    python -m shardlib.explain model=175b mesh=h100_64 parallel=3d mesh.axes={data:1,pipe:8,tensor:8} --json

Composes ``conf/`` like the main job, plans on an ``AbstractMesh`` (``frontend/dryrun.py``) and prints
memory per rank against the device's, bytes per step per axis, the pipeline bubble and an estimated
step time from the mesh preset's figures. A bad configuration exits 2 with one message per key.
"""

from __future__ import annotations

import argparse
import sys

from ..frontend.config.run_config import ConfigError, run_config
from .compose import check_overrides


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardlib.explain", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", action="store_true", help="print plan.explain() too")
    ap.add_argument("--full", action="store_true", help="print plan.explain(full=True) too")
    ap.add_argument("--json", action="store_true", help="print one JSON object (on one line) instead of the report")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch._dynamo  # noqa: F401  meta tensors' Python decompositions import it once per process (~1 s):
    #                       import it here, with torch, so "planned in" times the planning
    from ..errors import ShardingError
    from ..frontend.dryrun import dry_run, report
    try:
        run = run_config(check_overrides(args.overrides))
        d = dry_run(run)
    except ConfigError as e:
        print("explain: " + str(e), file=sys.stderr)
        return 2
    except ShardingError as e:
        from ..frontend.config.checking import collapse
        print("explain: plan: " + "\n  - ".join([""] + collapse(e.problems)).lstrip("\n  - ")
              if len(e.problems) == 1 else "explain: plan:\n  - " + "\n  - ".join(collapse(e.problems)),
              file=sys.stderr)
        return 2
    if args.json:
        import json
        print(json.dumps(as_json(d)))
        return 0
    if args.plan or args.full:
        print(d.plan.explain(full=args.full) + "\n")
    print(report(d))
    return 0


def as_json(d) -> dict:
    """The dry run as data: the worst rank's memory (by state, and the model states per memory kind),
    whether it fits, bytes per axis per step, the bubble, the step's bounds and tokens per second."""
    plan, e = d.plan, d.estimate
    mem = {k: int(v) for k, v in d.memory.items()}
    mem["by_kind"] = {k: int(plan.memory_per_rank(d.worst_rank, kind=k)["total"]) for k in ("device", "host", "disk")}
    pp = plan.pipeline
    from ..planner.simulate import bubble_formula
    bubble = bubble_formula(pp.schedule, pp.size, pp.microbatches, pp.virtual) if pp is not None else 0.0
    return {"memory_per_rank": mem, "worst_rank": d.worst_rank, "fits": d.fits,
            "bytes_per_axis": {k: int(v) for k, v in d.bytes_per_axis.items()}, "bubble": bubble,
            "step_ms": None if e is None else {"no_overlap": 1e3 * e.total_s, "full_overlap": 1e3 * e.overlapped_s,
                                               "predicted": 1e3 * e.step_s, "overlap": e.overlap},
            "tokens_per_s": None if e is None else e.tokens_per_s, "recompute": plan.recompute,
            "notes": list(d.notes)}
