"""What the side-by-side benchmarks share: the single-process reference, a world that reports its
failure instead of hiding it, the alternating timed loop, the common options and the JSON rows.

Imported by ``bench_tensor_parallel.py``, ``bench_pipeline.py`` and ``bench_3d.py`` (``benchmarks/`` is on
the path when they run as scripts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import shardlib as sl
from shardlib.models import GPT, token_batch


def reference_losses(cfg, batch: int, count: int, make_optimizer: Callable) -> list[float]:
    """One process, the plain GPT (seed 0), the whole global batch of ``batch`` sequences, the same
    optimizer and batches (``token_batch(cfg, batch, step)``): the losses every side must match."""
    torch.set_num_threads(1)
    model = GPT(cfg, seed=0)
    opt = make_optimizer(model.parameters())
    out = []
    for s in range(count):
        loss = model(*token_batch(cfg, batch, s))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


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
