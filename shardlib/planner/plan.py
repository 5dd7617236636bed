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

import functools
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import torch

from ..algebra.layout import Layout
from ..algebra.mesh import AbstractMesh
from ..algebra.spec import PartitionSpec
from ..quant.layout import QuantSpec
from . import explain as words
from . import memory, peak, traffic
from .flat import FlatLayout, flat_layout
from .states import StateLayouts
from .pipeline import PipelinePlan
from .tensor import TensorPlan
from .traffic import CommEntry as CommEntry  # re-exported: part of a plan's data

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# bytes of optimizer state per parameter (fp32 state tensors)
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4, "rmsprop": 4, "adagrad": 4}


# id(layout) -> (weak reference to it, {(shape, rank): elements}); see shard_numel
_SHARD_MEMO: dict[int, tuple[weakref.ref, dict]] = {}


def shard_numel(layout: Layout, shape: tuple[int, ...], rank: int | None = None, *, padded: bool = False) -> int:
    """Elements of ``rank``'s shard of a ``shape`` tensor (``padded``: of the shard padded to ``ceil``
    chunks, the same on every rank), remembered per layout object while it lives: a plan's thousands
    of parameters share a few layouts and shapes, so accounting a plan asks the layout a few dozen
    times, not once per parameter and rank."""
    if rank is None and not padded:          # the running process's rank: not remembered
        return math.prod(layout.local_shape(shape, None))
    entry = _SHARD_MEMO.get(id(layout))
    if entry is None or entry[0]() is not layout:
        key = id(layout)
        entry = _SHARD_MEMO[key] = (weakref.ref(layout, lambda _, key=key: _SHARD_MEMO.pop(key, None)), {})
    memo, key = entry[1], (shape, None if padded else rank)
    n = memo.get(key)
    if n is None:
        if len(memo) >= 1 << 16:            # bounded: planning every rank of a huge mesh
            memo.clear()
        n = math.prod(layout.padded_local_shape(shape) if padded else layout.local_shape(shape, rank))
        memo[key] = n
    return n


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
    # the parameter's own spec (tensor axis) over its full shape; ``full_shape`` is set in a
    # tensor-local plan (``Plan.local``), where ``shape`` is this rank's shard and the four layouts
    # above are the data axis's over that shard
    spec: PartitionSpec = PartitionSpec()
    full_shape: tuple[int, ...] | None = None
    # a quantized frozen weight (``quant/layout.py``): held as its packed bytes, not ``numel`` floats
    quant: QuantSpec | None = None

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def stored(self, itemsize: int) -> int:
        """Elements of ``itemsize`` bytes that hold the parameter at rest: ``numel``, or a quantized
        weight's packed bytes (of this plan's shape: a tensor shard in a local plan) rounded up."""
        if self.quant is None:
            return self.numel
        return -(-self.quant.packed_bytes(self.shape) // itemsize)

    def local_numel(self, layout: Layout, rank: int) -> int:
        return shard_numel(layout, self.flat_shape, rank)

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
    recompute: bool               # the whole unit (a checkpoint keeps its input)
    selective: bool = False       # only attention's core (comm/recompute.py)
    # False where no gradient runs through the unit: a frozen nn.Embedding (its input is indices),
    # never gathered again for a backward
    backward: bool = True

    @property
    def regathered(self) -> bool:
        """Freed after its forward and gathered again for its backward (twice a step)."""
        return self.reshard_after_forward and self.backward


@dataclass(frozen=True)
class Plan:
    """Per-parameter layouts, units, buckets, and what a step costs. Pure data; its analyses are functions
    of it beside it (``memory.py``, ``traffic.py``, ``explain.py``), which these methods call."""

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
    # replicas stay equal (runtime/sync.py): rank 0's buffers broadcast before each step's forward
    # (DDP's broadcast_buffers); (dtype, elements) of what is broadcast at set-up (parameters and
    # buffers) and per step (buffers), one fused broadcast per dtype
    broadcast_buffers: bool = True
    setup_sizes: tuple[tuple[torch.dtype, int], ...] = ()
    # the model was built on the meta device: set-up broadcasts rank 0's generator state over the
    # whole mesh (every rank replays rank 0's initialization) in place of the model
    meta_build: bool = False
    buffer_sizes: tuple[tuple[torch.dtype, int], ...] = ()
    # the tensor axis (planner/tensor.py); None when the mesh has no tensor axis larger than 1
    tensor: TensorPlan | None = None
    # per tensor coordinate, the activation collectives of one micro-step (traced at plan time
    # from ``batch=``; empty without it): ((coordinate, entries), ...)
    activations: tuple[tuple[int, tuple[CommEntry, ...]], ...] = ()
    # set in a tensor-local plan (``local``): the tensor coordinate whose shards it describes
    local_coord: int | None = None
    # set in an expert-local plan (``local``): the expert coordinate whose experts it holds
    expert_coord: int | None = None
    # the pipe axis (planner/pipeline.py); None when the mesh has no pipe axis larger than 1
    pipeline: PipelinePlan | None = None
    # set in a stage-local plan (``local``): the pipe coordinate whose stages it holds
    pipe_coord: int | None = None
    # a local plan's trainable weights tied across the first and last stage: (name, elements of this rank's
    # piece of its gradient), in the pipeline plan's order — held here or not (the stages between add zeros)
    tied_pieces: tuple[tuple[str, int], ...] = ()
    # HSDP: a second data axis over which the training states are replicated (``data`` shards them)
    replica_axis: str | None = None
    # the expert axis (planner/experts.py): experts' weights split over it, the batch too
    expert_axis: str | None = None
    # the sequence split over it (planner/context.py): the attention calls of a micro-batch on a rank, and the
    # modules holding learned position tables
    context_axis: str | None = None
    context_calls: tuple = ()
    context_attention: str | None = None     # allgather | ring | ulysses (runtime/context.py)
    # what one micro-batch's chunk saves for backward on a rank (planner/context.context_activations), where
    # measured: peak_per_rank's activations by default
    context_activations: int | None = None
    position_tables: tuple = ()
    # its experts modules, for planning their routing (planner/experts.py)
    expert_layers: tuple = ()
    # routers whose balance statistics are summed over the batch's ranks (planner/experts.py: RouterStats)
    router_stats: tuple = ()
    # a stated routing: per experts module, the tokens each expert gets (``with_routing``); () = uniform
    routing: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # memory kinds (planner/offload.py): ((state, "host" | "disk"), ...) — states not named live on the device
    offload: tuple[tuple[str, str], ...] = ()
    offload_dir: str | None = None
    # the optimizer on the host updates beside the next step's forward and backward, which computes with the
    # parameters one update behind (DeepSpeed's delayed parameter update): w_t = w_{t-1} - U(grad at w_{t-2})
    delayed: bool = False
    # without a pipe axis (a tensor axis): the layer stack and each block's saved bytes per micro-batch on rank 0,
    # measured on the meta device when the plan is given ``batch=`` (planner/pipeline_report.stack_saved_bytes)
    stack_saved: tuple[str, tuple[int, ...]] | None = None

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
    def recompute(self) -> str:
        """The recompute policy over the units below the root: ``"none"``, ``"selective"``
        (attention's core), ``"full"`` (every unit whole) or ``"some"`` (the units named)."""
        body = [u for u in self.units if u.name]
        if body and all(u.recompute for u in body):
            return "full"
        if any(u.recompute for u in body):
            return "some"
        return "selective" if any(u.selective for u in body) else "none"

    @property
    def data_size(self) -> int:
        """Ranks ZeRO shards the training states over (the ``data`` axis)."""
        return self.mesh.axis_size(self.data_axis)

    @property
    def replica_size(self) -> int:
        """HSDP: replicas of the sharded training states (1 without a replica axis)."""
        return self.mesh.axis_size(self.replica_axis) if self.replica_axis is not None else 1

    @property
    def expert_size(self) -> int:
        """Ranks the experts split over (1 without an expert axis)."""
        return self.mesh.axis_size(self.expert_axis) if self.expert_axis is not None else 1

    @property
    def context_size(self) -> int:
        """Ranks the sequence splits over (1 without a context axis)."""
        return self.mesh.axis_size(self.context_axis) if self.context_axis is not None else 1

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """The axes the batch splits over and gradients are summed over: ``data``, under HSDP the replica
        axis before it (replica major), the expert axis after it (experts' gradients: ``grad_axes``), and the
        context axis last (the sequence's chunks)."""
        return tuple(a for a in (self.replica_axis, self.data_axis, self.expert_axis, self.context_axis)
                     if a is not None)

    @property
    def row_axes(self) -> tuple[str, ...]:
        """The axes the batch's rows (dim 0) split over: ``dp_axes`` but the context axis (which splits dim 1)."""
        return tuple(a for a in self.dp_axes if a != self.context_axis)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the batch's chunks (``replica x data x expert x context``)."""
        return self.data_size * self.replica_size * self.expert_size * self.context_size

    def with_routing(self, tokens_per_expert: Mapping[str, Sequence[int]]) -> Plan:
        """This plan priced for a stated routing instead of a uniform one: ``{experts module: tokens per expert}``
        (``engine.tokens_per_expert``: a measured step's histogram). Each rank's tokens are taken to choose the
        experts in those shares, so the rows a rank sends and receives follow from its experts' share
        (``comm_per_step``'s routing entries; ``explain`` names the busiest rank)."""
        from ..errors import ShardingError
        layers = {layer.name: layer.experts for layer in self.expert_layers}
        problems = []
        for name, counts in tokens_per_expert.items():
            if name not in layers:
                problems.append(f"with_routing: {name!r} is not an experts module on the expert axis — expected one "
                                f"of {sorted(layers)}.")
            elif len(counts) != layers[name] or any(c < 0 for c in counts) or not sum(counts):
                problems.append(f"with_routing: {name!r} got {len(counts)} counts {list(counts)[:8]} — expected "
                                f"{layers[name]} non-negative token counts, not all zero.")
        if problems:
            raise ShardingError(problems, api="with_routing")
        return replace(self, routing=tuple((n, tuple(int(c) for c in v)) for n, v in sorted(tokens_per_expert.items())))

    def is_expert(self, name: str) -> bool:
        """Whether parameter ``name`` is split over the expert axis (an expert's weights)."""
        return self.expert_axis is not None and self.expert_axis in self.param(name).spec.axes

    def shard_axes(self, name: str) -> tuple[str, ...]:
        """The axes ZeRO splits parameter ``name``'s sharded states over: ``data``, and with an expert axis
        data x expert for everything that is not an expert (an expert's: data alone)."""
        extra = tuple(a for a in (None if self.expert_axis is None or self.is_expert(name) else self.expert_axis,
                                  self.context_axis) if a is not None)
        return self.mesh.canonical_axes((self.data_axis, *extra)) if extra else (self.data_axis,)

    def grad_axes(self, name: str) -> tuple[str, ...]:
        """The axes parameter ``name``'s gradient is summed over: the batch's, but for an expert's weights,
        which the expert axis splits (their gradients came to them over it)."""
        return tuple(a for a in self.dp_axes if not (a == self.expert_axis and self.is_expert(name)))

    @property
    def num_params(self) -> int:
        return self._totals[0]

    def param(self, name: str) -> ParamPlan:
        return self._by_name[name]

    def buckets(self) -> list[list[ParamPlan]]:
        """Gradient buckets (replicated parameters), in the order they are reduced."""
        out: dict[int, list[ParamPlan]] = {}
        for p in self.params:
            if p.bucket is not None:
                out.setdefault(p.bucket, []).append(p)
        return [out[b] for b in sorted(out)]

    def unit_params(self, unit: str) -> list[ParamPlan]:
        return list(self._by_unit.get(unit, ()))

    def _rank(self, rank: int | None) -> int:
        return rank if rank is not None else getattr(self.mesh, "rank", 0)

    @property
    def num_trainable(self) -> int:
        """Parameters that get gradients and optimizer state (``requires_grad``)."""
        return self._totals[1]

    # ---- the tensor axis -----------------------------------------------------------------------
    @property
    def tensor_size(self) -> int:
        return self.tensor.size if self.tensor is not None else 1

    @property
    def pipe_size(self) -> int:
        return self.pipeline.size if self.pipeline is not None else 1

    def pipe_coord_of(self, rank: int | None = None) -> int:
        return self.mesh.coord(self._rank(rank), self.pipeline.axis) if self.pipeline is not None else 0

    @property
    def split(self) -> bool:
        """Whether this is a whole-mesh plan whose parameters are split over ``tensor`` or cut into
        pipeline stages (its per-rank accounting is that of ``local(rank)``)."""
        return ((self.tensor_size > 1 and self.local_coord is None)
                or (self.pipe_size > 1 and self.pipe_coord is None)
                or (self.expert_size > 1 and self.expert_coord is None))

    def tensor_coord(self, rank: int | None = None) -> int:
        return self.mesh.coord(self._rank(rank), self.tensor.axis) if self.tensor is not None else 0

    def local(self, rank: int | None = None) -> Plan:
        """The plan of what ``rank`` holds: its pipeline stages' parameters only (pipe axis), each
        parameter's ``shape`` its shard on this rank's tensor coordinate (ceil chunks: uneven widths
        give uneven shards), with the data axis's layouts over that shard. The data-parallel engine
        (DP, ZeRO-1/2/3) runs this plan unchanged: ``data`` splits what the tensor and pipe axes
        left local. The plan itself when nothing is split over ``tensor`` or ``pipe``."""
        if not self.split:
            return self
        key = (self.pipe_coord_of(rank), self.tensor_coord(rank) if self.tensor_size > 1 else None,
               self.mesh.coord(self._rank(rank), self.expert_axis) if self.expert_size > 1 else None)
        cache = self._local_plans
        if key not in cache:
            cache[key] = _localize(self, self._rank(rank), key)
        return cache[key]

    def activation_entries(self, rank: int | None = None) -> tuple[CommEntry, ...]:
        """The tensor axis's activation collectives of one micro-step on ``rank`` (traced at plan
        time from ``batch=``; empty without it)."""
        if self.tensor is None:
            return ()
        coord = self.local_coord if self.local_coord is not None else self.tensor_coord(rank)
        return dict(self.activations).get(coord, ())

    @cached_property
    def _local_plans(self) -> dict[int, Plan]:
        return {}

    # per-rank accounting of a split plan is that of the rank's tensor-local plan
    def memory_per_rank(self, rank: int | None = None, *, at: str = "rest", kind: str = "device") -> dict[str, int]:
        if self.split:
            return self.local(rank).memory_per_rank(rank, at=at, kind=kind)
        return memory.memory_per_rank(self, rank, at=at, kind=kind)

    def disk_bytes(self) -> int:
        """The bytes ``offload_dir`` must hold when all ranks share one machine: every rank's ``disk``
        states, twice — each rank keeps two generations (a step writes the next while the last stays
        whole, ``runtime/offload/core.py``) — the largest rank's of a sample, times the ranks. (Offloaded
        activations come on top: their bytes depend on the forward.)"""
        n = self.mesh.size
        sample = range(0, n, max(1, n // 64))
        return 2 * max(self.memory_per_rank(r, kind="disk")["total"] for r in sample) * n

    def transient_per_rank(self, rank: int | None = None) -> dict[str, int]:
        if self.split:
            return self.local(rank).transient_per_rank(rank)
        return memory.transient_per_rank(self, rank)

    def gather_schedule(self, rank: int | None = None) -> tuple[str, ...]:
        if self.split:
            return self.local(rank).gather_schedule()
        return memory.gather_schedule(self)

    def peak_per_rank(self, rank: int | None = None, *, activation_bytes: int = 0, foreach: bool | None = None,
                      meta_build: bool | None = None) -> dict[str, int]:
        """The most memory ``rank`` holds at once in a step: model states + the largest transient
        + one micro-batch's ``activation_bytes`` (estimate it with ``sl.activation_bytes(model, batch)``), by
        the moments of a step (build, backward, update, publish): ``peak``, ``states``, ``transient``,
        ``activations`` and each moment's total. ``meta_build``: the model is built on the meta device
        (default: as the planned model was). The formulas: ``planner/peak.py``."""
        if not activation_bytes and self.context_activations:      # measured on the rank's chunk
            activation_bytes = self.context_activations
        if self.split:
            return self.local(rank).peak_per_rank(rank, activation_bytes=activation_bytes, foreach=foreach,
                                                  meta_build=meta_build)
        return peak.peak_per_rank(self, rank, activation_bytes=activation_bytes, foreach=foreach,
                                  meta_build=self.meta_build if meta_build is None else meta_build)

    def zero_formula(self, rank: int | None = None) -> dict[str, float]:
        if self.split:
            return self.local(rank).zero_formula()
        return memory.zero_formula(self)

    def ring_minimum(self, rank: int | None = None) -> int:
        if self.split:
            return self.local(rank).ring_minimum()
        return traffic.ring_minimum(self)

    def comm_per_step(self, rank: int | None = None) -> list[CommEntry]:
        if self.split:
            return self.local(rank).comm_per_step(rank)
        return traffic.comm_per_step(self, rank)


    # ---- analyses (functions of the plan, beside it) -------------------------------------------------
    def comm_setup(self) -> list[CommEntry]:
        return traffic.comm_setup(self)

    def step_buffer_sizes(self) -> tuple[tuple[torch.dtype, int], ...]:
        return traffic.step_buffer_sizes(self)

    def scalars_per_step(self) -> int:
        return traffic.scalars_per_step(self)

    def fingerprint_axes(self) -> tuple[str, ...]:
        return traffic.fingerprint_axes(self)

    def pipe_scalar_axes(self) -> tuple[str, ...]:
        return traffic.pipe_scalar_axes(self)

    @property
    def scalars_ride_gradients(self) -> bool:
        return traffic.scalars_ride_gradients(self)

    @property
    def pipe_unshard(self) -> bool:
        return traffic.pipe_unshard(self)

    def comm_bytes_per_step(self, what: str | None = None) -> int:
        return traffic.comm_bytes_per_step(self, what)

    def copy_bytes_per_step(self, rank: int | None = None) -> dict[str, int]:
        return traffic.copy_bytes_per_step(self, rank)

    def explain(self, max_params: int | None = None, *, full: bool = False) -> str:
        return words.explain(self, max_params, full=full)

    # ---- indexes (built once, on first use; not fields: equality and repr ignore them) ----------
    @cached_property
    def _by_name(self) -> dict[str, ParamPlan]:
        return {p.name: p for p in self.params}

    @cached_property
    def _by_unit(self) -> dict[str, tuple[ParamPlan, ...]]:
        out: dict[str, list[ParamPlan]] = {}
        for p in self.params:
            out.setdefault(p.unit, []).append(p)
        return {u: tuple(ps) for u, ps in out.items()}

    @cached_property
    def flat(self) -> FlatLayout:
        """The flat groups ZeRO shards (ZeRO-3 units or gradient buckets: parameters laid end to end,
        each segment split evenly over ``data``) and each parameter's slot in them (``flat.py``)."""
        return self.local().flat if self.split else flat_layout(self)

    @cached_property
    def _totals(self) -> tuple[int, int]:
        """(Ψ, trainable Ψ)."""
        return sum(p.numel for p in self.params), sum(p.numel for p in self.params if p.trainable)


@dataclass(frozen=True)
class LocalPlan(Plan):
    """What one rank holds of a split plan (``Plan.local(rank)``): its pipeline stages' parameters only, each
    parameter's ``shape`` its shard on the rank's tensor coordinate (``full_shape`` the whole tensor's), the
    data axis's layouts over that shard. The data-parallel engine runs it unchanged; ``local()`` of it is
    itself."""


def _localize(plan: Plan, rank: int, key: tuple[int, int | None, int | None]) -> LocalPlan:
    out = _localized(plan, rank, key)
    if plan.pipeline is not None and plan.pipe_size > 1 and plan.pipeline.tied:
        out = replace(out, tied_pieces=_tied_pieces(plan, rank, out if key[0] == 0 else None))
    return LocalPlan(**{f.name: getattr(out, f.name) for f in fields(out)})


def _localized(plan: Plan, rank: int, key: tuple[int, int | None, int | None]) -> Plan:
    """``plan.local(rank)``: the parameters of ``rank``'s pipeline stages; shapes become its tensor
    (and expert) shards, layouts the data axis's."""
    pcoord, tcoord, ecoord = key
    mesh, st = plan.mesh, plan.states
    out = plan
    if plan.pipeline is not None and plan.pipe_size > 1:
        pp = plan.pipeline
        mine = {s.index for s in pp.stages_of(pcoord)}
        keep = tuple(p for p in plan.params if any(s in mine for s in pp.stages_of_param(p.name)))
        names = {p.name for p in keep}
        units = []
        for u in plan.units:
            held = tuple(n for n in u.params if n in names)
            if held:
                units.append(replace(u, params=held))
        owners = {n.rpartition(".")[0] for n in names}        # the experts and routers of its blocks only
        out = replace(out, params=keep, units=tuple(units), pipe_coord=pcoord,
                      activations=_stage_activations(plan, mine),
                      expert_layers=tuple(x for x in plan.expert_layers if x.name in owners),
                      context_calls=tuple(c for c in plan.context_calls if c.unit in {u.name for u in units}),
                      router_stats=tuple(r for r in plan.router_stats
                                         if any(o == r.name or o.startswith(r.name + ".") for o in owners)))
    if (tcoord is None or plan.tensor_size <= 1) and ecoord is None:
        return out

    def data_layout(axis: str | None) -> Layout:
        return Layout(mesh, PartitionSpec(axis) if axis else PartitionSpec())

    rest, grad, optim, rep = data_layout(st.params), data_layout(st.grads), data_layout(st.optim), data_layout(None)
    params = []
    for p in out.params:
        shape = tuple(p.compute.local_shape(p.shape, rank)) if p.shape else p.shape   # compute = the spec's layout
        params.append(replace(p, shape=shape, full_shape=p.shape, rest=rest, compute=rep, grad=grad, optim=optim))
    return replace(out, params=tuple(params), local_coord=tcoord, expert_coord=ecoord)


def _tied_pieces(plan: Plan, rank: int, local: Plan | None) -> tuple[tuple[str, int], ...]:
    """Per tied weight, the elements of ``rank``'s piece of its reduced gradient, as the first stage's rank at
    the same data and tensor coordinates holds it (``local``: that rank's plan, when it is this one; the last
    stage lays the weight out alike: a bucket of its own)."""
    pp, mesh = plan.pipeline, plan.mesh
    coords = list(mesh.coords(rank))
    coords[mesh.axis_index(pp.axis)] = 0
    first = mesh.rank_at(coords)
    local = local if local is not None else plan.local(first)
    params = {p.name: p for p in local.params}
    out = []
    for name in pp.tied:
        if not params[name].trainable:       # a frozen weight has no gradient to sum
            continue
        piece = local.flat.piece(name, first) if local.states.optim is not None else None   # as setup.py lays it
        out.append((name, params[name].numel if piece is None else piece[1] - piece[0]))
    return tuple(out)


def _stage_activations(plan: Plan, mine: set[int]) -> tuple:
    """The traced tensor-axis activation collectives that ``mine`` (virtual stages) run: those of
    their blocks; the root's before the first block belong to the first stage (``pipeline_pre``),
    after the last block to the last stage (``pipeline_post``)."""
    pp = plan.pipeline
    last = len(pp.stages) - 1
    out = []
    for coord, entries in plan.activations:
        kept, seen_block = [], False
        for e in entries:
            stage = pp.stage_of_block(e.where)
            if stage is not None:
                seen_block = True
            else:
                stage = last if seen_block else 0
            if stage in mine:
                kept.append(e)
        out.append((coord, tuple(kept)))
    return tuple(out)
