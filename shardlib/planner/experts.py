"""The expert axis in the planner: which parameters it splits and what a plan with it may combine.

Experts' weights are laid out on their expert dim (dim 0, the logical dim ``experts``) over the mesh's
``expert`` axis (``rules={"experts": "expert"}``); the batch splits over data x expert, and everything that
is not an expert is replicated over ``expert`` like a data axis: its gradients are summed over data x
expert, an expert's over data alone (``Plan.grad_axes``); under ZeRO-1/2 the states of what is not an
expert are split over data x expert, an expert's over data (``Plan.shard_axes``). What this version runs:
the expert axis beside data (and HSDP's replica) and tensor (each expert's width split over it: the tensor
plan's experts site) and pipe, with ZeRO-0 to 3 and every offload (the experts' states and saved activations
move as the others' do); what does not run yet is refused by name, not run wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..algebra.spec import PartitionSpec


def expert_params(specs: dict[str, PartitionSpec], axis: str | None) -> set[str]:
    """The parameters whose spec splits over the expert axis ``axis``."""
    return {n for n, s in specs.items() if axis is not None and axis in s.axes} if axis else set()


def expert_owners(names) -> set[str]:
    """The experts modules holding the expert parameters ``names`` (a LoRA adapter of theirs is no experts
    module: PEFT's ``lora_A``/``lora_B`` of a wrapped 3-D weight)."""
    from .peft import is_adapter
    return {n.rpartition(".")[0] for n in names if not is_adapter(n)}


def _wrapped_weights(model: nn.Module, specs: dict[str, PartitionSpec]):
    """``(wrapper name, wrapper, base weight name, its spec, (out dim, in dim))`` of each PEFT ``ParamWrapper``
    (LoRA of a 3-D weight ``[E, out, in]``, or ``[E, in, out]`` where PEFT did not swap them)."""
    from .peft import param_wrappers
    for name, m, target in param_wrappers(model):
        dims = (1, 2) if getattr(m, "_did_swap_in_out_features", True) else (2, 1)
        yield name, m, target, specs.get(target, PartitionSpec()), dims


def _adapter_keys(name: str, m: nn.Module, specs: dict[str, PartitionSpec]):
    for adapter, r in m.r.items():
        for part in ("lora_A", "lora_B"):
            key = f"{name}.{part}.{adapter}.weight"
            if key in specs:
                yield key, part, r
        bias = f"{name}.lora_B.{adapter}.bias"
        if bias in specs:
            yield bias, "bias", r


def expert_adapter_specs(model: nn.Module, specs: dict[str, PartitionSpec], axis: str | None, size: int,
                         tensor: str | None = None, tensor_size: int = 1
                         ) -> tuple[dict[str, PartitionSpec], list[str]]:
    """``specs`` with PEFT's LoRA of the routed experts' 3-D weights (``LoraConfig(target_parameters=...)``:
    a ``ParamWrapper`` per weight ``[E, out, in]``) laid out as their weight is: ``lora_A [r·E, in]`` holds
    expert ``e``'s ``r`` rows at ``[e·r, (e+1)·r)`` — ``P(axis, <in's entry>)``; ``lora_B [out, r·E]`` holds
    them at columns ``e, E + e, ...`` — ``r`` blocks of ``E``, ``P(<out's entry>, Fused(r, axis))``: each rank
    its experts' slice of each block, and where ``tensor`` splits each expert's width (``expert_mlp``) the
    adapter on that side its rows or columns, the other one whole on every tensor rank (its gradient a partial
    sum over tensor: ``tensor_adapters``). A weight whose experts dim is split over another axis is refused."""
    from ..algebra.spec import Fused
    out, problems = dict(specs), []
    axis = axis if axis is not None and size > 1 else None
    tensor = tensor if tensor is not None and tensor_size > 1 else None
    if axis is None and tensor is None:
        return out, problems
    for name, m, target, spec, (o, i) in _wrapped_weights(model, specs):
        if not ({a for a in (axis, tensor) if a} & set(spec.axes)):
            continue
        entries = tuple(spec) + (None,) * (3 - len(tuple(spec)))
        if spec.dim_axes(0) not in ((axis,), ()) or (axis is not None and axis in PartitionSpec(*entries[1:]).axes):
            problems.append(f"plan: LoRA of {target} (laid out {spec}) — expected its experts dim (dim 0) split "
                            f"over the expert axis {axis!r} alone, if at all, and its other dims over the tensor "
                            "axis at most. Lay the weight out so, or leave it out of target_parameters.")
            continue
        ex = entries[0]
        for key, part, r in _adapter_keys(name, m, specs):
            if part == "bias":
                out[key] = PartitionSpec(entries[o]) if entries[o] is not None else PartitionSpec()
            elif part == "lora_A":
                out[key] = PartitionSpec(ex, entries[i])
            else:
                out[key] = PartitionSpec(entries[o], Fused(r, ex) if ex is not None else None)
    return out, problems


def wrapper_factors(model: nn.Module) -> dict[str, str]:
    """``factor module -> its ParamWrapper`` for PEFT's LoRA of 3-D weights: the ``lora_A``/``lora_B`` Linear
    modules are never called — the wrapper's forward reads their weights to build the delta."""
    from .peft import param_wrappers
    return {f"{name}.{part}.{adapter}" if name else f"{part}.{adapter}": name
            for name, m, _ in param_wrappers(model) for part in ("lora_A", "lora_B") for adapter in getattr(m, part)}


def wrapped_owner(model: nn.Module):
    """``module name -> the module a step calls for it``: a module PEFT wrapped (LoRA of its 3-D weights,
    ``ParamWrapper`` inside ``ParamWrapper``) and the wrappers' factors map to the outermost wrapper; any other
    to itself. A ZeRO-3 unit of experts is that module: whole around the call that reads all of them."""
    from .peft import param_wrappers
    around = {f"{name}.base_layer" if name else "base_layer": name for name, _, _ in param_wrappers(model)}
    factors = wrapper_factors(model)

    def owner(name: str) -> str:
        name = factors.get(name, name)
        while name in around:
            name = around[name]
        return name
    return owner


def tensor_adapters(model: nn.Module, specs: dict[str, PartitionSpec], tensor: str,
                    f_modules: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
    """``(wrapper module, adapter parameter)`` of each LoRA factor of a 3-D weight that enters its wrapper's
    forward through ``f`` (``comm/boundaries.py``: its gradient is each tensor rank's part of a sum): one
    whole on every tensor rank beside a weight split over ``tensor`` — ``lora_A`` where the weight's out dim
    is split (gate|up), ``lora_B`` where its in dim is (down), as Megatron's replicated inputs to a split layer
    — and any in ``f_modules`` (sequence parallelism's: whole experts on each rank's chunk of the tokens)."""
    found = []
    for name, m, target, spec, _ in _wrapped_weights(model, specs):
        for key, part, _r in _adapter_keys(name, m, specs):
            if part == "bias":
                continue
            if key.rpartition(".")[0] in f_modules or (tensor in spec.axes and tensor not in specs.get(key, PartitionSpec()).axes):
                found.append((name, key))
    return tuple(found)


def aux_loss_problems(model: nn.Module, batch_ranks: int, piped: bool = False, sp: bool = False) -> list[str]:
    """A transformers MoE model adding its router's load-balancing loss (``output_router_logits``) computes its
    statistics over the tokens it is given; with the batch split over ranks (or, ``sp``, the sequence over
    tensor) the runtime sums them over those ranks (``runtime/router_loss.py``) where its function is the known
    formula; under a pipe axis their statistics ride the stages' messages (``runtime/pipe_router.py``). Refused:
    another formula with a split batch or a pipe axis."""
    from .hf_router import adds_router_loss, known, recorded_routers
    if not adds_router_loss(model):
        return []
    where = (f"{type(model).__name__} adds its router's load-balancing loss (config.output_router_logits=True)")
    ok, name = known(model)
    if piped and not ok:
        return [f"plan: {where} through {name}, which is not the Switch formula shardlib sums across a pipe's "
                "stages (its body differs from transformers 5's Mixtral's): its layers' router logits sit on "
                "different stages. Set config.output_router_logits=False, or train without a pipe axis."]
    if piped and recorded_routers(model) is None:
        return [f"plan: {where}, but names no router module whose logits it records (_can_record_outputs has "
                "no 'router_logits'), so the stages cannot find them. Set config.output_router_logits=False, or "
                "train without a pipe axis."]
    if (batch_ranks > 1 or sp) and not ok:
        return [f"plan: {where} through {name}, which is not the Switch formula shardlib makes global (its body "
                f"differs from transformers 5's Mixtral's) — with the batch split over {batch_ranks} ranks each "
                "rank would take its own tokens' statistics, not the batch's, and training would differ from one "
                "process. Set config.output_router_logits=False, or train on one process."]
    return []


def router_loss_experts(model: nn.Module) -> int:
    """The experts of ``model``'s transformers router load-balancing loss of the known formula (summed over the
    batch's ranks, or carried by a pipe's messages: ``PipelinePlan.router_experts``), else 0."""
    from .hf_router import adds_router_loss, known, router_counts
    return router_counts(model)[0] if adds_router_loss(model) and known(model)[0] else 0


def module_list_experts(model: nn.Module) -> list[tuple[str, int]]:
    """``(name, count)`` of each container of experts one module each whose block loops over it (its own
    forward does not take the routing): the expert axis cannot move tokens to them (``planner/stacked.py``
    stacks those whose forward does)."""
    from .stacked import expert_containers, routes
    return [(name, len(keys)) for name, m, keys in expert_containers(model) if not routes(m)]


def expert_problems(specs: dict[str, PartitionSpec], mesh: Any, roles: Any, states: Any,
                    model: nn.Module | None = None) -> list[str]:
    """What is wrong with the expert axis of this plan, if it has one of size > 1."""
    axis = roles.expert_of(mesh)
    if axis is None or mesh.axis_sizes[axis] == 1:
        return []
    n = mesh.axis_sizes[axis]
    users = sorted(expert_params(specs, axis))
    if not users:
        lists = module_list_experts(model) if model is not None else []
        if lists:
            names = ", ".join(f"{name!r} ({k} modules)" for name, k in lists[:3]) + (" ..." if len(lists) > 3 else "")
            return [f"plan: the mesh's expert axis ({axis}={n}) splits no parameter — the model keeps its experts "
                    f"one module each: {names}, and its MoE block routes by looping over them, so no call carries the "
                    "routing to move tokens by. Give the container a forward taking (hidden_states [T, H], "
                    "top_k_index [T, k], top_k_weights [T, k]) that runs self[e] on the rows routed to expert e "
                    "(as shardlib.models.moe.ExpertList does; the block calls self.experts(x, index, weights)), "
                    "and shardlib stacks it and splits its experts; or store the experts as 3-D weights [E, out, in] "
                    "(transformers 5's fused *Experts); or give the expert axis size 1."]
        return [f"plan: the mesh's expert axis ({axis}={n}) splits no parameter — expected the experts' weights laid "
                f"out on it (rules={{'experts': '{axis}'}} on a mixture-of-experts model). An axis that splits "
                "nothing is refused: give it size 1, or use it as the data axis."]
    out = []
    from .peft import is_adapter
    for name in users:
        if is_adapter(name):          # the experts' LoRA: laid out by expert_adapter_specs
            continue
        spec = specs[name]
        if spec.dim_axes(0) != (axis,) or axis in PartitionSpec(*list(spec)[1:]).axes:
            out.append(f"plan: {name} is laid out {spec} — expected the expert axis {axis!r} alone on dim 0 (the "
                       "experts dim), each rank holding whole experts.")
    return out


@dataclass(frozen=True)
class ExpertLayer:
    """One experts module on the expert axis, for planning its routing: ``experts`` in all, ``top_k`` per
    token, rows of ``hidden`` elements, ``tokens`` rows entering it per rank and micro-batch (None where the
    plan was made without an example batch)."""

    name: str
    experts: int
    top_k: int
    hidden: int
    tokens: int | None


def expert_layers(model: nn.Module, params: dict[str, tuple[int, ...]], experts: set[str],
                  tokens: int | None) -> tuple[ExpertLayer, ...]:
    """The experts modules holding ``experts`` (their weights' full shapes in ``params``): the count from dim 0,
    the hidden width from ``down_proj``'s ``[E, H, I]`` (else the last dim of the first weight), ``top_k`` from
    the module that routes to them (its ``top_k``, or the model config's ``num_experts_per_tok``)."""
    modules = dict(model.named_modules())
    config = getattr(model, "config", None)
    out = []
    for owner in sorted(expert_owners(experts)):
        mine = sorted(n for n in experts if n.rpartition(".")[0] == owner)
        down = next((n for n in mine if n.endswith("down_proj")), None)
        common = set.intersection(*(set(params[n][1:]) for n in mine if len(params[n]) == 3)) \
            if any(len(params[n]) == 3 for n in mine) else set()
        # the row width: down_proj's [E, H, I], else the one width every expert matrix has (H in [E, 2I, H], [E, H, I])
        hidden = params[down][1] if down is not None else (common.pop() if len(common) == 1 else params[mine[0]][-1])
        parent = modules.get(owner.rpartition(".")[0]) if "." in owner else model
        k = getattr(parent, "top_k", None) or getattr(config, "num_experts_per_tok", None) or 1
        out.append(ExpertLayer(owner, params[mine[0]][0], int(k), hidden, tokens))
    return tuple(out)


@dataclass(frozen=True)
class RouterStats:
    """A router whose load-balancing statistics are summed over the batch's ranks (a module with a
    ``reduce_stats`` slot, ``models/moe.py``): per micro-batch its forward all-reduces ``experts + 1`` counts
    and ``experts`` probability sums, its backward (``backward``: the model adds the loss, ``aux_weight`` not
    0) the sums' cotangent; a recomputed ``unit`` runs its forward's again."""

    name: str
    experts: int
    unit: str
    backward: bool
    capacity: bool = False    # a capacity factor: every batch rank's rows per expert gathered (int64, E + 2)


def router_stats(model: nn.Module, units: set[str]) -> tuple[RouterStats, ...]:
    """The routers of ``model`` whose statistics the runtime makes global (``runtime/experts.global_statistics``;
    a transformers model's one load-balancing loss over all its layers: ``runtime/router_loss.py``)."""
    from ..algebra.qualnames import unit_of
    experts = router_loss_experts(model)
    if experts:
        return (RouterStats("<router load-balancing loss>", experts, "", True),)
    out = []
    for name, m in model.named_modules():
        if hasattr(m, "reduce_stats"):
            experts = int(getattr(m, "n_experts", 0) or getattr(getattr(m, "gate", None), "out_features", 0))
            out.append(RouterStats(name, experts, unit_of(name, units), bool(getattr(m, "aux_weight", 1.0)),
                                   bool(getattr(m, "capacity_factor", 0))))
    return tuple(out)
