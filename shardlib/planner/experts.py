"""The expert axis in the planner: which parameters it splits and what a plan with it may combine.

Experts' weights are laid out on their expert dim (dim 0, the logical dim ``experts``) over the mesh's
``expert`` axis (``rules={"experts": "expert"}``); the batch splits over data x expert, and everything that
is not an expert is replicated over ``expert`` like a data axis: its gradients are summed over data x
expert, an expert's over data alone (``Plan.grad_axes``). What this first version runs: the expert axis
beside data (and HSDP's replica) with ZeRO-0; ZeRO-1/2/3, the tensor and pipe axes and offload with an
expert axis are refused by name, not run wrong.
"""

from __future__ import annotations

from typing import Any

from ..algebra.spec import PartitionSpec


def expert_params(specs: dict[str, PartitionSpec], axis: str | None) -> set[str]:
    """The parameters whose spec splits over the expert axis ``axis``."""
    return {n for n, s in specs.items() if axis is not None and axis in s.axes} if axis else set()


def expert_problems(specs: dict[str, PartitionSpec], mesh: Any, roles: Any, states: Any, offload: tuple) -> list[str]:
    """What is wrong with the expert axis of this plan, if it has one of size > 1."""
    axis = roles.expert_of(mesh)
    if axis is None or mesh.axis_sizes[axis] == 1:
        return []
    n = mesh.axis_sizes[axis]
    users = sorted(expert_params(specs, axis))
    if not users:
        return [f"plan: the mesh's expert axis ({axis}={n}) splits no parameter — expected the experts' weights laid "
                f"out on it (rules={{'experts': '{axis}'}} on a mixture-of-experts model). An axis that splits "
                "nothing is refused: give it size 1, or use it as the data axis."]
    out = []
    for name in users:
        spec = specs[name]
        if spec.dim_axes(0) != (axis,) or axis in PartitionSpec(*list(spec)[1:]).axes:
            out.append(f"plan: {name} is laid out {spec} — expected the expert axis {axis!r} alone on dim 0 (the "
                       "experts dim), each rank holding whole experts.")
    sizes = mesh.axis_sizes
    others = [f"{role} axis {a!r}" for role, a in (("tensor", roles.tensor or "tensor"), ("pipe", roles.pipe or "pipe"))
              if sizes.get(a, 1) > 1]
    if others:
        out.append(f"plan: the expert axis {axis!r} beside the {' and the '.join(others)} is not supported yet — "
                   "expected expert x data (with replica) alone. Give those axes size 1.")
    if any(s is not None for s in (states.params, states.grads, states.optim)):
        out.append(f"plan: the expert axis {axis!r} with ZeRO (sharded training states) is not supported yet — "
                   "expected zero=0. Use zero=0 with the expert axis.")
    if offload:
        out.append(f"plan: the expert axis {axis!r} with offload is not supported yet — expected no offload.")
    return out
