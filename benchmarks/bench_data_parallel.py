"""shardlib's data-parallel engine vs torch's, side by side in the same processes.

    python benchmarks/bench_data_parallel.py              # N = 2 and 4, prints a Markdown table
    python benchmarks/bench_data_parallel.py --nprocs 2 --steps 20

For each N one ``sl.launch`` starts N gloo ranks. In them, for each pair, both approaches are
built from the same seed, warmed up, then stepped alternately (A B, B A, A B, ...) on the same
data for ``--steps`` timed optimizer steps each, so a change in machine load hits both alike;
peak resident memory is measured separately, each approach alone in a fresh world:

* shardlib DP (``zero=0``)      vs ``DistributedDataParallel``
* shardlib ZeRO-2 (``zero=2``)  vs FSDP2 ``fully_shard(reshard_after_forward=False)``
* shardlib ZeRO-3 (``zero=3``)  vs FSDP2 ``fully_shard`` (per block, then the root)
* at N = 4, shardlib HSDP (``zero=3`` on a ``replica 2 x data 2`` mesh) vs FSDP2's HSDP (``fully_shard``
  on a 2-D ``(replicate, shard)`` device mesh)

Reported: median step time (rank 0; with the 25th-75th percentiles), the ratio
shardlib/torch, peak resident memory per rank (the most any rank reached; ~263 MB of it is
``import torch`` and the process group),
the bytes shardlib sent per step (counted) vs the ring minimum for the layout, and the largest
loss difference between the two (same init, same data: they must train alike).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardlib as sl
from shardlib.models import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=512, seq_len=64, d_model=256, n_heads=4, n_layers=4)   # PLATFORM.md's model
PAIRS = [("DP", 0, "DDP"), ("ZeRO-2", 2, "FSDP2 reshard_after_forward=False"), ("ZeRO-3", 3, "FSDP2 fully_shard")]
HSDP = ("HSDP 2x2", "hsdp", "FSDP2 HSDP (replicate 2 x shard 2)")


def pairs(n: int) -> list[tuple]:
    return PAIRS + ([HSDP] if n == 4 else [])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def make_shardlib(mesh, zero):
    model = GPT(CFG, seed=0)
    if zero == "hsdp":            # the same world as a replica x data mesh: states sharded over data
        mesh, zero = sl.Mesh({"replica": 2, "data": mesh.size // 2}), 3
    plan = sl.plan(model, mesh, zero=zero)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))

    def step(batch):
        return engine.step(batch, local=True)

    return step, plan


def make_torch(kind):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = GPT(CFG, seed=0)
    if kind == 0:
        model = DistributedDataParallel(model)
    elif kind == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        mesh2d = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh2d)
        fully_shard(model, mesh=mesh2d)
    else:
        reshard = kind == 3
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def rss_main(n: int, zero: int, which: str, steps: int) -> int:
    """In a fresh world: peak resident memory of one approach building and running ``steps`` steps."""
    torch.set_num_threads(1)
    mesh = sl.Mesh({"data": n})
    batches = local_batches(mesh.rank, n, steps)
    step = make_shardlib(mesh, zero)[0] if which == "shardlib" else make_torch(zero)
    peak = rss_bytes()
    for b in batches:
        step(b)
        peak = max(peak, rss_bytes())
    return peak


def local_batches(rank: int, n: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    local = CFG_BATCH // n
    return [tuple(t[rank * local:(rank + 1) * local] for t in token_batch(CFG, CFG_BATCH, s)) for s in range(count)]


def timed_pair(make_a, make_b, batches, warmup: int, steps: int) -> dict:
    """Both approaches alive, stepped alternately (A B, B A, A B, ...) on the same batches, so that
    a change in machine load hits both alike. Returns per-step times, losses, A's counted bytes."""
    step_a, plan = make_a()
    step_b, = make_b()
    for b in batches[:warmup]:
        step_a(b)
        step_b(b)
    times = {"a": [], "b": []}
    losses = {"a": [], "b": []}
    sent = None
    for i, b in enumerate(batches[warmup:warmup + steps]):
        order = (("a", step_a), ("b", step_b)) if i % 2 == 0 else (("b", step_b), ("a", step_a))
        for key, step in order:
            dist.barrier()
            t0 = time.perf_counter()
            if key == "a" and sent is None:
                with sl.count_collectives() as c:
                    loss = step(b)
                sent = c.bytes
            else:
                loss = step(b)
            times[key].append(time.perf_counter() - t0)
            losses[key].append(float(loss))
    return {"times": times, "losses": losses, "bytes": sent, "planned": plan.comm_bytes_per_step(),
            "ring_min": plan.ring_minimum()}


def rank_main(n: int, warmup: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    mesh = sl.Mesh({"data": n})
    batches = local_batches(mesh.rank, n, warmup + steps)
    out = []
    for label, zero, torch_name in pairs(n):
        res = timed_pair(lambda zero=zero: make_shardlib(mesh, zero), lambda zero=zero: (make_torch(zero),),
                         batches, warmup, steps)
        # torch's losses are per rank; average them to the global batch loss shardlib returns
        tl = torch.tensor(res["losses"]["b"])
        dist.all_reduce(tl)
        out.append({"form": label, "torch": torch_name,
                    "sl_times": res["times"]["a"], "torch_times": res["times"]["b"],
                    "bytes": res["bytes"], "planned": res["planned"], "ring_min": res["ring_min"],
                    "dloss": max(abs(x - y) for x, y in zip(res["losses"]["a"], (tl / n).tolist()))})
        release_memory()
    return out


CFG_BATCH = 8


def summarize(n: int, per_rank: list[list[dict]], rss: dict[tuple[int, str], int]) -> list[dict]:
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        sl_t, th_t = r0["sl_times"], r0["torch_times"]
        q = lambda xs: statistics.quantiles(xs, n=4)  # noqa: E731
        rows.append({
            "N": n, "form": r0["form"], "torch": r0["torch"],
            "sl_ms": 1e3 * statistics.median(sl_t), "torch_ms": 1e3 * statistics.median(th_t),
            "sl_iqr": [1e3 * x for x in (q(sl_t)[0], q(sl_t)[2])],
            "torch_iqr": [1e3 * x for x in (q(th_t)[0], q(th_t)[2])],
            "ratio": statistics.median(sl_t) / statistics.median(th_t),
            "sl_rss_mb": rss[(pairs(n)[i][1], "shardlib")] / 2**20,
            "torch_rss_mb": rss[(pairs(n)[i][1], "torch")] / 2**20,
            "bytes": r0["bytes"], "planned": r0["planned"], "ring_min": r0["ring_min"],
            "dloss": max(r[i]["dloss"] for r in per_rank)})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| N | shardlib | torch | shardlib ms (p25-p75) | torch ms (p25-p75) | ratio | peak RSS/rank MB "
            "shardlib / torch | shardlib bytes/step (counted = planned) | ring minimum (params+grads) | max Δloss |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['N']} | {r['form']} | {r['torch']} | {r['sl_ms']:.1f} ({r['sl_iqr'][0]:.0f}-{r['sl_iqr'][1]:.0f}) | "
            f"{r['torch_ms']:.1f} ({r['torch_iqr'][0]:.0f}-{r['torch_iqr'][1]:.0f}) | **{r['ratio']:.2f}** | "
            f"{r['sl_rss_mb']:.0f} / {r['torch_rss_mb']:.0f} | "
            f"{sl.format_bytes(r['bytes'])} ({'=' if r['bytes'] == r['planned'] else '≠'}) | "
            f"{sl.format_bytes(r['ring_min'])} | {r['dloss']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per approach")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = []
    for n in args.nprocs:
        t0 = time.time()
        print(f"N={n}: running {len(pairs(n))} pairs ...", file=sys.stderr, flush=True)
        timed = sl.launch(rank_main, n, n, args.warmup, args.steps, threads=1)
        rss = {(zero, which): max(sl.launch(rss_main, n, n, zero, which, args.warmup + 2, threads=1))
               for _, zero, _ in pairs(n) for which in ("shardlib", "torch")}
        rows += summarize(n, timed, rss)
        print(f"N={n}: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"\nGPT {CFG.n_layers} layers, d_model {CFG.d_model}, vocab {CFG.vocab_size}, seq {CFG.seq_len}, "
          f"global batch {CFG_BATCH}, fp32 AdamW; torch {torch.__version__}, gloo, 1 thread per rank, "
          f"{os.cpu_count()} cores; median of {args.steps} steps each\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
