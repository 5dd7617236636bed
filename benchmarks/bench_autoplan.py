"""Does the auto-planner rank plans as the machine does? Predicted against measured, on this machine.

    python benchmarks/bench_autoplan.py                        # the tiny GPT, 4 and 8 processes, 12 plans each
    python benchmarks/bench_autoplan.py --model small --plans 12 --steps 6 --json rows.json

For each device count the search (``shardlib/planner/autoplan.py``, the mesh preset's figures: ``dp4`` for
4 processes, ``2x2x2`` for 8 — their axes ignored) prices every plan that fits; ``--plans`` of them are
taken evenly spread over the predicted order (the first is autoplan's own choice), each planned exactly
(``frontend/dryrun.py``: its predicted step is the plan's own estimate), then trained in a fresh process
world through the overrides autoplan prints (``frontend/run.Trainer``): the median step after 2 warm-up
steps, the slowest rank's wall clock. Reported: each plan's predicted and measured step, the Spearman
rank correlation of the two orders (goal >= 0.8), and how far autoplan's first choice is from the
measured best (goal: within 10%).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench_estimate import measured_step   # (benchmarks/: the same timing as the estimate's benchmark)
from harness import write_rows
from shardlib.cli.autoplan import block_probe, exact, model_shape
from shardlib.cli.compose import check_overrides
from shardlib.frontend.config.run_config import run_config
from shardlib.planner import autoplan as ap

MESH = {4: "dp4", 8: "2x2x2"}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):                       # ties share their mean rank
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def candidates(model: str, devices: int, batch: int, plans: int) -> list[tuple[ap.Candidate, list[str], float]]:
    """``plans`` plans spread over the predicted order, each with its overrides and exact predicted step."""
    mesh = MESH[devices]
    cfg = check_overrides([f"model={model}", f"mesh={mesh}", "parallel=zero3", f"train.batch={batch}"])
    cfg["mesh"]["axes"] = {"data": 1}
    cfg["mesh"]["links"] = {"default": cfg["mesh"]["links"]["default"]}
    run = run_config(cfg)
    costs = ap.Costs(model_shape(run.model.gpt(), run.seq), ap.Machine.of_mesh(run.mesh, devices), batch=batch,
                     precision="fp32", block_fn=block_probe(run.model.gpt(), run.seq, "fp32"))
    ranked, _ = ap.search(costs, devices, keep=100000)
    # one plan per mesh shape and policy mix: drop candidates whose prediction equals a kept one's
    seen, distinct = set(), []
    for got in ranked:
        key = round(got.step_s, 9)
        if key not in seen:
            seen.add(key)
            distinct.append(got)
    picks = [distinct[round(i * (len(distinct) - 1) / (plans - 1))] for i in range(plans)] if len(distinct) > plans \
        else distinct
    out = []
    for got in picks:
        ov = ap.overrides(got.cand, model=model, mesh=mesh, batch=batch, precision="fp32")
        try:
            priced = exact(got, run_config(check_overrides(ov)))
        except Exception as e:          # noqa: BLE001 — a plan the planner refuses is reported and skipped
            print(f"  skipped {ov}: {e}", file=sys.stderr)
            continue
        out.append((got.cand, ov, priced.step_s))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--plans", type=int, default=12)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--devices", type=int, nargs="*", default=[4, 8])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    for n in args.devices:
        for cand, ov, predicted in candidates(args.model, n, args.batch, args.plans):
            measured = measured_step(run_config(check_overrides(ov)), n, args.steps)
            rows.append({"devices": n, "mesh": cand.axes, "plan": ap.describe(cand), "overrides": ov,
                         "predicted_ms": 1e3 * predicted, "measured_ms": 1e3 * measured})
            print(f"{n} ranks {cand.axes} {ap.describe(cand)}: predicted {1e3 * predicted:.0f} ms, measured "
                  f"{1e3 * measured:.0f} ms", file=sys.stderr, flush=True)
    for n in args.devices:
        mine = [r for r in rows if r["devices"] == n]
        if not mine:
            continue
        rho = spearman([r["predicted_ms"] for r in mine], [r["measured_ms"] for r in mine])
        best = min(r["measured_ms"] for r in mine)
        first = mine[0]["measured_ms"]
        print(f"\n{n} processes (mesh={MESH[n]}'s figures), model={args.model}, batch {args.batch}: Spearman "
              f"{rho:.2f} over {len(mine)} plans; autoplan's choice measured {first:.0f} ms, the best {best:.0f} ms "
              f"({first / best - 1:+.0%})\n")
        print("| # | mesh | ZeRO | SP | schedule | m | recompute | offload | predicted ms | measured ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(mine, 1):
            q = r["plan"]
            print(f"| {i} | {r['mesh']} | {q['zero']} | {q['sequence_parallel']} | {q['schedule'] or '-'}"
                  f"{' v=2' if q['virtual_stages'] > 1 else ''} | {q['microbatches']} | {q['recompute']} | "
                  f"{'host' if q['offload'] else '-'} | {r['predicted_ms']:.0f} | {r['measured_ms']:.0f} |")
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
