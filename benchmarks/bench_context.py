"""Context parallel: a tiny transformers Llama, unchanged, with each sequence split over a ``context`` axis.

    PYTHONPATH=. python3 benchmarks/bench_context.py                       # both parts, prints Markdown tables
    PYTHONPATH=. python3 benchmarks/bench_context.py --budget-mib 48 --max-seq 8192 --json rows.json

Model (``build``): Llama, 2 layers, hidden 64, 4 heads (2 key/value heads), MLP 128, vocab 256, SDPA, fp32,
seed 0; AdamW (lr 1e-3); a batch of one sequence.

**Part 1: the longest sequence within a fixed memory per rank**, at context 1, 2 and 4. In a fresh world of
``C`` ranks, sequence lengths double from 1024; each is planned (``rules={"seq": "context"}``, the planner's
attention method) and trained one step; the memory a rank grew by during the step — its peak resident set
(``VmHWM``, reset before the step through ``/proc/self/clear_refs``) minus its resident set before it — is
measured on every rank, the worst kept. The longest length whose growth stays within ``--budget-mib`` is the
row's answer; beside it the plan's estimate of the activations (``plan.peak_per_rank()["activations"]``; at
context 1, ``sl.activation_bytes`` of the model on the batch) at that length.

**Part 2: step time and bytes at one length** (``--seq``), per method at context 2 and 4, side by side with
plain PyTorch in the same processes: rank 0 also holds the one-process model and steps it on the whole
sequence while the other ranks wait (its step alternating with shardlib's after a barrier:
``harness.alternate``); the ratio is shardlib's median step (the latest end minus the earliest start over the
ranks) over plain PyTorch's whole-sequence step on one rank. The attention's bytes rank 0 sent
in one step (``sl.count_collectives``, the activation moves) are set beside each method's formula
(``planner/context.FORMULAS`` x layers, forward and backward as the plan lists them). Losses are compared with
one process on every step.

**torch's own** ``torch.distributed.tensor.experimental.context_parallel`` is tried first in a 2-rank world; on
this build's CPU it stops at ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no sharding
strategy — the tables say so, and the side is absent.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_memory import proc_status, release_memory
from harness import alternate, launch, max_rel, write_rows

import shardlib as sl
from shardlib.planner.context import FORMULAS

LAYERS, HIDDEN, HEADS, KV, MLP, VOCAB = 2, 64, 4, 2, 128, 256


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=1 << 17,
                      attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


def batch_at(seq: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _engine(n: int, seq: int, method: str | None):
    model = build()
    mesh = sl.Mesh({"context": n} if n > 1 else {"data": 1})
    plan = sl.plan(model, mesh, rules={"seq": "context"} if n > 1 else None, batch=batch_at(seq, 0),
                   context_attention=method if n > 1 else None)
    return plan, sl.parallelize(model, plan, optimizer=_opt)


# ---- part 1: the longest sequence within a budget -------------------------------------------------------

def longest_main(n: int, lengths: list[int], budget: int) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    for seq in lengths:
        plan, engine = _engine(n, seq, None)
        engine.step(batch_at(seq, 1))                    # (the optimizer's states and buffers made once)
        release_memory()
        with open("/proc/self/clear_refs", "w") as f:    # the peak resident set starts again from here
            f.write("5")
        base = proc_status("VmRSS")
        t0 = time.perf_counter()
        engine.step(batch_at(seq, 0))
        grown = torch.tensor([proc_status("VmHWM") - base], dtype=torch.float64)
        if n > 1:
            dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        planned = plan.peak_per_rank(0)["activations"] if n > 1 else sl.activation_bytes(build(), batch_at(seq, 0))
        out.append({"seq": seq, "grown": int(grown.item()), "ms": 1e3 * (time.perf_counter() - t0),
                    "planned_activations": planned, "method": plan.context_attention})
        del engine, plan
        if grown.item() > budget:
            break
    return out


# ---- part 2: step time and bytes beside plain PyTorch ------------------------------------------------------

class _Plain:
    """The one-process model stepped on the whole sequence — on rank 0 only (``idle``: the other ranks wait at
    the barrier), so it has a core to itself as one process would."""

    def __init__(self, idle: bool = False):
        self.idle = idle
        self.model = None if idle else build()
        self.opt = None if idle else _opt(self.model.parameters())

    def step(self, batch) -> float:
        if self.idle:
            return float("nan")
        loss = self.model(**batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class _Shardlib:
    def __init__(self, n: int, seq: int, method: str):
        self.plan, self.engine = _engine(n, seq, method)

    def step(self, batch) -> float:
        return self.engine.step(batch)


def timed_main(n: int, seq: int, method: str, warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    built = {"shardlib": _Shardlib(n, seq, method), "torch": _Plain(idle=dist.get_rank() != 0)}
    batches = [batch_at(seq, s) for s in range(warmup + steps)]

    def count(side, b, batch):
        if side != "shardlib":
            return b.step(batch), None
        with sl.count_collectives() as counted:
            loss = b.step(batch)
        moved = {"forward": 0, "all": 0}
        plan = b.plan
        for e in plan.comm_per_step(plan.mesh.rank):
            if e.what == "activations":
                moved["all"] += e.total
                moved["forward"] += e.total if e.phase == "forward" else 0
        counted_bytes = sum(c.bytes for c in counted.records if c.axes == ("context",)
                            and c.op in ("all_gather", "reduce_scatter", "send_recv", "all_to_all"))
        return loss, {"counted": counted_bytes, "planned": moved["all"], "planned_forward": moved["forward"]}

    mine = alternate(built, batches, warmup, count=count)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def torch_cp_main() -> str:
    """torch's own context_parallel on two CPU ranks: 'ran', or why not."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, HEADS, 64, HIDDEN // HEADS) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ran"
    except Exception as e:        # what stops it on this build, reported as the side's absence
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-mib", type=float, default=64.0, help="memory a rank may grow by (part 1)")
    ap.add_argument("--max-seq", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=2048, help="the sequence of part 2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    timeout = (args.timeout, 20 * args.timeout)
    got, err = launch(torch_cp_main, 2, timeout=timeout)
    torch_cp = got[0] if got else err
    print(f"torch context_parallel on 2 CPU ranks: {torch_cp}", file=sys.stderr, flush=True)

    budget = int(args.budget_mib * 2**20)
    lengths = [1024 << i for i in range(12) if 1024 << i <= args.max_seq]
    longest = []
    for n in (1, 2, 4):
        t0 = time.time()
        got, err = launch(longest_main, n, n, lengths, budget, timeout=timeout)
        rows = got[0] if got else []
        fits = [r for r in rows if r["grown"] <= budget]
        longest.append({"context": n, "rows": rows, "failed": err,
                        "longest": fits[-1]["seq"] if fits else None, "load": os.getloadavg()[0]})
        print(f"context {n}: {[(r['seq'], r['grown'] >> 20) for r in rows]} in {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)

    timed = []
    for n in (2, 4):
        for method in ("allgather", "ring", "ulysses"):
            if method == "ulysses" and HEADS % n:
                continue
            got, err = launch(timed_main, n, n, args.seq, method, args.warmup, args.steps, timeout=timeout)
            row = {"context": n, "method": method, "seq": args.seq, "failed": err, "load": os.getloadavg()[0]}
            if got:
                per = got[0]
                torch.set_num_threads(1)              # (as the ranks: the same kernels' order of summation)
                plain = _Plain()
                ref = [plain.step(batch_at(args.seq, s)) for s in range(args.warmup + args.steps)]
                for side in ("shardlib", "torch"):
                    times = [max(r[side]["spans"][k][1] for r in per) - min(r[side]["spans"][k][0] for r in per)
                             for k in range(args.steps)] if side == "shardlib" else \
                        [per[0][side]["spans"][k][1] - per[0][side]["spans"][k][0] for k in range(args.steps)]
                    row[side] = {"ms": 1e3 * statistics.median(times), "dloss": max_rel(per[0][side]["losses"], ref)}
                row["ratio"] = row["shardlib"]["ms"] / row["torch"]["ms"]
                row["bytes"] = per[0]["shardlib"]["bytes"]
                head = HIDDEN // HEADS
                if method == "ulysses":       # key/value heads split over the axis where it divides them
                    row["formula_forward"] = LAYERS * FORMULAS[method](args.seq, HIDDEN, n, 4,
                                                                       head * (KV if KV % n == 0 else HEADS))
                else:
                    row["formula_forward"] = LAYERS * FORMULAS[method](args.seq, head * KV, n, 4)
            timed.append(row)
            print(f"context {n} {method}: {row.get('ratio')}", file=sys.stderr, flush=True)

    fb = sl.format_bytes
    print(f"torch's context_parallel (torch.distributed.tensor.experimental) on this build's CPU: {torch_cp}\n")
    print(f"Part 1: the longest sequence (doubling from 1024) a rank trains within {args.budget_mib:.0f} MiB of growth")
    print("| context | longest sequence | growth per rank at each length (MiB) | planned activations at the longest | method | load |")
    print("|---|---|---|---|---|---|")
    for r in longest:
        at = next((x for x in r["rows"] if x["seq"] == r["longest"]), None)
        steps = ", ".join(f"{x['seq']}: {x['grown'] / 2**20:.0f}" for x in r["rows"])
        print(f"| {r['context']} | {r['longest'] or '–'} | {steps or r['failed']} | "
              f"{fb(at['planned_activations']) if at else '–'} | {at['method'] if at else '–'} | {r['load']:.1f} |")
    print(f"\nPart 2: a {args.seq}-token sequence, shardlib vs plain PyTorch (one rank, the whole sequence), medians")
    print("| context | method | shardlib ms | torch ms | ratio | Δloss vs 1 process (shardlib / torch) | attention bytes rank 0 sent: counted / planned (forward: planned / formula) | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in timed:
        if "ratio" not in r:
            print(f"| {r['context']} | {r['method']} | FAILED: {r['failed']} | | | | | |")
            continue
        b = r["bytes"]
        print(f"| {r['context']} | {r['method']} | {r['shardlib']['ms']:.0f} | {r['torch']['ms']:.0f} | "
              f"**{r['ratio']:.2f}** | {r['shardlib']['dloss']:.1e} / {r['torch']['dloss']:.1e} | "
              f"{fb(b['counted'])} / {fb(b['planned'])}"
              f"{' (=)' if b['counted'] == b['planned'] else ' (≠)'} (forward {fb(b['planned_forward'])} / "
              f"{fb(r['formula_forward'])}) | {r['load']:.1f} |")
    write_rows({"torch_context_parallel": torch_cp, "longest": longest, "timed": timed}, args.json)


if __name__ == "__main__":
    main()
