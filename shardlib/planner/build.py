"""Building a plan: ``sl.plan(model, mesh, ...)`` -> ``Plan``; each parameter's unit (which modules
are units: ``units.py``), its layouts and its bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import os

import torch
from torch import nn

from ..algebra.layout import Layout
from ..algebra.mesh import AbstractMesh
from ..algebra.spec import Fused, PartitionSpec
from ..errors import ShardingError, ShardingTypeError
from ..quant.layout import QuantSpec, is_quantized, quantized_problems
from .offload import disk_problems, offload_problems
from .peft import adapter_specs
from .pipeline import PipelinePlan
from .pipeline import derive as derive_pipeline
from .plan import OPTIMIZER_STATE_BYTES, PRECISIONS, ParamPlan, Plan, UnitPlan
from .policies import DataPolicy, MemoryPolicy, PipelinePolicy, TensorPolicy, TrainingPolicy, grouped
from .specs import resolve_specs
from .states import StateLayouts, zero_problem
from .tensor import TensorPlan, derive
from .tensor_use import axis_use_problems, dims_source
from .traffic import fused_sizes
from .units import _few, _unit_of, _unit_problems, find_units, param_owners, with_leaf_units

# ---------------------------------------------------------------------------------------------

@grouped
def plan(model: nn.Module, mesh: AbstractMesh, zero: int | None = None, *, states: StateLayouts | None = None,
         precision: str = "fp32", reduce_dtype: str | torch.dtype | None = None, grad_accum: int = 1,
         clip_grad_norm: float | None = None, recompute: bool | str | Iterable[str] = False,
         units: Sequence[str] | None = None, bucket_mb: float = 25.0, optimizer: str | int = "adamw",
         reshard_after_forward: bool = True, data_axis: str = "data", broadcast_buffers: bool = True,
         rules: Any = None, sequence_parallel: bool = False, batch: Any = None, tensor_axis: str = "tensor",
         microbatches: int | None = None, schedule: str | None = None, virtual_stages: int | None = None,
         stages: Any = None, pipe_axis: str = "pipe", pipe_gather: str = "step",
         replica_axis: str | None = None, offload: Any = None, offload_dir: Any = None,
         data: DataPolicy | None = None, tensor: TensorPolicy | None = None, pipeline: PipelinePolicy | None = None,
         memory: MemoryPolicy | None = None, training: TrainingPolicy | None = None) -> Plan:
    """Plan training of ``model`` on ``mesh``: data parallel / ZeRO on ``data``, tensor parallel on ``tensor``.

    Each parameter's spec comes from the ``sl.shard`` tables on the model's modules, with logical
    dim names resolved through ``rules`` (``sl.AxisRules`` or a dict, e.g. ``{"heads": "tensor",
    "mlp": "tensor", "vocab": "tensor"}``); what the specs split on ``tensor`` runs Megatron-style
    (``planner/tensor.py``), ``sequence_parallel`` also splits the residual stream on the sequence
    dim inside the layer stack. ``batch`` (an example global batch: tensors, or meta tensors of its
    shape) lets the planner trace one forward on the meta device and account the activation
    collectives of the tensor axis in ``comm_per_step()`` and ``explain()``.

    The pipe axis (``planner/pipeline.py``): with the rule ``{"layers": "pipe"}`` the model's declared
    layer stack is cut into ``pipe x virtual_stages`` stages (``stages=``: blocks per stage, or a
    layout such as ``"E|t t|t t|t L"``; default balanced by parameter count), run by ``schedule``
    (``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"``, ``"zb_h1"``) over ``microbatches``
    micro-batches per step and data rank (default: the pipe size). ``microbatches`` is the same
    thing as ``grad_accum`` (give one of them). Under ZeRO-3, ``pipe_gather`` says when a stage's
    parameters are gathered (``planner/pipeline.py`` ``GATHER_POLICIES``): ``"step"`` (default) once
    per step, kept through its micro-batches and reduce-scattered once; ``"microbatch"`` each unit
    for every micro-batch's forward and backward, as ZeRO-3 without a pipeline (less memory, ``m``
    times the traffic).

    ``zero`` (0-3) names the usual stages; ``states`` gives the per-state layouts directly.
    **HSDP**: on a mesh with a second data axis (``replica_axis``; by default an axis named
    ``"replica"`` when the mesh has one) the batch splits over ``replica x data``, ZeRO shards the
    training states over ``data`` only and they are replicated over the replica axis, whose ranks
    sum their gradient shards with one all-reduce (FSDP2's HSDP, ZeRO++'s hpZ).
    ``precision`` is the compute dtype (``fp32``, ``bf16``, ``fp16``); master weights stay fp32.
    ``optimizer`` names the optimizer family (or gives its state bytes per parameter) so memory
    can be planned; ``recompute`` checkpoints units: ``True``/``"full"`` every block of the stacks,
    a list of unit names those units, ``"selective"`` only attention's core in every block
    (Megatron's default: ``comm/recompute.py``), ``False``/``"none"`` nothing.
    ``units`` names the modules gathered and freed together (default: each block of every
    ``nn.ModuleList``, and under ZeRO-3 without a tensor or pipe axis each embedding or linear layer
    outside them of at least half a block's parameters, untied — the token table, the LM head:
    ``planner/units.py``; the root unit holds the rest). ``broadcast_buffers`` (DDP's): rank 0's buffers
    are broadcast before each step's forward (False: each rank keeps its own, e.g. BatchNorm statistics;
    set-up always starts every rank from rank 0's parameters and buffers). Under ZeRO-3, ``reshard_after_forward`` frees
    each unit after its forward and gathers it again for its backward; the root unit, used at both
    ends of the model, stays gathered from its forward through its backward (as in FSDP2), and so
    does a default outer unit last in forward (the head: its backward comes next).

    The keywords grouped by concern (``planner/policies.py``): ``data=sl.DataPolicy(...)``,
    ``tensor=sl.TensorPolicy(...)``, ``pipeline=sl.PipelinePolicy(...)``, ``memory=sl.MemoryPolicy(...)``,
    ``training=sl.TrainingPolicy(...)``, each with fields named as the flat keywords above; a keyword
    given both flat and in a group must have one value.

    Every problem of the arguments is reported at once: a ``ShardingError`` listing them all
    (a ``ShardingTypeError`` when each is of the wrong kind).
    """
    if not isinstance(model, nn.Module):
        raise ShardingTypeError(f"plan: expected an nn.Module — got {type(model).__name__}.")
    if not isinstance(mesh, AbstractMesh):
        raise ShardingTypeError(f"plan: expected a Mesh or AbstractMesh — got {type(mesh).__name__}.")
    if data_axis == "data":          # a mesh without a data axis is one whose data size is 1
        mesh = mesh.with_axis(data_axis)
    states, rdt, (unit_names, stack_units), rec, sel, state_bytes, specs, tplan, pplan, kinds = _check(
        model, mesh, zero=zero, states=states, precision=precision, reduce_dtype=reduce_dtype,
        grad_accum=grad_accum, clip_grad_norm=clip_grad_norm, recompute=recompute, units=units,
        bucket_mb=bucket_mb, optimizer=optimizer, reshard_after_forward=reshard_after_forward,
        data_axis=data_axis, broadcast_buffers=broadcast_buffers, rules=rules,
        sequence_parallel=sequence_parallel, tensor_axis=tensor_axis, microbatches=microbatches,
        schedule=schedule, virtual_stages=virtual_stages, stages=stages, pipe_axis=pipe_axis,
        pipe_gather=pipe_gather, replica_axis=replica_axis, batch=batch, offload=offload, offload_dir=offload_dir)
    replica_axis = _replica(mesh, replica_axis)
    if pplan is not None:
        grad_accum = pplan.microbatches
    elif microbatches is not None:
        grad_accum = microbatches

    named = list(model.named_parameters())
    owners = param_owners(model)
    unit_set = set(unit_names)
    unit_of: dict[str, str] = {}           # parameter name -> unit
    for name, p in named:
        units_of = {_unit_of(f"{m}.{a}" if m else a, unit_set) for m, a in owners[id(p)]}
        unit_of[name] = units_of.pop() if len(units_of) == 1 else ""   # shared across units: root

    def layout(axis) -> Layout:
        return Layout(mesh, PartitionSpec(axis) if axis else PartitionSpec())

    layouts: dict[PartitionSpec, tuple[Layout, ...]] = {}

    def state_layouts(spec: PartitionSpec) -> tuple[Layout, ...]:
        """(rest, compute, grad, optim) over the whole mesh: the spec's own split, and ``data``
        splitting dim 0 of what it left local where the ZeRO stage shards that state."""
        if spec not in layouts:
            layouts[spec] = (Layout(mesh, with_data(spec, states.params)), Layout(mesh, spec),
                             Layout(mesh, with_data(spec, states.grads)), Layout(mesh, with_data(spec, states.optim)))
        return layouts[spec]
    itemsize = rdt.itemsize
    bucket_bytes = int(bucket_mb * 2**20)

    # Gradient buckets, in reverse order (the order gradients tend to become ready in backward),
    # up to bucket_mb each. With sharded gradients a bucket also ends where a unit ends: the
    # unit's full gradients are freed as soon as its bucket is reduce-scattered (as FSDP2 does per
    # unit), which bounds the transient memory at no measured cost in time.
    buckets: dict[str, int] = {}
    # A weight tied across the first and last pipeline stage is a bucket of its own: both stages then lay it
    # out alike (the same pieces of it under ZeRO-1/2), so its two gradients add up piece by piece.
    tied = set(pplan.tied) if pplan is not None else set()
    if states.params is None:
        b, filled, last_unit = 0, 0, None
        for name, p in reversed(named):
            if not p.requires_grad:
                continue
            size = p.numel() * itemsize
            unit = unit_of[name] if name not in tied else f"<tied {name}>"
            alone = name in tied or (last_unit or "").startswith("<tied ")
            if filled and (filled + size > bucket_bytes or ((states.grads is not None or alone) and unit != last_unit)):
                b, filled = b + 1, 0
            buckets[name] = b
            filled += size
            last_unit = unit
    specs = {k: _trim(v) for k, v in specs.items()}
    params = [ParamPlan(name, tuple(p.shape), unit_of[name], buckets.get(name), p.requires_grad,
                        *state_layouts(specs.get(name, PartitionSpec()) if p.dim() else PartitionSpec()),
                        spec=specs.get(name, PartitionSpec()), quant=QuantSpec.of(p) if is_quantized(p) else None)
              for name, p in named]
    members: dict[str, list[str]] = {}
    for pp in params:
        members.setdefault(pp.unit, []).append(pp.name)
    unit_list = [UnitPlan("", tuple(members[""]), False, False)] if "" in members else []
    # an outer layer last in forward (the LM head) stays gathered for its backward, which comes next
    # (as torchtitan's fully_shard([norm, output], reshard_after_forward=False))
    kept = unit_names[-1] if unit_names and unit_names[-1] not in stack_units else None
    # a frozen embedding runs no backward: not gathered again for one (the pipe axis's actions gather
    # every unit of a stage alike)
    modules = dict(model.named_modules())
    trained = {pp.unit for pp in params if pp.trainable}
    no_backward = {u for u in unit_names if pplan is None and u not in trained and isinstance(modules[u], nn.Embedding)}
    unit_list += [UnitPlan(u, tuple(members[u]), reshard_after_forward and u != kept, u in rec, u in sel,
                           backward=u not in no_backward)
                  for u in unit_names if u in members]
    buffers = list(model.buffers())
    tensors = [*(p for _, p in named), *buffers]
    # built on the meta device: the engine replays rank 0's initialization (runtime/materialize.py),
    # so set-up sends rank 0's generator state over the whole mesh instead of the model
    meta = bool(tensors) and all(t.is_meta for t in tensors)
    setup = ((torch.uint8, torch.get_rng_state().numel()),) if meta else fused_sizes(tensors)
    dp = (replica_axis, data_axis) if replica_axis is not None else data_axis
    out = Plan(mesh=mesh, data_axis=data_axis, states=states, precision=precision, reduce_dtype=rdt,
               grad_accum=grad_accum, clip_grad_norm=clip_grad_norm, optimizer_state_bytes=state_bytes,
               bucket_bytes=bucket_bytes, params=tuple(params), units=tuple(unit_list), batch=layout(dp),
               broadcast_buffers=broadcast_buffers, buffer_sizes=fused_sizes(buffers),
               setup_sizes=setup, meta_build=meta, tensor=tplan, pipeline=pplan, replica_axis=replica_axis,
               offload=kinds, offload_dir=None if offload_dir is None else os.fspath(offload_dir))
    if offload_dir is not None and any(k == "disk" for _, k in kinds) and getattr(mesh, "rank", None) is not None:
        found = disk_problems(offload_dir, out.disk_bytes())      # a running mesh: this machine's disk
        if found:
            raise ShardingError(found, api="plan")
    if tplan is not None and batch is not None:
        from .trace import trace_activations
        from .varying import derive_f
        out = derive_f(model, out, batch)
        out = replace(out, activations=trace_activations(model, out, batch))
    if pplan is not None:
        pplan = replace(pplan, trainable=sum(1 for p in params if p.trainable))
        if batch is not None:
            pplan = _with_stream(model, pplan, out, batch)
            from .pipeline_report import block_saved_bytes
            pplan = replace(pplan, block_saved=block_saved_bytes(model, replace(out, pipeline=pplan),
                                                                           batch=batch))
        out = replace(out, pipeline=pplan)
    return out


def _with_stream(model: nn.Module, pplan, plan: Plan, batch) -> Any:
    """The pipeline plan with the stream's per-micro-batch shape on each rank (``batch``: the
    example global batch), after checking that ``data x microbatches`` divides it."""
    from torch.utils._pytree import tree_leaves

    from .pipeline import stream_shape
    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    b = leaves[0].shape[0] if leaves and leaves[0].dim() else None
    need = plan.dp_size * pplan.microbatches
    if b is None or b % need:
        raise ShardingError(f"plan: the batch of {b} rows does not split into data={plan.dp_size} x "
                            f"microbatches={pplan.microbatches} = {need} micro-batches — expected a multiple of {need}. "
                            f"Use a batch of {max(need, (b or 0) // need * need)} or {((b or 0) // need + 1) * need}, "
                            "or change microbatches.")
    shape = list(stream_shape(model, pplan.stack, batch, b // need, plan.compute_dtype))
    tp = plan.tensor
    if tp is not None and tp.sequence_parallel and tp.size > 1:
        shape[tp.seq_dim] //= tp.size           # the stream is sequence-split between the stack's blocks
    return replace(pplan, stream=tuple(shape), stream_dtype=str(plan.compute_dtype).replace("torch.", ""))


def _replica(mesh: AbstractMesh, replica_axis: str | None) -> str | None:
    """HSDP's replica axis: the one given, else an axis named ``"replica"``; None where it is absent."""
    name = replica_axis if replica_axis is not None else "replica"
    return name if name in mesh.axis_names else None


def _trim(spec: PartitionSpec) -> PartitionSpec:
    """``P()`` for a spec that splits nothing (``P(None, None)``: logical names no rule maps)."""
    return spec if any(e is not None for e in spec) else PartitionSpec()


def with_data(spec: PartitionSpec, axis: str | None) -> PartitionSpec:
    """``spec`` with ``axis`` (ZeRO's data axis) splitting dim 0 inside whatever already splits it:
    ``P("tensor", None)`` -> ``P(("tensor", "data"), None)``, ``P(None, "tensor")`` ->
    ``P("data", "tensor")``. ``axis=None``: ``spec`` unchanged."""
    if axis is None:
        return spec
    entries = list(spec) or [None]
    first = entries[0]
    if isinstance(first, Fused):         # data splits each block's tensor-local slice, as the flat pieces do
        entries[0] = Fused(first.parts, (*first, axis))
    else:
        entries[0] = axis if first is None else ((*first, axis) if isinstance(first, tuple) else (first, axis))
    return PartitionSpec(*entries)


def _check(model: nn.Module, mesh: AbstractMesh, *, zero, states, precision, reduce_dtype, grad_accum,
           clip_grad_norm, recompute, units, bucket_mb, optimizer, reshard_after_forward, data_axis,
           broadcast_buffers, rules, sequence_parallel, tensor_axis, microbatches, schedule, virtual_stages,
           stages, pipe_axis, pipe_gather="step", replica_axis=None, batch=None, offload=None, offload_dir=None
           ) -> tuple[StateLayouts, torch.dtype, list[str], set[str], int, dict[str, PartitionSpec], TensorPlan | None,
                      PipelinePlan | None, tuple]:
    """Check every argument of ``plan`` and raise all problems at once; return what they resolve
    to: the state layouts, the reduction dtype, the unit names, the recomputed units and the
    optimizer's state bytes per parameter."""
    problems: list[tuple[bool, str]] = []     # (of the wrong kind, message)

    def add(message: str, wrong_kind: bool = False) -> None:
        problems.append((wrong_kind, message))

    def number(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if zero is not None and states is not None:
        add("plan: give either zero=... or states=..., not both.")
    if zero is not None and (problem := zero_problem(zero)) is not None:
        add(problem[1], problem[0] is ShardingTypeError)
    if states is not None and not isinstance(states, StateLayouts):
        add(f"plan: states must be a StateLayouts — got {type(states).__name__}; expected e.g. "
            "sl.StateLayouts.zero(2).", True)
    if not isinstance(data_axis, str):
        add(f"plan: data_axis must be a mesh axis name — got {type(data_axis).__name__} {data_axis!r}.", True)
    elif data_axis not in mesh.axis_names:
        add(f"plan: the mesh {mesh.axis_sizes} has no {data_axis!r} axis — expected data_axis to name one of "
            f"its axes {mesh.axis_names} (a mesh with no axis named 'data' plans with data = 1 by default). "
            "Fix data_axis=, or drop it.")
    if replica_axis is not None and not isinstance(replica_axis, str):
        add(f"plan: replica_axis must be a mesh axis name or None — got {type(replica_axis).__name__} "
            f"{replica_axis!r}.", True)
    elif replica_axis is not None and replica_axis not in mesh.axis_names:
        add(f"plan: replica_axis={replica_axis!r} is not an axis of the mesh {mesh.axis_sizes} — expected the "
            "axis over which HSDP replicates the sharded training states. Add it to the mesh, or drop replica_axis.")
    elif replica_axis is not None and replica_axis in (data_axis, tensor_axis, pipe_axis):
        add(f"plan: replica_axis={replica_axis!r} is also the data, tensor or pipe axis — expected an axis of its own.")
    rep = _replica(mesh, replica_axis if isinstance(replica_axis, str) else None)
    used = (data_axis, tensor_axis, pipe_axis, rep)
    others = {a: s for a, s in mesh.axis_sizes.items() if a not in used and s > 1}
    if others and data_axis in mesh.axis_names:
        add(f"plan: axes {others} are larger than 1, but this plan uses only {data_axis!r}, {pipe_axis!r} and "
            f"{tensor_axis!r} — expected the other axes of size 1. Use them as one of those (data_axis=, "
            "pipe_axis=, tensor_axis=, or replica_axis= for HSDP: states sharded over data, replicated over it) "
            "or give them size 1.")
    if microbatches is not None:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            add(f"plan: microbatches must be a positive int — got {microbatches!r}.")
        elif grad_accum != 1 and grad_accum != microbatches:
            add(f"plan: microbatches={microbatches} and grad_accum={grad_accum} disagree — they are the same thing "
                "(micro-batches per step and data rank); give one of them.")
    elif mesh.axis_sizes.get(pipe_axis, 1) > 1 and grad_accum != 1:
        microbatches = grad_accum
    if not isinstance(sequence_parallel, bool):
        add(f"plan: sequence_parallel must be True or False — got {sequence_parallel!r}.", True)
    if not (isinstance(precision, str) and precision in PRECISIONS):
        add(f"plan: precision {precision!r} is unknown — expected one of {tuple(PRECISIONS)}.")
    rdt = PRECISIONS.get(precision, torch.float32) if isinstance(precision, str) else torch.float32
    if reduce_dtype is not None:
        rdt = PRECISIONS.get(reduce_dtype) if isinstance(reduce_dtype, str) else reduce_dtype
        if rdt not in PRECISIONS.values():
            add(f"plan: reduce_dtype {reduce_dtype!r} is unknown — expected fp32, bf16 or fp16 (or the torch dtype).")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        add(f"plan: grad_accum must be a positive int — got {grad_accum!r}.")
    if clip_grad_norm is not None and not (number(clip_grad_norm) and clip_grad_norm > 0):
        add(f"plan: clip_grad_norm must be a positive number or None — got {clip_grad_norm!r}.")
    if not (number(bucket_mb) and bucket_mb > 0):
        add(f"plan: bucket_mb must be positive — got {bucket_mb!r}.")
    if not isinstance(broadcast_buffers, bool):
        add(f"plan: broadcast_buffers must be True or False — got {broadcast_buffers!r}.")
    if not isinstance(reshard_after_forward, bool):
        add(f"plan: reshard_after_forward must be True or False — got {reshard_after_forward!r}.")
    state_bytes = 0
    if isinstance(optimizer, str):
        if optimizer.lower() in OPTIMIZER_STATE_BYTES:
            state_bytes = OPTIMIZER_STATE_BYTES[optimizer.lower()]
        else:
            add(f"plan: optimizer {optimizer!r} is unknown — expected one of {tuple(OPTIMIZER_STATE_BYTES)} "
                "or its state bytes per parameter as an int.")
    elif isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        state_bytes = optimizer
    else:
        add(f"plan: optimizer must be a name such as 'adamw' or its state bytes per parameter (an int >= 0) "
            f"— got {type(optimizer).__name__} {optimizer!r}.", isinstance(optimizer, bool) or not isinstance(optimizer, int))
    if isinstance(states, StateLayouts):
        for message in states.problems(mesh):
            add(message)

    if units is not None and not isinstance(units, str) and isinstance(units, Iterable):
        units = list(units)                   # a generator is read once
    if next(model.parameters(), None) is None:
        add(f"plan: the model {type(model).__name__} has no parameters — expected at least one. There is "
            "nothing to train or shard.")
    zero3 = states.params is not None if isinstance(states, StateLayouts) else zero == 3
    if units is not None and (unit_problems := _unit_problems(model, units)):
        add(unit_problems[0], unit_problems[0].startswith("plan: units must be"))
        unit_names = [u for u in units if isinstance(u, str) and u] if isinstance(units, Iterable) else []
    else:
        unit_names = find_units(model, units)
    stack_units = unit_names
    sizes = mesh.axis_sizes
    if units is None and zero3 and all(not isinstance(a, str) or sizes.get(a, 1) == 1 for a in (tensor_axis, pipe_axis)):
        unit_names = with_leaf_units(model, stack_units)    # ZeRO-3 on the data axes alone (planner/units.py)
    rec: set[str] = set()
    sel: set[str] = set()
    if recompute is True or recompute == "full":       # the blocks: an embedding or a head is not replayed
        rec = set(stack_units)
    elif recompute == "selective":
        sel = set(stack_units)
    elif recompute is not False and recompute is not None and recompute != "none":
        if isinstance(recompute, str) or not isinstance(recompute, Iterable):
            add(f"plan: recompute must be 'none', 'selective', 'full' (True, False) or a list of unit names to "
                f"recompute whole — got {type(recompute).__name__} {recompute!r}.", True)
        else:
            names = list(recompute)
            known = set(unit_names)
            rec = {r for r in names if isinstance(r, str) and r in known}
            if unknown := [r for r in names if not (isinstance(r, str) and r in known)]:
                add(f"plan: recompute names {_few(unknown)}, which are not units — expected some of "
                    f"{_few(unit_names)}.")

    kinds, offload_found = offload_problems(offload, offload_dir, zero3=zero3, recompute=bool(rec))
    for m in offload_found:
        add(m, m.startswith("plan: offload must be a mapping") or m.startswith("plan: offload_dir must be"))
    specs: dict[str, PartitionSpec] = {}
    tplan = pplan = None
    if not problems:
        pplan, pproblems = derive_pipeline(model, mesh, rules=rules, axis=pipe_axis, microbatches=microbatches,
                                           schedule=schedule, virtual=virtual_stages, stages=stages,
                                           recompute=sorted(rec), gather=pipe_gather, zero3=zero3,
                                           reshard=reshard_after_forward, batch=batch)
        for m in pproblems:
            add(m)
        spec_problems: list[str] = []
        specs = resolve_specs(model, mesh, rules, collect=spec_problems)
        specs, adapter_problems = adapter_specs(model, specs, tensor_axis, mesh.axis_sizes.get(tensor_axis, 1))
        for m in spec_problems + adapter_problems + quantized_problems(model, specs, mesh):
            add(m)
        t = mesh.axis_sizes.get(tensor_axis, 1)
        if t > 1:       # with the spec problems: every problem at once
            tplan, tproblems = derive(model, specs, axis=tensor_axis, size=t, units=unit_names,
                                      sequence_parallel=bool(sequence_parallel))
            for m in tproblems + axis_use_problems(model, tplan, mesh, tensor_axis, rules):
                add(m)
            tplan = replace(tplan, dims_from=dims_source(model))
    if problems:
        messages = [m for _, m in problems]
        if all(wrong_kind for wrong_kind, _ in problems):
            raise ShardingTypeError(str(ShardingError(messages, api="plan")))
        raise ShardingError(messages, api="plan")
    if states is None:
        states = StateLayouts.zero(0 if zero is None else zero, data_axis)
    return states, rdt, (unit_names, set(stack_units)), rec, sel, state_bytes, specs, tplan, pplan, kinds
