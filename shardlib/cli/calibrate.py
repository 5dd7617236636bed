"""``python -m shardlib.calibrate [--ranks 1 2 4 8]``: measure the figures the estimator and the auto-planner
price a step with, on the machine at hand, for each rank count, and print them as a mesh preset's
``calibrated:`` table (paste it into ``meshes/<name>.yaml``):

* ``tflops`` — a rank's sustained rate in a transformer block's forward and backward (d 256), every
  rank computing at once (so ranks sharing cores share them);
* ``layer_us`` — what one block's forward and backward costs beyond its FLOPs (Python and kernel
  launches, which many small micro-batches pay): the intercept of the block's time at 1 and 16
  sequences of 64 tokens, the rate its slope;
* ``latency_us`` / ``gbps`` — an all-reduce's cost per ring hop (8 bytes, ``2(n-1)`` hops), measured
  between blocks of work as a step meets it, and its bandwidth per rank (4 MiB): with more ranks than
  cores each hop waits for its peer to be scheduled, which a loopback figure at two ranks does not show;
* ``rs_latency_us`` / ``ag_latency_us`` — the same for a reduce-scatter and an all-gather (``n-1`` hops
  each): gloo runs them as several rounds, each a scheduling wait, not as half an all-reduce;
* ``overlap`` — the fraction of the shorter of a block's work (16 sequences) and the 4 MiB all-reduce that
  is hidden when the all-reduce runs asynchronously beside the block: ``(t_block + t_comm - t_both) /
  min(t_block, t_comm)``, clamped to [0, 1] — the step is predicted between the estimate's bounds by it.

Medians of repeated runs; the figures are measured, never fitted to training runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _block(d: int, rows: int, seq: int):
    import torch

    from ..models.gpt import Block, GPTConfig
    torch.manual_seed(0)
    block = Block(GPTConfig(d_model=d, n_heads=4, seq_len=seq))
    x = torch.randn(rows, seq, d, requires_grad=True)
    return lambda: block(x).sum().backward()


def _seconds(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _block_flops(d: int, rows: int, seq: int) -> float:
    """Forward and backward of one block (``planner/estimate.py``'s per-layer term, x3)."""
    return 3 * rows * seq * (2 * 12 * d * d + 4 * seq * d)


def measure(reps: int = 10) -> dict[str, float]:
    """On every rank of the running world at once; rank 0's figures (the ranks agree within noise).

    The rate and the fixed cost come from one block at two micro-batch sizes (1 and 16 sequences of
    64 tokens, d 256): the time is ``layer + FLOPs / rate``. The collective's cost is measured inside
    that work, as a step meets it: the block's forward and backward followed by an all-reduce, against
    the block alone (the difference per ring hop), then a 4 MiB all-reduce for the bandwidth."""
    import torch
    import torch.distributed as dist

    from ..comm.core import all_gather_single_fn, reduce_scatter_single_fn
    torch.set_num_threads(1)
    n = dist.get_world_size() if dist.is_initialized() else 1

    def together(fn, r):
        if n > 1:
            dist.barrier()
        return _seconds(fn, r)

    one, many = _block(256, 1, 64), _block(256, 16, 64)
    t1, t16 = together(one, reps * 2), together(many, reps)
    f1, f16 = _block_flops(256, 1, 64), _block_flops(256, 16, 64)
    rate = (f16 - f1) / max(t16 - t1, 1e-9)
    out = {"tflops": rate / 1e12, "layer_us": max(0.0, t1 - f1 / rate) * 1e6, "latency_us": 0.0, "gbps": 0.0}
    if n > 1:
        hops = 2 * (n - 1)
        tiny = torch.zeros(2)

        def with_collective():
            one()
            dist.all_reduce(tiny)

        alone = together(one, reps * 3)
        both = together(with_collective, reps * 3)
        per_hop = max(both - alone, 0.0) / hops
        small_in, small_out = torch.zeros(2 * n), torch.zeros(2)        # n - 1 hops each
        gathered = torch.zeros(2 * n)

        def with_scatter():
            one()
            reduce_scatter_single_fn()(small_out, small_in)

        def with_gather():
            one()
            all_gather_single_fn()(gathered, small_out)
        out["rs_latency_us"] = max(together(with_scatter, reps * 3) - alone, 0.0) / (n - 1) * 1e6
        out["ag_latency_us"] = max(together(with_gather, reps * 3) - alone, 0.0) / (n - 1) * 1e6
        payload = torch.zeros(1 << 20)                # 4 MiB
        big = together(lambda: dist.all_reduce(payload), reps)
        sent = hops / n * payload.numel() * 4
        out["latency_us"] = per_hop * 1e6
        out["gbps"] = sent / max(big - hops * per_hop, 1e-9) / 1e9

        def beside():                                 # the all-reduce in flight while a block computes
            work = dist.all_reduce(payload, async_op=True)
            many()
            work.wait()
        both_async = together(beside, reps)
        hidden = t16 + big - both_async
        out["overlap"] = min(1.0, max(0.0, hidden / max(min(t16, big), 1e-9)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardlib.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    from ..frontend.launch.launcher import launch

    rows = {}
    for n in args.ranks:
        got = launch(measure, n, args.reps, threads=1) if n > 1 else [measure(args.reps)]
        rows[n] = got[0]
        print(f"{n} ranks: {got[0]}", file=sys.stderr, flush=True)
    print(f"calibrated:        # python -m shardlib.calibrate --ranks {' '.join(map(str, args.ranks))} "
          f"({time.strftime('%Y-%m-%d')})")
    for n, r in rows.items():
        ops = (f", rs_latency_us: {r['rs_latency_us']:.0f}, ag_latency_us: {r['ag_latency_us']:.0f}, "
               f"overlap: {r['overlap']:.2f}" if "rs_latency_us" in r else "")
        print(f"  {n}: {{tflops: {r['tflops']:.4g}, gbps: {r['gbps']:.3g}, latency_us: {r['latency_us']:.0f}, "
              f"layer_us: {r['layer_us']:.0f}{ops}}}")
    return 0
