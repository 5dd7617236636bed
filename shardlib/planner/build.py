"""Building a plan: ``sl.plan(model, mesh, ...)`` -> ``Plan``; each parameter's unit (which modules
are units: ``units.py``), its layouts and its bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import os

import torch
from torch import nn

from ..algebra.layout import Layout
from ..algebra.mesh import AbstractMesh
from ..algebra.qualnames import unit_of
from ..algebra.spec import Fused, PartitionSpec
from ..errors import Problems, ShardingError, ShardingTypeError
from ..quant.bnb4 import from_bitsandbytes
from ..quant.layout import quant_spec, quantized_problems
from .experts import (aux_loss_problems, expert_adapter_specs, expert_layers, expert_params, expert_problems,
                      router_loss_experts, router_stats, tensor_adapters, wrapped_owner)
from .offload import disk_problems, offload_problems
from .peft import adapter_specs
from .pipeline import PipelinePlan
from .pipeline import derive as derive_pipeline
from .pipeline import with_stream
from .plan import ParamPlan, Plan, UnitPlan
from .policies import (DataPolicy, MemoryPolicy, MeshRoles, PipelinePolicy, Policies, TensorPolicy,
                       TrainingPolicy, grouped)
from .specs import resolve_specs
from .states import StateLayouts
from .tensor import TensorPlan, derive
from .tensor_use import axis_use_problems, dims_source
from .traffic import fused_sizes
from .units import few, find_units, param_owners, unit_problems, with_leaf_units

# ---------------------------------------------------------------------------------------------

def _plan(model: nn.Module, mesh: AbstractMesh, *, policies: Policies, rules: Any = None, batch: Any = None) -> Plan:
    """``sl.plan`` on its settings collected into ``policies`` (``planner/policies.py``)."""
    if not isinstance(model, nn.Module):
        raise ShardingTypeError(f"plan: expected an nn.Module — got {type(model).__name__}.")
    if not isinstance(mesh, AbstractMesh):
        raise ShardingTypeError(f"plan: expected a Mesh or AbstractMesh — got {type(mesh).__name__}.")
    pol = policies.resolved()
    data_axis = pol.roles.data
    if data_axis == "data":          # a mesh without a data axis is one whose data size is 1
        mesh = mesh.with_axis(data_axis)
    with Problems("plan") as problems:          # bitsandbytes' 4-bit Linears: their weights laid out, in place
        for m in from_bitsandbytes(model):       # (quant/bnb4.py; nothing changed where one cannot be)
            problems.add(m)
    expert_axis = pol.roles.expert_of(mesh)
    if expert_axis is not None and mesh.axis_sizes[expert_axis] > 1:
        from .stacked import stack_experts
        stack_experts(model)         # experts one module each: stacked, in place, to be split (planner/stacked.py)
    r = _check(model, mesh, pol, rules=rules, batch=batch)
    states, unit_names, stack_units, rec, sel, specs, tplan, pplan = (
        r.states, r.unit_names, r.stack_units, r.recompute, r.selective, r.specs, r.tensor, r.pipeline)
    replica_axis = pol.roles.replica_of(mesh)
    expert_axis, context_axis = r.expert_axis, r.context_axis
    experts = expert_params(r.specs, expert_axis)
    if experts and states.params is not None:
        # ZeRO-3: each experts module a unit of its own inside its block, so a unit's states are split over one
        # set of axes (an expert's over data, the rest over data x expert: Plan.shard_axes)
        order = [n for n, _ in model.named_modules()]
        owner = wrapped_owner(model)        # (PEFT's LoRA of the experts' 3-D weights: the outermost wrapper)
        unit_names = sorted(set(unit_names) | {owner(n.rpartition(".")[0]) for n in experts}, key=order.index)
    grad_accum = pplan.microbatches if pplan is not None else (pol.training.microbatches or 1)
    precision, clip_grad_norm = pol.training.precision, pol.training.clip_grad_norm
    rdt, state_bytes = pol.training.reduction_dtype(), pol.training.state_bytes()
    bucket_mb, broadcast_buffers = pol.data.bucket_mb, pol.data.broadcast_buffers
    reshard_after_forward, kinds, offload_dir = pol.memory.reshard_after_forward, r.offload, pol.memory.offload_dir

    named = list(model.named_parameters())
    param_unit = _param_units(model, named, unit_names)

    layouts: dict[PartitionSpec, tuple[Layout, ...]] = {}

    def state_layouts(spec: PartitionSpec) -> tuple[Layout, ...]:
        """(rest, compute, grad, optim) over the whole mesh: the spec's own split, and ``data``
        splitting dim 0 of what it left local where the ZeRO stage shards that state (with an expert
        axis, data x expert for what is not an expert)."""
        def shard(axis: str | None):
            # what is not an expert is sharded over data x expert, and everything over the context axis too
            # (each context rank holds every parameter: it is a data axis for the states, as in torchtitan)
            extra = tuple(a for a in (expert_axis if expert_axis not in spec.axes else None, context_axis)
                          if a is not None)
            if axis is None or not extra:
                return axis
            return mesh.canonical_axes((axis, *extra))

        if spec not in layouts:
            layouts[spec] = (Layout(mesh, with_data(spec, shard(states.params))), Layout(mesh, spec),
                             Layout(mesh, with_data(spec, shard(states.grads))),
                             Layout(mesh, with_data(spec, shard(states.optim))))
        return layouts[spec]
    itemsize = rdt.itemsize
    bucket_bytes = int(bucket_mb * 2**20)

    tied = set(pplan.tied) if pplan is not None else set()
    buckets = _buckets(named, param_unit, states, tied, itemsize, bucket_bytes, experts)
    specs = {k: _trim(v) for k, v in specs.items()}
    params = [ParamPlan(name, tuple(p.shape), param_unit[name], buckets.get(name), p.requires_grad,
                        *state_layouts(specs.get(name, PartitionSpec()) if p.dim() else PartitionSpec()),
                        spec=specs.get(name, PartitionSpec()), quant=quant_spec(p))
              for name, p in named]
    unit_list = _unit_plans(model, params, unit_names, stack_units, rec, sel, reshard_after_forward,
                           piped=pplan is not None)
    buffers = list(model.buffers())
    tensors = [*(p for _, p in named), *buffers]
    # built on the meta device: the engine replays rank 0's initialization (runtime/materialize.py),
    # so set-up sends rank 0's generator state over the whole mesh instead of the model
    meta = bool(tensors) and all(t.is_meta for t in tensors)
    setup = ((torch.uint8, torch.get_rng_state().numel()),) if meta else fused_sizes(tensors)
    rows = tuple(a for a in (replica_axis, data_axis, expert_axis) if a is not None)     # the batch's rows
    rows = rows[0] if len(rows) == 1 else rows
    dp = tuple(a for a in (replica_axis, data_axis, expert_axis, context_axis) if a is not None)
    out = Plan(mesh=mesh, data_axis=data_axis, states=states, precision=precision, reduce_dtype=rdt,
               grad_accum=grad_accum, clip_grad_norm=clip_grad_norm, optimizer_state_bytes=state_bytes,
               bucket_bytes=bucket_bytes, params=tuple(params), units=tuple(unit_list),
               batch=Layout(mesh, PartitionSpec(rows, context_axis) if context_axis else PartitionSpec(rows)),
               broadcast_buffers=broadcast_buffers, buffer_sizes=fused_sizes(buffers),
               setup_sizes=setup, meta_build=meta, tensor=tplan, pipeline=pplan, replica_axis=replica_axis,
               expert_axis=expert_axis, context_axis=context_axis,
               context_calls=r.context.calls if context_axis else (),
               context_attention=_method(r, mesh, pol) if context_axis else None,
               position_tables=r.context.tables if context_axis else (),
               expert_layers=expert_layers(
                   model, {n: tuple(p.shape) for n, p in named}, experts,
                   _tokens(batch, mesh.axis_size(dp) * grad_accum))
               if experts else (),
               router_stats=router_stats(model, {u.name for u in unit_list})
               if mesh.axis_size(dp) > 1 or (r.tensor is not None and r.tensor.sp_axis is not None)
               else (),
               offload=kinds, offload_dir=None if offload_dir is None else os.fspath(offload_dir),
               delayed=bool(pol.memory.delayed))
    if offload_dir is not None and any(k == "disk" for _, k in kinds) and getattr(mesh, "rank", None) is not None:
        found = disk_problems(offload_dir, out.disk_bytes())      # a running mesh: this machine's disk
        if found:
            raise ShardingError(found, api="plan")
    if tplan is not None and batch is not None:
        from .hf_router import traced_router_loss
        from .trace import trace_activations
        from .varying import derive_f
        with traced_router_loss(model, tplan.size if tplan.sp_axis else 1, piped=pplan is not None):
            out = derive_f(model, out, batch)
            out = replace(out, activations=trace_activations(model, out, batch))
        if pplan is None and not experts:          # each block's saved bytes, as a pipeline's are measured
            from .pipeline_report import stack_saved_bytes
            out = replace(out, stack_saved=stack_saved_bytes(model, out, batch))
    if pplan is not None:
        pplan = replace(pplan, trainable=sum(1 for p in params if p.trainable),
                        aux_riding=any(getattr(m, "aux_weight", 0) for m in model.modules()),
                        router_experts=router_loss_experts(model))
        if batch is not None:
            pplan = with_stream(model, pplan, out, batch)
            from .pipeline_report import block_saved_bytes
            pplan = replace(pplan, block_saved=block_saved_bytes(model, replace(out, pipeline=pplan),
                                                                           batch=batch))
        out = replace(out, pipeline=pplan)
    if context_axis is not None and pplan is None and tplan is None:
        from .context import context_activations
        out = replace(out, context_activations=context_activations(model, out, batch))
    return out


def _param_units(model: nn.Module, named: list, unit_names: list[str]) -> dict[str, str]:
    """Each parameter's unit: the deepest unit holding every module that holds it, else the root ``""``."""
    owners = param_owners(model)
    unit_set = set(unit_names)
    out: dict[str, str] = {}
    for name, p in named:
        units_of = {unit_of(f"{m}.{a}" if m else a, unit_set) for m, a in owners[id(p)]}
        out[name] = units_of.pop() if len(units_of) == 1 else ""   # shared across units: root
    return out


def _buckets(named: list, param_unit: dict[str, str], states: StateLayouts, tied: set[str], itemsize: int,
             bucket_bytes: int, experts: set[str] = frozenset()) -> dict[str, int]:
    """Each trainable parameter's gradient bucket (none under ZeRO-3: its units are its buckets).

    Gradient buckets, in reverse order (the order gradients tend to become ready in backward),
    up to bucket_mb each. With sharded gradients a bucket also ends where a unit ends: the
    unit's full gradients are freed as soon as its bucket is reduce-scattered (as FSDP2 does per
    unit), which bounds the transient memory at no measured cost in time. A weight tied across the
    first and last pipeline stage is a bucket of its own: both stages then lay it out alike (the same
    pieces of it under ZeRO-1/2), so its two gradients add up piece by piece. Experts' weights (split over
    the expert axis, their gradients summed over data alone) and the rest never share a bucket."""
    buckets: dict[str, int] = {}
    if states.params is None:
        b, filled, last_unit = 0, 0, None
        for name, p in reversed(named):
            if not p.requires_grad:
                continue
            size = p.numel() * itemsize
            unit = param_unit[name] if name not in tied else f"<tied {name}>"
            alone = name in tied or (last_unit or "").startswith("<tied ")
            if name in experts:
                unit = f"<experts {unit}>"
            alone = alone or name in experts or (last_unit or "").startswith("<experts ")
            if filled and (filled + size > bucket_bytes or ((states.grads is not None or alone) and unit != last_unit)):
                b, filled = b + 1, 0
            buckets[name] = b
            filled += size
            last_unit = unit
    return buckets


def _unit_plans(model: nn.Module, params: list[ParamPlan], unit_names: list[str], stack_units: set[str],
                rec: set[str], sel: set[str], reshard_after_forward: bool, *, piped: bool) -> list[UnitPlan]:
    """The root unit (if it holds anything), then each unit in order, with its resharding and recompute."""
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
    no_backward = {u for u in unit_names if not piped and u not in trained and isinstance(modules[u], nn.Embedding)}
    return unit_list + [UnitPlan(u, tuple(members[u]), reshard_after_forward and u != kept, u in rec, u in sel,
                                 backward=u not in no_backward)
                        for u in unit_names if u in members]


@grouped(_plan)
def plan(model: nn.Module, mesh: AbstractMesh, zero: int | None = None, *, states: StateLayouts | None = None,
         precision: str = "fp32", reduce_dtype: str | torch.dtype | None = None, grad_accum: int = 1,
         clip_grad_norm: float | None = None, recompute: bool | str | Iterable[str] = False,
         units: Sequence[str] | None = None, bucket_mb: float = 25.0, optimizer: str | int = "adamw",
         reshard_after_forward: bool = True, data_axis: str = "data", broadcast_buffers: bool = True,
         rules: Any = None, sequence_parallel: bool = False, context_attention: str | None = None,
         batch: Any = None, tensor_axis: str = "tensor",
         microbatches: int | None = None, schedule: str | None = None, virtual_stages: int | None = None,
         stages: Any = None, pipe_axis: str = "pipe", pipe_gather: str = "step",
         replica_axis: str | None = None, expert_axis: str | None = None, context_axis: str | None = None,
         offload: Any = None, offload_dir: Any = None, delayed: bool = False,
         roles: MeshRoles | None = None, data: DataPolicy | None = None, tensor: TensorPolicy | None = None, pipeline: PipelinePolicy | None = None,
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

    Each keyword above is the short form of one field of one policy (``planner/policies.py``:
    ``roles=sl.MeshRoles(...)`` for the four ``*_axis``, ``data=sl.DataPolicy(...)``,
    ``tensor=sl.TensorPolicy(...)``, ``pipeline=sl.PipelinePolicy(...)``, ``memory=sl.MemoryPolicy(...)``,
    ``training=sl.TrainingPolicy(...)``); synonyms (``grad_accum``/``microbatches``, ``zero``/``states``)
    set one field, and a field given twice must have one value.

    Every problem of the arguments is reported at once: a ``ShardingError`` listing them all
    (a ``ShardingTypeError`` when each is of the wrong kind).
    """
    raise AssertionError("unreachable: grouped(_plan) runs the plan")



def _tokens(batch: Any, chunks: int) -> int | None:
    """Rows of tokens a rank's micro-batch holds: the example batch's first tensor ``(B, S, ...)`` split into
    ``chunks`` (data-parallel ranks x micro-batches), times its sequence; None without a batch."""
    from torch.utils._pytree import tree_leaves
    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 2] if batch is not None else []
    if not leaves:
        return None
    return leaves[0].shape[0] // chunks * leaves[0].shape[1]


def _trim(spec: PartitionSpec) -> PartitionSpec:
    """``P()`` for a spec that splits nothing (``P(None, None)``: logical names no rule maps)."""
    return spec if any(e is not None for e in spec) else PartitionSpec()


def with_data(spec: PartitionSpec, axis: str | tuple[str, ...] | None) -> PartitionSpec:
    """``spec`` with ``axis`` (ZeRO's data axis) splitting dim 0 inside whatever already splits it:
    ``P("tensor", None)`` -> ``P(("tensor", "data"), None)``, ``P(None, "tensor")`` ->
    ``P("data", "tensor")``. ``axis=None``: ``spec`` unchanged."""
    if axis is None:
        return spec
    entries = list(spec) or [None]
    first = entries[0]
    extra = axis if isinstance(axis, tuple) else (axis,)
    if isinstance(first, Fused):         # data splits each block's tensor-local slice, as the flat pieces do
        entries[0] = Fused(first.parts, (*first, *extra))
    else:
        entries[0] = axis if first is None else (*(first if isinstance(first, tuple) else (first,)), *extra)
    return PartitionSpec(*entries)


@dataclass(frozen=True)
class Resolved:
    """What ``_check`` resolves a call's policies to, with the model: the state layouts, the units (and the
    stack's), the recomputed units (whole, and selectively), the specs, the tensor and pipe plans, and the
    offload map."""

    states: StateLayouts
    unit_names: list[str]
    stack_units: set[str]
    recompute: set[str]
    selective: set[str]
    specs: dict[str, PartitionSpec]
    tensor: TensorPlan | None
    pipeline: PipelinePlan | None
    offload: tuple
    expert_axis: str | None = None
    context_axis: str | None = None
    context: Any = None            # planner/context.ContextTrace


def _check(model: nn.Module, mesh: AbstractMesh, pol: Policies, *, rules: Any, batch: Any) -> Resolved:
    """Check every setting (each policy its own fields, then what needs the model: units, recompute,
    offload, the specs, the pipe and tensor plans) and raise all problems at once."""
    problems: list[tuple[bool, str]] = pol.problems(mesh)     # (of the wrong kind, message)

    def add(message: str, wrong_kind: bool = False) -> None:
        problems.append((wrong_kind, message))

    roles, mem = pol.roles, pol.memory
    units = mem.units
    if units is not None and not isinstance(units, str) and isinstance(units, Iterable):
        units = list(units)                   # a generator is read once
    if next(model.parameters(), None) is None:
        add(f"plan: the model {type(model).__name__} has no parameters — expected at least one. There is "
            "nothing to train or shard.")
    zero3 = mem.zero3
    if units is not None and (bad_units := unit_problems(model, units)):
        add(bad_units[0], bad_units[0].startswith("plan: units must be"))
        unit_names = [u for u in units if isinstance(u, str) and u] if isinstance(units, Iterable) else []
    else:
        unit_names = find_units(model, units)
    stack_units = unit_names
    sizes = mesh.axis_sizes
    if units is None and zero3 and all(not isinstance(a, str) or sizes.get(a, 1) == 1 for a in (roles.tensor, roles.pipe)):
        unit_names = with_leaf_units(model, stack_units)    # ZeRO-3 on the data axes alone (planner/units.py)
    rec: set[str] = set()
    sel: set[str] = set()
    recompute = mem.recompute
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
                add(f"plan: recompute names {few(unknown)}, which are not units — expected some of "
                    f"{few(unit_names)}.")

    kinds, offload_found = offload_problems(mem.offload, mem.offload_dir, zero3=zero3, recompute=bool(rec))
    for m in offload_found:
        add(m, m.startswith("plan: offload must be a mapping") or m.startswith("plan: offload_dir must be"))
    if mem.delayed and (dict(kinds).get("optimizer") != "host" or dict(kinds).get("params")):
        add(f"plan: delayed=True with offload={dict(kinds) or None} — the delayed update is the host optimizer's "
            "(it runs beside the next step's forward and backward): expected offload={'optimizer': 'host'} without "
            "the parameters offloaded. Offload the optimizer to the host, or leave delayed=False.")
    specs: dict[str, PartitionSpec] = {}
    tplan = pplan = None
    if not problems:
        pp = pol.pipeline
        pplan, pproblems = derive_pipeline(model, mesh, rules=rules, axis=roles.pipe,
                                           microbatches=pol.training.microbatches, schedule=pp.schedule,
                                           virtual=pp.virtual_stages, stages=pp.stages, recompute=sorted(rec),
                                           gather=pp.pipe_gather, zero3=zero3, reshard=mem.reshard_after_forward,
                                           batch=batch)
        for m in pproblems:
            add(m)
        spec_problems: list[str] = []
        specs = resolve_specs(model, mesh, rules, collect=spec_problems)
        specs, adapter_problems = adapter_specs(model, specs, roles.tensor, mesh.axis_sizes.get(roles.tensor, 1))
        ex = roles.expert_of(mesh)
        specs, found = expert_adapter_specs(model, specs, ex, mesh.axis_sizes.get(ex, 1) if ex else 1,
                                            roles.tensor, mesh.axis_sizes.get(roles.tensor, 1))
        adapter_problems += found
        for m in spec_problems + adapter_problems + quantized_problems(model, specs, mesh):
            add(m)
        t = mesh.axis_sizes.get(roles.tensor, 1)
        if t > 1:       # with the spec problems: every problem at once
            tplan, tproblems = derive(model, specs, axis=roles.tensor, size=t, units=unit_names,
                                      sequence_parallel=bool(pol.tensor.sequence_parallel))
            for m in tproblems + axis_use_problems(model, tplan, mesh, roles.tensor, rules):
                add(m)
            tplan = replace(tplan, dims_from=dims_source(model),
                            adapter_f=tensor_adapters(model, specs, roles.tensor, tplan.f_modules))
        for m in expert_problems(specs, mesh, roles, mem.states(roles.data), model):
            add(m)
        ranks = [a for a in (roles.data or "data", roles.replica_of(mesh), roles.expert_of(mesh)) if a in sizes]
        piped = sizes.get(roles.pipe or "pipe", 1) > 1
        sp = tplan is not None and tplan.sp_axis is not None
        for m in aux_loss_problems(model, mesh.axis_size(tuple(ranks)) if ranks else 1, piped, sp):
            add(m)
        ctx_axis, ctx_trace = _context(model, mesh, roles, rules, batch, pol, unit_names, add,
                                       heads_over=t if tplan is not None else 1)
    if problems:
        messages = [m for _, m in problems]
        if all(wrong_kind for wrong_kind, _ in problems):
            raise ShardingTypeError(str(ShardingError(messages, api="plan")))
        raise ShardingError(messages, api="plan")
    expert = roles.expert_of(mesh)
    expert = expert if expert is not None and mesh.axis_sizes[expert] > 1 else None
    return Resolved(mem.states(roles.data), unit_names, set(stack_units), rec, sel, specs, tplan, pplan, kinds,
                    expert, ctx_axis, ctx_trace)


def _method(r: Resolved, mesh: AbstractMesh, pol: Policies) -> str:
    """The context axis's attention method: the one forced (``context_attention=``), else the fastest for
    this model's calls (``planner/context.choose_method``: its moves' bytes and messages)."""
    from .context import choose_method
    itemsize = {"bf16": 2, "fp16": 2}.get(pol.training.precision, 4)
    return choose_method(r.context.calls, mesh.axis_sizes[r.context_axis], itemsize, pol.tensor.context_attention)


def _context(model: nn.Module, mesh: AbstractMesh, roles: MeshRoles, rules: Any, batch: Any, pol: Policies,
             units: list[str], add, heads_over: int = 1) -> tuple[str | None, Any]:
    """The context axis and its trace (``planner/context.py``), or ``(None, None)``; what cannot run is
    ``add``ed. The axis must be what ``rules`` map ``seq`` to, and the plan needs an example batch. With the
    heads split over a tensor axis of ``heads_over`` (Megatron's attention), each rank's attention calls
    hold that share of them."""
    from .context import context_trace, whole_sequence_inputs
    axis = roles.context_of(mesh)
    size = mesh.axis_sizes.get(axis, 1) if axis else 1
    seq_rule = dict(rules.items()).get("seq") if rules is not None and hasattr(rules, "items") else None
    if axis is None or size == 1:
        if isinstance(seq_rule, str) and seq_rule in mesh.axis_names and mesh.axis_sizes[seq_rule] > 1 \
                and seq_rule != axis:
            add(f"plan: rules map 'seq' to {seq_rule!r}, which is not the context axis — expected the sequence "
                "split over an axis of its own, named 'context' (or context_axis=). Rename the axis, or pass "
                f"context_axis={seq_rule!r}.")
        return None, None
    if seq_rule != axis:
        add(f"plan: the context axis {axis!r} (size {size}) splits nothing — got rules "
            f"{'without' if seq_rule is None else 'mapping seq to ' + repr(seq_rule) + ', not'} 'seq': {axis!r}; "
            f"expected the sequence laid out over it. Add rules={{'seq': {axis!r}}}, or give the axis size 1.")
        return None, None
    found = []
    if batch is None:
        found.append(f"plan: a context axis ({axis}={size}) needs an example batch — expected batch= (tensors, or "
                     "meta tensors of its shape): the planner traces attention and positions on one rank's chunk.")
    piped = mesh.axis_sizes.get(roles.pipe or "pipe", 1) > 1
    if piped and isinstance(batch, dict) and any(k in batch for k in ("attention_mask", "position_ids")):
        found.append("plan: a context axis under a pipe with a batch of documents or padding (attention_mask / "
                     "position_ids) — not built yet: each stage's micro-batches would need their rows' masks. Pack "
                     "without padding or positions, or drop the pipe axis.")
    if found:
        for m in found:
            add(m)
        return None, None
    rows_over = mesh.axis_size(tuple(a for a in (roles.replica_of(mesh), roles.data or "data", roles.expert_of(mesh))
                                     if a in mesh.axis_names))
    m = pol.training.microbatches or 1
    from torch.utils._pytree import tree_leaves
    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    rows = max(1, (leaves[0].shape[0] if leaves and leaves[0].dim() else 1) // (rows_over * m))
    trace = context_trace(model, whole_sequence_inputs(model, batch), size, rows, units, heads_over,
                          selective=pol.memory.recompute == "selective")
    for m_ in trace.problems:
        add(m_)
    return axis, trace
