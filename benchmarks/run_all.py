"""Every form's side-by-side comparison against its torch-native baseline, in one command.

    PYTHONPATH=. python3 benchmarks/run_all.py --out results            # ~11 min on the 2-core reference machine
    PYTHONPATH=. python3 benchmarks/run_all.py --quick --out /tmp/r      # fewer steps and configs (~8 min)

Runs, one after the other (each in its own process worlds, both sides of a pair in the same world and
stepped alternately — see each script's docstring):

* ``bench_data_parallel.py``  DP vs DDP, ZeRO-2 vs FSDP2 (no reshard), ZeRO-3 vs FSDP2, HSDP vs FSDP2 HSDP
* ``bench_tensor_parallel.py`` TP (± SP) vs ``parallelize_module``, data x tensor ZeRO-3 vs FSDP2 + TP
* ``bench_pipeline.py``       GPipe / 1F1B / interleaved / ZB-H1 vs ``torch.distributed.pipelining``
* ``bench_3d.py``             data x pipe x tensor vs FSDP2 + TP + pipelining (torchtitan's composition)
* ``bench_hf.py``             a transformers Llama, pipe 2 and 2x2x2, vs hand-written stages + FSDP2 + TP +
                              pipelining (its step part; torch's ``pipeline()`` cannot run the model)
* ``bench_moe.py``            a transformers Mixtral and Qwen3-MoE on expert 2 and 4 vs a hand-written
                              ``all_to_all_single`` dispatch + DDP (torchtitan's way), and vs FSDP2 with every
                              expert on every rank
* ``bench_context.py``        a transformers Llama with each sequence over context 2 and 4 (all-gather, ring,
                              Ulysses) vs one rank's plain PyTorch step on the whole sequence (torch's own
                              ``context_parallel`` does not run on this CPU build: said in its output); and the
                              longest sequence a rank trains within a fixed memory, at context 1, 2 and 4

and writes ``<out>/summary.md`` (one table: form, baseline, ranks, median step ms of each side, ratio,
max relative loss difference of each side against one process) and ``<out>/summary.json``, plus each
script's own rows (``<out>/<script>.json``) and full output (``<out>/<script>.txt``). The top-level
README's performance section sums that table up; ``benchmarks/README.md`` keeps each run of it whole.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SCRIPTS = {
    "bench_data_parallel": {"full": [], "quick": ["--nprocs", "2", "4", "--steps", "8"]},
    "bench_tensor_parallel": {"full": [], "quick": ["--configs", "TP2", "2D", "--steps", "8"]},
    "bench_pipeline": {"full": ["--no-rss", "--steps", "20"], "quick": ["--configs", "1f1b-p2", "interleaved-p2",
                                                                       "1f1b-p4", "--steps", "8", "--no-rss"]},
    "bench_3d": {"full": [], "quick": ["--steps", "8"]},
    "bench_hf": {"full": ["--parts", "steps", "--no-rss", "--steps", "10"],
                 "quick": ["--parts", "steps", "--no-rss", "--steps", "5", "--warmup", "2"]},
    "bench_moe": {"full": [], "quick": ["--configs", "mixtral-e2", "qwen3_moe-e4", "--steps", "6"]},
    "bench_context": {"full": [], "quick": ["--max-seq", "8192", "--steps", "4"]},
}


def _rows(script: str, data) -> list[dict]:
    """The summary rows of one script's JSON: form, baseline, ranks, ms each side, ratio, Δloss each side."""
    out = []
    if script == "bench_data_parallel":
        for r in data:
            out.append({"form": r["form"], "baseline": r["torch"], "ranks": r["N"], "shardlib_ms": r["sl_ms"],
                        "torch_ms": r["torch_ms"], "ratio": r["ratio"], "dloss": r["dloss"], "dloss_kind": "abs vs torch"})
    elif script == "bench_tensor_parallel":
        for r in data:
            if "ratio" not in r:
                continue
            out.append({"form": f"{r['config']} ZeRO-{r['zero']}" if r["zero"] else r["config"],
                        "baseline": r["torch_name"], "ranks": r["mesh"]["data"] * r["mesh"]["tensor"],
                        "shardlib_ms": r["shardlib"]["ms"], "torch_ms": r["torch"]["ms"], "ratio": r["ratio"],
                        "dloss": max(r["shardlib"]["dloss"], r["torch"]["dloss"]), "dloss_kind": "rel vs 1 process"})
    elif script == "bench_pipeline":
        for r in data:
            res = r.get("results", {})
            if "ratio" not in r:
                continue
            out.append({"form": f"pipe {r['schedule']} (p={r['p']}, m={r['m']})", "baseline": r["torch_class"],
                        "ranks": r["p"], "shardlib_ms": res["shardlib"]["ms"], "torch_ms": res["torch"]["ms"],
                        "ratio": r["ratio"], "dloss": max(res["shardlib"]["dloss"], res["torch"]["dloss"]),
                        "dloss_kind": "rel vs 1 process"})
    elif script in ("bench_3d", "bench_hf"):
        for r in (data[0].get("steps", []) if script == "bench_hf" else data):
            if r.get("ratio") is None:
                continue
            out.append({"form": r.get("form", r.get("config", "3D")), "baseline": r.get("baseline", r.get("torch", "")),
                        "ranks": r.get("ranks", 8), "shardlib_ms": r["shardlib_ms"], "torch_ms": r["torch_ms"],
                        "ratio": r["ratio"], "dloss": r.get("dloss"), "dloss_kind": "rel vs 1 process"})
    elif script == "bench_moe":
        for r in data:
            res = r.get("results", {})
            for other, name in (("a2a", "all_to_all_single dispatch + DDP"), ("fsdp2", "FSDP2, experts replicated")):
                if f"ratio_{other}" not in r:
                    continue
                out.append({"form": f"{r['config']} (expert {r['experts']})", "baseline": name, "ranks": r["experts"],
                            "shardlib_ms": res["shardlib"]["ms"], "torch_ms": res[other]["ms"],
                            "ratio": r[f"ratio_{other}"], "dloss": max(res["shardlib"]["dloss"], res[other]["dloss"]),
                            "dloss_kind": "rel vs 1 process"})
    elif script == "bench_context":
        for r in data.get("timed", []):
            if "ratio" not in r:
                continue
            out.append({"form": f"context {r['context']} {r['method']} ({r['seq']} tokens)",
                        "baseline": "plain PyTorch, one rank, the whole sequence", "ranks": r["context"],
                        "shardlib_ms": r["shardlib"]["ms"], "torch_ms": r["torch"]["ms"], "ratio": r["ratio"],
                        "dloss": max(r["shardlib"]["dloss"], r["torch"]["dloss"]), "dloss_kind": "rel vs 1 process"})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| form | torch baseline | ranks | shardlib ms | torch ms | ratio | max Δloss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = "–" if r["dloss"] is None else f"{r['dloss']:.1e} ({r['dloss_kind']})"
        lines.append(f"| {r['form']} | {r['baseline']} | {r['ranks']} | {r['shardlib_ms']:.0f} | {r['torch_ms']:.0f} "
                     f"| **{r['ratio']:.2f}** | {d} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results", help="folder for summary.md/json and each script's output")
    ap.add_argument("--readme", default=None, help="also write the summary into this Markdown file, between its "
                    f"'{BEGIN}' and '{END}' lines (benchmarks/README.md's latest run)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and configs")
    ap.add_argument("--only", nargs="*", choices=list(SCRIPTS), default=list(SCRIPTS))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    rows, failed, started = [], [], time.time()
    for script in args.only:
        if not (HERE / f"{script}.py").exists():
            failed.append(f"{script}: missing")
            continue
        extra = SCRIPTS[script]["quick" if args.quick else "full"]
        js = out / f"{script}.json"
        t0 = time.time()
        print(f"{script} {' '.join(extra)} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, str(HERE / f"{script}.py"), *extra, "--json", str(js)], env=env,
                              capture_output=True, text=True, cwd=HERE.parent)
        (out / f"{script}.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        print(f"{script}: exit {proc.returncode} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        if proc.returncode != 0 or not js.exists():
            failed.append(f"{script}: exit {proc.returncode} (see {out / (script + '.txt')})")
            continue
        rows += _rows(script, json.loads(js.read_text()))
    load = os.getloadavg()
    head = (f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
            f"1 thread per rank; `PYTHONPATH=. python3 benchmarks/run_all.py{' --quick' if args.quick else ''}` in "
            f"{(time.time() - started) / 60:.0f} min, load average at the end {load[0]:.1f}. Ratio = shardlib / torch "
            "median step time (below 1: shardlib faster).")
    md = head + "\n\n" + table(rows) + ("\n\nFailed: " + "; ".join(failed) if failed else "") + "\n"
    (out / "summary.md").write_text(md)
    if args.readme:
        write_summary(Path(args.readme), md)
    (out / "summary.json").write_text(json.dumps({"header": head, "rows": rows, "failed": failed}, indent=1) + "\n")
    print(md)
    return 1 if failed else 0


BEGIN, END = "<!-- run_all.py summary: begin -->", "<!-- run_all.py summary: end -->"


def write_summary(readme: Path, md: str) -> None:
    """``md`` between ``readme``'s BEGIN and END lines (the previous summary replaced); refused when the file
    does not hold them once each, in that order."""
    text = readme.read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i or text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"run_all: {readme} holds no single '{BEGIN}' ... '{END}' pair — expected one, where the "
                         "summary goes.")
    readme.write_text(text[:i + len(BEGIN)] + "\n" + md.rstrip("\n") + "\n" + text[j:])


if __name__ == "__main__":
    sys.exit(main())
