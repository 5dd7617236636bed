"""Values for a model built on the meta device, one unit at a time, as a normal build gives them.

A model built under ``torch.device("meta")`` has shapes and no values. ``materialize`` recreates,
group by group (a ZeRO-3 unit), the values that building the model normally on the CPU from the
same random-number state gives, bit for bit; the caller keeps its piece of each group and drops
the rest, so building needs the memory of about one group, not of the model.

**The initialization contract.** Values come from the model's own initialization code, replayed in
the order a normal build runs it:

1. *Construction* — every module that directly holds parameters or buffers has
   ``reset_parameters()`` (or ``_reset_parameters()``), which sets them, and which its constructor
   calls once its children exist (as every ``torch.nn`` layer does). Replayed in post-order of
   ``named_modules()`` (children first, then the module; for a leaf this is its construction
   order), each call seeing the tensors of the module's subtree. A tensor tied to several modules
   keeps the value of its first owner in that order (the tied copies of later owners are built and
   dropped, as in a normal build where they are replaced by the tie).
2. *Re-initialization* (optional) — a model whose constructor, after building every module,
   re-initializes tensors (GPT-2's ``N(0, 0.02)``) defines ``init_weights(self, module)``, which
   sets ``module``'s own tensors (``recurse=False``), and its constructor ends with
   ``for m in self.modules(): self.init_weights(m)``. Replayed in that order, for the modules
   that hold tensors.

A model that draws random numbers any other way while it is built (``torch.randn`` in a
constructor, a loop over ``named_parameters()`` in ``__init__``) cannot be replayed: its values
would differ from a normal build, which cannot be detected afterwards. A module holding tensors
with neither ``reset_parameters`` nor a model ``init_weights`` is refused up front; a tensor that
no replayed call sets (a buffer computed in a constructor) is refused after the replay (floating
tensors are filled with NaN before it and checked after).

**The random-number stream.** The replay uses the global CPU generator (what ``nn.init`` draws
from), starting from ``rng_state`` — the generator's state when the model began to be built (by
default its state now: a meta-device build draws nothing, so this holds if nothing drew random
numbers between building the model and materializing it). Building the values of one group
needs the generator's state where each of its modules' calls began, which depends on every call
before: a first pass runs every call once on scratch tensors (one module's tensors at a time,
freed at once) and records the state at each *segment* (a run of calls whose tensors belong to
the same groups); a second pass, per group, restores each of its segments' states and runs
their calls on the group's real tensors. Initialization compute is therefore about twice a
normal build's; memory is one group plus one module's scratch. Afterwards the generator is left
where a normal build leaves it. Values are those of a CPU build (the CPU generator); a model
built normally on a GPU draws from that device's generator instead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..algebra.qualnames import unit_of
from ..errors import Problems, ShardingError

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


_default_alloc: list[Alloc] = [_empty]


@contextmanager
def allocator(alloc: Alloc) -> Iterator[None]:
    """Inside, every replay that is given no ``alloc`` (``sl.parallelize``'s) makes its tensors with
    ``alloc(shape, dtype)``: a way to watch what building a meta-device model holds (tests)."""
    _default_alloc.append(alloc)
    try:
        yield
    finally:
        _default_alloc.pop()


@dataclass(eq=False)
class _Slot:
    """One place a tensor is held: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module: nn.Module
    attr: str
    is_param: bool
    key: int          # index of the tensor (see _Tensors)

    def get(self) -> torch.Tensor | None:
        return (self.module._parameters if self.is_param else self.module._buffers)[self.attr]

    def put(self, t: torch.Tensor | None) -> None:
        (self.module._parameters if self.is_param else self.module._buffers)[self.attr] = t


@dataclass(eq=False)
class _Step:
    """One replayed call: ``fn()`` with the tensors of ``slots`` real or scratch."""

    label: str
    fn: Callable[[], object]
    slots: list[_Slot]
    construction: bool            # phase 1 (reset_parameters) or phase 2 (init_weights)
    groups: frozenset[int] = frozenset()


@dataclass(eq=False)
class _Segment:
    groups: frozenset[int]
    steps: list[_Step] = field(default_factory=list)
    rng: torch.Tensor | None = None


class _Tensors:
    """Every parameter and buffer of the model, once each (tied ones once), by first name."""

    def __init__(self, model: nn.Module):
        self.names: list[str] = []
        self.meta: list[torch.Tensor] = []
        self.is_param: list[bool] = []
        index: dict[int, int] = {}
        for is_param, items in ((True, model.named_parameters()), (False, model.named_buffers())):
            for name, t in items:
                if id(t) not in index:
                    index[id(t)] = len(self.names)
                    self.names.append(name)
                    self.meta.append(t)
                    self.is_param.append(is_param)
        self.index = index
        # every (module, attr) holding each tensor, and the module names, in named_modules order
        self.slots: dict[int, list[_Slot]] = {}
        self.module_name: dict[int, str] = {}
        for mname, mod in model.named_modules(remove_duplicate=False):
            self.module_name.setdefault(id(mod), mname)
            for is_param, store in ((True, mod._parameters), (False, mod._buffers)):
                for attr, t in store.items():
                    if t is not None and id(t) in index:
                        slots = self.slots.setdefault(id(mod), [])
                        if not any(s.attr == attr and s.is_param == is_param for s in slots):
                            slots.append(_Slot(mod, attr, is_param, index[id(t)]))

    def direct(self, mod: nn.Module) -> list[_Slot]:
        return list(self.slots.get(id(mod), []))

    def subtree(self, mod: nn.Module) -> list[_Slot]:
        out, seen = [], set()
        for m in mod.modules():
            if id(m) not in seen:
                seen.add(id(m))
                out += self.direct(m)
        return out


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``named_modules()`` (each module once, at its first occurrence), children before parents."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        seen.add(id(mod))
        for name, child in mod._modules.items():
            if child is not None and id(child) not in seen:
                visit(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, mod))

    visit("", model)
    return out


def _reset_fn(mod: nn.Module) -> Callable[[], object] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    return None


def init_program(model: nn.Module, api: str = "parallelize") -> tuple[list[_Step], _Tensors]:
    """The calls a normal build of ``model`` makes to initialize it, in order (see the module doc);
    raises ``ShardingError`` naming every module the contract cannot initialize."""
    tensors = _Tensors(model)
    init_weights = getattr(model, "init_weights", None)
    init_weights = init_weights if callable(init_weights) else None
    steps: list[_Step] = []
    missing = []
    for name, mod in _post_order(model):
        own = tensors.direct(mod)
        if not own:
            continue
        fn = _reset_fn(mod)
        if fn is None:
            if init_weights is None:
                missing.append(f"{name or '<root>'} ({type(mod).__name__}: {', '.join(s.attr for s in own)})")
            continue
        slots = tensors.subtree(mod) if mod._modules else own
        steps.append(_Step(f"{name or '<root>'}.{fn.__name__}()", fn, slots, True))
    if missing:
        with Problems(api, ShardingError) as p:
            p.add(f"{api}: the model is on the meta device (no values), and {len(missing)} module(s) hold "
                  f"parameters or buffers with no reset_parameters() to initialize them — got "
                  f"{'; '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; expected every module that "
                  "holds tensors to define reset_parameters(), or the model to define init_weights(module) "
                  "(see shardlib.runtime.materialize). Add one, or build the model on a real device.")
    if init_weights is not None:
        from ..planner.stacked import StackedExperts
        for name, mod in model.named_modules():
            own = tensors.direct(mod)
            if own:
                # stacked experts (planner/stacked.py): each expert's modules in turn, as the list's build ran them
                call = ((lambda m=mod: m.replay(init_weights)) if isinstance(mod, StackedExperts)
                        else (lambda m=mod: init_weights(m)))
                steps.append(_Step(f"init_weights({name or '<root>'})", call, own, False))
    return steps, tensors


def unit_groups(model: nn.Module, units: Sequence[str]) -> dict[str, list[str]]:
    """Tensor names (parameters and buffers) by unit, by the planner's rule: a tensor belongs to
    the deepest unit containing every module that holds it, else to the root unit ``""``."""
    tensors = _Tensors(model)
    unit_set = set(units)
    owners: dict[int, set[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for s in tensors.direct(mod):
            owners.setdefault(s.key, set()).add(unit_of(f"{mname}.{s.attr}" if mname else s.attr, unit_set))
    out: dict[str, list[str]] = {u: [] for u in [""] + [u for u in units if u != ""]}
    for key, name in enumerate(tensors.names):
        found = owners.get(key, {""})
        out[found.pop() if len(found) == 1 else ""].append(name)
    return {u: names for u, names in out.items() if names}


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))


def _unset(t: torch.Tensor) -> bool:
    return bool((t.is_floating_point() or t.is_complex()) and t.numel() and torch.isnan(t).any())


def _run(step: _Step, real: dict[int, torch.Tensor], first_owner: dict[int, int], alloc: Alloc) -> None:
    """Run one call with real tensors where ``real`` has them (and, in construction, where this slot
    is the tensor's first owner), scratch ones elsewhere; put the meta tensors back afterwards."""
    saved = []
    for slot in step.slots:
        meta = slot.get()
        t = real.get(slot.key) if (not step.construction or first_owner[slot.key] == id(slot)) else None
        if t is None:
            t = alloc(tuple(meta.shape), meta.dtype)
        holder = nn.Parameter(t, requires_grad=meta.requires_grad) if slot.is_param else t
        saved.append((slot, meta, holder, t))
        slot.put(holder)
    try:
        with torch.no_grad():
            step.fn()
        for slot, meta, holder, t in saved:
            now = slot.get()
            if now is not holder and now is not None:     # the call replaced the tensor: take its values
                with torch.no_grad():
                    t.copy_(now.detach().to(t.dtype).view(t.shape))
    finally:
        for slot, meta, holder, t in saved:
            slot.put(meta)


def materialize(model: nn.Module, groups: Sequence[Sequence[str]] | None = None, *,
                rng_state: torch.Tensor | None = None, alloc: Alloc | None = None, api: str = "parallelize",
                keep: Collection[int] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield ``(group index, {tensor name: full CPU value})`` for each of ``groups`` (lists of
    parameter/buffer names, each tensor in exactly one group; default: one group of every tensor),
    in order, one at a time. The values are what a normal build from ``rng_state`` gives (see the
    module doc). Keep what you need of a group before asking for the next: the yielded tensors are
    not referenced by the materializer afterwards. ``alloc(shape, dtype)`` makes every tensor the
    replay writes (default ``torch.empty``, or the one set by ``allocator``). ``keep``: the indices of
    the groups to build (default all; the others are neither built nor yielded — a pipeline stage's).
    The model is left on the meta device; on completion the global CPU generator is left where a
    normal build leaves it."""
    alloc = alloc if alloc is not None else _default_alloc[-1]
    steps, tensors = init_program(model, api)
    if groups is None:
        groups = [tensors.names]
    group_of: dict[int, int] = {}
    by_name = {n: i for i, n in enumerate(tensors.names)}
    with Problems(api, ShardingError) as p:
        for g, names in enumerate(groups):
            for n in names:
                if n not in by_name:
                    p.add(f"{api}: materialize: {n!r} is not a parameter or buffer of the model.")
                elif by_name[n] in group_of:
                    p.add(f"{api}: materialize: {n!r} is in two groups.")
                else:
                    group_of[by_name[n]] = g
        left = [n for i, n in enumerate(tensors.names) if i not in group_of]
        if left:
            p.add(f"{api}: materialize: {len(left)} tensor(s) in no group — got {left[:4]}; expected every "
                  "parameter and buffer in exactly one group.")
    first_owner: dict[int, int] = {}        # tensor -> the slot whose construction call sets it
    for step in steps:
        if step.construction:
            for slot in step.slots:
                first_owner.setdefault(slot.key, id(slot))
        step.groups = frozenset(group_of[s.key] for s in step.slots)
    start = rng_state if rng_state is not None else torch.get_rng_state()
    gen = torch.default_generator
    if len(groups) == 1 and keep is None:
        yield from _single(steps, tensors, first_owner, start, alloc, api)
        return
    # pass 1: run every call on scratch tensors, recording the generator state at each segment
    segments: list[_Segment] = []
    gen.set_state(start)
    for step in steps:
        if not segments or segments[-1].groups != step.groups:
            segments.append(_Segment(step.groups, rng=gen.get_state()))
        segments[-1].steps.append(step)
        _run(step, {}, first_owner, alloc)
    end = gen.get_state()
    # pass 2: per group, replay its segments on its real tensors
    for g, names in enumerate(groups):
        if keep is not None and g not in keep:
            continue
        real = _allocate([by_name[n] for n in names], tensors, alloc)
        for seg in segments:
            if g in seg.groups:
                gen.set_state(seg.rng)
                for step in seg.steps:
                    _run(step, real, first_owner, alloc)
        out = _check(real, tensors, api)
        del real
        gen.set_state(end)
        yield g, out
        del out
    gen.set_state(end)


def _single(steps: list[_Step], tensors: _Tensors, first_owner: dict[int, int], start: torch.Tensor,
            alloc: Alloc, api: str) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """One group: a single pass, every call on the real tensors."""
    gen = torch.default_generator
    gen.set_state(start)
    real = _allocate(list(range(len(tensors.names))), tensors, alloc)
    for step in steps:
        _run(step, real, first_owner, alloc)
    end = gen.get_state()
    out = _check(real, tensors, api)
    del real
    yield 0, out
    gen.set_state(end)


def _allocate(keys: list[int], tensors: _Tensors, alloc: Alloc) -> dict[int, torch.Tensor]:
    real = {}
    for k in keys:
        t = alloc(tuple(tensors.meta[k].shape), tensors.meta[k].dtype)
        _fill_sentinel(t)
        real[k] = t
    return real


def _check(real: dict[int, torch.Tensor], tensors: _Tensors, api: str) -> dict[str, torch.Tensor]:
    unset = [tensors.names[k] for k, t in real.items() if _unset(t)]
    if unset:
        raise ShardingError(
            f"{api}: the model is on the meta device, and replaying its initialization left {len(unset)} "
            f"tensor(s) without values — got {unset[:6]}{' ...' if len(unset) > 6 else ''}; expected every "
            "parameter and buffer set by a reset_parameters() or the model's init_weights(module) (a buffer "
            "computed in a constructor is lost on the meta device). Set it in reset_parameters(), or build "
            "the model on a real device.")
    return {tensors.names[k]: t for k, t in real.items()}


def materialize_(model: nn.Module, *, rng_state: torch.Tensor | None = None,
                 api: str = "parallelize", only: Collection[str] | None = None) -> nn.Module:
    """Give a meta-device ``model`` its values in place (every tensor, on the CPU), as a normal build
    from ``rng_state`` would: the whole model at once, for layouts that keep it whole on each rank.
    ``only``: the parameters to build (a pipeline stage's; every buffer is built too), the others
    left on the meta device. Each parameter becomes a new ``nn.Parameter`` (tied ones stay tied);
    build the optimizer after."""
    tensors = _Tensors(model)
    groups = None
    if only is not None:
        mine = [n for n, is_param in zip(tensors.names, tensors.is_param) if n in only or not is_param]
        groups = [mine, [n for n in tensors.names if n not in set(mine)]]
        groups = groups if groups[1] else [mine]
    for _, values in materialize(model, groups, rng_state=rng_state, api=api, keep=None if only is None else {0}):
        new = [(nn.Parameter(values[n], requires_grad=t.requires_grad) if is_param else values[n])
               if n in values else None for n, t, is_param in zip(tensors.names, tensors.meta, tensors.is_param)]
        for slots in tensors.slots.values():
            for s in slots:
                if new[s.key] is not None:
                    s.put(new[s.key])
    return model


def materialize_stage_(model: nn.Module, mesh, names: Collection[str], api: str = "parallelize") -> None:
    """A meta-device ``model`` under a pipe axis: this rank's stages' parameters ``names`` (and every
    buffer) given, in place, the values a normal build gives them on rank 0; the other stages' stay
    on the meta device. Checked before the one set-up collective (rank 0's generator state)."""
    real = partly_meta(model)
    if real:
        raise ShardingError(f"{api}: the model is partly on the meta device — got {len(real)} tensor(s) with values "
                            f"({', '.join(real[:4])}{' ...' if len(real) > 4 else ''}); expected every parameter and "
                            "buffer on the meta device or none. Build the whole model under torch.device('meta').")
    init_program(model, api)
    materialize_(model, rng_state=agreed_rng_state(mesh), api=api, only=names)


def agreed_rng_state(mesh, axes: str | Sequence[str] | None = None, state: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Member 0's generator state (``state``, default the global CPU generator's now) on every
    member of ``mesh``'s ``axes`` group (default: the whole mesh): replaying from it, ranks built
    with different seeds still give every tensor the same values. One broadcast of ~5 KB, a set-up
    collective (tag ``"setup"``)."""
    from ..comm import core as comm

    state = (torch.get_rng_state() if state is None else state).clone()
    axes = mesh.axis_names if axes is None else axes
    if comm.group_size(mesh, axes) > 1:
        moved = comm.broadcast(state.to(mesh.device), mesh, axes, src=0, inplace=True, tag="setup")
        state = moved.to("cpu")
    return state


def put_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put ``values`` (by the buffer's first name, as ``materialize`` yields them) in every module
    slot that holds that buffer (a shared buffer stays one tensor)."""
    tensors = _Tensors(model)
    for slots in tensors.slots.values():
        for s in slots:
            if not s.is_param and tensors.names[s.key] in values:
                s.put(values[tensors.names[s.key]])


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def partly_meta(model: nn.Module) -> list[str]:
    """Names of the tensors not on the meta device when some are (else ``[]``): such a model cannot
    be materialized (the replay would overwrite the real ones)."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    real = [n for n, t in named if not t.is_meta]
    return real if len(real) < len(named) else []
