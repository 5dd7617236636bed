"""Logical dim names -> mesh axes: ``sl.AxisRules``, and the checks a spec passes against a mesh.

Model code names a tensor's dims once (``("heads", "embed")``); a rule table decides, at plan time,
which mesh axis each name is split over (``{"heads": "tensor"}``), a tuple of axes splitting one dim
over several (major first) and a missing name replicating it. ``AxisRules.map`` turns names into a
``PartitionSpec`` and reports a mesh axis given to two dims; ``axis_problems`` / ``rank_problems``
are the checks shared by ``sl.shard``'s tables (``specs.py``) and ``AxisRules.resolve``: unknown mesh
axes, the axes no parameter spec may name (``data``: ZeRO's; ``pipe``: the layer stack's), and a
spec longer than the tensor's rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..algebra.mesh import AbstractMesh, unknown_axis_message
from ..algebra.spec import Fused, PartitionSpec, entry_axes
from ..errors import Problems, ShardingTypeError, SpecError
from ..validate import nonempty_str

RuleValue = str | tuple[str, ...] | None
Logical = tuple[str | None, ...]

# Mesh axes that a parameter spec may not name, and why (the fix in each message).
_FORBIDDEN = {
    "data": ("Parameters are sharded over 'data' by ZeRO, not by a spec: use sl.plan(..., zero=3) and "
             "drop 'data' from this spec"),
    "pipe": ("Pipeline parallelism shards only the layer stack (an nn.ModuleList named with the logical dim "
             "'layers' in a table, e.g. {'blocks': ('layers',)}, and the rule {'layers': 'pipe'}), not a "
             "parameter's dim: drop 'pipe' from this spec or rule"),
}


# ---------------------------------------------------------------------------------------------
# Logical dim names -> mesh axes
# ---------------------------------------------------------------------------------------------

class AxisRules(Mapping):
    """Logical dim name -> mesh axis, ``None`` (replicated) or a tuple of axes (major first).

    Immutable; a read-only mapping. A logical name absent from the rules is replicated.
    """

    __slots__ = ("_rules",)

    def __init__(self, rules: Mapping[str, RuleValue] | None = None):
        if isinstance(rules, AxisRules):
            self._rules: dict[str, RuleValue] = dict(rules._rules)
            return
        if rules is None:
            rules = {}
        if not isinstance(rules, Mapping):
            raise ShardingTypeError(
                f"AxisRules: expected a mapping of logical dim name to mesh axis — got {rules!r} of type "
                f"{type(rules).__name__}. Write sl.AxisRules({{'heads': 'tensor', 'embed': None}}).")
        bad: list[str] = []
        out: dict[str, RuleValue] = {}
        with Problems("AxisRules", SpecError) as problems:
            for key, value in rules.items():
                if not nonempty_str(key):
                    bad.append(f"AxisRules: key {key!r} of type {type(key).__name__} is not a logical dim "
                               "name — expected a non-empty str such as 'heads'.")
                    continue
                if value is None or nonempty_str(value):
                    out[key] = value
                elif isinstance(value, (tuple, list)) and all(nonempty_str(a) for a in value):
                    axes = tuple(value)
                    if len(set(axes)) != len(axes):
                        problems.add(f"AxisRules: rule {key!r} names a mesh axis twice — got {axes!r}; "
                                     "expected distinct axes. Drop the repeated axis.")
                    out[key] = None if not axes else axes[0] if len(axes) == 1 else axes
                else:
                    bad.append(f"AxisRules: rule {key!r} maps to {value!r} of type {type(value).__name__} — "
                               "expected a mesh axis name (str), None (replicated) or a tuple of axis "
                               f"names. Write {{{key!r}: 'tensor'}}.")
            if bad:
                raise ShardingTypeError(bad[0] if len(bad) == 1 else "AxisRules: several rules are of the "
                                        "wrong kind:\n" + "\n".join(f"  - {b}" for b in bad))
        self._rules = out

    @classmethod
    def coerce(cls, rules: AxisRules | Mapping[str, RuleValue] | None) -> AxisRules:
        """``rules`` as ``AxisRules``: a plain dict is accepted, ``None`` is no rules."""
        return rules if isinstance(rules, AxisRules) else cls(rules)

    def __getitem__(self, name: str) -> RuleValue:
        return self._rules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __hash__(self) -> int:
        return hash(tuple(self._rules.items()))

    def __repr__(self) -> str:
        return f"AxisRules({self._rules!r})"

    def __reduce__(self):
        return (AxisRules, (self._rules,))

    def map(self, logical: Logical, where: str) -> tuple[PartitionSpec, list[str]]:
        """Map logical names to a spec; problems (a mesh axis given to two dims) as messages,
        each starting with ``where``. The second use of an axis is dropped from the spec."""
        seen: dict[str, tuple[int, str]] = {}
        entries: list[tuple[str, ...]] = []
        problems: list[str] = []
        for d, entry in enumerate(logical):
            # Fused(parts, "heads"): a fused dim named logically; its blocks split over the rule's axes
            lname = entry[0] if isinstance(entry, Fused) else entry
            kept = []
            for a in entry_axes(None if lname is None else self._rules.get(lname)):
                if a in seen:
                    d0, n0 = seen[a]
                    problems.append(
                        f"{where}: the rules map two dims to mesh axis {a!r} — got dim {d0} {n0!r} -> "
                        f"{self._rules[n0]!r} and dim {d} {lname!r} -> {self._rules[lname]!r}; expected each "
                        f"mesh axis at most once per tensor. Map at most one of {n0!r} and {lname!r} to {a!r} "
                        "in the AxisRules (a tensor cannot be split twice over the same devices).")
                else:
                    seen[a] = (d, lname)
                    kept.append(a)
            entries.append(Fused(entry.parts, tuple(kept)) if isinstance(entry, Fused) and kept else tuple(kept))
        return PartitionSpec(*entries), problems

    def resolve(self, logical: Logical, *, mesh: AbstractMesh | None = None, name: str | None = None,
                shape: tuple[int, ...] | None = None) -> PartitionSpec:
        """The ``PartitionSpec`` of a tensor whose dims are named ``logical`` (``None`` = replicated).

        With ``mesh`` the axes are checked against it, with ``shape`` the rank; every problem is
        raised at once as a ``SpecError``.
        """
        api = "AxisRules.resolve" + (f" of {name!r}" if name else "")
        logical = _check_logical(logical, api)
        where = f"{api}: {logical!r}" + (f" (shape {tuple(shape)})" if shape is not None else "")
        spec, problems = self.map(logical, where)
        if shape is not None:
            problems += rank_problems(len(logical), tuple(shape), where, "Name at most one dim per tensor dim")
        if mesh is not None:
            problems += axis_problems(spec, mesh, where, logical=logical, rules=self, forbid=False)
        if problems:
            raise SpecError(problems, api=api)
        return spec


def _check_logical(logical: object, api: str) -> Logical:
    if isinstance(logical, (tuple, list)) and not isinstance(logical, PartitionSpec) and all(
            n is None or nonempty_str(n) or (isinstance(n, Fused) and len(n) == 1) for n in logical):
        return tuple(logical)
    raise ShardingTypeError(f"{api}: expected a tuple of logical dim names (str, or None for a replicated "
                            f"dim), one per tensor dim — got {logical!r} of type {type(logical).__name__}. "
                            "Write ('heads', 'embed').")


# ---------------------------------------------------------------------------------------------
# Checks shared by decoration and resolution
# ---------------------------------------------------------------------------------------------

def rank_problems(n: int, shape: tuple[int, ...], where: str, fix: str) -> list[str]:
    if n <= len(shape):
        return []
    return [(f"{where}: the spec has {n} entries but the tensor has rank {len(shape)} — expected at most one "
             f"entry per dim. {fix}.")]


def axis_problems(spec: PartitionSpec, mesh: AbstractMesh | None, where: str, *,
                   logical: Logical | None = None, rules: AxisRules | None = None,
                   forbid: bool = True) -> list[str]:
    """Unknown mesh axes, and (``forbid``) the axes a parameter spec may not name."""
    out = []
    for d, axes in spec.dims():
        for a in axes:
            name = logical[d][0] if logical and isinstance(logical[d], Fused) else logical[d] if logical else None
            via = f", dim {d}" + (f" ({logical[d]!r} -> {rules[name]!r} by the rules)" if logical else "")
            if forbid and a in _FORBIDDEN:
                out.append(f"{where}{via}: puts mesh axis {a!r} on a parameter — got {spec}; expected parameter "
                           f"specs over 'tensor' (or other model axes). {_FORBIDDEN[a]}.")
            elif mesh is not None and a not in mesh.axis_names:
                out.append(unknown_axis_message(a, mesh, where + via))
    return out
