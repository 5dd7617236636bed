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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...errors import ShardingError
from ..checkpoint.files import CheckpointError

if TYPE_CHECKING:
    from ...algebra.mesh import Mesh
    from ...planner.plan import Plan
    from ..state import ParamState


class EnginePretrained:
    """Empty states and buffers for ``init=False`` (mixed into ``Engine``). ``_awaited`` names the
    persistent buffers ``_fill_buffers`` zeroed: a load must bring each of them (a successful
    ``load_pretrained`` empties it). Inputs from the host: the model, plan and mesh; ``_needs_load``
    (True until a load, or why the engine holds no one step's state); and set-up's way of building
    a parameter's state (``_owners``, ``_param_state``, ``_put``: ``setup.py``)."""

    model: nn.Module
    plan: Plan
    mesh: Mesh
    _needs_load: bool | str
    _owners: Callable[[], dict[int, list[tuple[nn.Module, str]]]]
    _param_state: Callable[..., ParamState]
    _put: Callable[[ParamState], None]
    _awaited: frozenset[str] = frozenset()

    def _refuse_before_load(self, api: str) -> None:
        if isinstance(self._needs_load, str):       # a failure left it without one step's state
            raise CheckpointError(f"{api}: {self._needs_load}")
        if self._needs_load:
            raise CheckpointError(f"{api}: the engine was built with init=False and its parameters have no values "
                                  "yet — expected a load first. Call engine.load_pretrained(folder) (or "
                                  "engine.load(checkpoint)) before the first step, or parallelize with init=True.")

    def _build_states_empty(self) -> list:
        """Each parameter's state with zeros for values, each rank allocating only what it holds."""
        self._fill_buffers()
        named, owners = dict(self.model.named_parameters()), self._owners()
        zero3 = self.plan.states.params is not None
        states = []
        for i, pp in enumerate(self.plan.params):
            p = named[pp.name]
            who = owners[id(p)]
            # ZeRO-3 keeps only its piece (cloned from this): one zero seen whole through strides of 0,
            # not a whole tensor allocated for a moment; kept whole, the zeros are the parameter itself
            if pp.quant is not None:         # the codes' own layout (a load overwrites them, never a float)
                if p.is_meta:
                    raise ShardingError(f"parallelize: {pp.name} is a quantized {pp.quant.kind} on the meta device "
                                        "with init=False — got no codes to lay out; expected a quantized weight with "
                                        "values. Build the base, quantize it, then parallelize it.")
                st = self._param_state(i, pp, p, p.detach(), who)
                self._put(st)
                states.append(st)
                continue
            full = torch.zeros((), device=self.mesh.device).expand(pp.shape) if zero3 else \
                torch.zeros(pp.shape, device=self.mesh.device)
            if p.is_meta and self.plan.states.params is None:      # kept whole: a real parameter first
                p = nn.Parameter(full, requires_grad=pp.trainable)
                for mod, attr in who:
                    mod._parameters[attr] = p
            st = self._param_state(i, pp, p, full, who)
            self._put(st)
            states.append(st)
        return states

    @torch.no_grad()
    def _fill_buffers(self) -> None:
        """Meta buffers get values: zeros for persistent ones (the load fills them), and the model's
        own ``_init_weights(module)`` for each module holding one (transformers recomputes rotary
        tables there); a float buffer it leaves unset is refused."""
        init = getattr(self.model, "_init_weights", None)
        unset, awaited = [], set()
        for mname, mod in self.model.named_modules():
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
                mod._buffers[k] = mod._buffers[k].to(self.mesh.device)
        self._awaited = frozenset(awaited)
        if unset:
            raise CheckpointError(
                f"parallelize: init=False on a meta-device model whose non-persistent buffer(s) {unset[:6]} are not "
                "in any checkpoint and were not computed — expected the model's _init_weights(module) to set them "
                "(transformers models do). Build the model on a real device, or use init=True.")
