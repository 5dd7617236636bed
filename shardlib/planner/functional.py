"""``torch.func.functional_call`` for the planner's traces, leaving the module as it found it.

A forward that parametrizes a weight on the fly — PEFT's LoRA of a 3-D weight (``ParamWrapper``) registers a
parametrization around the call and removes it after — hands the traced value back to the module as a *buffer*
when the value it was given is a plain tensor (``torch.nn.utils.parametrize.remove_parametrizations``), so the
model would lose its parameter, and the next trace would meet the full weight where it expects a shard. Each
module's parameters and buffers are put back as they were. A wrapper's ``num_experts`` (how it folds its factors
into the weight) is the experts its weight's value holds while the call runs — a rank's, on an expert axis, as
``runtime/experts.route_experts`` sets it for the step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .peft import param_wrappers


def functional_call(module: nn.Module, values: dict[str, torch.Tensor], args: Any = (),
                    kwargs: dict[str, Any] | None = None, **options: Any) -> Any:
    """``torch.func.functional_call(module, values, args, kwargs, **options)``, ``module`` unchanged after."""
    held = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    counts = []
    for _, m, weight in param_wrappers(module):
        value = values.get(weight)
        if isinstance(getattr(m, "num_experts", None), int) and isinstance(value, torch.Tensor) and value.dim() == 3:
            counts.append((m, m.num_experts))
            m.num_experts = value.shape[0]
    try:
        return torch.func.functional_call(module, values, args, kwargs, **options)
    finally:
        for m, n in counts:
            m.num_experts = n
        for m, params, buffers in held:
            if m._parameters != params:
                m._parameters.clear()
                m._parameters.update(params)
            if m._buffers != buffers:
                m._buffers.clear()
                m._buffers.update(buffers)
