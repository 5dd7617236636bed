"""Traffic accounting of a ``Plan``: every collective of a step with the bytes a rank sends
(ring model), and the ring-minimum bound: functions of a plan, beside it (``Plan``'s methods call them)."""

from __future__ import annotations

import math

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from ..comm import core as comm
from ..comm.core import format_bytes
from .context import context_moves
from .flat import FROZEN, TRAIN
from .offload import COPY_OPS

if TYPE_CHECKING:
    from .plan import Plan


@dataclass(frozen=True)
class CommEntry:
    """One collective of a step: ``count`` times ``op`` over ``axes``, ``bytes`` each (per rank)."""

    phase: str        # "setup" (once, when the engine is built) | "forward" | "backward" | "step"
    what: str         # "params" | "grads" | "scalars" | "buffers" | "model" (params and buffers)
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
        where = f"({', '.join(self.axes)})" if self.axes else ""      # a copy between memory kinds: no axes
        return (f"{self.phase:<8} {self.what:<7} {self.op}{where}{times} "
                f"{format_bytes(self.total)}" + (f"  [{self.where}]" if self.where else ""))


def fused_sizes(tensors) -> tuple[tuple[torch.dtype, int], ...]:
    """``((dtype, elements), ...)`` of ``tensors`` packed one flat buffer per dtype, in order of first
    appearance: what a fused broadcast of them sends."""
    out: dict[torch.dtype, int] = {}
    for t in tensors:
        out[t.dtype] = out.get(t.dtype, 0) + t.numel()
    return tuple(out.items())


def comm_setup(plan: Plan) -> list[CommEntry]:
    """The collectives run once, when the engine is built: the ranks' plans compared (one all-gather of a CRC
    per ``planner/agreement.FIELDS`` over the whole mesh); rank 0's parameters (frozen ones too)
    and buffers broadcast over the data axis, one fused broadcast per dtype, so every replica
    starts from the same model (as ``DistributedDataParallel`` does). A model built on the meta
    device is not sent: rank 0's generator state is, over the whole mesh, and every rank
    replays rank 0's initialization from it (``runtime/materialize.py``)."""
    from .agreement import FIELDS
    everyone = plan.mesh.canonical_axes(plan.mesh.axis_names)
    world = plan.mesh.axis_size(everyone)
    # first, the plans' agreement (runtime/parted.check_agreement): each field's CRC from every rank
    out = [CommEntry("setup", "plan check", "all_gather", everyone, comm.all_gather_bytes(len(FIELDS), world, 8),
                     1, "int64")] if world > 1 else []
    # split over tensor: every rank takes rank 0's full model, then keeps its shards
    whole = plan.meta_build or plan.tensor_size > 1
    axes = plan.mesh.canonical_axes(plan.mesh.axis_names if whole else plan.dp_axes)
    n = plan.mesh.axis_size(axes) if axes else 1
    if n == 1:
        return out
    what = "rng state" if plan.meta_build else "model"
    return out + [CommEntry("setup", what, "broadcast", axes, comm.broadcast_bytes(k, n, dt.itemsize),
                            1, str(dt).replace("torch.", "")) for dt, k in plan.setup_sizes]

def step_buffer_sizes(plan: Plan) -> tuple[tuple[torch.dtype, int], ...]:
    """``buffer_sizes`` as the buffers are while training: floating ones in the compute dtype
    under mixed precision (the engine casts them, as ``model.to(dtype)`` does)."""
    out: dict[torch.dtype, int] = {}
    for dt, k in plan.buffer_sizes:
        dt = plan.compute_dtype if plan.mixed and dt.is_floating_point else dt
        out[dt] = out.get(dt, 0) + k
    return tuple(out.items())

FINGERPRINT_FLOATS = 4        # two hashes of the step's collectives and their squares (runtime/parted.py)


def fingerprint_axes(plan: Plan) -> tuple[str, ...]:
    """The axes whose ranks compare their collectives' fingerprint in the step's scalar all-reduce: those
    the scalars are summed over, whose ranks run the same collectives — () where there is none (one rank),
    where the group is too large for the fp32 sums to stay exact (``fingerprint_bits``), or under a pipe
    axis whose scalars are summed over the whole mesh (its stages run different collectives)."""
    mesh = plan.mesh
    if plan.pipeline is not None and plan.pipe_size > 1:
        axes = plan.pipe_scalar_axes()
        if axes == mesh.canonical_axes(mesh.axis_names):
            return ()
    else:
        tensor = (plan.tensor.axis,) if plan.tensor is not None and plan.tensor_size > 1 else ()
        axes = mesh.canonical_axes((*plan.dp_axes, *tensor))
    n = mesh.axis_size(axes) if axes else 1
    return axes if n > 1 and fingerprint_bits(n) > 0 else ()


def fingerprint_bits(n: int) -> int:
    """Bits per hash for ``n`` ranks: ``n² · 2^(2b) < 2^24`` keeps ``n · Σv²`` exact in fp32."""
    return min(8, 11 - math.ceil(math.log2(n)))


def scalars_per_step(plan: Plan) -> int:
    """Floats in the one all-reduce that ends a step: the loss, (with sharded gradients) a
    non-finite count under fp16 and a squared norm under clipping, and one flag per trainable
    parameter saying on how many ranks it got a gradient — a parameter that got none on any
    rank is left out of the update, as one process leaves a parameter whose ``grad`` is None
    (the role of DDP's ``find_unused_parameters`` bitmap). Under a pipe axis see
    ``pipe_scalar_axes``: over the whole mesh the vector holds every stage's flags, over
    ``data`` only this stage's."""
    fp = FINGERPRINT_FLOATS if fingerprint_axes(plan) else 0      # the collectives' fingerprint
    if plan.pipeline is not None and plan.pipe_size > 1:
        if plan.pipe_scalar_axes() == plan.mesh.canonical_axes(plan.mesh.axis_names):
            return (1 + plan.pipeline.trainable + int(plan.precision == "fp16")
                    + int(plan.clip_grad_norm is not None))
        return 1 + sum(1 for p in plan.params if p.trainable) + fp
    k = 1 + sum(1 for p in plan.params if p.trainable) + fp
    if plan.states.grads is not None or plan.tensor_size > 1 or plan.expert_size > 1:   # gradients differ by rank
        k += int(plan.precision == "fp16") + int(plan.clip_grad_norm is not None)
    if plan.pipe_size == 1:          # the tokens per expert ride along (runtime/experts.py)
        k += expert_count_floats(plan)
    return k


def expert_count_floats(plan: Plan) -> int:
    """The step's tokens per expert a rank sums over the batch's axes: a row of the most experts per experts
    module on the expert axis (``runtime/experts.ExpertCounts``); 0 without an expert axis."""
    if plan.expert_size == 1 or not plan.expert_layers:
        return 0
    return len(plan.expert_layers) * max(layer.experts for layer in plan.expert_layers)

def pipe_scalar_axes(plan: Plan) -> tuple[str, ...]:
    """Under a pipe axis, the mesh axes the step's scalars are summed over. The loss needs no
    collective: each micro-batch's loss rides its output gradient back through the stages
    (``runtime/pipeline.py``), so every rank holds its replica's losses when the schedule ends.
    A stage's gradients decide for every stage only under fp16 (an overflow skips the step
    everywhere) and clipping (the global norm): then the whole mesh. Otherwise ``data``, where
    the replicas' used flags and losses add up; nothing at all when ``data`` is 1."""
    if plan.precision == "fp16" or plan.clip_grad_norm is not None:
        return plan.mesh.canonical_axes(plan.mesh.axis_names)
    return plan.mesh.canonical_axes(plan.dp_axes)

def scalars_ride_gradients(plan: Plan) -> bool:
    """Whether the step's scalars travel in the last gradient bucket's all-reduce instead of an
    all-reduce of their own (one synchronization fewer per step). They can when gradients are
    replicated (overflow and norm are then computed locally, so nothing waits for the reduced
    gradients; under a pipe axis: when the scalars are summed over ``data`` alone) and reduced
    in fp32 (the loss keeps its precision). Not in a reduce-scatter: each rank would receive
    its own row's sum, added in another order, and ranks must agree on the loss to the bit. Nor with an
    expert axis: an expert's bucket is summed over data alone."""
    piped = plan.pipeline is not None and plan.pipe_size > 1
    return (plan.states.params is None and plan.states.grads is None and plan.dp_size > 1 and plan.expert_size == 1
            and plan.reduce_dtype == torch.float32 and plan.tensor_size == 1
            and (not piped or plan.pipe_scalar_axes() == plan.mesh.canonical_axes(plan.dp_axes)))

def pipe_unshard(plan: Plan) -> bool:
    """ZeRO-3 under a pipe axis with the ``"step"`` gather policy: each stage gathered once per
    step (the lowered schedule's ``UNSHARD``) and reduce-scattered once (``REDUCE_GRAD``). Under
    ``"microbatch"`` the units are gathered around every micro-batch, as without a pipeline."""
    return plan.states.params is not None and plan.pipe_size > 1 and plan.pipeline.gather == "step"

def comm_per_step(plan: Plan, rank: int | None = None) -> list[CommEntry]:
    """Every collective one ``step`` issues, with the bytes this rank sends (ring model), then the
    copies between memory kinds where states are offloaded (``planner/offload.py``'s
    ``copy_entries``: ops ``d2h``, ``h2d``, ``disk_read``, ``disk_write``; no axes). Under
    HSDP the training states are sharded over ``data`` and each rank's gradient shard is then
    summed over the replica axis (one all-reduce per bucket or unit); replicated gradients (DP)
    are all-reduced over both at once."""
    r, rep = plan.replica_size, (plan.replica_axis,)
    dpn, dp = plan.dp_size, plan.mesh.canonical_axes(plan.dp_axes)
    c, g = plan.compute_dtype.itemsize, plan.reduce_dtype.itemsize
    out: list[CommEntry] = []
    if dpn > 1:
        if plan.broadcast_buffers:     # rank 0's buffers before the step's forward (DDP's broadcast_buffers)
            out += [CommEntry("forward", "buffers", "broadcast", dp, comm.broadcast_bytes(k, dpn, dt.itemsize), 1,
                              str(dt).replace("torch.", "")) for dt, k in plan.step_buffer_sizes()]
        m = plan.grad_accum
        piped = plan.pipe_size > 1
        groups = plan.flat.groups                     # units (ZeRO-3) or buckets: flat.py
        if plan.states.params is not None:           # ZeRO-3: per unit, every micro-step
            for u, grp in zip(plan.units, groups):
                # under a pipe axis a stage's units (pipe_unshard), or with the microbatch policy the
                # root, are gathered once per step and reduced once (runtime/pipeline.py)
                once = piped and (plan.pipe_unshard or u.name == "")
                k = 1 if once else m
                name = u.name or "<root>"
                tr = grp.chunk(TRAIN)
                ux, un = grp.segments[TRAIN].layout.spec.axes, grp.ranks     # data (x expert: Plan.shard_axes)
                if un > 1:
                    # one chunk of each segment per rank: ceil(T/N) trainable + frozen elements
                    gathered = comm.all_gather_bytes(tr + grp.chunk(FROZEN), un, c)
                    out.append(CommEntry("forward", "params", "all_gather", ux, gathered, k, name))
                    if u.regathered and not once:
                        out.append(CommEntry("backward", "params", "all_gather", ux, gathered, k, name))
                    if tr:
                        out.append(CommEntry("backward", "grads", "reduce_scatter", ux,
                                             comm.reduce_scatter_bytes(tr, un, g), k, name))
                if r > 1 and tr:
                    out.append(CommEntry("backward", "grads", "all_reduce", rep, comm.all_reduce_bytes(tr, r, g),
                                         k, name))
        else:
            buckets = plan.buckets()
            k = plan.scalars_per_step() if plan.scalars_ride_gradients else 0
            for i, bucket in enumerate(buckets):
                extra = k if i == len(buckets) - 1 else 0
                shard = groups[i].chunk(TRAIN)
                sx = plan.mesh.canonical_axes(plan.shard_axes(bucket[0].name))   # data (x expert)
                sn = plan.mesh.axis_size(sx)
                if plan.states.grads is None:
                    numel = sum(p.numel for p in bucket)
                    # an expert's gradients are summed over data alone (Plan.grad_axes)
                    bx = plan.mesh.canonical_axes(plan.grad_axes(bucket[0].name))
                    bn = plan.mesh.axis_size(bx) if bx else 1
                    if bn > 1:
                        out.append(CommEntry("backward", "grads", "all_reduce", bx,
                                             comm.all_reduce_bytes(numel + extra, bn, g), 1, f"bucket {i}",
                                             comm.all_reduce_bytes(numel + extra, bn, g)
                                             - comm.all_reduce_bytes(numel, bn, g)))
                else:
                    if sn > 1:
                        out.append(CommEntry("backward", "grads", "reduce_scatter", sx,
                                             comm.reduce_scatter_bytes(shard, sn, g), 1, f"bucket {i}"))
                    if r > 1:
                        out.append(CommEntry("backward", "grads", "all_reduce", rep,
                                             comm.all_reduce_bytes(shard, r, g), 1, f"bucket {i}"))
                if plan.states.optim is not None and sn > 1:
                    out.append(CommEntry("step", "params", "all_gather", sx,
                                         comm.all_gather_bytes(shard, sn, c), 1, f"bucket {i}"))
        if not plan.scalars_ride_gradients and plan.tensor_size == 1 and plan.pipe_size == 1:
            out.append(CommEntry("step", "scalars", "all_reduce", dp,
                                 comm.all_reduce_bytes(plan.scalars_per_step(), dpn, 4), 1))
    if plan.expert_size > 1:       # the routing's all-to-alls (planner/experts.py: uniform routing)
        out += routing_entries(plan.expert_layers, plan.expert_size, plan.expert_axis, c, plan.grad_accum,
                               recomputed(plan), dict(plan.routing), expert_coordinate(plan, rank))
    if plan.context_size > 1:      # the keys' and values' all-gathers of attention (planner/context.py)
        again = {u.name for u in plan.units if u.recompute or u.selective}    # (selective: attention's core)
        out += [CommEntry(phase, "activations", op, (plan.context_axis,), n, k, where) for phase, op, n, k, where
                in context_moves(plan.context_calls, plan.context_size, c, plan.grad_accum, again,
                                 plan.context_attention)]
    out += stats_entries(plan)
    if plan.pipe_size > 1:
        out += _pipe_entries(plan) + _tied_entries(plan)
        k = expert_count_floats(plan)
        if k:                       # the stage's tokens per expert, on their own
            axes = plan.mesh.canonical_axes((*plan.dp_axes, *((plan.tensor.axis,) if plan.tensor_size > 1 else ())))
            out.append(CommEntry("step", "scalars", "all_reduce", axes,
                                 comm.all_reduce_bytes(k, plan.mesh.axis_size(axes), 4), 1, "tokens per expert"))
    elif plan.tensor_size > 1:
        # the step's scalars over the whole (data, tensor) group: split gradients' norms add up
        # over tensor (runtime/engine.py counts each element once)
        both = plan.mesh.canonical_axes((*plan.dp_axes, plan.tensor.axis))
        out.append(CommEntry("step", "scalars", "all_reduce", both,
                             comm.all_reduce_bytes(plan.scalars_per_step(), dpn * plan.tensor_size, 4), 1))
        out += [replace(e, count=e.count * plan.grad_accum) for e in plan.activation_entries()]
    return out + copy_entries(plan, rank)

def _tied_entries(plan: Plan) -> list[CommEntry]:
    """A weight tied across the first and last stage (``PipelinePlan.tied``): this rank's piece of its
    reduced fp32 gradient summed over the pipe axis once a step (Megatron's embedding group; the stages
    between add zeros)."""
    pp = plan.pipeline
    return [CommEntry("step", "tied-grads", "all_reduce", (pp.axis,), comm.all_reduce_bytes(n, pp.size, 4), 1, name)
            for name, n in plan.tied_pieces if n]

def _pipe_entries(plan: Plan) -> list[CommEntry]:
    """The pipe axis's traffic of a stage-local plan: the step's scalars (``pipe_scalar_axes``),
    the tensor axis's activation collectives of its stages, and its point-to-point sends (the
    stream, or its gradient with the micro-batch's loss, per micro-batch and stage boundary) and
    receives (counted, no bytes sent); a transformers router loss's statistics summed on the last stage."""
    pp = plan.pipeline
    axes = plan.pipe_scalar_axes()
    out = []
    if axes and not plan.scalars_ride_gradients:
        out.append(CommEntry("step", "scalars", "all_reduce", axes,
                             comm.all_reduce_bytes(plan.scalars_per_step(), plan.mesh.axis_size(axes), 4), 1))
    if plan.tensor_size > 1:
        out += [replace(e, count=e.count * plan.grad_accum) for e in plan.activation_entries()]
    if plan.pipe_coord is None:
        return out
    kinds = {"SEND_F": ("forward", "send"), "RECV_F": ("forward", "recv"),
             "SEND_B": ("backward", "send"), "RECV_B": ("backward", "recv")}
    counts: dict[str, int] = {}
    for a in pp.lowered(plan.pipe_coord, unshard=plan.pipe_unshard):
        if a.kind in kinds:
            counts[a.kind] = counts.get(a.kind, 0) + 1
    for kind, k in counts.items():
        phase, op = kinds[kind]
        nbytes = pp.stream_message_bytes if kind == "SEND_F" else pp.grad_message_bytes
        out.append(CommEntry(phase, "activations", op, (pp.axis,),
                             0 if op == "recv" or nbytes is None else nbytes, k, kind))
    if pp.router_experts and any(st.post for st in pp.stages_of(plan.pipe_coord)):
        # the router loss's statistics, summed over the stages by the messages, summed over the batch's ranks
        # and SP's chunks on the last stage (runtime/pipe_router.py), once per micro-batch
        tp = plan.tensor
        over = plan.mesh.canonical_axes((*plan.mesh.canonical_axes(plan.dp_axes),
                                         *((tp.sp_axis,) if tp is not None and tp.sp_axis else ())))
        n = plan.mesh.axis_size(over)
        if n > 1:
            out.append(CommEntry("forward", "router-stats", "all_reduce", over,
                                 comm.all_reduce_bytes(2 * pp.router_experts + 1, n, 4), pp.microbatches,
                                 "router load-balancing loss"))
    return out

def comm_bytes_per_step(plan: Plan, what: str | None = None) -> int:
    """Bytes this rank sends per step, all or those of one kind (``params``, ``grads``,
    ``scalars``); scalars riding in a gradient collective count as ``scalars``."""
    total = 0
    for e in plan.comm_per_step():
        if e.op in COPY_OPS:           # moved between memory kinds, not sent: copy_bytes_per_step
            continue
        if what is None:
            total += e.total
        elif what == "scalars":
            total += e.total if e.what == "scalars" else e.riders * e.count
        elif e.what == what:
            total += e.total - e.riders * e.count
    return total

def copy_bytes_per_step(plan: Plan, rank: int | None = None) -> dict[str, int]:
    """Bytes one step moves between memory kinds on this rank, by op (``d2h``, ``h2d``,
    ``disk_read``, ``disk_write``): the offload entries of ``comm_per_step``."""
    out = {op: 0 for op in COPY_OPS}
    for e in plan.comm_per_step(rank):
        if e.op in COPY_OPS:
            out[e.op] += e.total
    return out

def ring_minimum(plan: Plan) -> int:
    """The ring-algorithm bound for parameter and gradient traffic per rank per step, bytes:
    ``2Ψ(N-1)/N`` elements for DP and ZeRO-1/2; ``3Ψ(N-1)/N`` for ZeRO-3 (per micro-step), where
    a unit kept gathered from its forward through its backward (the root) needs 2, not 3.
    Gradients (and ZeRO-1/2's gather of updated parameters) only move for trainable
    parameters; ZeRO-3 gathers frozen ones too. Under HSDP (``R`` replicas of ``N``-way shards)
    each gradient shard is also all-reduced over the replicas: ``+2(Ψ/N)(R-1)/R``; DP
    all-reduces over all ``RN`` ranks. Padding is not counted: a collective over a flat segment
    of ``T`` elements moves ``ceil(T/N)`` per rank, so what runs exceeds this by less than one
    element per rank and collective."""
    n, r = plan.data_size, plan.replica_size
    c, g = plan.compute_dtype.itemsize, plan.reduce_dtype.itemsize
    f = Fraction(n - 1, n)                        # exact: a bound compared with counted bytes
    replica = Fraction(2 * g * (r - 1), r * n)    # per trainable element and reduction, over the replicas
    if plan.states.params is not None:
        if plan.pipe_unshard:     # a stage's units: one gather and one reduce-scatter per step
            return int((c * sum(p.stored(c) for p in plan.params) + g * plan.num_trainable) * f
                       + replica * plan.num_trainable)
        once = plan.pipe_size > 1            # the microbatch policy: the root once per step
        total = Fraction(0)
        for u in plan.units:
            k = 1 if once and u.name == "" else plan.grad_accum
            ps = plan.unit_params(u.name)
            trainable = sum(p.numel for p in ps if p.trainable)
            total += k * (((2 if u.regathered else 1) * c * sum(p.stored(c) for p in ps) + g * trainable)
                          * f + replica * trainable)
        return int(total)
    if plan.states.grads is None:            # all-reduce over every data-parallel rank
        dpn = n * r
        return int((Fraction(2 * g * (dpn - 1), dpn) + (c * f if plan.states.optim is not None else 0))
                   * plan.num_trainable)
    # sharded gradients: reduce-scatter (1), the replicas' all-reduce of the shard, and with a
    # sharded optimizer the all-gather of the updated parameters (1)
    per = g * f + replica + (c * f if plan.states.optim is not None else 0)
    return int(per * plan.num_trainable)


def copy_entries(plan: Plan, rank: int | None = None) -> list:
    """The bytes one step moves between memory kinds on this rank (a stage- and tensor-local plan):

    * ``d2h grads`` — the gradients an offloaded update reads, leaving the device in the reduce dtype:
      ZeRO-3 each unit's reduced piece at every reduce (per micro-step, or once per step for a pipeline
      stage's units), ZeRO-2 each bucket's once, ZeRO-0/1 every trainable gradient (its piece) at the
      update;
    * ``h2d params`` — every updated master back into the device's compute copy (its piece); with
      ``params`` offloaded instead, each unit's shard to the device at every gather (``host``: its
      pieces; ``disk``: its packed chunk, padding included, read first: ``disk_read params``), and the
      new pieces into the shards' kind after the update (``d2h params`` from a device optimizer,
      ``disk_write params``);
    * ``disk_read`` / ``disk_write optimizer`` — the masters and moments read and written once a step
      (the first step reads no moments: none exist yet).
    """
    where = dict(plan.offload)
    kind, pkind = where.get("optimizer"), where.get("params")
    if kind is None and pkind is None:
        return []
    st = plan.states
    rank = plan._rank(rank)
    g, c = plan.reduce_dtype.itemsize, plan.compute_dtype.itemsize
    groups = plan.flat.groups
    out = []
    n_opt = (sum(grp.local_numel(rank, TRAIN) for grp in groups) if st.optim is not None
             else plan.num_trainable)
    if st.params is not None:
        piped = plan.pipe_size > 1
        for u, grp in zip(plan.units, groups):
            once = piped and (plan.pipe_unshard or u.name == "")
            k = 1 if once else plan.grad_accum
            name = u.name or "<root>"
            if pkind is not None:
                gathers = k * (2 if u.regathered and not once else 1)
                if pkind == "host":
                    held = grp.local_numel(rank, TRAIN) + grp.local_numel(rank, FROZEN)
                    out.append(CommEntry("forward", "params", "h2d", (), held * c, gathers, name))
                else:
                    chunk = grp.chunk(TRAIN) + grp.chunk(FROZEN)
                    out.append(CommEntry("forward", "params", "disk_read", (), chunk * c, gathers, name))
                    out.append(CommEntry("forward", "params", "h2d", (), chunk * c, gathers, name))
            mine = grp.local_numel(rank, TRAIN)
            if kind is not None and mine:
                out.append(CommEntry("backward", "grads", "d2h", (), mine * g, k, name))
    elif kind is not None and st.grads is not None and not st.keep_local_grads:
        for i, grp in enumerate(groups):
            mine = grp.local_numel(rank, TRAIN)
            if mine:
                out.append(CommEntry("backward", "grads", "d2h", (), mine * g, 1, f"bucket {i}"))
    elif kind is not None:
        out.append(CommEntry("step", "grads", "d2h", (), n_opt * g, 1))
    if pkind is None:
        out.append(CommEntry("step", "params", "h2d", (), n_opt * c, 1))
    else:
        if kind is None:
            out.append(CommEntry("step", "params", "d2h", (), n_opt * c, 1))
        if pkind == "disk":
            out.append(CommEntry("step", "params", "disk_write", (), n_opt * c, 1))
    if kind == "disk":
        nbytes = n_opt * (4 + plan.optimizer_state_bytes)
        out.append(CommEntry("step", "optimizer", "disk_read", (), nbytes, 1))
        out.append(CommEntry("step", "optimizer", "disk_write", (), nbytes, 1))
    return out


def stats_entries(plan: Plan) -> list[CommEntry]:
    """The routers' load-balancing statistics summed over the batch's ranks (``Plan.router_stats``): per
    micro-batch the counts (``E + 1`` floats) and probability sums (``E``) forward, the sums' cotangent
    backward where the loss holds the term, and a recomputed unit's forward again."""
    axes = plan.mesh.canonical_axes(plan.dp_axes)
    n = plan.mesh.axis_size(axes)
    tp = plan.tensor
    sp = (tp.sp_axis,) if tp is not None and tp.sp_axis else ()   # SP's chunks of the tokens: summed (forward)
    again = recomputed(plan)
    out, m = [], plan.grad_accum
    for r in plan.router_stats:
        runs = [("forward", "router-stats")] + ([("backward", "recompute")] if again(r.name) else [])
        for phase, what in runs:    # the forward's moves, and again where a recomputed unit reruns it
            for over, size in ((axes, n), (sp, tp.size if sp else 1)):
                if size > 1:
                    out += [CommEntry(phase, what, "all_reduce", over, comm.all_reduce_bytes(k, size, 4), m,
                                      f"{r.name} {part}") for part, k in (("counts", r.experts + 1), ("sums", r.experts))]
            if r.capacity and n > 1:   # the capacity's order: every batch rank's rows per expert, its tokens and place
                out.append(CommEntry(phase, what, "all_gather", axes, comm.all_gather_bytes(r.experts + 2, n, 8), m,
                                     f"{r.name} capacity"))
        if r.backward and n > 1:
            out.append(CommEntry("backward", "router-stats", "all_reduce", axes,
                                 comm.all_reduce_bytes(r.experts, n, 4), plan.grad_accum, f"{r.name} sums"))
    return out


def recomputed(plan: Plan):
    """``name -> whether module `name` runs its forward again in backward``: it is inside a unit recomputed whole."""
    units = [u.name for u in plan.units if u.recompute and u.name]
    return lambda name: any(name == u or name.startswith(u + ".") for u in units)


def _routing_moves(experts: int, hidden: int, n: int, itemsize: int, sent: int, received: int
                   ) -> list[tuple[str, str, int]]:
    """``(phase, what, bytes a rank sends)`` of each all-to-all one module of ``experts`` runs per micro-batch
    over an expert axis of ``n`` ranks, for ``sent`` rows this rank's tokens route to other ranks' experts and
    ``received`` rows its experts get from other ranks (rows of ``hidden`` elements of ``itemsize`` bytes):
    forward the rows per expert (int64), the rows, their routing weights and the outputs back; backward the
    outputs', weights' and rows' gradients (``comm/experts.py``: each move's transpose)."""
    rows_out, rows_back = sent * hidden * itemsize, received * hidden * itemsize
    return [("forward", "counts", experts * (n - 1) // n * 8), ("forward", "rows", rows_out),
            ("forward", "weights", sent * itemsize), ("forward", "combine", rows_back),
            ("backward", "combine", rows_out), ("backward", "weights", received * itemsize),
            ("backward", "rows", rows_back)]


def routing_bytes(experts: int, hidden: int, n: int, itemsize: int, sent: int, received: int) -> int:
    """The bytes the all-to-alls of a module of ``experts`` send from a rank that routed ``sent`` rows away and
    received ``received`` (``_routing_moves``; summed over micro-batches when those are): the formula a measured
    routing (``Engine.routed_rows``) is checked against."""
    return sum(b for _, _, b in _routing_moves(experts, hidden, n, itemsize, sent, received)) if n > 1 else 0


def expert_shares(layer, n: int, routing: dict) -> list[float]:
    """Per coordinate of the expert axis (``n`` ranks), the share of the rows routed to the experts it holds:
    ``1/n`` each for uniform routing, else from the stated tokens per expert (``Plan.with_routing``)."""
    counts = routing.get(layer.name)
    if counts is None:
        return [1.0 / n] * n
    per = layer.experts // n
    return [sum(counts[j * per:(j + 1) * per]) / sum(counts) for j in range(n)]


def expert_coordinate(plan: Plan, rank: int | None) -> int:
    """The expert coordinate a routing is priced for: ``rank``'s (or a local plan's), else the busiest one
    (the coordinate whose experts get the most rows in the stated routing; 0 when uniform)."""
    if plan.expert_coord is not None:
        return plan.expert_coord
    if rank is not None:
        return plan.mesh.coord(rank, plan.expert_axis)
    loads = [0.0] * plan.expert_size
    for layer in plan.expert_layers:
        for j, share in enumerate(expert_shares(layer, plan.expert_size, dict(plan.routing))):
            loads[j] += share
    return max(range(plan.expert_size), key=lambda j: (loads[j], -j))


def routing_entries(layers: tuple, n: int, axis: str, itemsize: int, microbatches: int, again=lambda name: False,
                    routing: dict | None = None, coord: int = 0) -> list:
    """Each experts module's all-to-alls of one step over the expert axis (``n`` ranks) from the rank at expert
    coordinate ``coord``, per micro-batch (``_routing_moves``). Each rank's ``T·k`` rows go to the experts in the
    stated shares (``expert_shares``: uniform unless ``routing`` gives a module's tokens per expert): the rank
    sends the rows not for its own experts, ``T·k·(1 − P)``, and receives from the ``n − 1`` others their rows
    for its experts, ``(n − 1)·T·k·P`` (``P``: its experts' share; uniform: both ``T·k·(n−1)/n``). A layer
    recomputed (``again(name)``) runs its forward's 4 again in backward. The bytes are what the rank sends."""
    out = []
    for layer in layers:
        if layer.tokens is None or n == 1:
            continue
        share = expert_shares(layer, n, routing or {})[coord]
        rows = layer.tokens * layer.top_k
        sent, received = round(rows * (1 - share)), round((n - 1) * rows * share)
        moves = _routing_moves(layer.experts, layer.hidden, n, itemsize, sent, received)
        out += [CommEntry(phase, "routing", "all_to_all", (axis,), b, microbatches, f"{layer.name} {what}")
                for phase, what, b in moves]
        if again(layer.name):
            out += [CommEntry("backward", "recompute", "all_to_all", (axis,), b, microbatches, f"{layer.name} {what}")
                    for phase, what, b in moves if phase == "forward"]
    return out
