"""The planner: model + mesh + policies -> ``Plan`` (pure data, testable without processes).

Every parameter has four layouts, and the ZeRO stages are choices of them on the ``data`` axis:

==============  ======  ======  =======  ======================
state           DP      ZeRO-1  ZeRO-2   ZeRO-3
==============  ======  ======  =======  ======================
params at rest  R       R       R        S(data)
compute         R       R       R        R, gathered per unit
local grads     kept    kept    per-bucket  per-unit
grads           R       S(data) S(data)  S(data)
optim + master  R       S(data) S(data)  S(data)
==============  ======  ======  =======  ======================

``R`` = replicated over ``data``, ``S(data)`` = dim 0 split over ``data`` (ceil chunks; uneven
sizes work). The planner derives the traffic from these layouts: a replicated gradient is
all-reduced, a sharded one reduce-scattered; a sharded optimizer state with replicated params
means the updated shards are all-gathered; sharded params are all-gathered before each use.

Model-state bytes per rank follow (ZeRO paper, Ψ = parameter count, N = data degree, K = bytes
of optimizer state and master copy per parameter — 12 for Adam in mixed precision):

* DP: ``(2 + 2 + K)Ψ``  ·  ZeRO-1: ``4Ψ + KΨ/N``  ·  ZeRO-2: ``2Ψ + (2 + K)Ψ/N``  ·  ZeRO-3: ``(2 + 2 + K)Ψ/N``

in mixed precision (2-byte params and grads); in fp32 the 2s become 4s and the master copy is
the parameter itself. Communication per rank per step, ring model: DP and ZeRO-1/2 ``2Ψ(N-1)/N``
elements, ZeRO-3 ``3Ψ(N-1)/N`` (gather forward, gather backward, reduce-scatter grads).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from . import comm
from .comm import format_bytes
from .errors import Problems, ShardingError, ShardingTypeError
from .layout import Layout
from .mesh import AbstractMesh
from .spec import PartitionSpec

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# bytes of optimizer state per parameter (fp32 state tensors)
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4, "rmsprop": 4, "adagrad": 4}


@dataclass(frozen=True)
class StateLayouts:
    """Where each training state lives on the data axis. ``None`` = replicated, an axis name =
    dim 0 split over that axis. ``keep_local_grads``: the full local gradient buffers persist
    between steps (DP, ZeRO-1) instead of living only until their bucket is reduced."""

    params: str | None = None
    grads: str | None = None
    optim: str | None = None
    keep_local_grads: bool = True

    @classmethod
    def zero(cls, stage: int, axis: str = "data") -> StateLayouts:
        """The layouts that ZeRO stage ``stage`` (0 = plain data parallel) names."""
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ShardingTypeError(f"plan: zero must be an int — got {type(stage).__name__} {stage!r}; expected "
                                    "0 (data parallel), 1 (optimizer state sharded), 2 (+ gradients) or 3 "
                                    "(+ parameters).")
        if stage not in (0, 1, 2, 3):
            raise ShardingError(f"plan: zero={stage!r} is out of range — expected 0 (data parallel), 1 "
                                "(optimizer state sharded), 2 (+ gradients) or 3 (+ parameters).")
        return [cls(None, None, None, True), cls(None, axis, axis, True),
                cls(None, axis, axis, False), cls(axis, axis, axis, False)][stage]

    @property
    def stage(self) -> int | None:
        """The ZeRO stage these layouts are, or None for a combination with no stage number."""
        for k in range(4):
            if self == StateLayouts.zero(k, self.optim or self.grads or self.params or "data"):
                return k
        return None

    def validate(self, mesh: AbstractMesh) -> None:
        with Problems("plan", ShardingError) as p:
            for name in ("params", "grads", "optim"):
                axis = getattr(self, name)
                if axis is not None and axis not in mesh.axis_names:
                    p.add(f"plan: states.{name} = {axis!r} is not an axis of the mesh {mesh.axis_sizes}.")
            if self.params is not None and (self.grads != self.params or self.optim != self.params):
                p.add(f"plan: parameters sharded at rest over {self.params!r} need gradients and optimizer "
                      f"state sharded the same way — got grads={self.grads!r}, optim={self.optim!r}. Use "
                      "zero=3, or keep the parameters replicated.")
            if self.grads is not None and self.optim != self.grads:
                p.add(f"plan: gradients sharded over {self.grads!r} need the optimizer state sharded the same "
                      f"way — got optim={self.optim!r}. A rank can only update what it holds.")
            if self.grads is None and not self.keep_local_grads:
                p.add("plan: keep_local_grads=False frees each local gradient once it is reduced, which saves "
                      "memory only when the reduced gradient is a shard — got grads=None (replicated). Shard the "
                      "gradients (grads='data', i.e. zero=2) or keep the local gradients.")
            if self.params is not None and self.keep_local_grads:
                p.add(f"plan: parameters sharded over {self.params!r} are gathered per unit and their full "
                      "gradients freed once reduce-scattered — got keep_local_grads=True. Use zero=3 "
                      "(keep_local_grads=False).")


@dataclass(frozen=True)
class ParamPlan:
    """One parameter: its shape, unit, bucket and the layouts of its states."""

    name: str
    shape: tuple[int, ...]
    unit: str
    bucket: int | None
    trainable: bool
    rest: Layout      # compute-dtype copy at rest
    compute: Layout   # compute-dtype copy while used
    grad: Layout      # gradient after reduction
    optim: Layout     # fp32 master copy and optimizer state

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, layout: Layout, rank: int) -> int:
        return math.prod(layout.local_shape(self.flat_shape, rank))

    def padded_numel(self, layout: Layout) -> int:
        """Elements of one rank's shard padded to ``ceil`` (what a collective moves per rank)."""
        return math.prod(layout.padded_local_shape(self.flat_shape))

    @property
    def flat_shape(self) -> tuple[int, ...]:
        """Shape used for sharding (0-d parameters are treated as 1 element)."""
        return self.shape if self.shape else (1,)


@dataclass(frozen=True)
class UnitPlan:
    """A module subtree whose parameters are gathered and freed together (an FSDP wrap unit)."""

    name: str                     # qualified module name; "" is the root unit (everything else)
    params: tuple[str, ...]
    reshard_after_forward: bool
    recompute: bool


@dataclass(frozen=True)
class CommEntry:
    """One collective of a step: ``count`` times ``op`` over ``axes``, ``bytes`` each (per rank)."""

    phase: str        # "forward" | "backward" | "step"
    what: str         # "params" | "grads" | "scalars"
    op: str
    axes: tuple[str, ...]
    bytes: int
    count: int = 1
    where: str = ""   # unit or bucket
    riders: int = 0   # bytes of the step's scalars carried in this collective (see Plan.scalars_ride_gradients)

    @property
    def total(self) -> int:
        return self.bytes * self.count

    def __str__(self) -> str:
        times = f" x{self.count}" if self.count > 1 else ""
        return (f"{self.phase:<8} {self.what:<7} {self.op}({', '.join(self.axes)}){times} "
                f"{format_bytes(self.total)}" + (f"  [{self.where}]" if self.where else ""))


@dataclass(frozen=True)
class Plan:
    """Per-parameter layouts, units, buckets, and what a step costs. Pure data."""

    mesh: AbstractMesh
    data_axis: str
    states: StateLayouts
    precision: str
    reduce_dtype: torch.dtype
    grad_accum: int
    clip_grad_norm: float | None
    optimizer_state_bytes: int
    bucket_bytes: int
    params: tuple[ParamPlan, ...]
    units: tuple[UnitPlan, ...]
    batch: Layout = field(repr=False)

    # ---- basics --------------------------------------------------------------------------------
    @property
    def zero(self) -> int | None:
        return self.states.stage

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def data_size(self) -> int:
        return self.mesh.axis_size(self.data_axis)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def buckets(self) -> list[list[ParamPlan]]:
        """Gradient buckets (replicated parameters), in the order they are reduced."""
        out: dict[int, list[ParamPlan]] = {}
        for p in self.params:
            if p.bucket is not None:
                out.setdefault(p.bucket, []).append(p)
        return [out[b] for b in sorted(out)]

    def unit_params(self, unit: str) -> list[ParamPlan]:
        return [p for p in self.params if p.unit == unit]

    def _rank(self, rank: int | None) -> int:
        return rank if rank is not None else getattr(self.mesh, "rank", 0)

    @property
    def num_trainable(self) -> int:
        """Parameters that get gradients and optimizer state (``requires_grad``)."""
        return sum(p.numel for p in self.params if p.trainable)

    # ---- memory --------------------------------------------------------------------------------
    def memory_per_rank(self, rank: int | None = None, *, at: str = "rest") -> dict[str, int]:
        """Model-state bytes this rank holds, by kind: ``params`` (compute-dtype copies),
        ``grads``, ``optimizer`` (fp32 master copy where it is not the parameter itself, plus
        optimizer state), and their ``total``; apart from them, ``buffers``: the slots of the
        step's scalars kept at the end of the last gradient bucket when they ride its all-reduce
        (``scalars_ride_gradients``; 4 bytes a scalar).

        ``at="rest"``: between steps (the ZeRO-paper terms). ``at="update"``: while the optimizer
        steps, when ``grads`` also holds the gradients the optimizer reads where they are not
        kept between steps — fp32 copies where gradients are reduced in a 2-byte dtype, and
        with fp32 reduction under ZeRO-1 the reduce-scatter outputs (padded rows) that the
        masters' gradients view. ZeRO-3's
        gathered units are transient as well: see ``transient_per_rank``."""
        if at not in ("rest", "update"):
            raise ShardingError(f"memory_per_rank: at={at!r} — expected 'rest' or 'update'.")
        rank = self._rank(rank)
        c = self.compute_dtype.itemsize
        g = self.reduce_dtype.itemsize
        params = grads = optim = 0
        for p in self.params:
            params += p.local_numel(p.rest, rank) * c
            if not p.trainable:
                continue
            if self.states.keep_local_grads:
                grads += p.numel * c                      # full local gradients (compute dtype) persist
            else:
                grads += p.local_numel(p.grad, rank) * g  # only the reduced shard persists
            n_opt = p.local_numel(p.optim, rank)
            master = 4 * n_opt if self.mixed else 0       # in fp32 the parameter is the master
            optim += master + self.optimizer_state_bytes * n_opt
            if at == "update":
                if self.reduce_dtype != torch.float32:
                    grads += 4 * n_opt                    # fp32 copies of the reduced gradients
                elif self.states.keep_local_grads and (self.states.grads is not None
                                                       or self.reduce_dtype != self.compute_dtype):
                    # the master's gradient views the collective's output: ZeRO-1's reduced
                    # (padded) rows, or a full all-reduced gradient kept apart from the local one
                    grads += (p.padded_numel(p.grad) if self.states.grads is not None else p.numel) * g
        buffers = 4 * self.scalars_per_step() if self.scalars_ride_gradients and self._grad_views else 0
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim,
                "buffers": buffers}

    @property
    def _grad_views(self) -> bool:
        """Replicated-parameter gradients live in persistent bucket buffers (views into them)."""
        return (self.states.params is None and self.states.keep_local_grads
                and self.reduce_dtype == self.compute_dtype)

    def gather_schedule(self) -> tuple[str, ...]:
        """ZeRO-3: the order in which one micro-step starts gathering (``G``), waits for and
        unpacks (``W``) and frees (``F``) its units, as the runtime runs it: the root when the
        model's forward starts; each unit just before its forward, prefetching the next one; in
        backward each unit again (unless it stayed gathered), prefetching the one before it, and
        freed once its gradients are reduced; the root last. Empty when parameters are replicated.
        """
        if self.states.params is None:
            return ()
        root = next((u for u in self.units if u.name == ""), None)
        units = [u for u in self.units if u.name != ""]
        status = {u.name: "free" for u in self.units}
        events: list[str] = []

        def name(u: UnitPlan) -> str:
            return u.name or "<root>"

        def gather(u):
            if u is not None and status[u.name] == "free":
                events.append(f"G({name(u)})")
                status[u.name] = "gathering"

        def wait(u):
            if status[u.name] != "gathered":
                gather(u)
                events.append(f"W({name(u)})")
                status[u.name] = "gathered"

        def free(u):
            if status[u.name] == "gathered":
                events.append(f"F({name(u)})")
                status[u.name] = "free"

        if root is not None:
            wait(root)
        if units:
            gather(units[0])
        for i, u in enumerate(units):                       # forward
            gather(u)
            gather(units[i + 1] if i + 1 < len(units) else None)
            wait(u)
            if u.reshard_after_forward:
                free(u)
        for i in reversed(range(len(units))):               # backward
            u = units[i]
            gather(u)
            gather(units[i - 1] if i > 0 else None)
            wait(u)
            free(u)
        if root is not None:
            free(root)
        return tuple(events)

    def transient_per_rank(self, rank: int | None = None) -> dict[str, int]:
        """ZeRO-3: the peak bytes of gathered parameters plus the all-gather output buffers in
        flight, replaying ``gather_schedule``: a gather holds its unit's padded output buffer
        (``N x`` the padded shard) until its wait unpacks it into the parameters (both held for a
        moment), a free releases the parameters. The engine tracks the same quantity
        (``engine.peak_gathered_bytes``). Full-size gradients of a unit before its reduce-scatter
        are not counted. Zero when parameters are replicated."""
        if self.states.params is None:
            return {"gathered": 0}
        c, n = self.compute_dtype.itemsize, self.data_size
        full = {u.name: sum(p.numel for p in self.unit_params(u.name)) * c for u in self.units}
        buf = {u.name: sum(p.padded_numel(p.rest) for p in self.unit_params(u.name)) * n * c for u in self.units}
        by_label = {(u.name or "<root>"): u.name for u in self.units}
        live = peak = 0
        for ev in self.gather_schedule():
            op, u = ev[0], by_label[ev[2:-1]]
            if op == "G":
                live += buf[u]
            elif op == "W":
                live += full[u]
                peak = max(peak, live)
                live -= buf[u]
            else:
                live -= full[u]
            peak = max(peak, live)
        return {"gathered": peak}

    def zero_formula(self) -> dict[str, float]:
        """The ZeRO-paper terms for this plan, to compare with ``memory_per_rank``: parameters
        ``cΨ`` (``/N`` when sharded), gradients ``gΨ_t`` (``/N`` when sharded and not kept whole),
        optimizer ``KΨ_t`` (``/N`` when sharded), with Ψ the parameter count and Ψ_t the trainable
        count (equal in the paper). Equal to ``memory_per_rank`` when every dim 0 divides by N."""
        psi, psi_t, n = self.num_params, self.num_trainable, self.data_size
        c, g = self.compute_dtype.itemsize, self.reduce_dtype.itemsize
        k = (4 if self.mixed else 0) + self.optimizer_state_bytes
        params = c * psi / (n if self.states.params else 1)
        if self.states.keep_local_grads:
            grads = c * psi_t
        else:
            grads = g * psi_t / (n if self.states.grads else 1)
        optim = k * psi_t / (n if self.states.optim else 1)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    # ---- communication -------------------------------------------------------------------------
    def scalars_per_step(self) -> int:
        """Floats in the one all-reduce that ends a step: the loss, (with sharded gradients) a
        non-finite count under fp16 and a squared norm under clipping, and one flag per trainable
        parameter saying on how many ranks it got a gradient — a parameter that got none on any
        rank is left out of the update, as one process leaves a parameter whose ``grad`` is None
        (the role of DDP's ``find_unused_parameters`` bitmap)."""
        k = 1 + sum(1 for p in self.params if p.trainable)
        if self.states.grads is not None:
            k += int(self.precision == "fp16") + int(self.clip_grad_norm is not None)
        return k

    @property
    def scalars_ride_gradients(self) -> bool:
        """Whether the step's scalars travel in the last gradient bucket's all-reduce instead of an
        all-reduce of their own (one synchronization fewer per step). They can when gradients are
        replicated (overflow and norm are then computed locally, so nothing waits for the reduced
        gradients) and reduced in fp32 (the loss keeps its precision). Not in a reduce-scatter:
        each rank would receive its own row's sum, added in another order, and ranks must agree on
        the loss to the bit."""
        return (self.states.params is None and self.states.grads is None and self.data_size > 1
                and self.reduce_dtype == torch.float32)

    def comm_per_step(self) -> list[CommEntry]:
        """Every collective one ``step`` issues, with the bytes this rank sends (ring model)."""
        n, axis = self.data_size, (self.data_axis,)
        c, g = self.compute_dtype.itemsize, self.reduce_dtype.itemsize
        out: list[CommEntry] = []
        if n > 1:
            m = self.grad_accum
            if self.states.params is not None:           # ZeRO-3: per unit, every micro-step
                for u in self.units:
                    ps = self.unit_params(u.name)
                    shard = sum(p.padded_numel(p.rest) for p in ps)
                    gathered = comm.all_gather_bytes(shard, n, c)
                    out.append(CommEntry("forward", "params", "all_gather", axis, gathered, m, u.name or "<root>"))
                    if u.reshard_after_forward:
                        out.append(CommEntry("backward", "params", "all_gather", axis, gathered, m,
                                             u.name or "<root>"))
                    tr = sum(p.padded_numel(p.grad) for p in ps if p.trainable)
                    if tr:
                        out.append(CommEntry("backward", "grads", "reduce_scatter", axis,
                                             comm.reduce_scatter_bytes(tr, n, g), m, u.name or "<root>"))
            else:
                buckets = self.buckets()
                k = self.scalars_per_step() if self.scalars_ride_gradients else 0
                for i, bucket in enumerate(buckets):
                    extra = k if i == len(buckets) - 1 else 0
                    if self.states.grads is None:
                        numel = sum(p.numel for p in bucket)
                        out.append(CommEntry("backward", "grads", "all_reduce", axis,
                                             comm.all_reduce_bytes(numel + extra, n, g), 1, f"bucket {i}",
                                             comm.all_reduce_bytes(numel + extra, n, g)
                                             - comm.all_reduce_bytes(numel, n, g)))
                    else:
                        shard = sum(p.padded_numel(p.grad) for p in bucket)
                        out.append(CommEntry("backward", "grads", "reduce_scatter", axis,
                                             comm.reduce_scatter_bytes(shard, n, g), 1, f"bucket {i}"))
                    if self.states.optim is not None:
                        shard = sum(p.padded_numel(p.optim) for p in bucket)
                        out.append(CommEntry("step", "params", "all_gather", axis,
                                             comm.all_gather_bytes(shard, n, c), 1, f"bucket {i}"))
            if not self.scalars_ride_gradients:
                out.append(CommEntry("step", "scalars", "all_reduce", axis,
                                     comm.all_reduce_bytes(self.scalars_per_step(), n, 4), 1))
        return out

    def comm_bytes_per_step(self, what: str | None = None) -> int:
        """Bytes this rank sends per step, all or those of one kind (``params``, ``grads``,
        ``scalars``); scalars riding in a gradient collective count as ``scalars``."""
        total = 0
        for e in self.comm_per_step():
            if what is None:
                total += e.total
            elif what == "scalars":
                total += e.total if e.what == "scalars" else e.riders * e.count
            elif e.what == what:
                total += e.total - e.riders * e.count
        return total

    def ring_minimum(self) -> int:
        """The ring-algorithm bound for parameter and gradient traffic per rank per step, bytes:
        ``2Ψ(N-1)/N`` elements for DP and ZeRO-1/2; ``3Ψ(N-1)/N`` for ZeRO-3 (per micro-step), where
        a unit kept gathered from its forward through its backward (the root) needs 2, not 3.
        Gradients (and ZeRO-1/2's gather of updated parameters) only move for trainable
        parameters; ZeRO-3 gathers frozen ones too. Padding of uneven shards is not counted, so
        what runs may exceed this by the padding."""
        n = self.data_size
        c, g = self.compute_dtype.itemsize, self.reduce_dtype.itemsize
        if self.states.params is not None:
            per_unit = [(2 if u.reshard_after_forward else 1) * c * sum(p.numel for p in self.unit_params(u.name))
                        + g * sum(p.numel for p in self.unit_params(u.name) if p.trainable) for u in self.units]
            return self.grad_accum * sum(per_unit) * (n - 1) // n
        # replicated gradients: all-reduce (2 transfers); sharded: reduce-scatter (1); a sharded
        # optimizer with replicated parameters: + all-gather of the updated parameters (1)
        per = (2 * g if self.states.grads is None else g) + (c if self.states.optim is not None else 0)
        return per * self.num_trainable * (n - 1) // n

    # ---- printing ------------------------------------------------------------------------------
    def explain(self, max_params: int = 40) -> str:
        n = self.data_size
        stage = f"ZeRO-{self.zero}" if self.zero else ("data parallel" if self.zero == 0 else "custom")
        lines = [f"Plan: {stage} over {self.data_axis!r} (N={n}) on mesh {self.mesh.axis_sizes}; "
                 f"{self.precision} compute, {str(self.reduce_dtype).replace('torch.', '')} reduction, "
                 f"grad_accum={self.grad_accum}, clip={self.clip_grad_norm}",
                 f"  states: params at rest {_spec(self.states.params)}, grads {_spec(self.states.grads)}, "
                 f"optimizer {_spec(self.states.optim)}, local grads "
                 f"{'kept' if self.states.keep_local_grads else 'freed after reduction'}",
                 f"  batch: {self.batch.spec} (dim 0 over {self.data_axis!r})",
                 "  units: " + ", ".join(f"{u.name or '<root>'}({len(u.params)})"
                                          + ("*" if u.recompute else "") for u in self.units)
                 + ("   (* = recomputed in backward)" if any(u.recompute for u in self.units) else ""),
                 "", f"  {'parameter':<32} {'shape':<14} {'unit':<10} {'rest':<6} {'compute':<8} "
                 f"{'grad':<6} {'optim':<6}"]
        for p in self.params[:max_params]:
            lines.append(f"  {p.name:<32} {str(list(p.shape)):<14} {p.unit or '<root>':<10} "
                         f"{p.rest.short():<6} {p.compute.short():<8} {p.grad.short():<6} {p.optim.short():<6}")
        if len(self.params) > max_params:
            lines.append(f"  ... and {len(self.params) - max_params} more")
        mem, formula = self.memory_per_rank(), self.zero_formula()
        lines += ["", f"  model states per rank (Ψ = {self.num_params:,} parameters):"]
        for k in ("params", "grads", "optimizer", "total"):
            lines.append(f"    {k:<10} {format_bytes(mem[k]):>10}   (ZeRO formula {format_bytes(formula[k])})")
        if self.states.params is not None:
            lines.append(f"    gathered   {format_bytes(self.transient_per_rank()['gathered']):>10}   "
                         "(transient peak of gathered units and gather buffers, in this order:)")
            lines.append("      " + " ".join(self.gather_schedule()))
        lines += ["", "  collectives per step (bytes sent per rank):"]
        lines += [f"    {e}" for e in self.comm_per_step()] or ["    none (one rank)"]
        lines.append(f"    total {format_bytes(self.comm_bytes_per_step())}; params+grads "
                     f"{format_bytes(self.comm_bytes_per_step('params') + self.comm_bytes_per_step('grads'))} "
                     f"vs ring minimum {format_bytes(self.ring_minimum())}")
        return "\n".join(lines)


def _spec(axis: str | None) -> str:
    return f"S({axis})" if axis else "R"


# ---------------------------------------------------------------------------------------------
# Building a plan
# ---------------------------------------------------------------------------------------------

def find_units(model: nn.Module, units: Sequence[str] | None = None) -> list[str]:
    """Unit module names: given ones, or every child of an ``nn.ModuleList`` that has parameters
    (the blocks of a layer stack). The root unit ``""`` holds whatever is left."""
    names = dict(model.named_modules())
    if units is not None:
        bad = [u for u in units if u not in names or u == ""]
        if bad:
            raise ShardingError(f"plan: units {bad} are not submodules of the model — expected qualified "
                                f"names such as {[n for n in names if n][:3]}.")
        return list(units)
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            for child_name, child in mod.named_children():
                q = f"{name}.{child_name}" if name else child_name
                if any(True for _ in child.parameters()) and not any(q.startswith(f + ".") for f in found):
                    found.append(q)
    return found


def _unit_of(name: str, units: list[str]) -> str:
    best = ""
    for u in units:
        if (name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def param_owners(model: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """``id(param) -> [(module name, attribute)]`` for every module that holds it (tied weights
    have several owners)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                entry = (mname, attr)
                if entry not in owners.setdefault(id(p), []):
                    owners[id(p)].append(entry)
    return owners


def plan(model: nn.Module, mesh: AbstractMesh, zero: int | None = None, *, states: StateLayouts | None = None,
         precision: str = "fp32", reduce_dtype: str | torch.dtype | None = None, grad_accum: int = 1,
         clip_grad_norm: float | None = None, recompute: bool | Iterable[str] = False,
         units: Sequence[str] | None = None, bucket_mb: float = 25.0, optimizer: str | int = "adamw",
         reshard_after_forward: bool = True, data_axis: str = "data") -> Plan:
    """Plan data-parallel training of ``model`` on ``mesh``.

    ``zero`` (0-3) names the usual stages; ``states`` gives the per-state layouts directly.
    ``precision`` is the compute dtype (``fp32``, ``bf16``, ``fp16``); master weights stay fp32.
    ``optimizer`` names the optimizer family (or gives its state bytes per parameter) so memory
    can be planned; ``recompute`` checkpoints units (True: every unit but the root).
    ``units`` names the modules gathered and freed together (default: each block of every
    ``nn.ModuleList``; the root unit holds the rest). Under ZeRO-3, ``reshard_after_forward`` frees
    each unit after its forward and gathers it again for its backward; the root unit, used at both
    ends of the model, stays gathered from its forward through its backward (as in FSDP2).
    """
    if not isinstance(model, nn.Module):
        raise ShardingTypeError(f"plan: expected an nn.Module — got {type(model).__name__}.")
    if not isinstance(mesh, AbstractMesh):
        raise ShardingTypeError(f"plan: expected a Mesh or AbstractMesh — got {type(mesh).__name__}.")
    with Problems("plan", ShardingError) as p:
        if zero is not None and states is not None:
            p.add("plan: give either zero=... or states=..., not both.")
        if data_axis not in mesh.axis_names:
            p.add(f"plan: the mesh {mesh.axis_sizes} has no {data_axis!r} axis — expected the data-parallel "
                  f"axis. Add it (size 1 if unused) or pass data_axis=.")
        else:
            others = {a: s for a, s in mesh.axis_sizes.items() if a != data_axis and s > 1}
            if others:
                p.add(f"plan: axes {others} are larger than 1, but this plan only uses {data_axis!r} — expected "
                      "the other axes of size 1. Tensor and pipeline parallelism are not available yet.")
        if precision not in PRECISIONS:
            p.add(f"plan: precision {precision!r} is unknown — expected one of {tuple(PRECISIONS)}.")
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            p.add(f"plan: grad_accum must be a positive int — got {grad_accum!r}.")
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
            p.add(f"plan: clip_grad_norm must be a positive number or None — got {clip_grad_norm!r}.")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            p.add(f"plan: bucket_mb must be positive — got {bucket_mb!r}.")
        if isinstance(optimizer, str) and optimizer.lower() not in OPTIMIZER_STATE_BYTES:
            p.add(f"plan: optimizer {optimizer!r} is unknown — expected one of {tuple(OPTIMIZER_STATE_BYTES)} "
                  "or its state bytes per parameter as an int.")
    if states is None:
        states = StateLayouts.zero(0 if zero is None else zero, data_axis)
    states.validate(mesh)
    if reduce_dtype is None:
        rdt = PRECISIONS[precision]
    else:
        rdt = PRECISIONS.get(reduce_dtype, reduce_dtype) if isinstance(reduce_dtype, str) else reduce_dtype
        if rdt not in PRECISIONS.values():
            raise ShardingError(f"plan: reduce_dtype {reduce_dtype!r} is unknown — expected fp32, bf16 or fp16.")

    named = list(model.named_parameters())
    if not named:
        raise ShardingError(f"plan: the model {type(model).__name__} has no parameters — expected at least "
                            "one. There is nothing to train or shard.")
    unit_names = find_units(model, units)
    owners = param_owners(model)
    if recompute is True:
        rec = set(unit_names)
    elif recompute is False or recompute is None:
        rec = set()
    else:
        rec = set(recompute)
        if rec - set(unit_names):
            raise ShardingError(f"plan: recompute names {sorted(rec - set(unit_names))}, which are not units — "
                                f"expected some of {unit_names}.")

    def layout(axis: str | None) -> Layout:
        return Layout(mesh, PartitionSpec(axis) if axis else PartitionSpec())

    replicated = layout(None)
    itemsize = rdt.itemsize
    bucket_bytes = int(bucket_mb * 2**20)
    def unit_of(p: nn.Parameter) -> str:
        units_of = {_unit_of(f"{m}.{a}" if m else a, unit_names) for m, a in owners[id(p)]}
        return units_of.pop() if len(units_of) == 1 else ""   # shared across units: root

    # Gradient buckets, in reverse order (the order gradients tend to become ready in backward),
    # up to bucket_mb each. With sharded gradients a bucket also ends where a unit ends: the
    # unit's full gradients are freed as soon as its bucket is reduce-scattered (as FSDP2 does per
    # unit), which bounds the transient memory at no measured cost in time.
    buckets: dict[str, int] = {}
    if states.params is None:
        b, filled, last_unit = 0, 0, None
        for name, p in reversed(named):
            if not p.requires_grad:
                continue
            size = p.numel() * itemsize
            unit = unit_of(p)
            if filled and (filled + size > bucket_bytes or (states.grads is not None and unit != last_unit)):
                b, filled = b + 1, 0
            buckets[name] = b
            filled += size
            last_unit = unit
    params = []
    for name, p in named:
        unit = unit_of(p)
        params.append(ParamPlan(
            name=name, shape=tuple(p.shape), unit=unit, bucket=buckets.get(name),
            trainable=p.requires_grad, rest=layout(states.params), compute=replicated,
            grad=layout(states.grads), optim=layout(states.optim)))
    has_root = any(p.unit == "" for p in params)
    unit_list = ([UnitPlan("", tuple(p.name for p in params if p.unit == ""), False, False)] if has_root else [])
    unit_list += [UnitPlan(u, tuple(p.name for p in params if p.unit == u), reshard_after_forward, u in rec)
                  for u in unit_names if any(p.unit == u for p in params)]
    state_bytes = optimizer if isinstance(optimizer, int) else OPTIMIZER_STATE_BYTES[optimizer.lower()]
    return Plan(mesh=mesh, data_axis=data_axis, states=states, precision=precision, reduce_dtype=rdt,
                grad_accum=grad_accum, clip_grad_norm=clip_grad_norm, optimizer_state_bytes=state_bytes,
                bucket_bytes=bucket_bytes, params=tuple(params), units=tuple(unit_list), batch=layout(data_axis))
