"""Ranks that part ways, caught in the step where they part (the failure behind DeepSpeed #7170).

Every collective a rank enters folds its (op, axes, bytes, tag) into a CRC-32 (``comm/core.fingerprint``; the
bytes of ragged moves left out: they differ by rank by design; with a tensor axis all bytes left out, as its
ranks' shards, and so their buckets, may differ in size where a dim does not divide). The step's scalar all-reduce — the one it
runs anyway — carries, per rank, two small hashes of that fingerprint (and its count) and their squares:
summed over the ranks that must have run the same collectives (``plan.fingerprint_axes()``), ``n·Σv² = (Σv)²``
holds exactly when every rank's hash is the same (the values are small integers: the fp32 sums are exact).
So a rank that skipped a ZeRO-3 unit, a gradient bucket, or took a tensor-parallel branch the others did not
fails that step on every rank, before its update, naming the step and what this rank ran against the plan;
no collective is added. Where the ranks' collectives no longer pair at all (one ran more of them), the
scalar all-reduce itself meets another collective: its sums are then garbage, and the check fails all the
same on the ranks it reaches; the others wait and fail at the collective timeout, and the launcher's report
shows every rank's last collectives side by side (``comm/progress.flight_report``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import zlib

from ..comm import core as comm
from ..comm import progress
from ..errors import CollectiveError
from ..planner.agreement import fields
from ..planner.traffic import FINGERPRINT_FLOATS, fingerprint_bits

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh
    from ..planner.plan import Plan


class Fingerprint:
    """The engine's side: the values a rank adds to the step's scalars, and the check of their sums."""

    def __init__(self, plan: Plan, mesh: Mesh):
        self.plan, self.mesh = plan, mesh
        self.axes = plan.fingerprint_axes()
        self.n = mesh.axis_size(self.axes) if self.axes else 1
        self.mask = (1 << fingerprint_bits(self.n)) - 1 if self.axes else 0
        # a tensor axis's ranks hold shards of different sizes where a dim does not divide (their buckets, their
        # gathers): compared by op, axes and tag alone
        self.bytes_too = plan.tensor_size == 1
        comm.fingerprint_reset()

    @property
    def on(self) -> bool:
        return bool(self.axes)

    def values(self) -> list[torch.Tensor]:
        """``[v1, v1², v2, v2²]`` of this rank's fingerprint so far (empty where off)."""
        if not self.on:
            return []
        crc, count = comm.fingerprint(self.bytes_too)
        h = (crc ^ (count * 0x9E3779B1)) & 0xFFFFFFFF
        v1, v2 = h & self.mask, (h >> 16) & self.mask
        return [torch.tensor(float(v), device=self.mesh.device) for v in (v1, v1 * v1, v2, v2 * v2)]

    def placeholders(self) -> list[torch.Tensor]:
        """As many zeros as ``values`` (where the sums are read from elsewhere: riding the last bucket)."""
        return [torch.zeros((), device=self.mesh.device)] * (FINGERPRINT_FLOATS if self.on else 0)

    def check(self, sums: torch.Tensor, step: int) -> None:
        """Raise where the ranks' fingerprints differ; start the next window."""
        comm.fingerprint_reset()
        if not self.on:
            return
        s1, q1, s2, q2 = sums.double().tolist()
        if self.n * q1 == s1 * s1 and self.n * q2 == s2 * s2:
            return
        raise CollectiveError(self.message(step))

    def message(self, step: int) -> str:
        recent = progress.current().get("recent", [])[-6:]
        ran = "; ".join(progress.entry_words(e) for e in recent)
        planned = {}
        for e in self.plan.comm_per_step(self.mesh.rank):
            if e.axes:
                key = f"{e.op}({', '.join(e.axes)})"
                planned[key] = planned.get(key, 0) + e.count
        plan_words = ", ".join(f"{k} x{v}" for k, v in list(planned.items())[:8])
        return (f"step {step}: the ranks over {self.axes} took different paths — the collectives each entered since "
                f"the last step's check differ (their fingerprints of op, axes, bytes disagree in the step's scalar "
                f"all-reduce): a data-dependent branch, a rank skipping a layer (a ZeRO-3 unit, a gradient bucket) or "
                f"running another micro-batch count. Nothing of this step was applied, on any rank. Rank "
                f"{self.mesh.rank} entered its last collectives as: {ran or 'none recorded'}; the plan's per step: "
                f"{plan_words}. Make every rank run the same layers and micro-batches (a branch on the data must "
                "agree across ranks); the launcher's report sets every rank's last collectives side by side.")


def check_agreement(plan: Plan, mesh: Mesh) -> None:
    """Before the engine's first set-up collective: every rank's plan states the same facts
    (``planner/agreement.fields``: the mesh, parameters, training, units, pipeline schedule, tensor plan,
    memory policies, experts), compared by their CRCs in one all-gather over the whole mesh. Ranks that built
    different plans — a rank-dependent schedule, micro-batch count or ZeRO stage — fail here, every one of
    them, naming the fields and which ranks hold which, instead of later at a message or gather that does not
    pair."""
    if mesh.size == 1:
        return
    mine = fields(plan)
    words = torch.tensor([[zlib.crc32(text.encode()) for _, text in mine]], dtype=torch.int64, device=mesh.device)
    every = comm.all_gather(words, mesh, mesh.axis_names, tag="setup").cpu().tolist()
    parted = []
    for i, (name, text) in enumerate(mine):
        groups: dict[int, list[int]] = {}
        for rank, row in enumerate(every):
            groups.setdefault(row[i], []).append(rank)
        if len(groups) > 1:
            sides = " vs ".join(f"ranks {', '.join(map(str, r))}" if len(r) > 1 else f"rank {r[0]}"
                                for r in groups.values())
            said = text if len(text) <= 240 else text[:240] + " ..."
            parted.append(f"{name} differs: {sides} — rank {mesh.rank}'s: {said}")
    if parted:
        raise CollectiveError(
            f"parallelize: the ranks built different plans — {' | '.join(parted)}. Every rank must run one plan: "
            "build it from the same config on every rank (a schedule, micro-batch count, ZeRO stage or rule "
            "chosen by rank makes their collectives and messages fail to pair). Nothing was set up.")
