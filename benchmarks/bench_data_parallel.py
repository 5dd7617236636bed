"""shardlib's data-parallel engine vs torch's, side by side in the same processes.

    python benchmarks/bench_data_parallel.py              # N = 2 and 4, prints a Markdown table
    python benchmarks/bench_data_parallel.py --nprocs 2 --steps 20
    python benchmarks/bench_data_parallel.py --model 69m --nprocs 2 --steps 10   # the 69M GPT of bench_memory.py

For each N one ``sl.launch`` starts N gloo ranks. In them, for each pair, both approaches are
built from the same seed, warmed up, then stepped alternately (A B, B A, A B, ...) on the same
data for ``--steps`` timed optimizer steps each, so a change in machine load hits both alike;
peak resident memory is measured separately, each approach alone in a fresh world:

* shardlib DP (``zero=0``)      vs ``DistributedDataParallel``
* shardlib ZeRO-2 (``zero=2``)  vs FSDP2 ``fully_shard(reshard_after_forward=False)``
* shardlib ZeRO-3 (``zero=3``)  vs FSDP2 ``fully_shard`` (per block, then the root); on request
  (``--forms 'ZeRO-3 titan'``) vs FSDP2 wrapped as torchtitan wraps (embeddings, blocks, [norm, head], root)
* at N = 4, shardlib HSDP (``zero=3`` on a ``replica 2 x data 2`` mesh) vs FSDP2's HSDP (``fully_shard``
  on a 2-D ``(replicate, shard)`` device mesh)

Reported: median step time (rank 0; with the 25th-75th percentiles), the ratio
shardlib/torch, the median CPU seconds of a step summed over the ranks (``time.process_time``, all
threads: what a busy shared machine distorts least), peak resident memory per rank (the most any
rank reached; ~263 MB of it is ``import torch`` and the process group), the bytes shardlib sent per
step (counted) vs the ring minimum for the layout, and the largest loss difference between the two
(same init, same data: they must train alike).

**Peak memory** (each approach alone in a fresh world, as ``bench_memory.py`` measures it): the
kernel's high-water mark ``VmHWM`` of each rank, reset (``/proc/self/clear_refs``) after a baseline
taken once ``import torch``, the process group and a tiny model's warm-up steps through the same code
have loaded what torch loads on first use; the table gives the worst rank's absolute peak, and its
rise over the baseline against the plan's statement (``plan.peak_per_rank(activation_bytes=...)``,
the shardlib form's plan for both sides).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardlib as sl
from bench_memory import CFG as MEMORY_CFG
from bench_memory import TINY, release_memory, warmed_meter   # benchmarks/ is on the path when run as a script
from harness import n_params, optimizer_step, write_rows
from shardlib.models import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=512, seq_len=64, d_model=256, n_heads=4, n_layers=4)   # PLATFORM.md's model
MODELS = {   # name: (config, global batch)
    "small": (CFG, 8),
    "69m": (MEMORY_CFG, 4),   # bench_memory.py's GPT
}
PAIRS = [("DP", 0, "DDP"), ("ZeRO-2", 2, "FSDP2 reshard_after_forward=False"), ("ZeRO-3", 3, "FSDP2 fully_shard")]
HSDP = ("HSDP 2x2", "hsdp", "FSDP2 HSDP (replicate 2 x shard 2)")


# on request (--forms 'ZeRO-3 titan'): FSDP2 wrapped as torchtitan wraps a transformer — the token embeddings,
# each block, the final norm with the head (not resharded after forward), then the root — the units of
# shardlib's ZeRO-3 where the tables are large (planner/units.py)
TITAN = ("ZeRO-3 titan", "titan", "FSDP2 fully_shard, torchtitan's wrapping")


def pairs(n: int, forms: list[str] | None = None) -> list[tuple]:
    out = PAIRS + ([HSDP] if n == 4 else [])
    return out + [TITAN] if forms and TITAN[0] in forms else out


def make_shardlib(mesh, zero, cfg=CFG):
    model = GPT(cfg, seed=0)
    if zero == "hsdp":            # the same world as a replica x data mesh: states sharded over data
        mesh, zero = sl.Mesh({"replica": 2, "data": mesh.size // 2}), 3
    elif zero == "titan":
        zero = 3
    plan = sl.plan(model, mesh, zero=zero)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))

    def step(batch):
        return engine.step(batch, local=True)

    return step, plan


def make_torch(kind, cfg=CFG):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = GPT(cfg, seed=0)
    if kind == 0:
        model = DistributedDataParallel(model)
    elif kind == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        mesh2d = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh2d)
        fully_shard(model, mesh=mesh2d)
    elif kind == "titan":         # torchtitan's llama parallelize: apply_fsdp
        fully_shard(model.wte)
        for block in model.blocks:
            fully_shard(block)
        fully_shard([model.ln_f, model.head], reshard_after_forward=False)
        fully_shard(model)
    else:
        reshard = kind == 3
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    return optimizer_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _make(mesh, zero, which: str, cfg):
    if which == "shardlib":
        return make_shardlib(mesh, zero, cfg)
    return make_torch(zero, cfg), None


def rss_main(n: int, zero: int, which: str, steps: int, model: str = "small") -> dict:
    """In a fresh world: peak resident memory of one approach building and running ``steps`` steps
    (absolute, and its rise over the baseline after a tiny warm-up), and the plan's statement."""
    from shardlib.planner.peak import activation_bytes

    torch.set_num_threads(1)
    cfg, batch = MODELS[model]
    mesh = sl.Mesh({"data": n})
    # what torch loads on first use, through the same code
    base, meter = warmed_meter(lambda: _make(mesh, zero, which, TINY)[0], local_batches(mesh.rank, n, 2, TINY, batch))
    batches = local_batches(mesh.rank, n, steps, cfg, batch)
    step, plan = _make(mesh, zero, which, cfg)
    for b in batches:
        step(b)
    peak = meter.peak()
    meter.stop()
    del step
    if plan is None:                # the torch side: the shardlib form's plan, for the same statement
        with torch.device("meta"):
            shapes = GPT(cfg, seed=None)
        plan = sl.plan(shapes, sl.Mesh({"replica": 2, "data": n // 2}) if zero == "hsdp" else mesh,
                       zero=3 if zero in ("hsdp", "titan") else zero)
    with torch.device("meta"):
        shapes = GPT(cfg, seed=None)
    act = activation_bytes(shapes, batches[0])
    return {"peak": peak, "rise": peak - base, "exact": meter.exact,
            "planned": plan.peak_per_rank(activation_bytes=act)["peak"]}


def local_batches(rank: int, n: int, count: int, cfg: GPTConfig = CFG, batch: int | None = None):
    batch = CFG_BATCH if batch is None else batch
    local = batch // n
    return [tuple(t[rank * local:(rank + 1) * local] for t in token_batch(cfg, batch, s)) for s in range(count)]


def timed_pair(make_a, make_b, batches, warmup: int, steps: int) -> dict:
    """Both approaches alive, stepped alternately (A B, B A, A B, ...) on the same batches, so that
    a change in machine load hits both alike. Returns per-step times, losses, A's counted bytes."""
    step_a, plan = make_a()
    step_b, = make_b()
    for b in batches[:warmup]:
        step_a(b)
        step_b(b)
    times = {"a": [], "b": []}
    cpu = {"a": [], "b": []}
    losses = {"a": [], "b": []}
    sent = None
    for i, b in enumerate(batches[warmup:warmup + steps]):
        order = (("a", step_a), ("b", step_b)) if i % 2 == 0 else (("b", step_b), ("a", step_a))
        for key, step in order:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            if key == "a" and sent is None:
                with sl.count_collectives() as c:
                    loss = step(b)
                sent = c.bytes
            else:
                loss = step(b)
                if isinstance(loss, torch.Tensor):
                    loss = loss.item()      # (torch's step returns the loss tensor: its value, inside the timing)
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
            losses[key].append(float(loss))
    return {"times": times, "cpu": cpu, "losses": losses, "bytes": sent, "planned": plan.comm_bytes_per_step(),
            "ring_min": plan.ring_minimum()}


def rank_main(n: int, warmup: int, steps: int, model: str = "small", forms: list[str] | None = None) -> list[dict]:
    torch.set_num_threads(1)
    cfg, batch = MODELS[model]
    mesh = sl.Mesh({"data": n})
    batches = local_batches(mesh.rank, n, warmup + steps, cfg, batch)
    out = []
    for label, zero, torch_name in pairs(n, forms):
        if forms and label not in forms:
            continue
        res = timed_pair(lambda zero=zero: make_shardlib(mesh, zero, cfg), lambda zero=zero: (make_torch(zero, cfg),),
                         batches, warmup, steps)
        # torch's losses are per rank; average them to the global batch loss shardlib returns
        tl = torch.tensor(res["losses"]["b"])
        dist.all_reduce(tl)
        out.append({"form": label, "zero": zero, "torch": torch_name,
                    "sl_times": res["times"]["a"], "torch_times": res["times"]["b"],
                    "sl_cpu": res["cpu"]["a"], "torch_cpu": res["cpu"]["b"],
                    "bytes": res["bytes"], "planned": res["planned"], "ring_min": res["ring_min"],
                    "dloss": max(abs(x - y) for x, y in zip(res["losses"]["a"], (tl / n).tolist()))})
        release_memory()
    return out


CFG_BATCH = 8


def summarize(n: int, per_rank: list[list[dict]], rss: dict[tuple[int, str], dict]) -> list[dict]:
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        sl_t, th_t = r0["sl_times"], r0["torch_times"]
        q = lambda xs: statistics.quantiles(xs, n=4)  # noqa: E731
        # CPU seconds of each step summed over the ranks, then the median over steps
        sl_c = [sum(r[i]["sl_cpu"][k] for r in per_rank) for k in range(len(sl_t))]
        th_c = [sum(r[i]["torch_cpu"][k] for r in per_rank) for k in range(len(th_t))]
        mem_sl, mem_th = rss[(r0["zero"], "shardlib")], rss[(r0["zero"], "torch")]
        rows.append({
            "N": n, "form": r0["form"], "torch": r0["torch"],
            "sl_ms": 1e3 * statistics.median(sl_t), "torch_ms": 1e3 * statistics.median(th_t),
            "sl_iqr": [1e3 * x for x in (q(sl_t)[0], q(sl_t)[2])],
            "torch_iqr": [1e3 * x for x in (q(th_t)[0], q(th_t)[2])],
            "ratio": statistics.median(sl_t) / statistics.median(th_t),
            "sl_cpu_s": statistics.median(sl_c), "torch_cpu_s": statistics.median(th_c),
            "cpu_ratio": statistics.median(sl_c) / statistics.median(th_c),
            "sl_rss_mb": mem_sl["peak"] / 2**20, "torch_rss_mb": mem_th["peak"] / 2**20,
            "sl_rise_mb": mem_sl["rise"] / 2**20, "torch_rise_mb": mem_th["rise"] / 2**20,
            "planned_peak_mb": mem_sl["planned"] / 2**20, "rss_exact": mem_sl["exact"] and mem_th["exact"],
            "bytes": r0["bytes"], "planned": r0["planned"], "ring_min": r0["ring_min"],
            "dloss": max(r[i]["dloss"] for r in per_rank)})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| N | shardlib | torch | shardlib ms (p25-p75) | torch ms (p25-p75) | ratio | CPU s/step, all ranks "
            "shardlib / torch (ratio) | peak RSS/rank MiB shardlib / torch | rise over baseline MiB shardlib / torch "
            "/ planned peak (shardlib / planned) | shardlib bytes/step (counted = planned) | ring minimum "
            "(params+grads) | max Δloss |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['N']} | {r['form']} | {r['torch']} | {r['sl_ms']:.1f} ({r['sl_iqr'][0]:.0f}-{r['sl_iqr'][1]:.0f}) | "
            f"{r['torch_ms']:.1f} ({r['torch_iqr'][0]:.0f}-{r['torch_iqr'][1]:.0f}) | **{r['ratio']:.2f}** | "
            f"{r['sl_cpu_s']:.2f} / {r['torch_cpu_s']:.2f} (**{r['cpu_ratio']:.2f}**) | "
            f"{r['sl_rss_mb']:.0f} / {r['torch_rss_mb']:.0f} | "
            f"{r['sl_rise_mb']:.0f} / {r['torch_rise_mb']:.0f} / {r['planned_peak_mb']:.0f} "
            f"(**{r['sl_rise_mb'] / r['planned_peak_mb']:.2f}**) | "
            f"{sl.format_bytes(r['bytes'])} ({'=' if r['bytes'] == r['planned'] else '≠'}) | "
            f"{sl.format_bytes(r['ring_min'])} | {r['dloss']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per approach")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--model", choices=sorted(MODELS), default="small",
                    help="small: PLATFORM.md's 4-layer GPT; 69m: bench_memory.py's GPT (d_model 768, 8 layers)")
    ap.add_argument("--forms", nargs="*", default=None, help="a subset of the rows (DP, ZeRO-2, ZeRO-3, 'HSDP 2x2'; "
                    "'ZeRO-3 titan' adds FSDP2 wrapped as torchtitan wraps)")
    ap.add_argument("--rss-steps", type=int, default=None, help="steps in each peak-memory world (default warmup + 2)")
    args = ap.parse_args(argv)
    cfg, batch = MODELS[args.model]
    rows = []
    loads = [os.getloadavg()]
    for n in args.nprocs:
        t0 = time.time()
        chosen = [p for p in pairs(n, args.forms) if not args.forms or p[0] in args.forms]
        print(f"N={n}: running {len(chosen)} pairs ...", file=sys.stderr, flush=True)
        timed = sl.launch(rank_main, n, n, args.warmup, args.steps, args.model, args.forms, threads=1)
        loads.append(os.getloadavg())
        rss_steps = args.rss_steps or args.warmup + 2
        rss = {}
        for _, zero, _ in chosen:
            for which in ("shardlib", "torch"):
                per_rank = sl.launch(rss_main, n, n, zero, which, rss_steps, args.model, threads=1)
                rss[(zero, which)] = max(per_rank, key=lambda r: r["peak"])
                loads.append(os.getloadavg())
        rows += summarize(n, timed, rss)
        print(f"N={n}: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    psi = n_params(cfg)
    print(f"\nGPT {psi / 1e6:.0f}M parameters ({cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, "
          f"seq {cfg.seq_len}), global batch {batch}, fp32 AdamW; torch {torch.__version__}, gloo, 1 thread per rank, "
          f"{os.cpu_count()} cores; median of {args.steps} steps each; load average (1 min) during the run "
          f"{min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f}; glibc mmap threshold "
          f"{os.environ.get('SHARDLIB_MMAP_THRESHOLD', 'default')} (SHARDLIB_MMAP_THRESHOLD); peak memory "
          f"{'VmHWM (exact)' if all(r['rss_exact'] for r in rows) else 'sampled VmRSS'}, "
          f"{args.rss_steps or args.warmup + 2} steps in a fresh world per approach\n")
    print(table(rows))
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
