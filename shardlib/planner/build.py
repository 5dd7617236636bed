"""Building a plan: ``sl.plan(model, mesh, ...)`` -> ``Plan``; units, owners, buckets."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..algebra.layout import Layout
from ..algebra.mesh import AbstractMesh
from ..algebra.spec import PartitionSpec
from ..errors import Problems, ShardingError, ShardingTypeError
from .plan import OPTIMIZER_STATE_BYTES, PRECISIONS, ParamPlan, Plan, UnitPlan
from .states import StateLayouts

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
