"""Offload to disk on this machine: what it frees, what it costs, how much of the disk the read-ahead hides.

    python benchmarks/bench_offload.py                 # a 60M-parameter GPT at data 2, ZeRO-3, 6 steps each
    python benchmarks/bench_offload.py --steps 4 --json rows.json

Each configuration runs in a fresh 2-rank gloo world (``sl.launch``), so one's memory does not leak into
the next: ZeRO-3 fp32 AdamW with nothing offloaded (``none``), with the optimizer's states on the host
(``optimizer=host``: on this machine the same memory — the copies run, nothing is saved; the update streamed
into the next forward unit by unit, ``runtime/offload/streamed.py``), the same with the update whole before
the step returns (``optimizer=host,whole``), the same with
the delayed update (``optimizer=host,delayed``: the host update of a step beside the next step's forward and
backward, DeepSpeed's delayed parameter update; its losses differ by design), and with the
optimizer's states and the parameter shards in files (``optimizer=disk,params=disk``, under ``--dir``).

Reported per configuration (rank 0; the other rank alike):

* anonymous resident memory (``RssAnon`` of ``/proc/self/status``: the process's own heap, not the page
  cache that file I/O fills) between steps, after ``malloc_trim``, and its peak over the timed steps
  (sampled every 2 ms by a thread);
* the planned reduction: the model-state bytes the plan moves out of the process's memory (its
  ``memory_per_rank`` in device + host kinds, against ``none``'s), and the measured one; the goal is a
  measured saving of at least 90% of the planned;
* the median step time (25th-75th percentiles), and its ratio to ``none``;
* the disk traffic per step (counted copies) and, from the offload timelines of the last step, the
  seconds the reader thread spent reading (optimizer chunks and parameter units) against the seconds the
  step waited for those reads: the part of the disk time the read-ahead hid is ``1 - waited / read``.
  ``--plot PATH`` draws that step's timeline;
* a checkpoint of the trained state saved and loaded back: how far ``RssAnon`` rose above its level
  before each (offloaded states are read from and written to their files in place, and a load's reads
  come in batches: not the whole state in memory at once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time

import torch
from bench_memory import proc_status, release_memory   # benchmarks/ is on the path when run as a script

import shardlib as sl
from shardlib.models import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=16384, seq_len=128, d_model=640, n_heads=10, n_layers=8)     # 60.4M parameters
ROWS = 4
CONFIGS = {"none": None, "optimizer=host": {"optimizer": "host"},
           "optimizer=host,whole": {"optimizer": "host"},
           "optimizer=host,delayed": {"optimizer": "host"},
           "optimizer=disk,params=disk": {"optimizer": "disk", "params": "disk"}}


class Sampler:
    """The most ``RssAnon`` seen while running (a thread reading it every ``every`` seconds)."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def __enter__(self):
        self.peak = proc_status("RssAnon")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, proc_status("RssAnon"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def worker(name: str, steps: int, folder: str) -> dict:
    torch.set_num_threads(1)
    mesh = sl.Mesh({"data": 2})
    offload = CONFIGS[name]
    model = GPT(CFG, seed=0)
    plan = sl.plan(model, mesh, zero=3, offload=offload, delayed=name.endswith("delayed"),
                   offload_dir=folder if offload and "disk" in offload.values() else None)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    if name.endswith("whole"):          # the host update whole before the step returns (not streamed)
        engine.offload.stream_update = False
    del model
    batches = [token_batch(CFG, ROWS * mesh.size, seed=s) for s in range(steps + 1)]
    losses = [engine.step(batches[0])]                  # warm-up: the optimizer's states now exist
    release_memory()
    rest = proc_status("RssAnon")
    times = []
    with Sampler() as peak:
        for b in batches[1:]:
            t0 = time.perf_counter()
            losses.append(engine.step(b))
            times.append(time.perf_counter() - t0)
        if engine.offload is not None:      # an update still in flight (streamed, delayed): the last step's
            t0 = time.perf_counter()
            engine.offload.wait()
            times[-1] += time.perf_counter() - t0
    release_memory()
    after = proc_status("RssAnon")
    ckpt = {}                                 # a checkpoint's save and load: the rise of RssAnon above rest
    for what in ("save", "load"):
        release_memory()
        base = proc_status("RssAnon")
        with Sampler() as peak_ck:
            engine.save(f"{folder}/ckpt-{name}") if what == "save" else engine.load(f"{folder}/ckpt-{name}")
        ckpt[what] = peak_ck.peak - base
    kinds = {k: plan.memory_per_rank(mesh.rank, kind=k) for k in ("device", "host", "disk")}
    timeline = []
    for off in (engine.offload, engine.params_offload):
        timeline += list(getattr(off, "timeline", []))
    copies = {f"{op} {what}": v[0] for (op, what), v in engine.copies.step.items()}
    for off in (engine.offload, engine.params_offload):
        if off is not None:
            off.close()
    return {"name": name, "losses": losses, "times": times, "rss_rest": rest, "rss_after": after,
            "rss_peak": peak.peak, "in_memory": {s: kinds["device"][s] + kinds["host"][s]
                                                 for s in ("params", "grads", "optimizer", "total")},
            "disk": kinds["disk"]["total"], "copies": copies, "timeline": timeline, "checkpoint": ckpt,
            "params": sum(p.numel for p in plan.params)}


def hidden(timeline: list) -> dict:
    """Seconds read by the reader threads and waited for by the step, per kind of read."""
    out = {}
    for what, wait in (("optimizer", "wait"), ("params", "wait params")):
        read = sum(e - s for k, _, s, e in timeline if k == ("read" if what == "optimizer" else "read params"))
        waited = sum(e - s for k, _, s, e in timeline if k == wait)
        out[what] = {"read_s": read, "waited_s": waited, "hidden": 1 - waited / read if read else None}
    return out


def plot(timeline: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = ["read params", "wait params", "read", "wait", "update", "write"]
    labels = ["params: read (thread)", "params: step waits", "optimizer: read (thread)",
              "optimizer: update waits", "optimizer: update", "optimizer: write (thread)"]
    t0 = min(s for _, _, s, _ in timeline)
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for y, kind in enumerate(rows):
        bars = [(s - t0, e - s) for k, _, s, e in timeline if k == kind]
        ax.broken_barh(bars, (y - 0.35, 0.7), color=f"C{y}")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("seconds into the step (rank 0)")
    ax.set_title("offload to disk, one step: reads run ahead of the work that needs them", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dir", default=None, help="offload_dir (default: a temporary folder under /tmp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for name in CONFIGS:
            got = sl.launch(worker, 2, name, args.steps, folder)
            rows.append(got[0])
            print(f"{name}: done ({statistics.median(got[0]['times']):.2f} s/step)", file=sys.stderr, flush=True)
    base = rows[0]
    if any(r["losses"] != base["losses"] for r in rows if not r["name"].endswith("delayed")):
        print("WARNING: the losses differ between configurations:", [r["losses"] for r in rows], file=sys.stderr)
    mib = 2**20
    print(f"GPT {base['params'] / 1e6:.1f}M parameters, data 2, ZeRO-3 fp32, fused AdamW, {ROWS * 2} x {CFG.seq_len} "
          f"tokens per step, {args.steps} timed steps; rank 0\n")
    print("| offload | RssAnon between steps MiB | peak RssAnon MiB | planned reduction MiB | measured (between / "
          "peak) MiB | measured / planned | on disk MiB | step s (p25-p75) | / none | disk read+write per step MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med0 = statistics.median(base["times"])
    for r in rows:
        planned = base["in_memory"]["total"] - r["in_memory"]["total"]
        saved, saved_peak = base["rss_after"] - r["rss_after"], base["rss_peak"] - r["rss_peak"]
        q = statistics.quantiles(r["times"], n=4) if len(r["times"]) > 1 else [r["times"][0]] * 3
        disk = sum(v for k, v in r["copies"].items() if k.startswith("disk"))
        frac = f"{saved / planned:.1%} / {saved_peak / planned:.1%}" if planned else "-"
        print(f"| {r['name']} | {r['rss_after'] / mib:.0f} | {r['rss_peak'] / mib:.0f} | {planned / mib:.0f} | "
              f"{saved / mib:.0f} / {saved_peak / mib:.0f} | {frac} | {r['disk'] / mib:.0f} | "
              f"{statistics.median(r['times']):.2f} ({q[0]:.2f}-{q[2]:.2f}) | "
              f"{statistics.median(r['times']) / med0:.2f} | {disk / mib:.0f} |")
    print("\ncheckpoint of the trained state (rank 0): the most RssAnon rose above its level before, while")
    for r in rows:
        print(f"  {r['name']}: saving {r['checkpoint']['save'] / mib:.0f} MiB, loading {r['checkpoint']['load'] / mib:.0f} "
              f"MiB (the model states it holds in memory: {r['in_memory']['total'] / mib:.0f} MiB, on disk "
              f"{r['disk'] / mib:.0f} MiB)")
    disk_row = rows[-1]
    h = hidden(disk_row["timeline"])
    print("\nread-ahead, last step of optimizer=disk,params=disk (rank 0):")
    for what, v in h.items():
        if v["read_s"]:
            print(f"  {what}: read {v['read_s'] * 1e3:.0f} ms on the reader thread, the step waited "
                  f"{v['waited_s'] * 1e3:.0f} ms: {v['hidden']:.0%} of the read time hidden")
    if args.plot:
        plot(disk_row["timeline"], args.plot)
        print(f"  timeline: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "timeline"} | {"hidden": hidden(r["timeline"])}
                       for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
