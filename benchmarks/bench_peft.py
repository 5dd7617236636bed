"""Fine-tuning with LoRA: shardlib ZeRO-3 vs PEFT + FSDP2 on the same PEFT model, with an int8 base beside them.

    PYTHONPATH=. python3 benchmarks/bench_peft.py --json rows.json   # data 2 and 4: 2.5 min at load 2-3, 6.5 at 7-10
    PYTHONPATH=. python3 benchmarks/bench_peft.py --quick                # smoke run: tiny model, data 2, ~1 min

**Model.** A transformers ``LlamaForCausalLM`` built from ``FULL`` (``Size``; seed 0), wrapped by
``peft.get_peft_model`` with LoRA r = 16 (alpha 32, no dropout) on q/k/v/o/gate/up/down, adapters drawn after
``torch.manual_seed(1)`` with ``init_lora_weights=False`` (A and B random, so the adapters change the loss
from the first step; PEFT's default zeroes B). The base is frozen (PEFT's doing); AdamW (lr 1e-3) over the
trainable parameters only. ``int8``: torchao ``quantize_(base, Int8WeightOnlyConfig(), filter_fn=<the
Linear layers LoRA adapts>)`` before ``get_peft_model`` (embeddings, norms and LM head stay fp32).

**Sides**, one world per data size (``--data``: 2 and 4 gloo ranks, 1 thread each), every side built in it
from the same seeds and fed the same global batches (``Size.batch`` rows per rank):

* ``shardlib``       ``sl.plan(peft_model, Mesh({"data": d}), zero=3)``, ``sl.parallelize``,
                     ``engine.step(global_batch)`` (each rank takes its rows);
* ``fsdp2``          ``fully_shard`` (torch.distributed.fsdp) on every decoder layer, then on the PEFT model's
                     root, ``model(**rows).loss.backward()``, ``opt.step()``, ``opt.zero_grad()``;
* ``shardlib-int8``  as ``shardlib``, over the int8 base;
* ``fsdp2-int8``     as ``fsdp2``, over the int8 base. It fails in ``fully_shard`` (torchao's ``Int8Tensor``
                     has no ``aten.split``, which FSDP2 uses to chunk a parameter); the error is the row;
* ``local``          the compute floor: the whole fp32 PEFT model in every rank, stepped on the rank's rows
                     with no collective at all — what both sharded sides would take with free communication
                     and no framework overhead (its ratio is the best any side can reach here).

After ``--warmup`` steps (the last one counted), the sides that built are stepped alternately (A B C, C B A,
...) after a barrier, so a change in machine load hits them alike; a step is the latest end minus the
earliest start over the ranks; medians (p25-p75), ratio = side / ``fsdp2`` (FSDP2 cannot run the int8 base, so
the int8 row's ratio is against FSDP2 over the fp32 base: the same step, the same fine-tune).

**Bytes** sent per rank per step (ring model), counted in one warm-up step: shardlib's by
``sl.count_collectives()`` (checked against ``plan.comm_bytes_per_step()``), FSDP2's by
``bench_tensor_parallel``'s dispatch-mode counter; split into all-gathers (parameters: the frozen base and
the adapters) and reduce-scatters / all-reduces (adapter gradients, scalars).

**Peak RSS** per rank: ``VmHWM`` of each side alone in a fresh world after ``warmup + 2`` steps (harness
``rss_of``; the rise over the RSS before building in brackets). **Losses**: each side's against one process
training the same PEFT model on the whole global batch (the first ``warmup`` steps), and shardlib's against
FSDP2's over every step: max relative difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from bench_3d import Built, collect, counted_step                   # benchmarks/ is on the path when run
from bench_hf import hf_loss, ids_batch
from bench_hf import llama_config as hf_llama_config
from harness import (common_options, gathered_alternate, launch, max_rel, optimizer_step, rss_of, train_losses,
                     write_rows)
from transformers import LlamaConfig, LlamaForCausalLM

import shardlib as sl

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIDES = ("shardlib", "fsdp2", "shardlib-int8", "fsdp2-int8", "local")
LR, RANK = 1e-3, 16
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Size:
    """The model and batch of a run: Llama ``hidden`` / MLP ``inter`` / ``layers`` / heads (kv), ``vocab``,
    ``seq`` tokens, ``batch`` sequences per data rank."""
    hidden: int = 256
    inter: int = 688
    layers: int = 4
    heads: int = 4
    kv: int = 2
    vocab: int = 2048
    seq: int = 128
    batch: int = 8


FULL, QUICK = Size(), Size(hidden=64, inter=160, layers=2, vocab=256, seq=32, batch=2)


def llama_config(s: Size) -> LlamaConfig:
    """``bench_hf``'s Llama config at the sizes of ``s``."""
    return hf_llama_config(s.vocab, s.hidden, s.inter, s.heads, s.kv, s.layers, s.seq)


def adapted(module: torch.nn.Module, fqn: str) -> bool:
    """The Linear layers LoRA adapts (the ones the int8 base quantizes)."""
    return isinstance(module, torch.nn.Linear) and fqn.rpartition(".")[2] in TARGETS


def base_model(s: Size, int8: bool) -> LlamaForCausalLM:
    """The Llama of ``s`` (seed 0), its adapted Linear layers quantized with ``int8``."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(s)).float().train()
    if int8:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        quantize_(base, Int8WeightOnlyConfig(), filter_fn=adapted)
    return base


def peft_model(s: Size, int8: bool):
    """The PEFT LoRA model every side and the reference start from (same seeds everywhere)."""
    from peft import LoraConfig, get_peft_model
    base = base_model(s, int8)
    torch.manual_seed(1)
    cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(base, cfg)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR)


def global_batch(s: Size, d: int, step: int) -> Batch:
    return ids_batch(s.vocab, s.batch * d, s.seq, step)


def rows_of(batch: Batch, s: Size, rank: int) -> Batch:
    return {k: v[rank * s.batch:(rank + 1) * s.batch] for k, v in batch.items()}


def run_shardlib(s: Size, d: int, int8: bool) -> Built:
    model = peft_model(s, int8)
    plan = sl.plan(model, sl.Mesh({"data": d}), zero=3)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer)
    return Built(lambda batch: float(engine.step(batch)), plan=plan)


def run_fsdp2(s: Size, d: int, int8: bool) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (d,), mesh_dim_names=("data",))
    model = peft_model(s, int8)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Built(_plain_step(model, s), groups={mesh.get_group().group_name: "data"})


def run_local(s: Size, d: int, int8: bool) -> Built:
    """The compute floor: the whole PEFT model in every rank, stepped on the rank's rows, no collective (each
    rank trains its own copy; its losses are not the global batch's and are not compared)."""
    return Built(_plain_step(peft_model(s, int8), s))


def _plain_step(model, s: Size):
    """One optimizer step of ``model`` on this rank's rows of a batch (the torch-side loop): the loss."""
    rank = dist.get_rank()
    step = optimizer_step(model, make_optimizer(model.parameters()),
                          lambda m, batch: hf_loss(m, rows_of(batch, s, rank)))
    return lambda batch: float(step(batch))


def build(side: str, s: Size, d: int) -> Built:
    run = run_local if side == "local" else run_shardlib if side.startswith("shardlib") else run_fsdp2
    return run(s, d, side.endswith("int8"))


def count(side: str, built: Built, batch: Batch) -> tuple[float, dict]:
    """``bench_3d.counted_step``: shardlib's counter for the shardlib sides, the dispatch-mode one for FSDP2's."""
    return counted_step("shardlib" if side.startswith("shardlib") else "torch", built, batch)


def rank_main(s: Size, d: int, sides: list[str], warmup: int, steps: int) -> dict:
    """Every side of ``sides`` built (a side whose build raises is reported, not run: the failures seen are
    raised before any collective, on every rank alike), then ``gathered_alternate``; plus each shardlib
    plan's planned bytes, all-gather bytes and model states for this rank."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    built, failed, planned = {}, {}, {}
    for side in sides:
        try:
            built[side] = build(side, s, d)
        except Exception as e:   # noqa: BLE001  (a benchmark reports what a stack does, whatever it raises)
            failed[side] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            continue
        if built[side].plan is not None:
            p = built[side].plan
            gathers = [e for e in p.comm_per_step() if e.op == "all_gather"]
            planned[side] = {"total": p.comm_bytes_per_step(), "all_gather": sum(e.total for e in gathers),
                             "layer_all_gather": sum(e.total for e in gathers if ".layers." in e.where),
                             "states": p.memory_per_rank(rank)["total"]}
    batches = [global_batch(s, d, k) for k in range(warmup + steps)]
    per = gathered_alternate(built, batches, warmup, count=count)
    return {"per": per, "failed": failed, "planned": planned}


def rss_main(s: Size, d: int, side: str, steps: int) -> dict:
    return rss_of(lambda: build(side, s, d), lambda k: global_batch(s, d, k), steps)


def reference_losses(s: Size, d: int, int8: bool, count: int) -> list[float]:
    """One process, the whole global batch of ``d`` ranks, the same AdamW: what every side must match."""
    torch.set_num_threads(2)
    return train_losses(peft_model(s, int8), make_optimizer, (global_batch(s, d, k) for k in range(count)), hf_loss)


def op_bytes(ops: dict[str, list[int]]) -> dict[str, int]:
    """Rank 0's counted ops, by kind: ``all_gather`` / ``reduce_scatter`` / ``all_reduce`` bytes."""
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}   # all_reduce: also broadcasts
    for name, (_, b) in ops.items():
        key = ("all_gather" if "gather" in name else "reduce_scatter" if "reduce_scatter" in name
               else "all_reduce")
        out[key] += b
    return out


def run_data(s: Size, d: int, sides: list[str], warmup: int, steps: int, timeout: tuple[float, float],
             rss: bool, check: bool) -> dict:
    t0 = time.time()
    row: dict[str, Any] = {"data": d, "results": {}, "failed": {}, "rss": {}, "load": [os.getloadavg()[0]]}
    per, err = launch(rank_main, d, s, d, sides, warmup, steps, timeout=timeout)
    if per is None:
        row["failed"] = {side: err for side in sides}
        return row
    row["failed"] = per[0]["failed"]
    for side in per[0]["per"][0]:
        r = collect(per[0]["per"], side, steps)
        r["ops"] = op_bytes(r["bytes"]["ops_rank0"])
        r["planned"] = per[0]["planned"].get(side)
        row["results"][side] = r
    row["load"].append(os.getloadavg()[0])
    if check:
        for int8 in (False, True):
            if any(side.endswith("int8") == int8 for side in row["results"]):
                ref = reference_losses(s, d, int8, warmup)
                for side, r in row["results"].items():
                    if side.endswith("int8") == int8 and side != "local":
                        r["dloss_ref"] = max_rel(r["losses"][:warmup], ref)
    res = row["results"]
    for side, r in res.items():
        if "fsdp2" in res and side != "fsdp2":
            r["ratio"] = r["ms"] / res["fsdp2"]["ms"]
        twin = side.replace("shardlib", "fsdp2")
        if side.startswith("shardlib") and twin in res:
            r["dloss_fsdp2"] = max_rel(r["losses"], res[twin]["losses"])
    print(f"data {d}: timed world and references done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    if rss:
        for side in [x for x in res if x != "local"]:
            out, _ = launch(rss_main, d, s, d, side, warmup + 2, timeout=timeout)
            if out is not None:
                row["rss"][side] = out
                res[side]["rss_mb"] = [x["peak"] / 2**20 for x in out]
                res[side]["rise_mb"] = [(x["peak"] - x["before"]) / 2**20 for x in out]
    return row


def short(error: str) -> str:
    """An error's first line without torchao's argument-type dump (the JSON keeps it whole)."""
    return error.split(", types=")[0]


def table(rows: list[dict]) -> str:
    fb = sl.format_bytes
    lines = ["| data | side | step s (p25-p75) | ratio vs FSDP2 | peak RSS MB per rank (+ rise) | bytes/step rank 0: "
             "all-gather / reduce-scatter / all-reduce | total (planned) | model states per rank (planned) | "
             "max rel Δloss vs 1 process | vs FSDP2 |", "|" + "---|" * 10]
    for row in rows:
        d = row["data"]
        for side in SIDES:
            if side in row["failed"]:
                lines.append(f"| {d} | {side} | FAILED: {short(row['failed'][side])} |" + " – |" * 7)
                continue
            if side not in row["results"]:
                continue
            r = row["results"][side]
            ratio = f"**{r['ratio']:.2f}**" if "ratio" in r else "–"
            rss = (" / ".join(f"{p:.0f} (+{q:.0f})" for p, q in zip(r["rss_mb"], r["rise_mb"]))
                   if "rss_mb" in r else "–")
            ops = " / ".join(fb(r["ops"][k]) for k in ("all_gather", "reduce_scatter", "all_reduce"))
            if side == "local":
                lines.append(f"| {d} | local (no collective: the compute floor) | {r['ms'] / 1e3:.3f} "
                             f"({r['p25'] / 1e3:.3f}-{r['p75'] / 1e3:.3f}) | {ratio} |" + " – |" * 6)
                continue
            total = r["bytes"]["per_rank"][0]["total"]
            pl = r["planned"]
            planned = f" ({'=' if r['bytes']['counted_eq_planned'] else '≠'} planned)" if pl else ""
            states = fb(pl["states"]) if pl else "–"
            ref = f"{r['dloss_ref']:.1e}" if "dloss_ref" in r else "–"
            vs = f"{r['dloss_fsdp2']:.1e}" if "dloss_fsdp2" in r else "–"
            lines.append(f"| {d} | {side} | {r['ms'] / 1e3:.3f} ({r['p25'] / 1e3:.3f}-{r['p75'] / 1e3:.3f}) | "
                         f"{ratio} | {rss} | {ops} | {fb(total)}{planned} | {states} | {ref} | {vs} |")
    return "\n".join(lines)


def gather_ratios(rows: list[dict]) -> list[str]:
    """The int8 base's all-gathers against the fp32 base's, counted and planned, per data size."""
    out = []
    for row in rows:
        res = row["results"]
        if "shardlib" in res and "shardlib-int8" in res:
            a, b = res["shardlib"], res["shardlib-int8"]
            out.append(f"- data {row['data']}: shardlib all-gathers per step, int8 / fp32 base: counted "
                       f"{sl.format_bytes(b['ops']['all_gather'])} / {sl.format_bytes(a['ops']['all_gather'])} = "
                       f"{b['ops']['all_gather'] / a['ops']['all_gather']:.3f}; planned "
                       f"{b['planned']['all_gather'] / a['planned']['all_gather']:.3f}; the decoder layers' units "
                       f"alone (planned): {sl.format_bytes(b['planned']['layer_all_gather'])} / "
                       f"{sl.format_bytes(a['planned']['layer_all_gather'])} = "
                       f"{b['planned']['layer_all_gather'] / a['planned']['layer_all_gather']:.3f}")
    return out


def base_bytes(s: Size) -> str:
    """What the adapted Linear weights hold, fp32 vs int8 (qdata + per-row scales), in one process."""
    fp = sum(m.weight.numel() * 4 for n, m in base_model(s, False).named_modules() if adapted(m, n))
    q8 = 0
    for n, m in base_model(s, True).named_modules():
        if adapted(m, n):
            w = m.weight
            q8 += sum(getattr(w, k).numel() * getattr(w, k).element_size() for k in w.__tensor_flatten__()[0])
    return (f"adapted Linear weights: fp32 {sl.format_bytes(fp)}, int8 {sl.format_bytes(q8)} (qdata + scales) = "
            f"{q8 / fp:.3f} of fp32")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=int, nargs="*", default=None, help="data sizes (default 2 and 4; --quick: 2)")
    ap.add_argument("--sides", nargs="*", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 warm-up + 2 steps, no RSS worlds")
    ap.add_argument("--no-check", action="store_true", help="skip the one-process reference losses")
    common_options(ap, steps=10)
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    data = args.data or ([2] if args.quick else [2, 4])
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    rss = not (args.no_rss or args.quick)
    timeout = (args.timeout, args.world_timeout)
    t0 = time.time()
    rows = []
    for d in data:
        t1 = time.time()
        row = run_data(s, d, args.sides, warmup, steps, timeout, rss, not args.no_check)
        rows.append(row)
        print(f"data {d}: done in {time.time() - t1:.0f} s, load {row['load']}", file=sys.stderr, flush=True)
    model = peft_model(s, False)
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"\nLlama {s.layers} layers, hidden {s.hidden}, heads {s.heads} (kv {s.kv}), MLP {s.inter}, vocab {s.vocab}, "
          f"seq {s.seq}: {total / 1e6:.2f} M parameters, LoRA r={RANK} on {'/'.join(TARGETS)}: {train / 1e6:.3f} M "
          f"trainable; {s.batch} sequences per data rank; fp32 AdamW lr {LR} on the adapters; ZeRO-3 / FSDP2 "
          f"per decoder layer + root. Median of {steps} alternating steps after {warmup} warm-up (p25-p75); "
          f"torch {torch.__version__}, gloo, 1 thread per rank, {os.cpu_count()} cores; load (1-min) per world "
          f"{', '.join('–'.join(f'{x:.1f}' for x in r['load']) for r in rows)}. Total {time.time() - t0:.0f} s.\n")
    print(table(rows))
    print()
    print("\n".join(gather_ratios(rows) + [f"- {base_bytes(s)}"]))
    for row in rows:
        for side, r in row["results"].items():
            if side == "local":
                continue
            ops = ", ".join(f"{k} x{n} {sl.format_bytes(b)}" for k, (n, b) in sorted(r["bytes"]["ops_rank0"].items()))
            print(f"- data {row['data']} {side}: {ops}")
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
