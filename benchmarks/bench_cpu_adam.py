"""The host-side update of optimizer offload (issue 20): torch's CPU AdamW, per-tensor vs foreach vs fused.

    python3 benchmarks/bench_cpu_adam.py --json rows.json          # 10M, 50M, 100M elements: 3.3 min at load 3-6
    python3 benchmarks/bench_cpu_adam.py --sizes 10 --steps 3       # a quick look
    python3 benchmarks/bench_cpu_adam.py --sizes                     # the numerics check only: ~3 s

ZeRO-Offload runs AdamW on the host over fp32 masters; DeepSpeed ships its own AVX512/OpenMP kernel
(``DeepSpeedCPUAdam``, "5X-7X faster than the standard PyTorch implementation" — the per-tensor Python loop
of torch 1.6-era ``torch.optim.Adam``). torch 2.13 has three AdamW paths on CPU tensors: the per-tensor loop
(``foreach=False, fused=False``), ``foreach=True`` (one ``_foreach_*`` kernel per arithmetic op over the
whole list, so several passes over memory) and ``fused=True`` (one pass, ``_fused_adamw_``). This measures
all three on the same parameters, stepped alternately (so a load change on the shared machine hits all
three), at 1 and 2 threads:

- two layouts per size: ``mixed`` — ~200 tensors shaped like a GPT's (16 blocks of qkv / proj / fc / fc2
  weights and biases and two LayerNorms, an 8h x h embedding, the final LayerNorm) — and ``flat``: one 1-D
  tensor of the same total, the ZeRO flat-shard case;
- median seconds per step, elements/s, and GB/s of the state an AdamW step must touch: it reads param,
  grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq, 16 + 12 = 28 bytes per fp32 element
  (the unfused paths move more than that: this is the useful traffic, a roofline-comparable figure);
- an fp32 ``copy_`` of ``n`` elements (8 bytes each) as a memory-bandwidth reference, and the upcast of bf16 gradients into the
  fp32 gradient buffers (no torch AdamW path accepts bf16 gradients on fp32 parameters: checked below);
- numerics: all three paths, both layouts (``flat`` = ``mixed`` concatenated) and every thread count from
  the same parameters and gradients for 3 steps, max |diff| of the parameters and both moments against
  the per-tensor path on the mixed layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PATHS = {"per-tensor": {"foreach": False, "fused": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
BYTES_PER_ELEMENT = 28          # AdamW, fp32: reads param, grad, exp_avg, exp_avg_sq (16); writes three (12)
BYTES = {**dict.fromkeys(PATHS, BYTES_PER_ELEMENT), "bf16 upcast": 2 + 4, "copy_": 4 + 4}
OPT = {"lr": 1e-3, "weight_decay": 0.01}


def gpt_shapes(total: int, blocks: int = 16) -> list[tuple[int, ...]]:
    """~``total`` elements as a GPT's tensors: ``12·blocks·h² + 8h·h`` ≈ ``200 h²`` at 16 blocks."""
    h = max(16, round((total / (12 * blocks + 8)) ** 0.5 / 16) * 16)
    block = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,), (h,), (h,)]
    return [(8 * h, h)] + block * blocks + [(h,), (h,)]


def make_params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g))
        p.grad = torch.randn(s, generator=g) * 1e-2
        params.append(p)
    return params


def layouts(total: int) -> dict[str, list[tuple[int, ...]]]:
    shapes = gpt_shapes(total)
    n = sum(torch.Size(s).numel() for s in shapes)
    return {"mixed": shapes, "flat": [(n,)]}


def time_paths(params: list[torch.nn.Parameter], steps: int) -> dict[str, list[float]]:
    """Each path's own optimizer (own moments) over the same parameters, stepped alternately; the bf16
    gradient upcast (``_foreach_copy_`` into the fp32 grads) and an fp32 ``copy_`` of ``n`` elements alongside."""
    opts = {name: torch.optim.AdamW(params, **OPT, **kw) for name, kw in PATHS.items()}
    grads32 = [p.grad for p in params]
    grads16 = [g.to(torch.bfloat16) for g in grads32]
    n = sum(p.numel() for p in params)
    src, dst = torch.ones(n), torch.empty(n)       # 4 B read + 4 B written per element
    work = {**{name: opt.step for name, opt in opts.items()},
            "bf16 upcast": lambda: torch._foreach_copy_(grads32, grads16),
            "copy_": lambda: dst.copy_(src)}
    for fn in work.values():                       # warm-up: allocates the moments, first-touch pages
        fn()
    times: dict[str, list[float]] = {k: [] for k in work}
    for _ in range(steps):
        for name, fn in work.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def numerics(total: int, threads: list[int]) -> list[dict]:
    """3 steps of every path x layout x thread count from the same values and gradients (``flat`` is the
    concatenation of ``mixed``); max |diff| of parameters and moments against per-tensor, mixed, first
    thread count, and whether each is bitwise its own path's mixed, first-thread-count result."""
    shapes = gpt_shapes(total)
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) * 1e-2 for s in shapes] for _ in range(3)]
    flat = lambda ts: [torch.cat([t.reshape(-1) for t in ts])]                     # noqa: E731
    finals = {}
    for t in threads:
        torch.set_num_threads(t)
        for name, kw in PATHS.items():
            for layout in ("mixed", "flat"):
                pick = flat if layout == "flat" else list
                params = [torch.nn.Parameter(v.clone()) for v in pick(init)]
                opt = torch.optim.AdamW(params, **OPT, **kw)
                for step_grads in grads:
                    for p, gr in zip(params, pick(step_grads)):
                        p.grad = gr.clone()
                    opt.step()
                finals[name, layout, t] = {
                    "param": flat(params)[0].detach(),
                    "exp_avg": flat([opt.state[p]["exp_avg"] for p in params])[0],
                    "exp_avg_sq": flat([opt.state[p]["exp_avg_sq"] for p in params])[0]}
    ref = finals["per-tensor", "mixed", threads[0]]
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)                     # noqa: E731
    rows = []
    for (name, layout, t), got in finals.items():
        rows.append({"path": name, "layout": layout, "threads": t, "bitwise": same(ref, got),
                     "bitwise_own_path": same(finals[name, "mixed", threads[0]], got),
                     **{k: (ref[k] - got[k]).abs().max().item() for k in ref}})
    return rows


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="*", default=[10, 50, 100],
                    help="millions of elements (none: the numerics check only)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per path")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    t0 = time.time()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores, load (1/5/15 min) {os.getloadavg()}")
    num = numerics(200_000, args.threads)
    print(f"\nnumerics, 3 AdamW steps, 0.2M elements, max |diff| vs per-tensor, mixed, {args.threads[0]} thread:")
    print("| path | layout | threads | bitwise | param | exp_avg | exp_avg_sq | bitwise = own path, mixed, "
          f"{args.threads[0]} thread |\n|---|---|---|---|---|---|---|---|")
    for r in num:
        print(f"| {r['path']} | {r['layout']} | {r['threads']} | {r['bitwise']} | {r['param']:.1e} "
              f"| {r['exp_avg']:.1e} | {r['exp_avg_sq']:.1e} | {r['bitwise_own_path']} |")

    rows = []
    if args.sizes:
        print("\n| elements | layout (tensors) | threads | path | median s/step (min-max) | elements/s "
              "| GB/s (B/el: AdamW 28, upcast 6, copy_ 8) | vs per-tensor | load before-after |\n|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for layout, shapes in layouts(int(size * 1e6)).items():
            params = make_params(shapes, seed=0)
            n = sum(p.numel() for p in params)
            for threads in args.threads:
                torch.set_num_threads(threads)
                load0 = os.getloadavg()[0]
                times = time_paths(params, args.steps)
                load1 = os.getloadavg()[0]
                base = statistics.median(times["per-tensor"])
                for name, ts in times.items():
                    med = statistics.median(ts)
                    row = {"elements": n, "layout": layout, "tensors": len(params), "threads": threads,
                           "path": name, "median_s": med, "min_s": min(ts), "max_s": max(ts),
                           "elements_per_s": n / med, "gb_per_s": BYTES[name] * n / med / 1e9,
                           "vs_per_tensor": base / med if name in PATHS else None, "load": [load0, load1]}
                    rows.append(row)
                    ratio = f"**{row['vs_per_tensor']:.2f}x**" if name in PATHS else "–"
                    print(f"| {n / 1e6:.1f}M | {layout} ({len(params)}) | {threads} | {name} | {fmt_s(med)} "
                          f"({fmt_s(min(ts))}-{fmt_s(max(ts))}) | {n / med / 1e6:.0f}M | {row['gb_per_s']:.1f} | {ratio} "
                          f"| {load0:.1f}-{load1:.1f} |", flush=True)
            del params
    fused = [r for r in rows if r["path"] == "fused"]
    for threads in args.threads if fused else []:
        best = max(r["elements_per_s"] for r in fused if r["threads"] == threads)
        print(f"fused, {threads} thread(s): best {best / 1e6:.0f}M elements/s -> {1e9 / best:.2f} s per 1B "
              f"parameters per update")
    print(f"total {time.time() - t0:.0f} s, load after {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numerics": num, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
