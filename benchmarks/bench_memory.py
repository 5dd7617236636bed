"""Peak memory per rank, measured against the plan: shardlib DP / ZeRO-1 / ZeRO-2 / ZeRO-3 and FSDP2.

    python benchmarks/bench_memory.py                 # 69M-parameter GPT, data = 2, prints a Markdown table
    python benchmarks/bench_memory.py --steps 3 --json rows.json

Each configuration runs in a fresh ``sl.launch`` world of 2 gloo ranks (1 thread each), on the same
model (GPT, d_model 768, 8 layers, 12 heads, vocab 8192, seq 128: 69M parameters, so model states
dominate), the same fp32 AdamW and the same batch (2 sequences per rank). FSDP2 is
``torch.distributed.fsdp.fully_shard`` on every block, then the root — the layout of shardlib's ZeRO-3,
whose plan its row shows.

**What is measured.** The rise of the rank's peak resident memory over a baseline taken after
``import torch``, the process group and a warm-up step of a tiny model through the same code (so the
libraries torch loads on first use, ~85 MB, are in the baseline and not counted as model memory; the
warm-up's own rise is printed). The peak is the kernel's high-water mark ``VmHWM`` from
``/proc/self/status``, reset to the current RSS right after the baseline by writing ``5`` to
``/proc/self/clear_refs``: exact, no sampling. Where that file cannot be written the peak comes from a
thread sampling ``VmRSS`` every millisecond (it can miss short peaks). The model is built normally
(every rank builds the whole model, then shards it), and a few optimizer steps run; the table gives
the worst rank.

**What is planned.** ``plan.memory_per_rank()['total']`` (model states between steps) and
``plan.peak_per_rank(activation_bytes=activation_bytes(model, batch))['peak']``: states + the largest
transient (gathered units, gradients on their way to a reduce-scatter, optimizer temporaries) + the
micro-batch's activations (``planner/peak.py``).

Every rank runs with glibc's mmap threshold fixed (``set_mmap_threshold``, done by ``sl.launch``'s
ranks): FSDP2 too, as it runs in the same kind of rank.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable

import torch
from harness import n_params, optimizer_step, write_rows   # benchmarks/ is on the path when run as a script

import shardlib as sl
from shardlib.models import GPT, GPTConfig, token_batch
from shardlib.planner.peak import activation_bytes

CFG = GPTConfig(vocab_size=8192, seq_len=128, d_model=768, n_heads=12, n_layers=8)
TINY = GPTConfig(vocab_size=256, seq_len=128, d_model=64, n_heads=4, n_layers=2)
LOCAL_BATCH = 2
CONFIGS = [("DP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3), ("FSDP2", None)]
MiB = 2**20


def proc_status(key: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def release_memory() -> None:
    """Collect garbage and hand glibc's free heap back to the kernel (``malloc_trim``)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakRSS:
    """The most resident memory since ``start()``: the kernel's VmHWM after resetting it, or a
    sampling thread where the reset is not allowed."""

    def __init__(self) -> None:
        self.exact, self._peak, self._stop = True, 0, threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.exact = False
            self._peak = proc_status("VmRSS")
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, proc_status("VmRSS"))

    def peak(self) -> int:
        if self.exact:
            return proc_status("VmHWM")
        self._peak = max(self._peak, proc_status("VmRSS"))
        return self._peak

    def stop(self) -> None:
        self._stop.set()


def warmed_meter(make_step: Callable[[], Callable], batches: Iterable) -> tuple[int, PeakRSS]:
    """A tiny model's steps through the same code (``make_step()`` over ``batches``: what torch loads on first
    use), the step dropped: the RSS after it (the baseline) and a ``PeakRSS`` started there."""
    step = make_step()
    for b in batches:
        step(b)
    del step
    gc.collect()
    base = proc_status("VmRSS")
    meter = PeakRSS()
    meter.start()
    return base, meter


def _batches(cfg: GPTConfig, rank: int, n: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in range(count):
        idx, tgt = token_batch(cfg, LOCAL_BATCH * n, s)
        lo = rank * LOCAL_BATCH
        out.append((idx[lo:lo + LOCAL_BATCH].contiguous(), tgt[lo:lo + LOCAL_BATCH].contiguous()))
    return out


def _build(cfg: GPTConfig, mesh, zero: int | None):
    """The model and a step function; the plan (ZeRO-3's for FSDP2) for the planned numbers."""
    model = GPT(cfg, seed=0)
    plan = sl.plan(model, mesh, zero=3 if zero is None else zero)
    if zero is None:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return optimizer_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3)), plan
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    return (lambda batch: engine.step(batch, local=True)), plan


def rank_main(zero: int | None, steps: int) -> dict:
    torch.set_num_threads(1)
    mesh = sl.Mesh({"data": 2})
    n = mesh.axis_size("data")
    # warm-up: load what torch loads on first use, through the same code, on a tiny model
    before = proc_status("VmRSS")
    base, meter = warmed_meter(lambda: _build(TINY, mesh, zero)[0], _batches(TINY, mesh.rank, n, 2))
    step, plan = _build(CFG, mesh, zero)
    batches = _batches(CFG, mesh.rank, n, steps)
    with torch.device("meta"):
        shapes = GPT(CFG, seed=None)
    act = activation_bytes(shapes, batches[0])
    times = []
    for b in batches:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t0)
    peak = meter.peak()
    meter.stop()
    return {"rise": peak - base, "warmup": base - before, "exact": meter.exact,
            "states": plan.memory_per_rank()["total"],
            "planned": plan.peak_per_rank(activation_bytes=act)["peak"], "activations": act,
            "ms": 1e3 * statistics.median(times[1:] if len(times) > 1 else times)}


def table(rows: list[dict]) -> str:
    head = ("| config | planned states MiB | planned peak MiB | measured peak rise MiB | measured / planned peak "
            "| step ms (median) |")
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        note = " (ZeRO-3's plan)" if r["config"] == "FSDP2" else ""
        lines.append(f"| {r['config']} | {r['states'] / MiB:.0f}{note} | {r['planned'] / MiB:.0f} | "
                     f"{r['rise'] / MiB:.0f} | {r['rise'] / r['planned']:.2f} | {r['ms']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--configs", nargs="*", default=[c for c, _ in CONFIGS], help="a subset of the rows")
    args = ap.parse_args(argv)
    rows = []
    for label, zero in [c for c in CONFIGS if c[0] in args.configs]:
        t0 = time.time()
        per_rank = sl.launch(rank_main, 2, zero, args.steps, threads=1)
        worst = max(per_rank, key=lambda r: r["rise"])
        rows.append({"config": label, **worst, "ms": per_rank[0]["ms"]})
        print(f"{label}: peak rise {worst['rise'] / MiB:.0f} MiB (planned {worst['planned'] / MiB:.0f}), "
              f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    psi = n_params(CFG)
    exact = all(r["exact"] for r in rows)
    print(f"\nGPT {psi / 1e6:.0f}M parameters (d_model {CFG.d_model}, {CFG.n_layers} layers, vocab {CFG.vocab_size}, "
          f"seq {CFG.seq_len}), fp32 AdamW, data = 2 (gloo, 1 thread per rank, {os.cpu_count()} cores), "
          f"{LOCAL_BATCH} sequences per rank, {args.steps} steps; torch {torch.__version__}. Peak = "
          f"{'VmHWM (exact)' if exact else 'sampled VmRSS'} minus the baseline after imports and a tiny warm-up "
          f"step ({max(r['warmup'] for r in rows) / MiB:.0f} MiB); activations planned "
          f"{rows[0]['activations'] / MiB:.0f} MiB.\n")
    print(table(rows))
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
