"""How long planning a large model takes, with no processes (issue 7, item 6).

    python benchmarks/bench_planning_model.py                 # 1000-layer GPT, 12,005 tensors
    python benchmarks/bench_planning_model.py --layers 2000 --data 16384

The model is built on the meta device (no memory), so only the planner is timed: ``sl.plan``,
``Plan.explain()`` (short and ``full=True``) and each accounting query explain uses. Each is
run ``--repeat`` times; the best time is printed (seconds). A second, shallow model (the same
blocks, ``--layers // 10`` of them) shows how the times scale: linear planning takes about 10x
longer on the deep model, quadratic about 100x.

Also printed: the line count and longest line of ``explain()`` for a 1T-parameter, 128-block GPT
at N = 16,384 (the size of a plan that must still read in one screen).
"""

from __future__ import annotations

import argparse
import time

import torch

import shardlib as sl
from shardlib.models import GPT, GPTConfig


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def best_fresh(make, fn, repeat: int) -> float:
    """Best time of ``fn(x)`` over ``repeat`` fresh ``x = make()`` (made outside the timing)."""
    times = []
    for _ in range(repeat):
        x = make()
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return min(times)


def gpt(layers: int, d_model: int = 64, vocab: int = 128) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=vocab, seq_len=32, d_model=d_model, n_heads=4, n_layers=layers), seed=None)


def row(model: torch.nn.Module, mesh: sl.AbstractMesh, zero: int, repeat: int) -> dict[str, float]:
    plan = sl.plan(model, mesh, zero=zero)
    return {
        "plan": best(lambda: sl.plan(model, mesh, zero=zero), repeat),
        # each on a fresh plan (no warm caches); planning itself is the "plan" row
        "explain": best_fresh(lambda: sl.plan(model, mesh, zero=zero), lambda p: p.explain(), repeat),
        "explain(full)": best_fresh(lambda: sl.plan(model, mesh, zero=zero), lambda p: p.explain(full=True), repeat),
        "memory_per_rank": best(plan.memory_per_rank, repeat),
        "comm_per_step": best(plan.comm_per_step, repeat),
        "transient_per_rank": best(plan.transient_per_rank, repeat),
        "gather_schedule": best(plan.gather_schedule, repeat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--data", type=int, default=16384, help="data-parallel degree N of the AbstractMesh")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    mesh = sl.AbstractMesh({"data": args.data})
    deep, shallow = gpt(args.layers), gpt(max(1, args.layers // 10))
    n_deep, n_shallow = len(list(deep.parameters())), len(list(shallow.parameters()))
    print(f"N = {args.data}; seconds, best of {args.repeat}; deep GPT: {args.layers} layers, {n_deep:,} tensors; "
          f"shallow: {args.layers // 10} layers, {n_shallow:,} tensors")
    print(f"{'zero':<5} {'query':<20} {'deep':>9} {'shallow':>9} {'ratio':>7}")
    for zero in (0, 2, 3):
        a, b = row(deep, mesh, zero, args.repeat), row(shallow, mesh, zero, args.repeat)
        for k in a:
            print(f"{zero:<5} {k:<20} {a[k]:>9.4f} {b[k]:>9.4f} {a[k] / max(b[k], 1e-9):>7.1f}")
    with torch.device("meta"):
        big = GPT(GPTConfig(vocab_size=50304, seq_len=2048, d_model=25600, n_heads=128, n_layers=128), seed=None)
    plan = sl.plan(big, mesh, zero=3, precision="bf16")
    text = plan.explain()
    print(f"1T GPT ({plan.num_params / 1e12:.2f}T parameters, {len(plan.units)} units, N = {args.data}): "
          f"explain() {len(text.splitlines())} lines, longest {max(map(len, text.splitlines()))} chars; "
          f"explain(full=True) {len(plan.explain(full=True).splitlines())} lines")


if __name__ == "__main__":
    main()
