"""Experts kept one module each — an ``nn.ModuleList`` or ``nn.ModuleDict`` of identical expert modules, as
older families, Switch Transformers and hand-written models hold them — held as one stacked module, so the
expert axis splits them as it splits transformers 5's fused experts.

``stack_experts(model)`` replaces each such container, in place, by a ``StackedExperts``: every parameter of
the expert module stacked on a new dim 0, the logical dim ``experts`` (``experts.3.w1.weight [out, in]`` is
row 3 of ``experts.w1_weight [E, out, in]``; dots become ``_``). The container's own forward runs unchanged:
``self[i]`` (or ``self["expert_3"]``) is a view of the ``i``-th expert this module holds, running the expert
module's own forward on its slices (``torch.func.functional_call`` of one template), and ``len(self)`` is the
number held — split over an ``expert`` axis, this rank's, the routing then naming them by their place here
(as the fused experts read their count off the weight). ``state_dict`` keeps the per-expert names, and
``load_state_dict`` takes them, where the module holds every expert.

A container is stacked when it has at least two children of one class with the same parameters, is named
``experts`` (``expert``, ``mlps``), and its forward takes the routing: ``(hidden_states [T, H], top_k_index
[T, k], top_k_weights [T, k])`` as transformers' fused experts, or Switch's ``(hidden_states, one-hot mask
[T, k, E], weights [T, k])``. A plain list a block loops over has no such forward: it is refused by name
(``planner/experts.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

EXPERT_NAMES = ("experts", "expert", "mlps")


def expert_containers(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """``(name, container, its expert keys)`` of each container of experts, one module per expert."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict)) or name.rpartition(".")[2] not in EXPERT_NAMES:
            continue
        kids = [(k, c) for k, c in m._modules.items() if c is not None]
        if not kids:
            continue
        classes = [type(c) for _, c in kids]
        kind = max(classes, key=classes.count)          # the experts; anything else it holds stays beside them
        common = [(k, c) for k, c in kids if type(c) is kind]
        if len(common) < 2:
            continue
        params = [tuple(n for n, _ in c.named_parameters()) for _, c in common]
        if len(set(params)) == 1 and params[0]:
            out.append((name, m, [k for k, _ in common]))
    return out


def routes(container: nn.Module) -> bool:
    """Whether the container's own forward takes the routing (else its block loops over it)."""
    return type(container).forward is not nn.Module.forward and not isinstance(container, StackedExperts)


def stack_experts(model: nn.Module) -> list[str]:
    """Stack every container of experts whose forward takes the routing (module doc), in place; returns their
    names. Already stacked ones are left alone."""
    from ..errors import ShardingError
    from ..quant.layout import is_quantized
    done = []
    for name, container, keys in expert_containers(model):
        packed = [f"{name}.{k}.{n}" for k in keys[:1] for n, p in container._modules[k].named_parameters()
                  if is_quantized(p)]
        if routes(container) and packed:
            raise ShardingError(f"plan: the experts {name!r} are one module each with quantized weights "
                                f"({', '.join(packed[:2])}) — the expert axis splits them stacked [E, out, in], and a "
                                "quantized tensor does not stack. Stack the float model first "
                                "(shardlib.planner.stacked.stack_experts(model)), then quantize the stacked 3-D "
                                "weights by name: sl.quantize(model, 'int8' | 'int4' | 'nf4', parameters=["
                                "'*.experts.*']) (NF4 expert by expert, as to_nf4 would).",
                                api="plan")
        adapters = [f"{name}.{k}.{n}" for k in keys[:1] for n, _ in container._modules[k].named_parameters()
                    if "lora_" in n]
        if routes(container) and adapters:
            raise ShardingError(f"plan: the experts {name!r} are one module each with PEFT adapters inside "
                                f"({', '.join(adapters[:2])}) — the expert axis splits them stacked [E, out, in], and "
                                "stacking would stack the adapters too. Stack the base model first "
                                "(shardlib.planner.stacked.stack_experts(model)), then give the stacked 3-D weights "
                                "LoRA by name (LoraConfig(target_parameters=[...]), as for fused experts).", api="plan")
        if routes(container):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, stacked_class(type(container))(container, keys))
            done.append(name)
    return done


@functools.lru_cache(maxsize=None)
def stacked_class(kind: type) -> type:
    """The ``StackedExperts`` of one container class: its forward is the container's (signature included)."""
    own = kind.forward

    @functools.wraps(own)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return own(self, *args, **kwargs)

    return type(f"Stacked{kind.__name__}", (StackedExperts,), {"forward": forward, "__module__": __name__,
                                                                "__qualname__": f"Stacked{kind.__name__}"})


class StackedExperts(nn.Module):
    """A container of ``E`` expert modules as one module: each expert parameter ``p`` stacked ``[E, *p.shape]``
    (module doc). Holds whatever experts its weights hold; its forward is the container's own."""

    stacked_experts = True          # what planner/specs.py asks (it does not import this module)

    def __init__(self, container: nn.Module, keys: list[str]):
        super().__init__()
        experts = [container._modules[k] for k in keys]
        template = experts[0]
        self.__dict__["_kind"] = type(container)
        self._keys = list(keys)
        self._names: dict[str, str] = {}                 # stacked name -> the expert's own name (w1_weight -> w1.weight)
        for k, v in vars(container).items():             # its settings (num_experts, ...), not torch's own state
            if not k.startswith("_") and k != "training":
                setattr(self, k, v)
        for k, m in container._modules.items():          # what else it holds (a dropout)
            if k not in keys:
                self.add_module(k, m)
        for pname, p in template.named_parameters():
            flat = pname.replace(".", "_")
            stacked = torch.stack([e.get_parameter(pname).detach() for e in experts])
            self.register_parameter(flat, nn.Parameter(stacked, requires_grad=p.requires_grad))
            self._names[flat] = pname
        for m in template.modules():                     # the template computes only with the slices given it
            for k, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[k] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        self.__dict__["_template"] = template            # not a child: it holds no parameter of the model
        self.train(container.training)
        self._register_tables(template)
        self.register_state_dict_post_hook(_per_expert_names)
        self.register_load_state_dict_pre_hook(_stacked_names)

    def _register_tables(self, template: nn.Module) -> None:
        """Each stacked weight's dims: ``experts`` then the expert's own (from its class's ``sl.shard`` table
        where it has one with logical dims, else unnamed)."""
        from .specs import class_tables, shard
        table: dict[str, tuple] = {}
        for flat, pname in self._names.items():
            dims: tuple = (None,) * (getattr(self, flat).dim() - 1)
            for t in class_tables(type(template)):
                for e in t.match(pname):
                    if e.logical is not None and len(e.logical) == len(dims):
                        dims = tuple(e.logical)
            table[flat] = ("experts", *dims)
        shard(table)(self)

    def replay(self, fn: Callable[[nn.Module], Any], *, post: bool = False) -> None:
        """``fn(m)`` for every module ``m`` of every expert that holds parameters, in the order a build of the
        container calls it — expert by expert, each expert's modules in post-order (``post``: construction's
        ``reset_parameters``) or in ``modules()`` order (a model's ``init_weights``) — each ``m`` seeing its
        expert's slices of the stacked weights (what it writes lands in them). The meta-device replay
        (``runtime/materialize.py``) gives a stacked model the values a build of the list gives."""
        mods = _post(self._template) if post else list(self._template.named_modules())
        for i in range(self.held):
            for mname, m in mods:
                own = [k for k, p in m._parameters.items() if p is not None]
                if not own:
                    continue
                saved = {k: m._parameters[k] for k in own}
                bound = {}
                for k in own:
                    flat = (f"{mname}.{k}" if mname else k).replace(".", "_")
                    bound[k] = nn.Parameter(getattr(self, flat)[i], requires_grad=False)
                    m._parameters[k] = bound[k]
                try:
                    with torch.no_grad():
                        fn(m)
                        for k in own:
                            if m._parameters[k] is not bound[k]:      # replaced: take its values
                                bound[k].copy_(m._parameters[k].detach().view_as(bound[k]))
                finally:
                    m._parameters.update(saved)

    def reset_parameters(self) -> None:
        """Construction's ``reset_parameters`` of every expert's modules (``replay``)."""
        def reset(m: nn.Module) -> None:
            fn = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if callable(fn):
                fn()
        self.replay(reset, post=True)

    @property
    def held(self) -> int:
        """The experts this module holds (all of them on one process; this rank's on an expert axis)."""
        return getattr(self, next(iter(self._names))).shape[0]

    def __len__(self) -> int:
        return self.held

    def __getitem__(self, key: int | str) -> _Expert:
        if isinstance(key, str):
            if key not in self._keys:
                raise KeyError(key)
            key = self._keys.index(key)
        key = int(key)
        if key < 0:
            key += self.held
        if not 0 <= key < self.held:
            raise IndexError(f"{self._kind.__name__}: expert {key} of the {self.held} held here — the routing names "
                             "this module's experts by their place among those it holds.")
        return _Expert(self, key)

    def __iter__(self) -> Iterator[Any]:
        if issubclass(self._kind, nn.ModuleDict):
            return iter(self._keys[:self.held])
        return (self[i] for i in range(self.held))

    def keys(self) -> list[str]:
        return self._keys[:self.held]

    def values(self) -> list[_Expert]:
        return [self[i] for i in range(self.held)]

    def items(self) -> list[tuple[str, _Expert]]:
        return list(zip(self.keys(), self.values()))

    def extra_repr(self) -> str:
        return f"{self._kind.__name__} of {len(self._keys)} experts stacked, {self.held} held"


def _post(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``named_modules()`` children before parents."""
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod._modules.items():
            if child is not None:
                visit(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, mod))

    visit("", module)
    return out


class _Expert:
    """Expert ``i`` of a ``StackedExperts``: its module's forward on its slices."""

    def __init__(self, owner: StackedExperts, i: int):
        self.owner, self.i = owner, i

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        o = self.owner
        template = o._template
        if template.training != o.training:
            template.train(o.training)
        params = {pname: getattr(o, flat)[self.i] for flat, pname in o._names.items()}
        return functional_call(template, params, args, kwargs)

    def __getattr__(self, name: str) -> Any:       # the expert's own attributes (its config, its act_fn)
        return getattr(self.owner._template, name)


def _per_expert_names(module: StackedExperts, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """``state_dict``: each stacked weight as its experts' own (``experts.3.w1.weight``), where all are held."""
    if module.held != len(module._keys):
        return
    for flat, pname in module._names.items():
        stacked = state_dict.pop(prefix + flat)
        for i, key in enumerate(module._keys):
            state_dict[f"{prefix}{key}.{pname}"] = stacked[i]


def _stacked_names(module: StackedExperts, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                   missing: list, unexpected: list, errors: list) -> None:
    """``load_state_dict`` of the experts' own names: stacked into this module's weights."""
    for flat, pname in module._names.items():
        names = [f"{prefix}{key}.{pname}" for key in module._keys]
        if prefix + flat not in state_dict and all(n in state_dict for n in names):
            state_dict[prefix + flat] = torch.stack([state_dict.pop(n) for n in names])


def per_expert_names(model: nn.Module) -> dict[str, list[str]]:
    """``{stacked parameter's name: its experts' own names, in order}`` of every ``StackedExperts`` in
    ``model`` (``...experts.w1_weight`` -> ``[...experts.0.w1.weight, ...]``): what a folder or a
    ``state_dict`` of the list holds."""
    out = {}
    for mname, m in model.named_modules():
        if isinstance(m, StackedExperts):
            pre = f"{mname}." if mname else ""
            for flat, pname in m._names.items():
                out[pre + flat] = [f"{pre}{key}.{pname}" for key in m._keys]
    return out
