"""A transformers ``LlamaForCausalLM``, unchanged: shardlib vs torch's native composition, and loading a
pretrained folder straight into shards vs ``from_pretrained`` in every process.

    PYTHONPATH=. python3 benchmarks/bench_hf.py --steps 5 --json rows.json          # both parts
    PYTHONPATH=. python3 benchmarks/bench_hf.py --parts load --repeats 3             # the load part only

**Part 1, step time** (``--parts steps``; ``bench_3d.py``'s method: both sides in one ``sl.launch`` world,
built from the same seed, ``--warmup`` steps, then stepped alternately on the same global batches; step =
latest end - earliest start over the ranks; medians, ratio shardlib / torch; losses against one process
running ``model(**batch).loss`` on the whole global batch with the same AdamW). Model: ``STEP_CFG``, 8 decoder
layers cut 4 | 4, global batch 16 sequences of 64 tokens, 1F1B over 4 micro-batches per data rank, fp32.

* ``pp2``  pipe 2 (2 ranks);
* ``3D``   data 2 x pipe 2 x tensor 2 (8 ranks), ZeRO-3 on data, Megatron TP on tensor (q/k/v, gate/up
           column-parallel, o/down row-parallel; embeddings, norms and head replicated — the same on both sides).

shardlib: ``sl.shard({"model.layers": ("layers",), **tp})(llama)``, ``sl.plan(llama, mesh, rules={"layers":
"pipe"}, microbatches=4, schedule="1f1b", zero=3 for 3D)``, ``engine.step({"input_ids", "labels"})``: the
model's own loss, no code. torch: **hand-written stages** (``LlamaStage``: the model's own modules, each stage
recomputing the rotary tables and causal mask; only the hidden state crosses), ``PipelineStage`` +
``Schedule1F1B``, and for 3D torchtitan's order — ``parallelize_module`` on ``tp``, ``fully_shard`` per layer
and stage root on ``dp`` (``reshard_after_forward=False``). Why hand-written: **torch's ``pipeline()`` traces
the model but cannot run it** — the ``pipeline`` probe (a world of 2) splits the same Llama with
``split_spec={"m.model.layers.4": SplitPoint.BEGINNING}``, builds each rank's stage with ``pipe.build_stage``
and steps ``Schedule1F1B``; it records the values its split graph sends between stages (bytes per micro-batch)
and the error. With stage 0 unable to run a forward, ``parallelize_module``/``fully_shard`` on the traced
submodules have nothing to compose with.

**Part 2, loading** (``--parts load``): ``LOAD_CFG`` (hidden 768, 12 layers, 12 heads, vocab 32000: 134 M
parameters), saved once with ``save_pretrained`` (fp32 safetensors) to a temporary folder. Each side runs alone
in a fresh world (``--repeats`` times; medians) and every rank reports the seconds from the start of the
measured phase until the model is sharded and ready to step (after a barrier) and its peak RSS during it
(``VmHWM`` reset with ``clear_refs``, ``bench_memory.PeakRSS``), and the rise over the RSS at its start.
``from_pretrained`` maps the safetensors file and its fp32 tensors stay views of it until touched, so the torch
side reads every value it keeps (a sum) inside the measured phase; shardlib's values are copied in by the load.
shardlib's ``init=False`` allocates the rank's model states up front (parameters, gradients, AdamW moments:
``plan.memory_per_rank``, listed), where the torch side allocates gradients and moments at its first step:

* ``shardlib``       ``with torch.device("meta"): LlamaForCausalLM(cfg)``, ``sl.parallelize(model, plan,
                     optimizer=..., init=False)``, ``engine.load_pretrained(folder)``;
* ``shardlib-full``  ``from_pretrained(folder)`` in every rank, then ``sl.parallelize`` (today's path);
* ``torch``          ``from_pretrained(folder)`` in every rank, then data 2 x tensor 2: ``parallelize_module``
                     + ``fully_shard``; pipe 2: the rank's ``LlamaStage`` kept, the rest dropped.

Layouts: data 2 x tensor 2 ZeRO-3 (4 ranks) and pipe 2 (2 ranks). shardlib's first step after the load is
checked against one process's ``from_pretrained`` loss on the same batch.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_3d import Built, collect, counted_step, ops_lines, summarize, table    # benchmarks/ is on the path
from bench_memory import PeakRSS, proc_status
from harness import (common_options, gathered_alternate, launch, print_tables, rss_of, run_sides, train_losses,
                     write_rows)
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask

import shardlib as sl
from shardlib.planner.hf_tp import tp_table


def llama_config(vocab: int, hidden: int, inter: int, heads: int, kv: int, layers: int, seq: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=hidden // heads, num_hidden_layers=layers,
                       max_position_embeddings=seq, attention_dropout=0.0, tie_word_embeddings=False,
                       use_cache=False, pad_token_id=None, attn_implementation="sdpa", dtype=torch.float32)


STEP_CFG = llama_config(512, 128, 344, 4, 2, 8, 64)        # 2.45 M parameters
LOAD_CFG = llama_config(32000, 768, 2048, 12, 12, 12, 64)  # 134 M parameters
BATCH, M, LR = 16, 4, 1e-3
LOAD_BATCH = 4            # the load part's example and checked batch
# label: (mesh, torch's composition)
CONFIGS = {
    "pp2": ({"pipe": 2}, "hand-written stages + Schedule1F1B (pipeline() cannot run it)"),
    "3D": ({"data": 2, "pipe": 2, "tensor": 2},
           "hand-written stages + parallelize_module + FSDP2 + Schedule1F1B (pipeline() cannot run it)"),
}
LOAD_LAYOUTS = {"dp2xtp2": {"data": 2, "tensor": 2}, "pp2": {"pipe": 2}}
LOAD_SIDES = ("shardlib", "shardlib-full", "torch")
Batch = dict[str, torch.Tensor]


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def ids_batch(vocab: int, batch: int, seq: int, step: int) -> Batch:
    """Step ``step``'s batch of ``batch`` random sequences of ``seq`` tokens (seed ``1000 + step``), its own labels."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def llama_batch(cfg: LlamaConfig, batch: int, step: int) -> Batch:
    return ids_batch(cfg.vocab_size, batch, cfg.max_position_embeddings, step)


def build_llama(cfg: LlamaConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().train()


def hf_loss(model, batch: Batch) -> torch.Tensor:
    """A transformers causal LM's own loss of ``batch``: ``model(**batch).loss``."""
    return model(**batch).loss


def reference_losses(count: int) -> list[float]:
    """One process, the whole global batch, ``model(**batch).loss``: what every side must match."""
    torch.set_num_threads(1)
    return train_losses(build_llama(STEP_CFG), make_optimizer, (llama_batch(STEP_CFG, BATCH, s) for s in range(count)),
                        hf_loss)


# ---------------------------------------------------------------------------------------------
# shardlib: the model unchanged, a table entry and a rule
# ---------------------------------------------------------------------------------------------

def shardlib_plan(model: LlamaForCausalLM, shape: dict[str, int], cfg: LlamaConfig, batch: int | None):
    """Table and plan of either part: the layer stack named ``layers`` (cut by ``pipe``), Megatron TP where
    the mesh has ``tensor``, ZeRO-3 where it has ``data``. ``batch=None`` (the load part): no example batch,
    no activation accounting (the load is measured, not a step)."""
    table = {**(tp_table(model) if "tensor" in shape else {}), **({"model.layers": ("layers",)} if "pipe" in shape else {})}
    if table:
        sl.shard(table)(model)
    pipe = {"rules": {"layers": "pipe"}, "microbatches": M, "schedule": "1f1b"} if "pipe" in shape else {}
    return sl.plan(model, sl.Mesh(shape), zero=3 if "data" in shape else 0,
                   batch=None if batch is None else llama_batch(cfg, batch, 0), **pipe)


def run_shardlib(shape: dict[str, int]) -> Built:
    model = build_llama(STEP_CFG)
    plan = shardlib_plan(model, shape, STEP_CFG, BATCH)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer)
    return Built(lambda batch: float(engine.step(batch)), plan=plan)


# ---------------------------------------------------------------------------------------------
# torch: hand-written stages of the same modules
# ---------------------------------------------------------------------------------------------

class LlamaStage(torch.nn.Module):
    """Decoder layers ``[lo, hi)`` of a ``LlamaForCausalLM`` (its own modules), the embedding when ``first``,
    final norm and head when ``last``; ``LlamaModel.forward``'s math, each stage computing the positions,
    rotary tables and causal mask itself, so only the hidden state crosses stages."""

    def __init__(self, model: LlamaForCausalLM, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.config, self.first, self.last = model.config, first, last
        self.rotary = model.model.rotary_emb
        if first:
            self.embed = model.model.embed_tokens
        self.layers = torch.nn.ModuleList(model.model.layers[lo:hi])
        if last:
            self.norm, self.head = model.model.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        pe = self.rotary(x, position_ids=pos)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        return self.head(self.norm(x)) if self.last else x


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM targets: labels shifted left by one, ``-100`` at the end."""
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``ForCausalLMLoss`` on shifted targets (every micro-batch has the same count of counted tokens, so the
    mean of the micro-batch means is the batch's)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def torch_tp(stage: LlamaStage, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row,
            "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}
    for layer in stage.layers:
        parallelize_module(layer, tp_mesh, plan)


def torch_mesh(shape: dict[str, int]):
    """torch's mesh of ``shape`` (the same rank -> coordinate map as shardlib's), and its sub-meshes by axis."""
    from torch.distributed.device_mesh import init_device_mesh
    names = tuple(shape)
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=names)
    return {a: mesh[a] for a in names}


def torch_stage(model: LlamaForCausalLM, subs: dict, layers: int) -> tuple[LlamaStage, int, bool, bool]:
    p = subs["pipe"].size()
    s = subs["pipe"].get_local_rank()
    per = layers // p
    return LlamaStage(model, s * per, (s + 1) * per, s == 0, s == p - 1), s, s == 0, s == p - 1


def run_torch(shape: dict[str, int]) -> Built:
    from torch.distributed import pipelining as pp
    from torch.distributed.fsdp import fully_shard
    subs = torch_mesh(shape)
    model = build_llama(STEP_CFG)
    mod, s, first, last = torch_stage(model, subs, STEP_CFG.num_hidden_layers)
    del model
    if "tensor" in shape:
        torch_tp(mod, subs["tensor"])
    if "data" in shape:
        for layer in mod.layers:
            fully_shard(layer, mesh=subs["data"], reshard_after_forward=False)
        fully_shard(mod, mesh=subs["data"], reshard_after_forward=False)
    stage = pp.PipelineStage(mod, s, shape["pipe"], torch.device("cpu"), group=subs["pipe"].get_group())
    sched = pp.Schedule1F1B(stage, n_microbatches=M, loss_fn=lm_loss)
    opt = make_optimizer(mod.parameters())
    d = shape.get("data", 1)
    di = subs["data"].get_local_rank() if "data" in shape else 0
    rows = BATCH // d

    def step(batch: Batch) -> float | None:
        ids, labels = (batch[k][di * rows:(di + 1) * rows] for k in ("input_ids", "labels"))
        losses: list = []
        if first:
            sched.step(ids)
        elif last:
            sched.step(target=shifted(labels), losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if last else None

    return Built(step, groups={g.get_group().group_name: a for a, g in subs.items()})


SIDES = {"shardlib": run_shardlib, "torch": run_torch}


def rank_main(label: str, sides: list[str], warmup: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    batches = [llama_batch(STEP_CFG, BATCH, s) for s in range(warmup + steps)]
    built = {side: SIDES[side](CONFIGS[label][0]) for side in sides}
    return gathered_alternate(built, batches, warmup, count=counted_step)


def rss_main(label: str, side: str, steps: int) -> dict:
    """In a fresh world, one side alone: RSS before building and its peak (VmHWM) after ``steps``."""
    return rss_of(lambda: SIDES[side](CONFIGS[label][0]), lambda s: llama_batch(STEP_CFG, BATCH, s), steps)


# ---------------------------------------------------------------------------------------------
# torch's pipeline(): what it traces, what its stages send, whether it runs
# ---------------------------------------------------------------------------------------------

class Logits(torch.nn.Module):
    """``pipeline()`` traces a module of tensors: ``input_ids -> logits``."""

    def __init__(self, m: LlamaForCausalLM):
        super().__init__()
        self.m = m

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids).logits


def probe_pipeline(steps: int) -> dict:
    """In a world of 2: ``pipeline()`` + ``build_stage`` + ``Schedule1F1B`` on ``STEP_CFG``'s Llama; the split
    graph's values into stage 1 (name, shape, dtype, bytes per micro-batch), and the step's losses or error."""
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline
    torch.set_num_threads(1)
    model = build_llama(STEP_CFG)
    rows = BATCH // M
    batch = llama_batch(STEP_CFG, BATCH, 0)
    out: dict[str, Any] = {"crossing": [], "losses": None, "error": None}
    try:
        pipe = pipeline(Logits(model), mb_args=(batch["input_ids"][:rows],),
                        split_spec={f"m.model.layers.{STEP_CFG.num_hidden_layers // 2}": SplitPoint.BEGINNING})
    except Exception as e:   # noqa: BLE001  (a benchmark reports what torch does, whatever it raises)
        out["error"] = f"pipeline(): {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return out
    for n in pipe.get_stage_module(1).graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            out["crossing"].append({"name": n.name, "shape": list(v.shape), "dtype": str(v.dtype),
                                    "bytes": v.numel() * v.element_size()})
    stage = pipe.build_stage(dist.get_rank(), torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=M, loss_fn=lm_loss)
    losses: list = []
    try:
        for s in range(steps):
            b = llama_batch(STEP_CFG, BATCH, s)
            if dist.get_rank() == 0:
                sched.step(b["input_ids"])
            else:
                sched.step(target=shifted(b["labels"]), losses=losses)
        out["losses"] = [float(x) for x in losses]
    except Exception as e:   # noqa: BLE001
        cause = e.__cause__ or e
        out["error"] = f"stage {dist.get_rank()}: {type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
    return out


# ---------------------------------------------------------------------------------------------
# Part 2: loading a pretrained folder
# ---------------------------------------------------------------------------------------------

def save_folder(path: str) -> int:
    """``LOAD_CFG``'s Llama, random init, ``save_pretrained(path)`` (fp32 safetensors); its parameter count."""
    model = build_llama(LOAD_CFG)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def load_main(side: str, shape: dict[str, int], folder: str) -> dict:
    """One rank: the measured phase (seconds to a model ready to step, peak RSS), then shardlib's first step."""
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.barrier()
    peak = PeakRSS()
    peak.start()
    before = proc_status("VmRSS")
    t0 = time.perf_counter()
    engine = None
    if side == "torch":
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        subs = torch_mesh(shape)
        if "pipe" in shape:
            mod = torch_stage(model, subs, LOAD_CFG.num_hidden_layers)[0]
            del model
        else:
            torch_tp(model.model, subs["tensor"])
            for layer in model.model.layers:
                fully_shard(layer, mesh=subs["data"])
            fully_shard(model, mesh=subs["data"])
        with torch.no_grad():   # from_pretrained maps the file: read every value this rank keeps
            for q in (mod if "pipe" in shape else model).parameters():
                float((q.to_local() if hasattr(q, "to_local") else q).sum())
    else:
        if side == "shardlib":
            with torch.device("meta"):
                model = LlamaForCausalLM(LOAD_CFG)
        else:
            model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        plan = shardlib_plan(model, shape, LOAD_CFG, None)
        if side == "shardlib":
            engine = sl.parallelize(model, plan, optimizer=make_optimizer, init=False)
            engine.load_pretrained(folder)
        else:
            engine = sl.parallelize(model, plan, optimizer=make_optimizer)
    dist.barrier()
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "peak": peak.peak(), "before": before, "exact": peak.exact}
    if engine is not None:
        out["states"] = plan.memory_per_rank(dist.get_rank())["total"]
    peak.stop()
    if engine is not None:
        out["loss"] = float(engine.step(llama_batch(LOAD_CFG, LOAD_BATCH, 0)))
    return out


def load_reference(folder: str) -> float:
    """One process: ``from_pretrained`` and the loss of the first global batch."""
    torch.set_num_threads(2)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return float(model(**llama_batch(LOAD_CFG, LOAD_BATCH, 0)).loss)


def run_load(repeats: int, timeout: tuple[float, float], layouts: list[str], sides: list[str]) -> dict:
    out: dict[str, Any] = {"rows": []}
    with tempfile.TemporaryDirectory() as folder:
        out["params"] = save_folder(folder)
        out["files"] = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}
        out["reference_loss"] = load_reference(folder)
        for layout in layouts:
            shape = LOAD_LAYOUTS[layout]
            n = math.prod(shape.values())
            for side in sides:
                row = {"layout": layout, "side": side, "runs": [], "failed": None}
                for _ in range(repeats):
                    per, err = launch(load_main, n, side, shape, folder, timeout=timeout)
                    if per is None:
                        row["failed"] = err
                        break
                    row["runs"].append(per)
                if row["runs"]:
                    runs = row["runs"]
                    row["seconds"] = statistics.median(max(r["seconds"] for r in per) for per in runs)
                    row["peak_mib"] = [statistics.median(per[k]["peak"] for per in runs) / 2**20 for k in range(n)]
                    row["rise_mib"] = [statistics.median(per[k]["peak"] - per[k]["before"] for per in runs) / 2**20
                                       for k in range(n)]
                    if "states" in runs[0][0]:
                        row["states_mib"] = [runs[0][k]["states"] / 2**20 for k in range(n)]
                    losses = [r.get("loss") for r in runs[0]]
                    if losses[0] is not None:
                        row["dloss"] = max(abs(x - out["reference_loss"]) / out["reference_loss"] for x in losses)
                out["rows"].append(row)
                print(f"load {layout} {side}: {row.get('seconds', 'FAILED')} s {row.get('peak_mib')} "
                      f"{row['failed'] or ''}", file=sys.stderr, flush=True)
    return out


def load_table(load: dict) -> str:
    lines = ["| layout | side | seconds to sharded (median) | peak RSS MiB per rank (rise) | planned model states MiB "
             "per rank | max rel Δ first loss vs 1 process from_pretrained |", "|---|---|---|---|---|---|"]
    for r in load["rows"]:
        if r["failed"] and not r["runs"]:
            lines.append(f"| {r['layout']} | {r['side']} | FAILED ({r['failed']}) | – | – |")
            continue
        rss = " / ".join(f"{p:.0f} (+{q:.0f})" for p, q in zip(r["peak_mib"], r["rise_mib"]))
        st = " / ".join(f"{x:.0f}" for x in r["states_mib"]) if "states_mib" in r else "–"
        dl = f"{r['dloss']:.1e}" if "dloss" in r else "–"
        lines.append(f"| {r['layout']} | {r['side']} | {r['seconds']:.1f} | {rss} | {st} | {dl} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="*", default=["steps", "pipeline", "load"], choices=["steps", "pipeline", "load"])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--sides", nargs="*", default=["shardlib", "torch"], choices=["shardlib", "torch"])
    ap.add_argument("--load-layouts", nargs="*", default=list(LOAD_LAYOUTS), choices=list(LOAD_LAYOUTS))
    ap.add_argument("--load-sides", nargs="*", default=list(LOAD_SIDES), choices=list(LOAD_SIDES))
    ap.add_argument("--repeats", type=int, default=3, help="load part: fresh worlds per side and layout")
    common_options(ap, steps=5)
    args = ap.parse_args(argv)
    timeout = (args.timeout, args.world_timeout)
    report: dict[str, Any] = {"torch": torch.__version__, "cores": os.cpu_count()}
    t_start = time.time()
    if "steps" in args.parts:
        ref = reference_losses(args.warmup + args.steps)
        rows = []
        for label in args.configs:
            shape, torch_name = CONFIGS[label]
            n = math.prod(shape.values())
            row = {"config": label, "form": f"transformers Llama {label} ({' x '.join(f'{a} {v}' for a, v in shape.items())}"
                   f"{', ZeRO-3' if 'data' in shape else ''}, 1F1B m={M})", "baseline": torch_name, "ranks": n,
                   "results": {}, "failed": {}, "rss": {}, "load": [os.getloadavg()[0]]}
            row = summarize(run_sides(row, n, rank_main, rss_main, label, args.sides, args.warmup, args.steps,
                                      timeout, not args.no_rss, lambda per, side: collect(per[0], side, args.steps)),
                            ref)
            for side, err in row["failed"].items():
                print(f"{label}: {side}: {err}", file=sys.stderr, flush=True)
            rows.append(row)
        report["steps"] = rows
        print(f"\nLlama {STEP_CFG.num_hidden_layers} layers, hidden {STEP_CFG.hidden_size}, heads "
              f"{STEP_CFG.num_attention_heads} (kv {STEP_CFG.num_key_value_heads}), vocab {STEP_CFG.vocab_size}, seq "
              f"{STEP_CFG.max_position_embeddings}; global batch {BATCH}, 1F1B m={M} per data rank; fp32 AdamW; "
              f"{args.steps} alternating steps after {args.warmup} warm-up; torch {torch.__version__}, "
              f"{os.cpu_count()} cores.\n")
        print_tables(rows, table, ("Collectives counted in one step (rank 0)", ops_lines))
    if "pipeline" in args.parts:
        per, err = launch(probe_pipeline, 2, 1, timeout=(min(args.timeout, 30.0), args.world_timeout))
        probe = per[1] if per is not None else {"error": err, "crossing": []}
        probe["errors"] = [p["error"] for p in per] if per is not None else [err]
        report["pipeline"] = probe
        hidden = BATCH // M * STEP_CFG.max_position_embeddings * STEP_CFG.hidden_size * 4
        print("\ntorch pipeline(): values into stage 1 per micro-batch: "
              + ", ".join(f"{c['name']} {c['shape']} {c['dtype']} {sl.format_bytes(c['bytes'])}"
                          for c in probe["crossing"])
              + f" = {sl.format_bytes(sum(c['bytes'] for c in probe['crossing']))} (shardlib: the hidden state, "
              f"{sl.format_bytes(hidden)}); step: {probe['errors']}")
    if "load" in args.parts:
        report["load"] = run_load(args.repeats, timeout, args.load_layouts, args.load_sides)
        ld = report["load"]
        print(f"\nLoad: Llama {ld['params'] / 1e6:.0f} M parameters, fp32, files {ld['files']}; medians of "
              f"{args.repeats} fresh worlds per row; one process's first loss {ld['reference_loss']:.6f}.\n")
        print(load_table(ld))
    print(f"\nTotal {time.time() - t_start:.0f} s.", file=sys.stderr)
    write_rows([report], args.json)


if __name__ == "__main__":
    main()
