"""What the benchmarks share: the single-process reference, a world that reports its failure instead
of hiding it, the alternating timed loop, the step time over the ranks, the loss gap, the common
options, the loop over configs, the printed tables and the JSON rows.

Imported by the side-by-side benchmarks (``bench_tensor_parallel.py``, ``bench_pipeline.py``,
``bench_3d.py``, ``bench_hf.py``, ``bench_peft.py``) and for its smaller pieces by others
(``benchmarks/`` is on the path when they run as scripts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

import shardlib as sl
from shardlib.models import GPT, token_batch


def gpt_loss(model, batch) -> torch.Tensor:
    """The reference GPT's loss of ``batch = (idx, targets)``: ``model(*batch)``."""
    return model(*batch)


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                   loss_of: Callable[[Any, Any], torch.Tensor] = gpt_loss) -> Callable[[Any], torch.Tensor]:
    """Plain PyTorch's training step of ``model``: ``loss_of(model, batch)``, backward, ``opt``'s step, the
    gradients dropped; it returns the loss, detached."""
    def step(batch) -> torch.Tensor:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def train_losses(model: torch.nn.Module, make_optimizer: Callable, batches: Iterable,
                 loss_of: Callable[[Any, Any], torch.Tensor] = gpt_loss) -> list[float]:
    """``model`` trained in this process on ``batches`` (``optimizer_step`` with
    ``make_optimizer(model.parameters())``): the loss of every step."""
    step = optimizer_step(model, make_optimizer(model.parameters()), loss_of)
    return [step(batch).item() for batch in batches]


def reference_losses(cfg, batch: int, count: int, make_optimizer: Callable) -> list[float]:
    """One process, the plain GPT (seed 0), the whole global batch of ``batch`` sequences, the same
    optimizer and batches (``token_batch(cfg, batch, step)``): the losses every side must match."""
    torch.set_num_threads(1)
    return train_losses(GPT(cfg, seed=0), make_optimizer, (token_batch(cfg, batch, s) for s in range(count)))


def max_rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference of ``a`` from ``b``, element by element."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def n_params(cfg) -> int:
    """The parameter count of ``GPT(cfg, seed=0)``."""
    return sum(q.numel() for q in GPT(cfg, seed=0).parameters())


def gpt_line(cfg) -> str:
    """``GPT <layers> layers, d_model <d>, <heads> heads, vocab <v>, seq <s>``: the model of a table's caption."""
    return (f"GPT {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, vocab {cfg.vocab_size}, "
            f"seq {cfg.seq_len}")


def launch(fn, n: int, *args, timeout: tuple[float, float]) -> tuple[list | None, str | None]:
    """``sl.launch`` of ``n`` ranks under ``timeout = (collective, whole world)`` seconds: ``(results,
    None)``, or ``(None, first line of the error)`` with the whole error on stderr."""
    try:
        return sl.launch(fn, n, *args, threads=1, timeout=timeout[0], run_timeout=timeout[1]), None
    except sl.WorkerError as e:   # a rank raised, died or hung: reported, not hidden
        tb = getattr(e, "remote_traceback", "")
        print(f"{fn.__name__}{args}: FAILED: {e}\n{tb}", file=sys.stderr, flush=True)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]


def alternate(built: dict[str, Any], batches: list, warmup: int, *,
              count: Callable[[str, Any, Any], tuple[float | None, Any]] | None = None,
              record: Callable[[Any], Any] | None = None) -> dict[str, dict]:
    """Every side in ``built`` (``.step(batch) -> loss``) runs ``warmup`` steps, then the rest of
    ``batches`` stepped alternately (A B, B A, ...) after a barrier, so a change in machine load hits
    both alike. Per side: ``losses``, ``spans`` (``perf_counter`` start and end of each timed step),
    ``bytes`` (``count(side, built, batch) -> (loss, bytes)`` runs the last warm-up step, never a
    timed one) and ``records`` (``record(built)`` after each timed step)."""
    mine = {s: {"losses": [], "spans": [], "bytes": None, "records": []} for s in built}
    for i, batch in enumerate(batches[:warmup]):
        for side, b in built.items():
            if count is not None and i == warmup - 1:
                loss, mine[side]["bytes"] = count(side, b, batch)
            else:
                loss = b.step(batch)
            mine[side]["losses"].append(loss)
    order = list(built)
    for i, batch in enumerate(batches[warmup:]):
        for side in (order if i % 2 == 0 else order[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            loss = built[side].step(batch)
            mine[side]["spans"].append((t0, time.perf_counter()))
            mine[side]["losses"].append(loss)
            if record is not None:
                mine[side]["records"].append(record(built[side]))
    return mine


def step_times(recs: list[dict], steps: int) -> list[float]:
    """Each timed step's time over the ranks: the latest end minus the earliest start of its ``spans``
    (``recs``: one side's ``alternate`` record of every rank)."""
    return [max(r["spans"][k][1] for r in recs) - min(r["spans"][k][0] for r in recs) for k in range(steps)]


def gathered_alternate(built: dict[str, Any], batches: list, warmup: int, **kw) -> list[dict]:
    """``alternate`` on this rank; every rank's record, on every rank."""
    mine = alternate(built, batches, warmup, **kw)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def rss_of(build: Callable[[], Any], batch_of: Callable[[int], Any], steps: int) -> dict:
    """In a fresh world, one side alone: RSS before ``build()`` and its peak (VmHWM) after ``steps``."""
    from bench_memory import proc_status

    torch.set_num_threads(1)
    before = proc_status("VmRSS")
    b = build()
    for s in range(steps):
        b.step(batch_of(s))
    return {"before": before, "peak": proc_status("VmHWM")}


def common_options(ap: argparse.ArgumentParser, *, steps: int, rss: bool = True) -> None:
    """``--steps --warmup --timeout --world-timeout [--no-rss] --json``."""
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0, help="collective (and p2p) timeout, seconds")
    ap.add_argument("--world-timeout", type=float, default=900.0, help="one world's whole run, seconds")
    if rss:
        ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS worlds")
    ap.add_argument("--json", default=None, help="also write the rows to this file")


def missing_cells(row: dict, side: str, n: int, absent: str = "–") -> list[str] | None:
    """A side's ``n`` table cells where it has no result: ``FAILED (first error line)`` where it failed,
    ``absent`` where it did not run, "–" after; None where it has a result."""
    if side in row["failed"]:
        return [f"FAILED ({row['failed'][side]})"] + ["–"] * (n - 1)
    if side not in row["results"]:
        return [absent] + ["–"] * (n - 1)
    return None


def ms_cell(r: dict) -> str:
    """A side's median step ms with its 25th-75th percentiles: ``ms (p25-p75)``."""
    return f"{r['ms']:.0f} ({r['p25']:.0f}-{r['p75']:.0f})"


def pair_cells(row: dict) -> list[str]:
    """A side-by-side row's own cells: the ratio shardlib / torch (bold), the loss gap between the sides, the
    load at the config's start-end ("–" where a side is missing)."""
    return [f"**{row['ratio']:.2f}**" if "ratio" in row else "–",
            f"{row['dloss_sl_torch']:.1e}" if "dloss_sl_torch" in row else "–",
            "–".join(f"{x:.1f}" for x in row["load"])]


def side_by_side_parser(doc: str, configs, steps: int) -> argparse.ArgumentParser:
    """The options of a side-by-side benchmark: ``--configs --sides`` and ``common_options``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=list(configs), choices=list(configs))
    ap.add_argument("--sides", nargs="*", default=["shardlib", "torch"], choices=["shardlib", "torch"])
    common_options(ap, steps=steps)
    return ap


def run_configs(args, run_config: Callable, summarize: Callable[[dict], dict], side_line: Callable[[dict], str],
                each_side: Callable[[str, dict, str], None] | None = None) -> list[dict]:
    """``summarize(run_config(label, sides, warmup, steps, timeout, rss))`` for each of ``args.configs``
    (``side_by_side_parser``'s options), reporting on stderr each failed side, ``side_line(result)`` of
    each side that ran (then ``each_side(label, row, side)``), and the config's time and load."""
    rows = []
    for label in args.configs:
        t0 = time.time()
        row = summarize(run_config(label, args.sides, args.warmup, args.steps, (args.timeout, args.world_timeout),
                                   not args.no_rss))
        rows.append(row)
        for side, err in row["failed"].items():
            print(f"{label}: {side}: {err}", file=sys.stderr, flush=True)
        for side, r in row["results"].items():
            print(f"{label} {side}: {side_line(r)}", file=sys.stderr, flush=True)
            if each_side is not None:
                each_side(label, row, side)
        print(f"{label}: done in {time.time() - t0:.0f} s, load {row['load']}", file=sys.stderr, flush=True)
    return rows


def print_tables(rows: list, table: Callable[[list], str], *more: tuple[str, Callable[[list], str]]) -> None:
    """``table(rows)``, then each ``(title, table)`` of ``more`` under its title."""
    print(table(rows))
    for title, other in more:
        print(f"\n{title}:\n")
        print(other(rows))


def write_rows(rows: list, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1, default=str)


def run_sides(row: dict, n: int, rank_main, rss_main, label: str, sides: list[str], warmup: int, steps: int,
              timeout: tuple[float, float], rss: bool, results: Callable[[list, str], dict]) -> dict:
    """Fill ``row`` (``results``, ``failed``, ``rss``, ``load``): ``rank_main(label, sides, warmup, steps)``
    in one world of ``n`` ranks, ``results(per_rank, side)`` taking each side's entry; if that world
    fails, each side alone in its own (one side's failure must not hide the other's numbers); then,
    with ``rss``, each side alone again for its peak RSS (``rss_main(label, side, warmup + 2)``)."""
    per, err = launch(rank_main, n, label, sides, warmup, steps, timeout=timeout)
    if per is not None:
        for side in sides:
            row["results"][side] = results(per, side)
    elif len(sides) > 1:
        for side in sides:
            alone, e = launch(rank_main, n, label, [side], warmup, steps, timeout=timeout)
            if alone is None:
                row["failed"][side] = e
            else:
                row["results"][side] = results(alone, side)
    else:
        row["failed"][sides[0]] = err
    if rss:
        for side in row["results"]:
            out, _ = launch(rss_main, n, label, side, warmup + 2, timeout=timeout)
            if out is not None:
                row["rss"][side] = out
    row["load"].append(os.getloadavg()[0])
    return row
