"""Replicated copies are bit-equal: the check that catches a drifting replica a loss comparison misses.

A trainable parameter's fp32 master is split over the mesh axes its optimizer layout names (the tensor
axis where its spec splits it, ``data`` where ZeRO shards it) and *replicated* over every other axis of
size > 1 but the pipe axis (whose ranks hold other stages). After a step, every copy must be the same
bits: a partial gradient left unreduced, a rank that skipped an update or a nondeterministic kernel
shows here first. Each rank fingerprints each master piece (two integer sums of its bit pattern, one
position-weighted: any changed bit changes them), all-gathers the fingerprints once per set of
replica axes, and the first parameter whose copies differ is named with the ranks and the size of the
difference (its values gathered only then). Cost: one small all-gather per set of axes, and a pass
over the masters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm import core as comm
from ..errors import ShardingError
from ..planner.peft import uses_axis

if TYPE_CHECKING:
    from .engine import Engine


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bit pattern (as int32 words; wrapping): plain and position-weighted."""
    flat = t.detach().reshape(-1).contiguous()
    nbytes = flat.numel() * flat.element_size()
    words = flat.view(torch.uint8)[: nbytes - nbytes % 4].view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), dtype=torch.int64, device=words.device) % 65521 + 1
    return torch.stack([words.sum(), (words * weights).sum()]) if words.numel() else torch.zeros(2, dtype=torch.int64)


def replica_axes(engine: Engine, name: str) -> tuple[str, ...]:
    """The mesh axes (size > 1, mesh order) over which parameter ``name``'s master is replicated."""
    gplan = engine.global_plan
    gp = gplan.param(name)
    mesh = engine.mesh
    pipe = gplan.pipeline.axis if gplan.pipe_size > 1 else None
    if pipe is not None and name in gplan.pipeline.tied:
        pipe = None              # tied across the first and last stage: one tensor, held by both
    spec = gp.optim.spec
    return tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1 and a != pipe and not uses_axis(spec, a))


def replica_mismatches(engine: Engine) -> list[str]:
    """Every trainable parameter whose master copies differ across their replica axes, one line each
    (the same list on every rank of a group). A collective over each set of replica axes."""
    gplan, mesh = engine.global_plan, engine.mesh
    pipe = gplan.pipeline if gplan.pipe_size > 1 else None
    tied = set(pipe.tied) if pipe is not None else set()
    by_name = {s.name: s for s in engine.states if s.trainable and s.master is not None}
    groups: dict[tuple[str, ...], list] = {}
    for name, s in by_name.items():
        axes = replica_axes(engine, name)
        if axes and name not in tied:
            groups.setdefault(axes, []).append((name, s))
    # a weight tied across the first and last stage is compared over the pipe axis: every pipe rank takes
    # part in the gather (the stages between, which hold none of it, with a placeholder)
    for name in (pipe.tied if pipe is not None else ()):
        groups.setdefault(replica_axes(engine, name), []).append((name, by_name.get(name)))
    out: list[str] = []
    with engine.offload_mapped():
        for axes in sorted(groups, key=lambda a: [mesh.axis_names.index(x) for x in a]):
            entries = groups[axes]
            mine = torch.stack([_fingerprint(s.master.to("cpu")) if s is not None else torch.zeros(2, dtype=torch.int64)
                                for _, s in entries]).to(mesh.device)
            every = comm.all_gather(mine.unsqueeze(0), mesh, axes).cpu()      # (k, n, 2)
            ranks = mesh.group_ranks(mesh.rank, mesh.canonical_axes(axes))
            for i, (name, s) in enumerate(entries):
                holders = [j for j, r in enumerate(ranks) if name not in tied
                           or mesh.coord(r, pipe.axis) in (0, pipe.size - 1)]
                differ = [ranks[j] for j in holders if not torch.equal(every[j, i], every[holders[0], i])]
                if differ:
                    out.append(f"{name}: its copies over {axes} differ — rank {ranks[holders[0]]} and rank(s) "
                               f"{differ} hold different values" + _gap(engine, s, axes, name in tied))
    return out


def _gap(engine: Engine, s, axes: tuple[str, ...], tied: bool) -> str:
    """`` (max |difference| x)`` of a parameter whose copies differ (its values gathered; not for a tied
    weight, which the stages between do not hold)."""
    if tied:
        return ""
    mesh = engine.mesh
    vals = comm.all_gather(s.master.detach().to(mesh.device).reshape(1, -1).float(), mesh, axes).cpu()
    return f" (max |difference| {float((vals - vals[0]).abs().max()):.3g})"


def check_replicas(engine: Engine) -> None:
    """Raise ``ShardingError`` naming the first parameter whose replicated copies are not bit-equal
    (see the module doc); nothing when every copy agrees. A collective: call it on every rank."""
    found = replica_mismatches(engine)
    if found:
        raise ShardingError(f"check_replicas: after step {engine.step_count}, {found[0]}"
                            + (f"; {len(found) - 1} more parameter(s) differ" if len(found) > 1 else "")
                            + ". A replicated parameter whose gradient is a partial sum that was not reduced "
                            "drifts this way: report the model and the plan.", api=None)
