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
    groups: dict[tuple[str, ...], list] = {}
    for s in engine.states:
        if s.trainable and s.master is not None:
            axes = replica_axes(engine, s.name)
            if axes:
                groups.setdefault(axes, []).append(s)
    out: list[str] = []
    mesh = engine.mesh
    with engine._offload_mapped():
        for axes in sorted(groups, key=lambda a: [mesh.axis_names.index(x) for x in a]):
            states = groups[axes]
            mine = torch.stack([_fingerprint(s.master.to("cpu")) for s in states]).to(mesh.device)
            every = comm.all_gather(mine.unsqueeze(0), mesh, axes).cpu()      # (k, n, 2)
            ranks = mesh.group_ranks(mesh.rank, mesh.canonical_axes(axes))
            for i, s in enumerate(states):
                differ = [r for j, r in enumerate(ranks) if not torch.equal(every[j, i], every[0, i])]
                if differ:
                    vals = comm.all_gather(s.master.detach().to(mesh.device).reshape(1, -1).float(), mesh, axes).cpu()
                    gap = float((vals - vals[0]).abs().max())
                    out.append(f"{s.name}: its copies over {axes} differ — rank {ranks[0]} and rank(s) {differ} "
                               f"hold different values (max |difference| {gap:.3g})")
    return out


def check_replicas(engine: Engine) -> None:
    """Raise ``ShardingError`` naming the first parameter whose replicated copies are not bit-equal
    (see the module doc); nothing when every copy agrees. A collective: call it on every rank."""
    found = replica_mismatches(engine)
    if found:
        raise ShardingError(f"check_replicas: after step {engine.step_count}, {found[0]}"
                            + (f"; {len(found) - 1} more parameter(s) differ" if len(found) > 1 else "")
                            + ". A replicated parameter whose gradient is a partial sum that was not reduced "
                            "drifts this way: report the model and the plan.", api=None)
