"""Which modules are units: the groups ZeRO-3 gathers and frees together, recompute replays whole,
and the tensor axis derives per block. Owners: the modules that hold each parameter.

By default the units are the blocks of the model's layer stacks (the children of each
``nn.ModuleList``); the root unit ``""`` holds whatever is left. Under ZeRO-3 on a mesh with
neither a tensor nor a pipe axis, each large embedding or linear layer outside the stacks (the
token embeddings, an untied LM head) is a unit of its own as well, as torchtitan wraps them
(``fully_shard(tok_embeddings)``, ``fully_shard([norm, output])``): the root is gathered for the
whole step, so a vocabulary-sized table held there through the backward would sit on top of the
peak. "Large" is at least half the largest stack block's parameters: below that the extra gather
in backward costs more than the bytes it frees (a position table, a norm).

Linear in the number of parameter tensors: a parameter's unit is found by walking the prefixes
of its qualified name (``a.b.c`` -> ``a.b``, ``a``) through a set of unit names, never by
scanning the units.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from ..algebra.qualnames import unit_of
from ..errors import ShardingError

# an outer layer is a unit of its own when it holds at least this share of the largest block's parameters
LEAF_UNIT_SHARE = 0.5


def find_units(model: nn.Module, units: Sequence[str] | None = None) -> list[str]:
    """Unit module names: given ones, or every child of an ``nn.ModuleList`` that has parameters
    (the blocks of a layer stack), outermost first."""
    if units is not None:
        problems = unit_problems(model, units)
        if problems:
            raise ShardingError(problems, api="plan")
        return list(units)
    found: list[str] = []
    seen: set[str] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            for child_name, child in mod.named_children():
                q = f"{name}.{child_name}" if name else child_name
                if unit_of(q, seen) == "" and any(True for _ in child.parameters()):
                    found.append(q)
                    seen.add(q)
    return found


def with_leaf_units(model: nn.Module, stack_units: Sequence[str]) -> list[str]:
    """``stack_units`` and the large outer layers (``leaf_units``), in the order of
    ``model.named_modules()`` (forward order for the usual model: embeddings, blocks, head)."""
    if not stack_units:
        return list(stack_units)
    chosen = set(stack_units) | set(leaf_units(model, stack_units))
    return [n for n, _ in model.named_modules() if n in chosen]


def leaf_units(model: nn.Module, stack_units: Sequence[str]) -> list[str]:
    """The ``nn.Embedding`` and ``nn.Linear`` layers outside ``stack_units`` whose parameters are
    theirs alone (not tied to another module) and number at least ``LEAF_UNIT_SHARE`` of the largest
    stack unit's."""
    modules = dict(model.named_modules())
    biggest = max(sum(p.numel() for p in modules[u].parameters()) for u in stack_units)
    owners = param_owners(model)
    stacked = set(stack_units)
    out = []
    for name, mod in modules.items():
        if not name or not isinstance(mod, (nn.Embedding, nn.Linear)) or unit_of(name, stacked):
            continue
        params = list(mod.parameters(recurse=False))
        if any(True for _ in mod.children()) or not params:
            continue           # a wrapped layer (an adapter around it): left to the root
        if all(len(owners[id(p)]) == 1 for p in params) and \
                sum(p.numel() for p in params) >= LEAF_UNIT_SHARE * biggest:
            out.append(name)
    return out


def unit_problems(model: nn.Module, units: object) -> list[str]:
    if isinstance(units, str) or not isinstance(units, Iterable):
        return [f"plan: units must be a list of module names — got {type(units).__name__} {units!r}; expected "
                "qualified names such as ['blocks.0', 'blocks.1']."]
    names = dict(model.named_modules())
    bad = [u for u in units if not isinstance(u, str) or u not in names or u == ""]
    if bad:
        return [f"plan: units {few(bad)} are not submodules of the model — expected qualified names such as "
                f"{[n for n in names if n][:3]}."]
    return []


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


def few(items: Sequence, k: int = 8) -> str:
    """``items`` printed in full when short, else the first ``k`` and how many more."""
    items = list(items)
    return repr(items) if len(items) <= k else f"{items[:k]!r} (and {len(items) - k} more)"
