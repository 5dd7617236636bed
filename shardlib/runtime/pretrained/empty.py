"""Building without values: ``sl.parallelize(model, plan, ..., init=False)``, the states a
``load_pretrained`` (``pretrained.py``) or ``engine.load`` fills.

**Empty states.** ``sl.parallelize(model, plan, ..., init=False)`` gives each rank zeros of exactly
what it holds (ZeRO-3: its flat piece of each parameter, never a whole tensor even for a moment; a
pipe axis: its stages' parameters only, once — the fp32 master is the parameter), never a full
model; besides, the engine holds what it holds for a model built normally (zero=0: gradient
buckets as large as the parameters, allocated at set-up — on a ``from_pretrained`` model the
parameters are the file's mapped pages, resident only once read, so its set-up RSS shows the
buckets alone). Buffers the file does not carry (rotary ``inv_freq``) are recomputed by the
model's own ``_init_weights``; persistent ones are zeros the load must replace (a folder without
one is refused by name). A step before a load is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...errors import ShardingError
from ...quant.api import is_pending
from ...quant.layout import zeros
from ..checkpoint.files import CheckpointError

if TYPE_CHECKING:
    from ..setup import StateBuilder
    from ..state import ParamState


def refuse_before_load(needs_load: bool | str, api: str) -> None:
    """``api`` refused while the engine holds no values (``init=False`` before a load) or no one step's
    state (``needs_load`` then says why)."""
    if isinstance(needs_load, str):       # a failure left it without one step's state
        raise CheckpointError(f"{api}: {needs_load}")
    if needs_load:
        raise CheckpointError(f"{api}: the engine was built with init=False and its parameters have no values "
                              "yet — expected a load first. Call engine.load_pretrained(folder) (or "
                              "engine.load(checkpoint)) before the first step, or parallelize with init=True.")


def build_empty(builder: StateBuilder) -> tuple[list[ParamState], frozenset[str]]:
    """Each parameter's state with zeros for values, each rank allocating only what it holds; and the
    persistent buffers zeroed here, which a load must bring (``fill_buffers``)."""
    awaited = fill_buffers(builder.model, builder.mesh.device)
    named, owners = dict(builder.model.named_parameters()), builder.owners()
    zero3 = builder.plan.states.params is not None
    states = []
    for i, pp in enumerate(builder.plan.params):
        p = named[pp.name]
        who = owners[id(p)]
        # ZeRO-3 keeps only its piece (cloned from this): one zero seen whole through strides of 0,
        # not a whole tensor allocated for a moment; kept whole, the zeros are the parameter itself
        if pp.quant is not None:         # the codes' own layout (a load overwrites them, never a float)
            if p.is_meta:
                raise ShardingError(f"parallelize: {pp.name} is a quantized {pp.quant.kind} on the meta device "
                                    "with init=False — got no codes to lay out; expected a quantized weight with "
                                    "values, or a float weight marked by sl.quantize(model, format) before "
                                    "peft.get_peft_model. Mark it with sl.quantize, or quantize a built base.")
            # a weight sl.quantize marked: zeros of this rank's tensor shard in the packed layout
            full = zeros(p.quantized_layout, pp.shape) if is_pending(p) else p.detach()
            st = builder.param_state(i, pp, p, full, who)
            builder.put(st)
            states.append(st)
            continue
        if not p.is_meta:                # real values (PEFT's adapters of a meta base): kept until a load
            st = builder.param_state(i, pp, p, p.detach(), who)
            builder.put(st)
            states.append(st)
            continue
        full = torch.zeros((), device=builder.mesh.device).expand(pp.shape) if zero3 else \
            torch.zeros(pp.shape, device=builder.mesh.device)
        if p.is_meta and builder.plan.states.params is None:      # kept whole: a real parameter first
            p = nn.Parameter(full, requires_grad=pp.trainable)
            for mod, attr in who:
                mod._parameters[attr] = p
        st = builder.param_state(i, pp, p, full, who)
        builder.put(st)
        states.append(st)
    return states, awaited


@torch.no_grad()
def fill_buffers(model: nn.Module, device: torch.device) -> frozenset[str]:
    """Meta buffers get values: zeros for persistent ones (the load fills them), and the model's
    own ``_init_weights(module)`` for each module holding one (transformers recomputes rotary
    tables there); a float buffer it leaves unset is refused."""
    init = getattr(model, "_init_weights", None)
    unset, awaited = [], set()
    for mname, mod in model.named_modules():
        metas = [k for k, b in mod._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        for k in metas:
            b = mod._buffers[k]
            mod._buffers[k] = torch.full(b.shape, float("nan"), dtype=b.dtype) if b.is_floating_point() \
                else torch.zeros(b.shape, dtype=b.dtype)
        if callable(init):
            init(mod)
        for k in metas:
            if k in mod._non_persistent_buffers_set and (not callable(init) or (
                    mod._buffers[k].is_floating_point() and torch.isnan(mod._buffers[k]).any())):
                unset.append(f"{mname}.{k}" if mname else k)
            elif k not in mod._non_persistent_buffers_set:
                mod._buffers[k].zero_()
                awaited.add(f"{mname}.{k}" if mname else k)
        for k in metas:
            mod._buffers[k] = mod._buffers[k].to(device)
    if unset:
        raise CheckpointError(
            f"parallelize: init=False on a meta-device model whose non-persistent buffer(s) {unset[:6]} are not "
            "in any checkpoint and were not computed — expected the model's _init_weights(module) to set them "
            "(transformers models do). Build the model on a real device, or use init=True.")
    return frozenset(awaited)
