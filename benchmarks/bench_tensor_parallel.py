"""shardlib tensor parallelism vs torch's ``parallelize_module``, side by side in the same processes.

    python benchmarks/bench_tensor_parallel.py                      # every config, prints a Markdown table
    python benchmarks/bench_tensor_parallel.py --configs TP2 TP2+SP --steps 10

Configs (``mesh`` is data × tensor; ``zero`` is shardlib's stage on ``data``):

* ``TP2``, ``TP4``           tensor = 2, 4          vs ``parallelize_module`` Colwise/Rowwise + vocab-parallel
                                                    embedding and head with ``loss_parallel``
* ``TP2+SP``, ``TP4+SP``     the same, sequence parallel  vs ``SequenceParallel`` on the LayerNorms
* ``2D``, ``2D+SP``          data 2 × tensor 2, ZeRO-3    vs FSDP2 ``fully_shard`` on ``data`` + torch TP

The torch side, on the reference GPT (``shardlib.models.gpt``; the fused ``qkv`` orders its features
``(head, q|k|v, head_dim)``, so a contiguous column shard holds whole heads and the model's einops
code runs on the local tensors): ``ColwiseParallel`` on ``attn.qkv``/``mlp.fc``, ``RowwiseParallel`` on
``attn.proj``/``mlp.out``, ``RowwiseParallel(input_layouts=Replicate())`` on ``wte`` (vocab-parallel
embedding, as torch's docs do), ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``
on ``head`` and ``F.cross_entropy`` under ``loss_parallel()``. With SP: ``SequenceParallel`` on
``ln1``/``ln2``/``ln_f``, ``PrepareModuleInput`` Shard(1) -> Replicate on ``attn``/``mlp``, row outputs
``Shard(1)``, ``wte`` output ``Shard(1)`` (reduce-scatter) and ``wpe``'s output sliced to the
rank's positions (``PrepareModuleOutput`` Replicate -> Shard(0)), ``head`` input ``Shard(1)``.

For each config one ``sl.launch`` world runs both sides, built from the same seed, warmed up, then
stepped alternately (A B, B A, ...) on the same batches, so a change in machine load hits both alike.
Peak RSS is measured apart, each side alone in a fresh world. The shardlib side is
``run_shardlib`` below (rules ``heads``/``mlp``/``vocab`` -> ``tensor`` on the GPT's named dims).

Reported per config: median step time on rank 0 (AdamW step included; p25-p75), the ratio
shardlib/torch, peak resident memory per rank (``VmHWM``, the most any rank reached, ~263 MB of it
is ``import torch`` and the process group), bytes sent per rank per step on each axis — counted
(torch: a dispatch mode that sees every collective DTensor and FSDP2 issue; shardlib:
``sl.count_collectives``), in the ring model of ``shardlib.comm.core`` — beside Megatron's formula,
and the largest loss difference from one process training on the whole batch.

**Megatron's formula.** Per transformer block per step, without SP: 4 all-reduces of the
activation, ``b·s·h`` elements (``b`` the tensor group's batch): 2 forward (after the attention and
MLP row layers), 2 backward (before the column layers). In the ring model each sends
``2·(t-1)/t·b·s·h`` elements per rank. With SP they become 4 all-gathers + 4 reduce-scatters of
``(t-1)/t·b·s·h`` each: the same volume, and 2 all-gathers more in backward (each region's input gathered
again from the chunk forward kept: Korthikanti et al. 2022, and ``comm/sp_saved.py``). Outside the blocks: the embedding's all-reduce (forward)
and the LM head's input (backward) add 2 more, and the vocab-parallel loss a few ``b·s`` vectors.
On ``data`` (ZeRO-3/FSDP): 2 all-gathers of the tensor-local parameters + 1 reduce-scatter of the
gradients, ``3·(d-1)/d·Ψ/t`` elements.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import shardlib as sl
from harness import (alternate, gpt_line, max_rel, print_tables, reference_losses,  # benchmarks/ is on the path
                     rss_of, write_rows)
from shardlib.comm.core import all_gather_bytes, all_reduce_bytes, broadcast_bytes, reduce_scatter_bytes
from shardlib.models import GPT, GPTConfig, token_batch

CFG = GPTConfig(vocab_size=512, seq_len=64, d_model=256, n_heads=4, n_layers=4)   # PLATFORM.md's model
BATCH = 8   # global batch (sequences); each tensor group runs BATCH / data of them
# label: ({"data": d, "tensor": t}, sequence_parallel, shardlib's zero stage on data, torch's name)
CONFIGS = {
    "TP2": ({"data": 1, "tensor": 2}, False, 0, "parallelize_module"),
    "TP2+SP": ({"data": 1, "tensor": 2}, True, 0, "parallelize_module + SequenceParallel"),
    "TP4": ({"data": 1, "tensor": 4}, False, 0, "parallelize_module"),
    "TP4+SP": ({"data": 1, "tensor": 4}, True, 0, "parallelize_module + SequenceParallel"),
    "2D": ({"data": 2, "tensor": 2}, False, 3, "FSDP2 + parallelize_module"),
    "2D+SP": ({"data": 2, "tensor": 2}, True, 3, "FSDP2 + parallelize_module + SequenceParallel"),
}
# the GPT's parameters the tensor axis shards (column: weight and bias; row, embedding, head: weight)
TP_SHARDED = ("qkv.weight", "qkv.bias", "fc.weight", "fc.bias", "proj.weight", "out.weight", "wte.weight",
              "head.weight")
Step = Callable[[tuple[torch.Tensor, torch.Tensor]], float]


@dataclass
class Built:
    """One side, built in a rank: its step function; shardlib's plan (for ``comm_bytes_per_step``);
    torch's process groups by name -> mesh axis (to file counted bytes under an axis)."""
    step: Step
    plan: Any = None
    groups: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The shardlib side
# ---------------------------------------------------------------------------------------------

def run_shardlib(cfg: GPTConfig, mesh_shape: dict[str, int], sequence_parallel: bool, zero: int) -> Built:
    """Build shardlib's TP engine for ``GPT(cfg, seed=0)`` in this rank; return ``Built(step, plan)``.

    Called inside every rank of a world of ``data·tensor`` ranks. ``step((idx, targets))`` takes this
    rank's data-coordinate rows of the global batch (the same rows on every tensor rank), runs one
    optimizer step (``torch.optim.AdamW(ps, lr=1e-3)``) and returns the loss as a float (the loss of
    those rows). ``plan`` supplies ``comm_bytes_per_step()`` for the "planned" column; it is given the
    example batch, so it traces the activation collectives too.
    """
    mesh = sl.Mesh(mesh_shape)
    model = GPT(cfg, seed=0)
    example = token_batch(cfg, BATCH, 0)
    plan = sl.plan(model, mesh, zero=zero, rules={"heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
                   sequence_parallel=sequence_parallel, batch=example)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    return Built(lambda batch: float(engine.step(batch, local=True)), plan)


# ---------------------------------------------------------------------------------------------
# The torch side
# ---------------------------------------------------------------------------------------------

def torch_tp_plan(sequence_parallel: bool) -> tuple[dict, dict]:
    """``parallelize_module`` plans for the GPT: ``(top-level plan, per-block plan)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        top = {"wte": RowwiseParallel(input_layouts=Replicate()),
               "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        block = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                 "mlp.fc": ColwiseParallel(), "mlp.out": RowwiseParallel()}
        return top, block
    top = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           # x = wte(idx) + wpe(pos): the positions' embeddings, cut to this rank's sequence chunk
           "wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
           "ln_f": SequenceParallel(),
           "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    block = {"ln1": SequenceParallel(), "attn": gather, "attn.qkv": ColwiseParallel(),
             "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
             "ln2": SequenceParallel(), "mlp": gather, "mlp.fc": ColwiseParallel(),
             "mlp.out": RowwiseParallel(output_layouts=Shard(1))}
    return top, block


def run_torch(cfg: GPTConfig, mesh_shape: dict[str, int], sequence_parallel: bool, zero: int) -> Built:
    """torch's TP (+ FSDP2 on ``data`` when ``data > 1``) of ``GPT(cfg, seed=0)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    d, t = mesh_shape["data"], mesh_shape["tensor"]
    if d > 1:
        mesh = init_device_mesh("cpu", (d, t), mesh_dim_names=("data", "tensor"))
        tp_mesh = mesh["tensor"]
        groups = {mesh["data"].get_group().group_name: "data", tp_mesh.get_group().group_name: "tensor"}
    else:
        tp_mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tensor",))
        groups = {tp_mesh.get_group().group_name: "tensor"}
    model = GPT(cfg, seed=0)
    top, block = torch_tp_plan(sequence_parallel)
    parallelize_module(model, tp_mesh, top)
    for b in model.blocks:
        parallelize_module(b, tp_mesh, block)
    if d > 1:
        from torch.distributed.fsdp import fully_shard

        if zero != 3:
            raise ValueError(f"run_torch: the 2D baseline is FSDP2 (ZeRO-3) — got zero={zero}; expected 3.")
        for b in model.blocks:
            fully_shard(b, mesh=mesh["data"])
        fully_shard(model, mesh=mesh["data"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        with loss_parallel():
            loss = model(*batch)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    return Built(step, groups=groups)


SIDES = {"torch": run_torch, "shardlib": run_shardlib}


# ---------------------------------------------------------------------------------------------
# Counting torch's collectives
# ---------------------------------------------------------------------------------------------

class CountCollectives(TorchDispatchMode):
    """Every collective that reaches the dispatcher (DTensor's functional collectives, FSDP2's c10d
    calls), priced in the ring model shardlib's counter uses: ``{(op, group name): [count, bytes]}``
    per rank. DTensor ops are let through (``NotImplemented``) so that their collectives show."""

    def __init__(self) -> None:
        super().__init__()
        self.by = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, name = func.namespace, func._overloadpacket.__name__
        if ns in ("_c10d_functional", "c10d") and not name.startswith(("wait", "barrier", "monitored")):
            self._record(name, args)
        return out

    def _record(self, name: str, args) -> None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        # functional ops name their group last (after a reduce op's name); c10d ops pass the group
        # (a boxed ProcessGroup, beside a boxed ReduceOp for the reducing ones)
        names = [a for a in args if isinstance(a, str)]
        groups = [g for g in map(_unbox_group, args) if g is not None]
        pg = groups[0] if groups else _resolve_process_group(names[-1]) if names else None
        k = pg.size() if pg is not None else None
        tensors = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(x, torch.Tensor)]
        if k is None or not tensors:
            return
        op = name.rstrip("_").lstrip("_")
        # c10d's in-place ops take (outputs, inputs, ...); the functional ones the input first
        if op in ("allgather_base", "reduce_scatter_base"):
            out_t, in_t = tensors[0], tensors[1]
        else:
            in_t = out_t = tensors[0]
        size = in_t.element_size()
        if "allreduce" in op or "all_reduce" in op:
            b, op = sum(all_reduce_bytes(x.numel(), k, x.element_size()) for x in tensors), "all_reduce"
        elif "allgather" in op or "all_gather" in op:
            b, op = all_gather_bytes(in_t.numel(), k, size), "all_gather"
        elif "reduce_scatter" in op:
            b, op = reduce_scatter_bytes(out_t.numel() if out_t is not in_t else in_t.numel() // k, k, size), \
                "reduce_scatter"
        elif "broadcast" in op:
            b = broadcast_bytes(in_t.numel(), k, size)
        elif "all_to_all" in op or "alltoall" in op:
            b = in_t.numel() * size * (k - 1) // k
        else:
            b = in_t.numel() * size
        self.by[(op, pg.group_name)][0] += 1
        self.by[(op, pg.group_name)][1] += b


def _unbox_group(a) -> dist.ProcessGroup | None:
    if isinstance(a, dist.ProcessGroup):
        return a
    if isinstance(a, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(a)
        except (RuntimeError, TypeError):   # a boxed ReduceOp
            return None
    return None


def megatron_bytes(cfg: GPTConfig, mesh_shape: dict[str, int], itemsize: int = 4, sp: bool = False) -> dict[str, int]:
    """Megatron's tensor-axis traffic per rank per step (ring model): ``blocks`` = 4 all-reduces of
    ``b·s·h`` per block; ``total`` adds the embedding's and the LM head input's all-reduce. SP
    moves the same volume as all-gather + reduce-scatter pairs, plus (``sp``) the all-gather of each
    region's input again in backward for the columns' weight gradients (Korthikanti et al. 2022: the
    ``b·s·h/t`` chunk is what forward keeps), ``(t-1)/t·b·s·h`` twice per block. ``data`` = ZeRO-3's
    ``3·(d-1)/d`` of the tensor-local parameters."""
    d, t = mesh_shape["data"], mesh_shape["tensor"]
    bsh = BATCH // d * cfg.seq_len * cfg.d_model
    ar = all_reduce_bytes(bsh, t, itemsize)
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    data = 0
    for name, p in model.named_parameters():   # each parameter's tensor-local shard, split on data
        local = -(-p.numel() // t) if name.endswith(TP_SHARDED) else p.numel()
        data += 3 * all_gather_bytes(-(-local // d), d, itemsize)
    regather = 2 * cfg.n_layers * all_gather_bytes(bsh // t, t, itemsize) if sp else 0
    return {"blocks": 4 * cfg.n_layers * ar + regather, "total": (4 * cfg.n_layers + 2) * ar + regather, "data": data}


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------

def local_batches(mesh_shape: dict[str, int], rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of ``count`` global batches: its data coordinate's slice (rank-major mesh)."""
    d, t = mesh_shape["data"], mesh_shape["tensor"]
    lo, n = (rank // t) * (BATCH // d), BATCH // d
    return [tuple(x[lo:lo + n].contiguous() for x in token_batch(CFG, BATCH, s)) for s in range(count)]


def _count(side: str, built: Built, batch) -> tuple[float, dict]:
    """One step with its collectives counted: ``(loss, {"tensor": bytes, "data": bytes, "ops": {...}})``
    (collectives over the whole mesh, e.g. a global-norm scalar, are filed under ``data``)."""
    if side == "shardlib":
        with sl.count_collectives() as c:
            loss = built.step(batch)
        tensor = sum(b for axes, b in c.by_axes().items() if axes == ("tensor",))
        ops = {op: list(v) for op, v in c.by_op().items()}
        return loss, {"tensor": tensor, "data": c.bytes - tensor, "ops": ops}
    mode = CountCollectives()
    with mode:
        loss = built.step(batch)
    out = {"tensor": 0, "data": 0, "ops": {}}
    for (op, group), (n, b) in mode.by.items():
        axis = built.groups.get(group, "data")
        out[axis] += b
        key = f"{op}({axis})"
        out["ops"][key] = [out["ops"].get(key, [0, 0])[0] + n, out["ops"].get(key, [0, 0])[1] + b]
    return loss, out


def rank_main(label: str, warmup: int, steps: int) -> dict:
    """Both sides (shardlib where available) alive, warmed up, then stepped alternately."""
    torch.set_num_threads(1)
    mesh_shape, sp, zero, _ = CONFIGS[label]
    batches = local_batches(mesh_shape, dist.get_rank(), warmup + steps)
    built, errors = {}, {}
    for side in ("shardlib", "torch"):
        try:
            built[side] = SIDES[side](CFG, mesh_shape, sp, zero)
        except NotImplementedError as e:
            errors[side] = str(e)
    res = {"errors": errors, "bytes": {}, "planned": {}}
    for side, b in built.items():
        if b.plan is not None:
            res["planned"][side] = b.plan.comm_bytes_per_step()
    mine = alternate(built, batches, warmup, count=_count)
    res["times"] = {side: [t1 - t0 for t0, t1 in m["spans"]] for side, m in mine.items()}
    res["losses"] = {side: m["losses"] for side, m in mine.items()}
    res["bytes"] = {side: m["bytes"] for side, m in mine.items()}
    # the global batch's loss: the mean over data coordinates (tensor ranks hold equal values)
    for side, ls in res["losses"].items():
        x = torch.tensor(ls, dtype=torch.float64)
        dist.all_reduce(x)
        res["losses"][side] = (x / dist.get_world_size()).tolist()
    return res


def rss_main(label: str, side: str, steps: int) -> dict:
    """In a fresh world, one side alone: RSS before building and its peak (VmHWM) after ``steps``."""
    mesh_shape, sp, zero, _ = CONFIGS[label]
    batches = local_batches(mesh_shape, dist.get_rank(), steps)
    return rss_of(lambda: SIDES[side](CFG, mesh_shape, sp, zero), batches.__getitem__, steps)


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------

def summarize(label: str, per_rank: list[dict], rss: dict[str, list[dict]], ref: list[float]) -> dict:
    mesh_shape, sp, zero, torch_name = CONFIGS[label]
    r0 = per_rank[0]
    row = {"config": label, "mesh": mesh_shape, "sp": sp, "zero": zero, "torch_name": torch_name,
           "megatron": megatron_bytes(CFG, mesh_shape, sp=sp), "pending": sorted(r0["errors"])}
    for side, times in r0["times"].items():
        q = statistics.quantiles(times, n=4)
        row[side] = {
            "ms": 1e3 * statistics.median(times), "p25": 1e3 * q[0], "p75": 1e3 * q[2],
            "peak_mb": max(r["peak"] for r in rss[side]) / 2**20,
            "rise_mb": max(r["peak"] - r["before"] for r in rss[side]) / 2**20,
            "bytes": r0["bytes"][side], "planned": r0["planned"].get(side),
            "dloss": max_rel(r0["losses"][side], ref)}
    if "shardlib" in row and "torch" in row:
        row["ratio"] = row["shardlib"]["ms"] / row["torch"]["ms"]
    return row


def _cells(side: dict | None) -> list[str]:
    """The per-side cells of a row, or "pending"."""
    if side is None:
        return ["pending"] * 6
    fb = sl.format_bytes
    planned = "" if side["planned"] is None else f" ({'=' if side['planned'] == side['bytes']['tensor'] + side['bytes']['data'] else '≠'} planned)"
    return [f"{side['ms']:.0f} ({side['p25']:.0f}-{side['p75']:.0f})",
            f"{side['peak_mb']:.0f} (+{side['rise_mb']:.0f})",
            fb(side["bytes"]["tensor"]) + planned, fb(side["bytes"]["data"]), f"{side['dloss']:.1e}", ""]


def table(rows: list[dict]) -> str:
    fb = sl.format_bytes
    head = ("| config | d×t | torch | ms torch | ms shardlib | ratio | peak RSS/rank MB (+ rise) torch | shardlib "
            "| tensor-axis bytes/step torch | shardlib | Megatron: blocks 4L·AR(b·s·h) / + emb, head "
            "| data-axis bytes torch | shardlib | ZeRO-3 3·Ψ/t | max rel Δloss torch | shardlib |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        t, s, m = _cells(r.get("torch")), _cells(r.get("shardlib")), r["megatron"]
        data = r["mesh"]["data"] > 1
        ratio = f"**{r['ratio']:.2f}**" if "ratio" in r else "–"
        lines.append("| " + " | ".join([
            r["config"], f"{r['mesh']['data']}×{r['mesh']['tensor']}", r["torch_name"], t[0], s[0], ratio, t[1], s[1],
            t[2], s[2], f"{fb(m['blocks'])} / {fb(m['total'])}",
            t[3] if data else "–", s[3] if data else "–", fb(m["data"]) if data else "–", t[4], s[4]]) + " |")
    return "\n".join(lines)


def ops_table(rows: list[dict]) -> str:
    """Counted collectives per step, rank 0: ``op(axis) xcount bytes``."""
    lines = []
    for r in rows:
        for side in ("torch", "shardlib"):
            if side in r:
                ops = ", ".join(f"{k} x{n} {sl.format_bytes(b)}" for k, (n, b) in sorted(r[side]["bytes"]["ops"].items()))
                lines.append(f"- {r['config']} {side}: {ops}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    ref = reference_losses(CFG, BATCH, args.warmup + args.steps, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    rows = []
    for label in args.configs:
        t0 = time.time()
        mesh_shape = CONFIGS[label][0]
        n = mesh_shape["data"] * mesh_shape["tensor"]
        per_rank = sl.launch(rank_main, n, label, args.warmup, args.steps, threads=1)
        sides = list(per_rank[0]["times"])
        rss = {side: sl.launch(rss_main, n, label, side, args.warmup + 2, threads=1) for side in sides}
        rows.append(summarize(label, per_rank, rss, ref))
        for side, err in per_rank[0]["errors"].items():
            print(f"{label}: {side}: pending ({err})", file=sys.stderr, flush=True)
        print(f"{label}: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"\n{gpt_line(CFG)}, global batch {BATCH}, fp32 AdamW; torch {torch.__version__}, gloo, 1 thread per rank, "
          f"{os.cpu_count()} cores; median of {args.steps} steps each. Bytes: sent per rank per step (ring model), "
          f"rank 0. Δloss: relative to one process on the whole batch, every step (warm-up included).\n")
    print_tables(rows, table, ("Collectives counted in one step (rank 0)", ops_table))
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
