"""Dry-run planning: a ``RunConfig`` planned on an ``AbstractMesh`` with no process, priced.

``dry_run(run)`` builds the model on the meta device, plans it, and reports per rank the memory
(model states by kind, ZeRO-3's gathered units, the activations of the rank's pipeline stages and
what it adds up to against the device's memory), the bytes each rank sends per step per axis, the
pipeline bubble, and an estimated step time from the mesh's figures (``planner/estimate.py``). It
is what ``python -m shardlib.explain`` prints; the numbers are the plan's own, the same ones the
runtime is tested to hold and send.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algebra.mesh import AbstractMesh
from ..comm.core import format_bytes
from ..planner.estimate import (ModelDims, StepEstimate, estimate_step, pipeline_rank_flops, recompute_passes,
                                score_elements)
from .config.run_config import RunConfig


@dataclass
class DryRun:
    run: RunConfig
    plan: Any
    params: int
    memory: dict[str, int]            # the worst rank's: params, grads, optimizer, gathered, activations, total
    worst_rank: int
    bytes_per_axis: dict[str, int]    # rank 0 per step
    estimate: StepEstimate | None
    seconds: float                    # building on meta + planning + pricing
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        mem = self.run.mesh.memory_gib
        return None if mem is None else self.memory["total"] <= mem * 2**30


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Initializers on meta tensors write nothing; torch still runs them through its Python
    references (~1 ms each), so a meta build of an 80-layer model spent most of its time there."""

    _INIT = ("normal_", "uniform_", "zero_", "fill_", "trunc_normal_", "kaiming_uniform_")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self._INIT:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def _ranks_to_check(plan) -> list[int]:
    """One rank per pipe coordinate (stages differ), at tensor/data coordinate 0 and the last
    tensor coordinate (uneven widths make the last shard the smallest, the first the largest)."""
    mesh = plan.mesh
    out = set()
    pipe = plan.pipeline.axis if plan.pipeline is not None else None
    for c in range(plan.pipe_size):
        coords = [0] * mesh.ndim
        if pipe is not None:
            coords[mesh.axis_index(pipe)] = c
        out.add(mesh.rank_at(coords))
    return sorted(out)


def _activations(plan, model, run: RunConfig, rank: int) -> tuple[int | None, str | None]:
    from ..planner.pipeline_report import rank_activation_bytes
    got = rank_activation_bytes(plan, rank)
    if got is not None:
        return got, None
    if plan.context_activations is not None:       # measured on the rank's chunk (planner/context.py)
        return plan.context_activations, None
    if plan.tensor is None:
        from ..planner.peak import activation_bytes
        rows = run.train.batch // (plan.dp_size // plan.context_size * run.microbatches)
        ids = torch.zeros(rows, run.seq, dtype=torch.long, device="meta")
        batch = {"input_ids": ids, "labels": ids} if run.model.kind == "hf" else (ids, ids)
        from torch._subclasses.fake_tensor import DynamicOutputShapeException
        try:
            return activation_bytes(model, batch, plan=plan), None
        except DynamicOutputShapeException:      # a mixture of experts: how many rows each expert gets is data
            return None, ("activations: not estimated for a model whose shapes depend on its data (a mixture of "
                          "experts routes a data-dependent number of rows to each expert)")
    if plan.stack_saved is not None:        # each block measured on its shards; micro-batches run in turn
        return sum(plan.stack_saved[1]), None
    return None, "activations: not estimated for a tensor axis on a model without one stack of identical blocks"


def dry_run(run: RunConfig) -> DryRun:
    from ..models.gpt import GPT
    from .run import make_plan

    t0 = time.perf_counter()
    if run.model.kind == "hf":                # a transformers folder's config (its weights are not read)
        from .hf import meta_model
        model = meta_model(run)
    else:
        with torch.device("meta"), _SkipInit():
            model = GPT(run.model.gpt(), seed=None)
    dims = ModelDims.of(model)
    plan = make_plan(model, AbstractMesh(run.mesh.shape), run)
    if plan.mixed:                # activations are measured as a step makes them: in the compute dtype
        model = model.to(plan.compute_dtype)
    notes: list[str] = []
    worst, worst_rank = None, 0
    for r in _ranks_to_check(plan):
        states = plan.memory_per_rank(r)
        gathered = plan.transient_per_rank(r)["gathered"]
        acts, note = _activations(plan, model, run, r)
        if note and note not in notes:
            notes.append(note)
        mem = {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
               "gathered": gathered, "activations": acts or 0}
        mem["total"] = sum(mem.values())
        if worst is None or mem["total"] > worst["total"]:
            worst, worst_rank = mem, r
    by_axis: dict[str, int] = {}
    for e in plan.comm_per_step(0):
        if e.axes:
            by_axis["+".join(e.axes)] = by_axis.get("+".join(e.axes), 0) + e.total
    t = run.train
    tokens = t.batch * run.seq
    est = None
    if run.mesh.device_tflops is not None and (run.mesh.links or run.mesh.size == 1):
        flops = dims.flops(seq=run.seq, tokens=tokens, recompute=t.recompute)
        mc = run.mesh.at(run.mesh.size)          # calibrated figures for this many ranks, where measured
        links = {a: (lk.bandwidth, lk.latency) for a, lk in mc.links}
        pp = plan.pipeline
        micro = pp.microbatches if pp is not None else run.train.grad_accum
        per_rank, blocks = None, dims.layers
        if pp is not None:             # the busiest stage sets the pace
            per_rank, blocks = pipeline_rank_flops(plan, layers=dims.layers, d_model=dims.d_model, seq=run.seq,
                                                   vocab=dims.vocab, tokens=tokens, mlp_ratio=dims.mlp_ratio,
                                                   recompute=t.recompute, block_matrix=dims.block_matrix)
        passes = blocks * micro * recompute_passes(t.recompute)
        scores = score_elements(blocks=blocks, microbatches=micro, heads=dims.heads, seq=run.seq,
                                sequences=t.batch // (plan.dp_size * micro), tensor=plan.tensor_size,
                                recompute=t.recompute)
        est = estimate_step(plan, flops=flops, tokens=tokens, device_flops=mc.rank_tflops * 1e12, links=links,
                            layer_s=(mc.layer_us or 0.0) * 1e-6, layer_passes=passes, flops_per_rank=per_rank,
                            hop_s=dict(mc.hop_s), overlap=mc.overlap or 0.0,
                            score_s=(mc.score_ns or 0.0) * 1e-9, scores=scores,
                            **{k: getattr(mc, f"{k}_gbps") * 1e9 for k in ("host", "disk", "host_update")
                               if getattr(mc, f"{k}_gbps") is not None})
        if plan.offload and (mc.host_gbps is None or (plan.disk_bytes() and mc.disk_gbps is None)):
            notes.append("offload copies: not priced — the mesh preset gives no host_gbps / disk_gbps")
    else:
        notes.append("step time: not estimated — the mesh preset gives no device_tflops or links")
    n = sum(p.numel for p in plan.params)
    return DryRun(run, plan, n, worst, worst_rank, by_axis, est, time.perf_counter() - t0, notes)


def report(d: DryRun) -> str:
    run, plan, mem = d.run, d.plan, d.memory
    mesh = run.mesh
    lines = [f"model={run.model.name} ({d.params / 1e9:.3g} B parameters), mesh={mesh.name} "
             f"{mesh.shape} ({mesh.size} {mesh.device} devices), parallel={run.parallel.name}; "
             f"global batch {run.train.batch} x {run.seq} tokens, {run.train.precision}",
             "", f"memory per rank (the largest, rank {d.worst_rank}):"]
    for k in ("params", "grads", "optimizer", "gathered", "activations"):
        lines.append(f"  {k:<12}{format_bytes(mem[k]):>12}")
    fits = d.fits
    lines.append(f"  {'total':<12}{format_bytes(mem['total']):>12}"
                 + ("" if fits is None else f"  of {mesh.memory_gib:g} GiB: {'fits' if fits else 'DOES NOT FIT'}")
                 + ("  (device)" if plan.offload else ""))
    if plan.offload:                     # memory kinds: what the offloaded states take where they live
        for kind in ("host", "disk"):
            got = plan.memory_per_rank(d.worst_rank, kind=kind)["total"]
            cap = mesh.host_memory_gib if kind == "host" else None
            if kind == "disk" and got:
                cap = None
                lines.append(f"  {kind:<12}{format_bytes(got):>12}  (x2 generations x {mesh.size} ranks = "
                             f"{format_bytes(plan.disk_bytes())} under offload_dir"
                             + (f"; {mesh.disk_gbps:g} GB/s per rank)" if mesh.disk_gbps else ")"))
                continue
            lines.append(f"  {kind:<12}{format_bytes(got):>12}"
                         + ("" if cap is None or not got else f"  of {cap:g} GiB: "
                            f"{'fits' if got <= cap * 2**30 else 'DOES NOT FIT'}"))
        lines.append("  offload: " + ", ".join(f"{s} -> {k}" for s, k in plan.offload))
    lines += ["", "bytes sent per step by rank 0: " + (", ".join(f"{a} {format_bytes(b)}" for a, b in
                                                               d.bytes_per_axis.items()) or "none")]
    pp = plan.pipeline
    if pp is not None:
        lines.append(f"pipeline: {pp.schedule}, p={pp.size}, m={pp.microbatches}, v={pp.virtual}: bubble "
                     f"{d.estimate.idle if d.estimate else 0:.3f} of the step")
    e = d.estimate
    if e is not None:
        comm = ", ".join(f"{a} {s * 1e3:.1f} ms" for a, s in sorted(e.comm_s.items(), key=lambda x: -x[1]))
        lines += ["", f"estimated step: compute {e.compute_s * 1e3:.1f} ms ({e.flops / 1e15:.3g} PFLOP per step, "
                      f"{mesh.rank_tflops:g} TFLOP/s sustained per rank"
                      + (f"; of it attention scores {e.scores_s * 1e3:.1f} ms at {mesh.score_ns:g} ns per element"
                         if e.scores_s else "") + ")"
                      + (f" / (1 - bubble {e.idle:.3f}) = {e.compute_with_bubble_s * 1e3:.1f} ms" if e.idle else ""),
                  f"  + communication {sum(e.comm_s.values()) * 1e3:.1f} ms ({comm or 'none'})",
                  *(["  + offload: " + ", ".join(f"{k} copies {s * 1e3:.1f} ms" for k, s in e.copy_s)
                     + (f", host update {e.update_s * 1e3:.1f} ms" if e.update_s else "")]
                    if e.copy_s or e.update_s else []),
                  f"  = {e.total_s * 1e3:.1f} ms without overlap, {e.overlapped_s * 1e3:.1f} ms with full overlap; "
                  f"{e.tokens_per_s:,.0f} to {e.tokens / e.overlapped_s:,.0f} tokens/s"]
    lines += [f"note: {n}" for n in d.notes]
    lines.append(f"\nplanned in {d.seconds:.2f} s (model on the meta device, no process)")
    return "\n".join(lines)
