"""Parameter specs from pattern tables: ``@sl.shard``, ``sl.AxisRules`` and ``resolve_specs``.

A model says where its parameters live with tables of ``fnmatch`` patterns, relative to the
module they are attached to::

    @sl.shard({"qkv.weight": ("heads", "embed"), "proj.weight": ("embed", "heads")})
    class Attention(nn.Module): ...

    sl.shard(mesh, {"*.q_proj.weight": P("tensor", None)})(llama)     # a third-party instance

A value is either a ``PartitionSpec`` (mesh axes) or a tuple of *logical* dim names, one per
tensor dim, that ``AxisRules`` maps to mesh axes at plan time (``{"heads": "tensor"}``); a logical
name with no rule is a replicated dim, so a model that names its dims trains replicated until
rules are given. The tables live in side tables keyed by class and by module instance
(weak references): nothing is stored on a tensor or a module, and a decorated class is returned
unchanged (a ``copy.deepcopy`` of an instance does not carry the tables of ``sl.shard(...)(instance)``;
class tables apply to every instance, copies included).

``resolve_specs(model, mesh, rules)`` gives every parameter (qualified names as
``model.named_parameters()``) its spec, checking everything against the mesh and raising once with
every problem. Work is linear in the number of parameters: each parameter looks up the tables of
its ancestors by qualified-name prefix (depth many dict look-ups), and each table's patterns are
compiled once. The rules that map logical names to mesh axes, and the checks a spec passes against
the mesh, are ``rules.py``.
"""

from __future__ import annotations

import fnmatch
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from torch import nn

from ..algebra.mesh import AbstractMesh, current_mesh
from ..algebra.spec import Fused, PartitionSpec, entry_axes
from ..errors import MeshError, Problems, ShardingTypeError, SpecError
from ..validate import flag, nonempty_str
from .hf_dims import hf_dims
from .names import closest, relative_names
from .peft import base_name, is_adapter, is_peft
from .rules import AxisRules as AxisRules      # re-exported: sl.AxisRules was first defined here
from .rules import Logical, RuleValue, axis_problems, rank_problems

M = TypeVar("M")
API = "sl.shard"


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Entry:
    index: int
    pattern: str
    spec: PartitionSpec | None      # a mesh-axis spec, or
    logical: Logical | None         # logical dim names resolved through the rules


class ShardTable:
    """One ``sl.shard`` table: patterns compiled once; ``match(rel)`` lists the entries matching a
    name relative to the decorated module, in table order."""

    def __init__(self, table: object, *, strict: bool, mesh: AbstractMesh | None):
        if not isinstance(table, Mapping):
            raise ShardingTypeError(
                f"{API}: expected a table mapping parameter-name patterns to a P or a tuple of logical dim "
                f"names — got {table!r} of type {type(table).__name__}. Write sl.shard(mesh, "
                "{'attn.qkv.weight': P('tensor', None)}).")
        bad: list[str] = []
        entries: list[_Entry] = []
        for i, (pattern, value) in enumerate(table.items()):
            if not nonempty_str(pattern):
                bad.append(f"{API}: pattern {pattern!r} of type {type(pattern).__name__} — expected a non-empty "
                           "fnmatch pattern (str) such as '*.o_proj.weight'.")
            elif isinstance(value, PartitionSpec):
                entries.append(_Entry(i, pattern, value, None))
            elif isinstance(value, (tuple, list)) and all(n is None or nonempty_str(n) or _logical_fused(n)
                                                          for n in value):
                entries.append(_Entry(i, pattern, None, tuple(value)))
            else:
                bad.append(f"{API}: pattern {pattern!r} maps to {value!r} of type {type(value).__name__} — "
                           "expected a P (mesh axes) or a tuple of logical dim names (str or None). Write "
                           f"{{{pattern!r}: P('tensor', None)}} or {{{pattern!r}: ('heads', 'embed')}}"
                           + ("; P() replicates" if value is None else "") + ".")
        if bad:
            raise ShardingTypeError(bad[0] if len(bad) == 1 else f"{API}: several table entries are of the "
                                    "wrong kind:\n" + "\n".join(f"  - {b}" for b in bad))
        with Problems(API, SpecError) as problems:
            for e in entries:
                if e.spec is not None:
                    for p in axis_problems(e.spec, mesh, f"{API}: pattern {e.pattern!r} -> {e.spec}"):
                        problems.add(p)
        self.entries = tuple(entries)
        self.strict = strict
        self.mesh = mesh
        self._literal = {e.pattern: e for e in entries if not any(c in e.pattern for c in "*?[")}
        self._wild = [(e, re.compile(fnmatch.translate(e.pattern))) for e in entries
                      if e.pattern not in self._literal]
        self._any_wild = (re.compile("|".join(f"(?:{fnmatch.translate(e.pattern)})" for e, _ in self._wild))
                          if self._wild else None)

    def match(self, rel: str) -> list[_Entry]:
        hit = self._literal.get(rel)
        out = [hit] if hit is not None else []
        if self._any_wild is not None and self._any_wild.match(rel):
            out += [e for e, rx in self._wild if rx.match(rel)]
            out.sort(key=lambda e: e.index)
        return out


_CLASS_TABLES: weakref.WeakKeyDictionary[type, list[ShardTable]] = weakref.WeakKeyDictionary()
_INSTANCE_TABLES: weakref.WeakKeyDictionary[nn.Module, list[ShardTable]] = weakref.WeakKeyDictionary()


def shard(mesh: AbstractMesh | Mapping | None = None, spec: Mapping | None = None, *,
          strict: bool = False) -> Callable[[M], M]:
    """Attach a spec table to an ``nn.Module`` subclass (every instance) or instance (returned).

    ``sl.shard(mesh, table)``, ``sl.shard(table)`` or ``sl.shard(spec=table)``: the mesh (given, or
    from an enclosing ``with sl.use_mesh(mesh):``) is used only to check the table's axes now;
    planning uses the plan's mesh. With ``strict=True`` every parameter under the module must
    match a pattern, and every pattern a parameter.
    """
    if spec is None and isinstance(mesh, Mapping):
        mesh, spec = None, mesh
    if isinstance(mesh, nn.Module) or (isinstance(mesh, type) and issubclass(mesh, nn.Module)):
        raise ShardingTypeError(f"{API}: got the module {mesh!r} where the mesh belongs — expected "
                                "sl.shard(mesh, table) or sl.shard(table). Apply the result to the module: "
                                "sl.shard(mesh, table)(model), or use @sl.shard(table) on the class.")
    if mesh is not None and not isinstance(mesh, AbstractMesh):
        raise ShardingTypeError(f"{API}: expected a Mesh or AbstractMesh — got {mesh!r} of type "
                                f"{type(mesh).__name__}. Pass the table as the second argument or spec=.")
    if spec is None:
        raise ShardingTypeError(f"{API}: no table given — expected sl.shard(mesh, {{pattern: spec}}). "
                                "Write sl.shard(mesh, {'attn.qkv.weight': P('tensor', None)}).")
    if problem := flag(strict, f"{API}: strict"):
        raise ShardingTypeError(f"{problem}.")
    if mesh is None:
        try:
            mesh = current_mesh(API)
        except MeshError:
            mesh = None          # checked against the plan's mesh later
    table = ShardTable(spec, strict=strict, mesh=mesh)

    def apply(target: M) -> M:
        if isinstance(target, type) and issubclass(target, nn.Module):
            _CLASS_TABLES.setdefault(target, []).append(table)
        elif isinstance(target, nn.Module):
            _INSTANCE_TABLES.setdefault(target, []).append(table)
        else:
            raise ShardingTypeError(f"{API}: applied to {target!r} of type {type(target).__name__} — "
                                    "expected an nn.Module subclass or instance.")
        return target

    return apply


def class_tables(cls: type) -> list[ShardTable]:
    """The tables ``@sl.shard`` attached to ``cls`` and its bases (bases first)."""
    return [t for c in reversed(cls.__mro__) for t in _CLASS_TABLES.get(c, ())]


def _owner(prefix: str, module: nn.Module, cls: type | None) -> str:
    at = f"{prefix!r}" if prefix else "the model"
    if cls is not None:
        return f"@sl.shard on class {cls.__qualname__} (at {at})"
    return f"sl.shard on {at} ({type(module).__qualname__})"


def tables_by_prefix(model: nn.Module) -> dict[str, list[tuple[ShardTable, str]]]:
    """Qualified module name -> the tables attached there (base classes, class, then instance)."""
    out: dict[str, list[tuple[ShardTable, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        found = [(t, _owner(prefix, module, cls)) for cls in reversed(type(module).__mro__)
                 for t in _CLASS_TABLES.get(cls, ())]
        found += [(t, _owner(prefix, module, None)) for t in _INSTANCE_TABLES.get(module, ())]
        if found:
            out[prefix] = found
    if all(getattr(model.get_submodule(p), "stacked_experts", False) for p in out):
        # a transformers model with no table (but its stacked experts'): the dims its own plans give
        # (planner/hf_dims.py)
        table = _model_table(model)
        if table is not None:
            out.setdefault("", []).insert(0, (table, OWN_PLANS))
    return out


OWN_PLANS = "the model's own plans (sl.hf_dims)"
_MODEL_TABLES: weakref.WeakKeyDictionary[nn.Module, ShardTable | None] = weakref.WeakKeyDictionary()


def _model_table(model: nn.Module) -> ShardTable | None:
    """The table ``hf_dims(model)`` makes (built once per model), or None for a model without one."""
    if model not in _MODEL_TABLES:
        dims = hf_dims(model)
        _MODEL_TABLES[model] = ShardTable(dims, strict=False, mesh=None) if dims else None
    return _MODEL_TABLES[model]


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------

def _same(a: PartitionSpec, b: PartitionSpec) -> bool:
    """Equal layouts: trailing replicated dims do not count."""
    return (PartitionSpec.from_dim_axes([ax for _, ax in a.dims()])
            == PartitionSpec.from_dim_axes([ax for _, ax in b.dims()]))


def resolve_specs(model: nn.Module, mesh: AbstractMesh | None = None,
                  rules: AxisRules | Mapping[str, RuleValue] | None = None, *,
                  strict: bool | None = None, collect: list[str] | None = None) -> dict[str, PartitionSpec]:
    """``{qualified parameter name: PartitionSpec over the full parameter shape}`` for ``model``.
    ``collect``: append the problems to it and return what resolved, instead of raising.

    A parameter no pattern matches is ``P()``. ``strict=True`` makes every table strict (``None``
    or ``False`` leave each table's own ``strict``). Raises one ``SpecError`` listing every problem.
    """
    if not isinstance(model, nn.Module):
        raise ShardingTypeError(f"resolve_specs: expected an nn.Module — got {type(model).__name__}.")
    mesh = current_mesh("resolve_specs") if mesh is None else mesh
    if not isinstance(mesh, AbstractMesh):
        raise ShardingTypeError(f"resolve_specs: expected a Mesh or AbstractMesh — got {type(mesh).__name__}.")
    if strict is not None and not isinstance(strict, bool):
        raise ShardingTypeError(f"resolve_specs: strict must be True, False or None — got {strict!r}.")
    rules = AxisRules.coerce(rules)
    by_prefix = tables_by_prefix(model)
    aliases: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), (p, []))[1].append(name)

    problems = Problems(API, SpecError)
    used: set[tuple[int, int]] = set()                 # (table, entry) pairs that matched something
    valid: set[tuple[PartitionSpec, int]] = set()      # (spec, rank) known to pass every check
    mapped: dict[Logical, PartitionSpec] = {}          # logical dims the rules map without a problem
    out: dict[str, PartitionSpec] = {}
    peft_root = is_peft(model)
    for p, names in aliases.values():
        shape = tuple(p.shape)
        hits: list[tuple[PartitionSpec, _Entry, str]] = []
        strict_by: list[str] = ["resolve_specs(strict=True)"] if strict else []
        if peft_root and is_adapter(names[0]):     # laid out from its base weight (planner/peft.py)
            out[names[0]] = PartitionSpec()
            continue
        for name in names:
            for cut in [-1] + [i for i, c in enumerate(name) if c == "."]:
                tables = by_prefix.get(name[:cut] if cut >= 0 else "")
                if not tables:
                    continue
                rel = name[cut + 1:]
                seen = base_name(rel, root=peft_root and cut < 0)     # PEFT's wrappers are transparent
                for table, owner in tables:
                    if table.strict:
                        strict_by.append(owner)
                    found = table.match(rel)
                    if seen != rel:
                        found += [e for e in table.match(seen) if e not in found]
                    for e in found:
                        used.add((id(table), e.index))
                        spec = e.spec if e.spec is not None else mapped.get(e.logical)
                        if spec is None:
                            src = f"{API}: parameter {name!r} of shape {shape}, {_origin(e, owner)}"
                            spec, found = _resolve_logical(e.logical, rules, mesh, src)
                            for msg in found:
                                problems.add(msg)
                            if not found:
                                mapped[e.logical] = spec
                        if (spec, len(shape)) not in valid:
                            src = f"{API}: parameter {name!r} of shape {shape}, {_origin(e, owner, spec)}"
                            found = rank_problems(len(spec), shape, src,
                                                   "Give the pattern a spec of the parameter's rank, or narrow "
                                                   "the pattern so it does not match this parameter")
                            found += axis_problems(spec, mesh, src, logical=e.logical, rules=rules)
                            for msg in found:
                                problems.add(msg)
                            if not found:
                                valid.add((spec, len(shape)))
                        hits.append((spec, e, owner))
        where = f"{API}: parameter {names[0]!r} of shape {shape}"
        if not hits and strict_by:
            under = strict_by[0] if strict else f"the strict table of {strict_by[0]}"
            problems.add(f"{where} matches no pattern — expected every parameter under {under} to match one. "
                         "Add a pattern for it (P() to replicate it), or drop strict.")
        if any(h[0] != hits[0][0] for h in hits):
            groups: list[tuple[PartitionSpec, list[str]]] = []    # the matches, by distinct layout
            for spec, e, owner in hits:
                group = next((g for g in groups if _same(g[0], spec)), None)
                if group is None:
                    groups.append((spec, [_origin(e, owner, spec)]))
                else:
                    group[1].append(_origin(e, owner, spec))
            if len(groups) > 1:
                problems.add(f"{where} gets different specs from different patterns — got "
                             + "; ".join(" and ".join(o) for _, o in groups) + "; expected one spec per "
                             "parameter. Narrow the patterns so only one of them matches it, or give them the "
                             "same spec.")
        out[names[0]] = hits[0][0] if hits else PartitionSpec()

    for _, table, e, _ in _stack_hits(model, by_prefix):     # a stack entry names a module, not a parameter
        used.add((id(table), e.index))
    unused: dict[int, tuple[ShardTable, str, list[str], list[_Entry]]] = {}
    for prefix, tables in by_prefix.items():
        for table, owner in tables:
            missed = [e for e in table.entries if (id(table), e.index) not in used]
            if missed:
                got = unused.setdefault(id(table), (table, owner, [], missed))
                got[2].append(prefix)
    for table, owner, prefixes, missed in unused.values():
        names = relative_names(model, prefixes)
        for e in missed:
            problems.add(f"{API}: pattern {e.pattern!r} of {owner} matches no parameter — expected every pattern to "
                         f"match a parameter (or name the layer stack), relative to the module it is attached to; "
                         f"{closest(e.pattern, names)}. Fix the pattern or drop it.")
    if collect is not None:              # the planner lists these with its own problems
        collect.extend(problems.items)
        return out
    problems.raise_if_any()
    return out


def _logical_fused(n: object) -> bool:
    """``Fused(parts, "heads")``: a fused dim named by one logical name."""
    return isinstance(n, Fused) and len(n) == 1


def _origin(e: _Entry, owner: str, spec: PartitionSpec | None = None) -> str:
    """Where a parameter's spec came from, for messages."""
    if e.spec is not None:
        return f"spec {e.spec} from pattern {e.pattern!r} of {owner}"
    got = f"logical dims {e.logical!r}" if spec is None else f"{e.logical!r} -> {spec}"
    return f"{got} from pattern {e.pattern!r} of {owner}"


def _resolve_logical(logical: Logical, rules: AxisRules, mesh: AbstractMesh, src: str
                     ) -> tuple[PartitionSpec, list[str]]:
    spec, found = rules.map(logical, src)
    for n in logical:
        if n is not None and n not in rules and n in mesh.axis_names:
            found.append(f"{src}: {n!r} is a mesh axis but no logical dim name of the AxisRules — got rules "
                         f"{dict(rules)!r}; expected a tuple in a table to hold logical dim names. Write "
                         f"P(...) to name mesh axes, or add a rule for {n!r}.")
    return spec, found


# ---------------------------------------------------------------------------------------------
# The layer stack (the pipe axis)
# ---------------------------------------------------------------------------------------------

def _stack_hits(model: nn.Module, by_prefix: dict[str, list[tuple[ShardTable, str]]]
                ) -> list[tuple[str, ShardTable, _Entry, str]]:
    """Table entries whose pattern names an ``nn.ModuleList`` under the table's module:
    ``(qualified module name, table, entry, owner)``."""
    out = []
    modules = dict(model.named_modules())
    for prefix, tables in by_prefix.items():
        for table, owner in tables:
            for e in table.entries:
                rel = e.pattern
                name = f"{prefix}.{rel}" if prefix else rel
                if isinstance(modules.get(name), nn.ModuleList):
                    out.append((name, table, e, owner))
    return out


def find_stack(model: nn.Module, rules: AxisRules | Mapping[str, RuleValue] | None
               ) -> tuple[str | None, tuple[str, ...], list[str]]:
    """The model's declared layer stack: ``(qualified name or None, the mesh axes its dim is split
    over, problems)``. The stack is an ``nn.ModuleList`` named in a table with a one-dim entry —
    logical (``{"blocks": ("layers",)}``, mapped through ``rules``) or a mesh-axis spec
    (``{"blocks": P("pipe")}``)."""
    rules = AxisRules.coerce(rules)
    hits = _stack_hits(model, tables_by_prefix(model))
    problems: list[str] = []
    found: dict[str, tuple[tuple[str, ...], str]] = {}
    for name, _, e, owner in hits:
        where = f"{API}: the layer stack {name!r} ({_origin(e, owner)})"
        dims = e.spec if e.spec is not None else e.logical
        if len(tuple(dims)) != 1:
            problems.append(f"{where} has {len(tuple(dims))} dims — expected one: the stack's index, e.g. "
                            f"{{{e.pattern!r}: ('layers',)}}.")
            continue
        if e.spec is not None:
            axes = tuple(a for _, ax in e.spec.dims() for a in ax)
        else:
            axes = entry_axes(None if e.logical[0] is None else rules.get(e.logical[0]))
        if name in found and found[name][0] != axes:
            problems.append(f"{where} is split over {axes}, but {found[name][1]} splits it over "
                            f"{found[name][0]} — expected one layout for the stack.")
        found.setdefault(name, (axes, owner))
    if len(found) > 1:
        problems.append(f"{API}: several layer stacks are declared — got {sorted(found)}; expected one "
                        "nn.ModuleList with the 'layers' dim. Declare only the stack the pipeline cuts.")
    if not found:
        return None, (), problems
    name = next(iter(found))
    return name, found[name][0], problems
