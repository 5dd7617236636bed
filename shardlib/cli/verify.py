"""The parity matrix users can run: the same training under many layouts against one process.

    python -m shardlib.verify                                   # the default matrix (7 layouts), train=quick
    python -m shardlib.verify --cases dp4 3d_zero3 train.steps=10 model.n_layers=2
    python -m shardlib.verify --case mine:mesh=pp4,parallel=pp_zb     # add your own (name:overrides)

Every case composes ``conf/`` with the shared overrides plus its own ``mesh=`` / ``parallel=`` (a
layout: nothing that changes what is computed), trains ``train.steps`` steps of the reference GPT on
the same text in its own process world, and is compared with plain PyTorch in this process (the same
model, AdamW, learning-rate schedule, clipping and batches, no shardlib): the largest relative loss
difference over the steps, and whether every rank returned the same losses. A Markdown table is
printed; any case beyond ``--rtol`` (default 1e-5, fp32 round-off), or whose ranks disagree, or that
fails to run, makes the command exit 1 and says which.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch

from ..frontend.config.run_config import ConfigError, RunConfig, run_config
from .compose import check_overrides

# name: (mesh, parallel, extra overrides)
CASES = {
    "single": ("single", "dp", ()),
    "dp4": ("dp4", "dp", ()),
    "zero3": ("dp4", "zero3", ()),
    "hsdp": ("hsdp2x2", "hsdp", ()),
    "tp2_dp2": ("dp2_tp2", "tp", ()),
    "pp2_dp2": ("pp2_dp2", "pp_1f1b", ("parallel.microbatches=4",)),
    "3d_zero3": ("2x2x2", "3d", ("parallel.zero=3",)),
}
LAYOUT_KEYS = ("mesh", "parallel")


def reference_losses(run: RunConfig, steps: int) -> list[float]:
    """Plain PyTorch in this process: the whole model on the whole batch, no shardlib engine."""
    from ..frontend.data.text import batch_at, load_text
    from ..frontend.run import lr_factor
    from ..models.gpt import GPT

    t = run.train
    torch.manual_seed(t.seed)
    model = GPT(run.model.gpt(), seed=t.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(t, i))
    text = load_text(run.data, run.seq)
    out = []
    for i in range(steps):
        idx, tgt = batch_at(text, i, t.batch, run.seq, t.seed)
        loss = model(idx, tgt)
        loss.backward()
        if t.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def rank_losses(run: RunConfig, steps: int, mesh=None) -> list[float]:
    """One case on this rank (on ``mesh``, default a new ``Mesh`` of the case's shape over the world):
    the engine's losses, step by step."""
    from ..algebra.mesh import Mesh
    from ..frontend.run import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(run, mesh if mesh is not None else Mesh(run.mesh.shape, **run.mesh.process_kwargs()))
    return [trainer.step(i, record=False)["loss"] for i in range(steps)]


def _case_overrides(spec: str) -> tuple[str, list[str]]:
    name, _, rest = spec.partition(":")
    if not name or not rest:
        raise ConfigError(f"--case {spec!r}: expected name:key=value,key=value (e.g. mine:mesh=pp4,parallel=pp_zb).")
    return name, [o for o in rest.split(",") if o]


def main(argv: list[str] | None = None, *, run_case: Callable[[RunConfig, int], list] | None = None) -> int:
    """The command. ``run_case(run, steps)`` returns every rank's losses for one case; by default
    each case is a fresh process world (``sl.launch``) — a test passes its warm worker pools."""
    from ..frontend.launch.launcher import launch
    from ..frontend.launch.outcomes import WorkerError

    if run_case is None:
        def run_case(run: RunConfig, steps: int) -> list:
            return launch(rank_losses, run.mesh.size, run, steps, threads=1)

    ap = argparse.ArgumentParser(prog="python -m shardlib.verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--case", action="append", default=[], metavar="NAME:OVERRIDES",
                    help="an extra case, e.g. mine:mesh=pp4,parallel=pp_zb")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("overrides", nargs="*", help="shared overrides (default train=quick)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    shared = ["train=quick", *args.overrides]
    try:
        if unknown:
            raise ConfigError(f"--cases: {', '.join(unknown)} — expected some of {', '.join(CASES)}, or --case "
                              "name:overrides for another layout.")
        bad = [o for o in shared if o.split("=", 1)[0].lstrip("+~").split(".")[0] in LAYOUT_KEYS]
        if bad:
            raise ConfigError(f"verify: {', '.join(bad)} — the layout (mesh=, parallel=) is each case's; expected shared "
                              "overrides of model, train and data only. Add a case: --case name:mesh=...,parallel=...")
        cases = {c: [f"mesh={CASES[c][0]}", f"parallel={CASES[c][1]}", *CASES[c][2]] for c in args.cases}
        for spec in args.case:
            name, ov = _case_overrides(spec)
            cases[name] = ov
        runs = {name: run_config(check_overrides(shared + ov)) for name, ov in cases.items()}
        base = run_config(check_overrides(shared + ["mesh=single", "parallel=dp"]))
    except ConfigError as e:
        print("verify: " + str(e), file=sys.stderr)
        return 2
    from ..frontend.run import check
    problems = [f"{name}: {p}" for name, run in runs.items() for p in check(run)]
    if problems:
        print("verify: " + "\n  - ".join(["problems before any process started:"] + problems), file=sys.stderr)
        return 2
    steps = base.train.steps
    ref = reference_losses(base, steps)
    print(f"reference: plain PyTorch, one process — model={base.model.name}, {steps} steps of {base.train.batch} x "
          f"{base.seq} tokens, loss {ref[0]:.4f} -> {ref[-1]:.4f}\n", flush=True)
    rows, failed = [], []
    for name, run in runs.items():
        t0 = time.perf_counter()
        try:
            per_rank = run_case(run, steps)
            err = None
        except WorkerError as e:
            per_rank, err = None, str(e).splitlines()[0]
        secs = time.perf_counter() - t0
        if per_rank is None:
            rows.append((name, run, None, None, f"FAILED: {err}", secs))
            failed.append(name)
            continue
        agree = all(r == per_rank[0] for r in per_rank)
        diff = max(abs(a - b) / abs(b) for a, b in zip(per_rank[0], ref))
        ok = agree and diff <= args.rtol and not math.isnan(diff)
        rows.append((name, run, diff, agree, "ok" if ok else "DRIFT" if agree else "RANKS DISAGREE", secs))
        if not ok:
            failed.append(name)
    print("| case | mesh | parallel | ZeRO | ranks | max rel Δloss vs one process | ranks agree | result | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, run, diff, agree, result, secs in rows:
        shape = " x ".join(f"{a} {s}" for a, s in run.mesh.axes if s > 1) or "1"
        print(f"| {name} | {run.mesh.name} ({shape}) | {run.parallel.name} | {run.parallel.zero} | {run.mesh.size} "
              f"| {'-' if diff is None else f'{diff:.1e}'} | {'-' if agree is None else agree} | {result} "
              f"| {secs:.0f} |")
    if failed:
        print(f"\nverify: {len(failed)} of {len(rows)} cases drifted or failed: {', '.join(failed)} "
              f"(tolerance {args.rtol:g} relative)", file=sys.stderr)
        return 1
    print(f"\nall {len(rows)} layouts train like one process (max rel Δloss <= {args.rtol:g}, every rank the same)")
    return 0
