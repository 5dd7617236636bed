"""``python -m shardlib.autoplan <overrides> --devices N [--top K] [--json]``: search every plan of a model on
N devices of a machine and print the fastest that fit, each with the Hydra overrides that run it.

    python -m shardlib.autoplan model=175b mesh=h100_64 train.batch=512 --devices 64 --top 5
    python -m shardlib.autoplan model=1t mesh=h100_16384 train.batch=4096 --devices 16384 --json
    python -m shardlib.autoplan model=tiny mesh=dp4 --devices 4 --top 3    # this machine's figures
    python -m shardlib.autoplan model=hf model.path=<folder> mesh=h100_64 --devices 64   # a transformers config

``model=`` picks the model (a preset, or ``model=hf model.path=<folder>``: a transformers causal LM's
``config.json``; its weights are not read), ``mesh=`` the machine (its figures: device_tflops, memory_gib, links, host
figures; its axes are ignored: the search picks them), ``train.batch`` / ``train.seq`` /
``train.precision`` the global batch, sequence and precision. ``--memory-gib`` overrides the device
memory budget. The search and its pruning: ``shardlib/planner/autoplan.py``. A bad input exits 2 with
a message naming the fix.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace

from ..errors import ShardingError
from ..planner.autoplan import (Costs, Machine, ModelShape, Priced, describe, plan_search, overrides, tiebreak)
from ..validate import positive_int


def model_shape(cfg, seq: int, dtype=None) -> ModelShape:
    """A reference GPT's ``ModelShape``: its parameters per block (of them its routed experts') and outside
    them counted, and what the embeddings, head and loss save for backward per sequence, measured on the
    meta device in ``dtype`` (a one-block model against a two-block one)."""
    import torch

    from ..models.gpt import GPT
    from ..planner.peak import activation_bytes

    h, v, r = cfg.d_model, cfg.vocab_size, cfg.mlp_ratio
    with torch.device("meta"):
        m = GPT(replace(cfg, n_layers=1), seed=None)
    block = sum(p.numel() for p in m.blocks[0].parameters())
    experts = sum(p.numel() for n, p in m.blocks[0].named_parameters() if ".experts." in f".{n}")
    pre = m.wte.weight.numel() + m.wpe.weight.numel()
    post = sum(p.numel() for p in m.parameters()) - block - pre
    acts = []
    for n in (1, 2):        # (the embeddings', head's and loss's bytes: a dense block of the same widths will do)
        with torch.device("meta"):
            m = GPT(replace(cfg, n_layers=n, n_experts=0), seed=None)
        if dtype is not None:
            m = m.to(dtype)
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        acts.append(activation_bytes(m, (ids, ids)))
    matrix = None
    if cfg.n_experts:        # a token multiplies attention, the router, its top_k experts and the shared ones
        matrix = 4 * h * h + cfg.n_experts * h + (cfg.top_k + cfg.shared_experts) * 3 * cfg.expert_width * h
    return ModelShape(cfg.n_layers, h, cfg.n_heads, v, seq, r, block, pre, post, 2 * acts[0] - acts[1], matrix,
                      cfg.n_experts, cfg.top_k if cfg.n_experts else 0, experts)


def hf_model_shape(run, dtype=None) -> ModelShape:
    """A transformers folder's ``ModelShape`` (``model=hf model.path=<folder>``): its config's sizes, one
    block's parameters and matrices, the rest split into the embeddings (first stage) and what follows
    the stack (last stage), and what the embeddings, head and loss save per sequence (a one-layer model
    against a two-layer one, on the meta device)."""
    import torch

    from ..frontend.hf import meta_model
    from ..planner.estimate import ModelDims
    from ..planner.peak import activation_bytes
    from ..planner.stack import auto_stack
    model = meta_model(run)
    dims = ModelDims.of(model)
    stack, _ = auto_stack(model)
    block = sum(p.numel() for p in next(iter(dict(model.named_modules())[stack].children())).parameters())
    total = sum(p.numel() for p in model.parameters())
    pre = model.get_input_embeddings().weight.numel()
    acts = []
    for n in (1, 2):
        m = _hf_layers(run, n)
        if dtype is not None:
            m = m.to(dtype)
        ids = torch.zeros(1, run.seq, dtype=torch.long, device="meta")
        acts.append(activation_bytes(m, {"input_ids": ids, "labels": ids}))
    return ModelShape(dims.layers, dims.d_model, dims.heads, dims.vocab, run.seq, 4, block, pre,
                      total - dims.layers * block - pre, 2 * acts[0] - acts[1], dims.block_matrix)


def _hf_layers(run, n: int):
    """The folder's model with ``n`` layers, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(run.model.path)
    config.use_cache, config.num_hidden_layers = False, n
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def hf_block_probe(run, precision: str):
    """``block_probe`` for a transformers folder: its two-layer model, given its family's Megatron table
    over ``tensor`` (vocab-parallel) where ``t > 1``, planned on ``pipe 2 x tensor t``."""
    import torch

    from ..algebra.mesh import AbstractMesh
    from ..planner.build import plan
    from ..planner.hf_tp import tp_table
    from ..planner.specs import shard

    def probe(t: int, sp: bool, recompute: str = "none") -> float:
        model = _hf_layers(run, 2)
        if t > 1:
            shard(tp_table(model, vocab=True, axis="tensor"))(model)
        ids = torch.zeros(1, run.seq, dtype=torch.long, device="meta")
        got = plan(model, AbstractMesh({"pipe": 2, **({"tensor": t} if t > 1 else {})}), rules={"layers": "pipe"},
                   batch={"input_ids": ids, "labels": ids}, microbatches=1, precision=precision,
                   sequence_parallel=sp and t > 1, recompute=recompute)
        return float(got.pipeline.block_saved[-1])
    return probe


def block_probe(cfg, seq: int, precision: str):
    """``(t, sp) -> bytes``: one block's saved bytes for one sequence on a tensor-``t`` shard, as the
    planner measures them (``pipeline_report.block_saved_bytes``): a two-block model of the same widths
    planned on ``pipe 2 x tensor t``."""
    import torch

    from ..algebra.mesh import AbstractMesh
    from ..models.gpt import GPT
    from ..planner.build import plan

    def probe(t: int, sp: bool, recompute: str = "none") -> float:
        with torch.device("meta"):
            model = GPT(replace(cfg, n_layers=2), seed=None)
        axes = {"pipe": 2, **({"tensor": t} if t > 1 else {})}
        rules = {"layers": "pipe", **({"heads": "tensor", "mlp": "tensor", "vocab": "tensor"} if t > 1 else {}),
                 **({"expert_mlp": "tensor"} if t > 1 and cfg.n_experts else {})}
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        got = plan(model, AbstractMesh(axes), rules=rules, batch=(ids, ids), microbatches=1, precision=precision,
                   sequence_parallel=sp and t > 1, recompute=recompute)
        return float(got.pipeline.block_saved[-1])
    return probe


def exact(priced: Priced, run) -> Priced:
    """``priced`` planned by the real planner (``frontend/dryrun.py``): the plan's memory and estimate
    (its step between the estimate's bounds by the machine's ``overlap``: ``StepEstimate.step_s``)."""
    from ..frontend.dryrun import dry_run
    d = dry_run(run)
    mem = dict(d.memory)
    mem["host"] = d.plan.memory_per_rank(d.worst_rank, kind="host")["total"] if d.plan.offload else 0
    est = d.estimate
    if est is None:
        return replace(priced, exact=True, notes=priced.notes + ["no estimate: the mesh lacks figures"])
    no, full = est.total_s, est.overlapped_s
    fits = d.fits if d.fits is not None else priced.fits
    return Priced(priced.cand, mem, est.step_s, no, full, bool(fits), exact=True, notes=list(d.notes))


def autoplan(*, model: str = "1b", devices: int, mesh: str = "h100_64", batch: int | None = None,
             seq: int | None = None, precision: str = "bf16", top: int = 5, memory_gib: float | None = None,
             keep: int | None = None, prune: bool = True, verify: bool = True, overrides_extra: tuple = ()) -> dict:
    """Search the plans of ``model`` (a ``model=`` preset) on ``devices`` devices of ``mesh``'s machine
    (its figures; its axes ignored) for a global ``batch`` of ``seq``-token sequences in ``precision``;
    return ``{"candidates": [...], "searched": n, "seconds": s}``, the ``top`` fastest that fit
    ``memory_gib`` (default: the machine's) with their predicted step, memory and Hydra overrides."""
    from ..frontend.config.run_config import run_config
    from .compose import check_overrides

    t0 = time.perf_counter()
    if problem := positive_int(devices, "autoplan: devices"):
        raise ShardingError(f"{problem}.", api="autoplan")
    base = [f"model={model}", f"mesh={mesh}", "parallel=zero3", f"train.precision={precision}", *overrides_extra]
    if batch is not None:
        base.append(f"train.batch={batch}")
    if seq is not None:
        base.append(f"train.seq={seq}")
    cfg = check_overrides(base)
    # the machine's figures; its axes are the search's (every axis a link may name kept, of size 1)
    cfg["mesh"]["axes"] = {"data": 1, **{a: 1 for a in cfg["mesh"].get("links") or {} if a not in ("data", "default")}}
    run = run_config(cfg)
    machine = Machine.of_mesh(run.mesh, devices)
    if memory_gib is not None:
        machine = replace(machine, memory=memory_gib * 2**30)
    import torch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if run.model.kind == "hf":               # a transformers folder: its config's sizes, its own blocks probed
        shape, probe = hf_model_shape(run, dtype), hf_block_probe(run, precision)
    else:
        shape, probe = model_shape(run.model.gpt(), run.seq, dtype), block_probe(run.model.gpt(), run.seq, precision)
    costs = Costs(shape, machine, batch=run.train.batch, precision=precision, block_fn=probe)
    best, priced = plan_search(costs, devices, keep=keep or max(2 * top, 8), prune=prune, model=model)
    results = []
    for got in best:
        if verify and len(results) >= top:
            break
        ov = overrides(got.cand, model=model, mesh=mesh, batch=run.train.batch, precision=precision,
                       moe=bool(shape.experts))
        ov += [o for o in overrides_extra if o not in ov]
        if seq is not None:
            ov.append(f"train.seq={seq}")
        if verify:
            try:
                got = exact(got, run_config(check_overrides(ov)))
            except ShardingError as e:
                got.notes.append(f"the planner refused it: {e.problems[0] if getattr(e, 'problems', None) else e}")
                continue
            if memory_gib is not None:
                got.fits = got.memory["total"] <= memory_gib * 2**30
            if not got.fits:
                continue
        results.append((got, ov))
    results.sort(key=lambda x: (x[0].step_s, tiebreak(x[0].cand)))
    out = []
    for got, ov in results[:top]:
        k = got.cand
        out.append({"mesh": k.axes, "parallel": describe(k),
                    "train": {"batch": run.train.batch, "precision": precision, "recompute": k.recompute,
                              **({"grad_accum": k.microbatches} if k.pipe == 1 else {})},
                    "overrides": ov, "step_ms": 1e3 * got.step_s,
                    "step_ms_bounds": {"no_overlap": 1e3 * got.no_overlap_s, "full_overlap": 1e3 * got.full_overlap_s},
                    "memory_gib": got.memory["total"] / 2**30, "fits": got.fits, "exact": got.exact,
                    "tokens_per_s": run.train.batch * run.seq / got.step_s})
    return {"candidates": out, "searched": priced, "seconds": time.perf_counter() - t0}





def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardlib.autoplan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, required=True, help="how many devices (ranks)")
    ap.add_argument("--top", type=int, default=5, help="how many plans to print")
    ap.add_argument("--memory-gib", type=float, default=None, help="the device memory budget (default: the mesh's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch._dynamo  # noqa: F401  (meta tensors' decompositions import it once per process)

    from ..frontend.config.run_config import ConfigError

    pick = {k: v for k, v in (o.split("=", 1) for o in args.overrides if "=" in o and not o.startswith(("+", "~")))}
    rest = [o for o in args.overrides if o.split("=", 1)[0] not in ("model", "mesh", "train.batch", "train.seq",
                                                                     "train.precision")]
    try:
        got = autoplan(model=pick.get("model", "tiny"), mesh=pick.get("mesh", "dp4"), devices=args.devices,
                       batch=int(pick["train.batch"]) if "train.batch" in pick else None,
                       seq=int(pick["train.seq"]) if "train.seq" in pick else None,
                       precision=pick.get("train.precision", "fp32"), top=args.top, memory_gib=args.memory_gib,
                       overrides_extra=tuple(rest))
    except (ConfigError, ShardingError, ValueError) as e:
        print("autoplan: " + str(e).removeprefix("autoplan: "), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(got))                     # one object, one line
        return 0
    print(f"searched {got['searched']:,} plans in {got['seconds']:.1f} s; the {len(got['candidates'])} fastest that fit:")
    for i, c in enumerate(got["candidates"], 1):
        p = c["parallel"]
        words = [f"ZeRO-{p['zero']}"] + (["SP"] if p["sequence_parallel"] else []) \
            + ([f"{p['schedule']} m={p['microbatches']}" + (f" v={p['virtual_stages']}" if p['virtual_stages'] > 1 else "")]
               if p["schedule"] else ([f"accumulation {p['microbatches']}"] if p["microbatches"] > 1 else [])) \
            + ([f"{p['recompute']} recompute"] if p["recompute"] != "none" else []) \
            + (["optimizer on the host"] if p["offload"] else []) \
            + ([f"HSDP replica {p['replica']}"] if p["replica"] > 1 else [])
        b = c["step_ms_bounds"]
        print(f"\n{i}. mesh {c['mesh']}: {', '.join(words)}\n   step {c['step_ms']:.0f} ms ({b['full_overlap']:.0f}-"
              f"{b['no_overlap']:.0f}), {c['tokens_per_s']:,.0f} tokens/s, {c['memory_gib']:.1f} GiB per device"
              f"{'' if c['exact'] else ' (analytic)'}\n   python examples/train_gpt.py " + " ".join(map(shlex.quote, c["overrides"])))
    return 0
