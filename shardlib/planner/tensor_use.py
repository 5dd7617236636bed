"""A tensor axis of size > 1 must split something: an axis that splits nothing is a bug, not a fallback.

Without this check a mesh ``{"data": 2, "tensor": 2}`` and a model with no table (or rules mapping none
of its dims to ``tensor``) trains replicated over ``tensor``: every tensor rank computes the same thing,
and half the devices are wasted without a word. ``sl.plan`` refuses it, naming what would split the axis:
rules for the logical dims the model's table names, or a table. A transformers model's own plan that
holds a kind shardlib cannot lower (``planner/hf_dims.py``) is refused here too, by entry.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .hf_dims import hf_dims, unsupported
from .specs import OWN_PLANS, tables_by_prefix
from .tensor import TensorPlan


def _logical_names(model: nn.Module) -> list[str]:
    """The logical dim names the model's tables use (its own plans' where it has no table)."""
    names: list[str] = []
    for tables in tables_by_prefix(model).values():
        for table, _ in tables:
            for e in table.entries:
                for n in e.logical or ():
                    n = n[0] if isinstance(n, tuple) else n
                    if n is not None and n not in names and n not in ("embed", "layers"):
                        names.append(n)
    return names


def axis_use_problems(model: nn.Module, tplan: TensorPlan, mesh, axis: str, rules: Mapping | None) -> list[str]:
    """Messages for a tensor axis of size > 1 on which nothing is split, and for the model's own plan
    entries that shardlib cannot lower (when the model is planned by its own table)."""
    out: list[str] = []
    own = all(owner == OWN_PLANS for tables in tables_by_prefix(model).values() for _, owner in tables)
    if own and hf_dims(model):
        for line in unsupported(model):
            out.append(f"plan: the model's tensor-parallel plan has an entry shardlib does not lower — {line}. "
                       f"Lowering it takes a split site for that layout (planner/tensor.py) and its boundary "
                       f"collectives (comm/boundaries.py). Until then, give the model a table of your own "
                       f"(sl.shard) that keeps those modules replicated, or plan without a {axis!r} axis.")
    if not tplan.sites:
        names = _logical_names(model)
        hint = (f"map some of the logical dims its table names ({', '.join(repr(n) for n in names)}) to "
                f"{axis!r} in rules=, e.g. rules={{{', '.join(f'{n!r}: {axis!r}' for n in names[:3])}}}"
                if names else "give it a table (sl.shard(model, {pattern: P(...) or logical dims})) and rules")
        out.append(f"plan: the mesh axis {axis!r} has size {mesh.axis_size(axis)} but the plan splits nothing "
                   f"over it — got rules {dict(rules or {})!r}; expected some parameter split over {axis!r} (an "
                   f"axis that splits nothing leaves its ranks computing the same thing). To split the model, "
                   f"{hint}; or use a mesh without {axis!r} (or of size 1).")
    return out


def dims_source(model: nn.Module) -> str:
    """Where the model's logical dims come from, for ``explain()``: its own plans (and which of them), or
    the ``sl.shard`` tables on it."""
    tables = tables_by_prefix(model)
    if tables and all(owner == OWN_PLANS for ts in tables.values() for _, owner in ts):
        sources = sorted({src for _, src in hf_dims(model, sources=True).values()})
        return "the model's own plans (sl.hf_dims): " + "; ".join(sources)
    owners = sorted({owner for ts in tables.values() for _, owner in ts})
    return "sl.shard tables: " + ", ".join(owners) if owners else "no table"
