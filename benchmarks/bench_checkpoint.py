"""Checkpoint save and load: shardlib's ``engine.save``/``engine.load`` vs DCP with FSDP2, same model, same run.

    PYTHONPATH=. python3 benchmarks/bench_checkpoint.py                      # both configs, ~3 min
    PYTHONPATH=. python3 benchmarks/bench_checkpoint.py --configs 3d --repeats 3 --json rows.json

Configs (one ``sl.launch`` world each, 1 thread per rank):

* ``3d``: the main job's tiny GPT (0.87 M parameters) on data x pipe x tensor = 2x2x2, ZeRO-3 + SP (8 ranks);
  the torch side: FSDP2 ``fully_shard`` per block and root over the 8 ranks;
* ``large``: a CPU-sized GPT (d_model 768, 8 layers, vocab 8192, seq 128: 69 M parameters) on data 4, ZeRO-3;
  the torch side: FSDP2 over the 4 ranks.

Both sides hold fp32 AdamW state after one step. shardlib: ``engine.save(dir)`` (DCP underneath, plus its
manifest with a hash (XXH3-128) of every file, moved into place when complete) and ``engine.load(dir)`` (the files
checked, then DCP). torch: ``get_state_dict(model, optimizer)`` -> ``dcp.save`` and ``dcp.load`` ->
``set_state_dict`` (torch's recommended FSDP2 path). Each is repeated, alternating the sides; medians of the
slowest rank's wall clock, and of the CPU seconds all ranks spent (process time: what other tenants of a
shared machine distort least); bytes = the checkpoint folder's size on disk. A load is checked: the next step's
loss equals the one the saved state gives.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness import optimizer_step, write_rows   # benchmarks/ is on the path when run as a script

import shardlib as sl
from shardlib.models import GPT, GPTConfig, token_batch

CONFIGS = {
    "3d": (GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4),
           {"data": 2, "pipe": 2, "tensor": 2},
           dict(zero=3, microbatches=2, sequence_parallel=True,
                rules={"layers": "pipe", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}), 16),
    "large": (GPTConfig(vocab_size=8192, seq_len=128, d_model=768, n_heads=12, n_layers=8), {"data": 4},
              dict(zero=3), 8),
}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed(fn, cpu: list) -> float:
    """Wall clock between two barriers; this process's CPU seconds appended to ``cpu`` (what a busy
    shared machine distorts least)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()
    dist.barrier()
    cpu.append(c1 - c0)
    return time.perf_counter() - t0


def rank_main(label: str, repeats: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    cfg, shape, kw, batch = CONFIGS[label]
    mesh = sl.Mesh(shape)
    b0, b1 = token_batch(cfg, batch, 0), token_batch(cfg, batch, 1)
    model = GPT(cfg, seed=0)
    plan = sl.plan(model, mesh, batch=b0, **kw)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    engine.step(b0)
    tmodel = GPT(cfg, seed=0)
    for blk in tmodel.blocks:
        fully_shard(blk)
    fully_shard(tmodel)
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-3)
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = b0[0].shape[0] // n
    local_step = optimizer_step(tmodel, topt, lambda m, b: m(*(t[rank * rows:(rank + 1) * rows] for t in b)))

    def tstep(b):
        """FSDP2's step on this rank's rows; the global batch's loss (the mean over the ranks)."""
        out = local_step(b).clone()
        dist.all_reduce(out)
        return float(out) / n
    tstep(b0)
    sdir, tdir = Path(root) / "shardlib", Path(root) / "torch"

    def tsave():
        msd, osd = get_state_dict(tmodel, topt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tdir))

    def tload():
        msd, osd = get_state_dict(tmodel, topt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tdir))
        set_state_dict(tmodel, topt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    times = {"shardlib_save": [], "shardlib_load": [], "torch_save": [], "torch_load": []}
    cpu = {k: [] for k in times}
    for i in range(repeats):
        order = [("shardlib", lambda: engine.save(sdir), lambda: engine.load(sdir)), ("torch", tsave, tload)]
        for side, save, load in (order if i % 2 == 0 else order[::-1]):
            if rank == 0:
                shutil.rmtree(sdir if side == "shardlib" else tdir, ignore_errors=True)
            dist.barrier()
            times[f"{side}_save"].append(_timed(save, cpu[f"{side}_save"]))
            times[f"{side}_load"].append(_timed(load, cpu[f"{side}_load"]))
    # the loaded state trains on as the saved one would have
    loss_after_load = engine.step(b1)
    tloss = tstep(b1)
    sizes = (_size(sdir), _size(tdir)) if rank == 0 else (0, 0)
    return {"times": times, "cpu": cpu, "sizes": sizes, "losses": (loss_after_load, tloss),
            "params": sum(p.numel() for p in GPT(cfg, seed=0).parameters())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = []
    for label in args.configs:
        shape = CONFIGS[label][1]
        n = math.prod(shape.values())
        with tempfile.TemporaryDirectory() as root:
            per_rank = sl.launch(rank_main, n, label, args.repeats, root, threads=1, timeout=300)
        r0 = per_rank[0]
        med = {k: 1e3 * statistics.median(max(r["times"][k][i] for r in per_rank) for i in range(args.repeats))
               for k in r0["times"]}
        # CPU: all ranks' seconds summed per repeat, median over repeats
        cpu = {k: statistics.median(sum(r["cpu"][k][i] for r in per_rank) for i in range(args.repeats))
               for k in r0["cpu"]}
        row = {"config": label, "mesh": shape, "params": r0["params"], **{f"{k}_ms": v for k, v in med.items()},
               **{f"{k}_cpu_s": v for k, v in cpu.items()},
               "shardlib_bytes": r0["sizes"][0], "torch_bytes": r0["sizes"][1],
               "next_loss": r0["losses"]}
        out.append(row)
        print(f"{label}: {row}", flush=True)
    print("\n| config | ranks | params | save ms shardlib / DCP+FSDP2 | load ms shardlib / DCP+FSDP2 | "
          "save CPU s (all ranks) | load CPU s (all ranks) | bytes on disk shardlib / DCP+FSDP2 |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in out:
        mesh = " x ".join(f"{a} {s}" for a, s in r["mesh"].items())
        print(f"| {r['config']} ({mesh}) | {math.prod(r['mesh'].values())} | "
              f"{r['params'] / 1e6:.2f} M | {r['shardlib_save_ms']:.0f} / {r['torch_save_ms']:.0f} | "
              f"{r['shardlib_load_ms']:.0f} / {r['torch_load_ms']:.0f} | "
              f"{r['shardlib_save_cpu_s']:.2f} / {r['torch_save_cpu_s']:.2f} | "
              f"{r['shardlib_load_cpu_s']:.2f} / {r['torch_load_cpu_s']:.2f} | "
              f"{sl.format_bytes(r['shardlib_bytes'])} / {sl.format_bytes(r['torch_bytes'])} |")
    write_rows(out, args.json)


if __name__ == "__main__":
    main()
