"""``PartitionSpec`` (``P``): which mesh axes shard which tensor dims.

One entry per tensor dim, JAX semantics:

* ``None`` — the dim is replicated;
* ``"data"`` — the dim is split over the ``data`` axis;
* ``("data", "tensor")`` — the dim is split over the product of both axes, ``data`` major
  (rank order is ``data_coord * tensor_size + tensor_coord``);
* ``Fused(3, "tensor")`` — the dim is 3 equal blocks laid end to end (``q|k|v``, ``gate|up``), each
  split over the axis (or axes): a rank holds its chunk of every block, concatenated in block
  order, which is what unchanged model code ``.split()``s or ``.chunk()``s.

A spec shorter than the tensor's rank leaves the trailing dims replicated. A spec is a
tuple, so it is immutable and hashable; it prints as itself.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import Problems, ShardingTypeError, SpecError
from ..validate import is_int



class Fused(tuple):
    """A spec entry for a fused dim: ``parts`` equal blocks end to end, each split over ``axis``.

    It is the tuple of its axes (so code asking which axes split a dim reads it like a plain
    split) that also carries ``parts``: immutable, hashable, equal only to a ``Fused`` of the same
    parts and axes, printed as ``Fused(3, 'tensor')``. Rank ``r`` holds, of each block, the ceil
    chunk its coordinate on the axes picks (``torch.chunk`` per block; uneven widths work), and its
    shard is those chunks concatenated in block order. ``parts`` must divide the dim's size
    (checked against a shape by ``Layout.check``)."""

    parts: int

    def __new__(cls, parts: int, axis: str | tuple[str, ...] | list[str]) -> Fused:
        if not is_int(parts) or parts < 1:
            raise ShardingTypeError(f"Fused: parts must be an int >= 1 (the number of blocks laid end to end) — "
                                    f"got {parts!r}. Write Fused(3, 'tensor') for q|k|v.")
        axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
        if not axes or any(not isinstance(a, str) or not a for a in axes):
            raise ShardingTypeError(f"Fused: axis must be a mesh axis name or a tuple of them — got {axis!r}. "
                                    "Write Fused(3, 'tensor').")
        if len(set(axes)) != len(axes):
            raise SpecError(f"Fused: axis {axes} names an axis twice — expected each axis once.")
        self = super().__new__(cls, axes)
        object.__setattr__(self, "parts", parts)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"Fused is immutable — cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fused) and self.parts == other.parts and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("Fused", self.parts, tuple(self)))

    def __reduce__(self):
        return (Fused, (self.parts, tuple(self)))

    def __repr__(self) -> str:
        axis = self[0] if len(self) == 1 else tuple(self)
        return f"Fused({self.parts}, {axis!r})"

    __str__ = __repr__

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self)


Entry = str | tuple[str, ...] | Fused | None


def _normalize_entry(entry: object, dim: int, bad_types: list[str]) -> Entry:
    if entry is None:
        return None
    if isinstance(entry, Fused):
        return entry
    if isinstance(entry, str):
        if not entry:
            bad_types.append(f"P: dim {dim} names an empty axis — got ''; expected an axis name. "
                             "Use None for a replicated dim.")
        return entry
    if isinstance(entry, (tuple, list)):
        for name in entry:
            if isinstance(name, Fused):
                bad_types.append(f"P: dim {dim} holds {name!r} inside {entry!r} — expected a Fused entry on its own. "
                                 f"Write P(Fused({name.parts}, {tuple(a for e in entry for a in (e if isinstance(e, tuple) else (e,)))!r})) "
                                 "to split every block over several axes.")
            elif not isinstance(name, str) or not name:
                bad_types.append(
                    f"P: dim {dim} holds {name!r} of type {type(name).__name__} inside {entry!r} — "
                    "expected axis names (str). Write P(('data', 'tensor')) to shard one dim over two axes.")
        names = tuple(entry)
        if len(names) == 0:
            return None
        if len(names) == 1:
            return names[0]
        return names
    bad_types.append(
        f"P: dim {dim} is {entry!r} of type {type(entry).__name__} — expected None, an axis name (str), "
        "a tuple of axis names or a Fused(parts, axis). Write P('data', None), not P(0, None).")
    return None


class PartitionSpec(tuple):
    """An immutable tuple of per-dim entries; ``P`` is its short name."""

    def __new__(cls, *entries: object) -> PartitionSpec:
        bad_types: list[str] = []
        normalized = tuple(_normalize_entry(e, i, bad_types) for i, e in enumerate(entries))
        if bad_types:
            if len(bad_types) == 1:
                raise ShardingTypeError(bad_types[0])
            raise ShardingTypeError("P: several entries are of the wrong kind:\n"
                                    + "\n".join(f"  - {b}" for b in bad_types))
        with Problems("P", SpecError) as problems:
            seen: dict[str, int] = {}
            for dim, entry in enumerate(normalized):
                for axis in entry_axes(entry):
                    if axis in seen:
                        problems.add(
                            f"P: axis {axis!r} is used twice, by dim {seen[axis]} and dim {dim} — "
                            f"got {_repr_entries(normalized)}; expected each mesh axis at most once per "
                            "spec. A tensor cannot be split twice over the same devices: drop one use, "
                            "or shard the second dim over another axis.")
                    else:
                        seen[axis] = dim
        return super().__new__(cls, normalized)

    def __reduce__(self):
        return (PartitionSpec, tuple(self))

    def __repr__(self) -> str:
        return _repr_entries(tuple(self))

    __str__ = __repr__

    def __getitem__(self, item):  # slicing keeps the type
        out = tuple.__getitem__(self, item)
        return PartitionSpec(*out) if isinstance(item, slice) else out

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """Axes that shard ``dim`` (major first); ``()`` for a replicated or absent dim."""
        return entry_axes(self[dim]) if dim < len(self) else ()

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec uses, in dim order."""
        return tuple(a for e in self for a in entry_axes(e))

    def dims(self) -> Iterator[tuple[int, tuple[str, ...]]]:
        """``(dim, axes)`` for each dim of the spec."""
        for d, e in enumerate(self):
            yield d, entry_axes(e)

    def fused(self) -> dict[int, int]:
        """``{dim: parts}`` of the dims with a ``Fused`` entry."""
        return {d: e.parts for d, e in enumerate(self) if isinstance(e, Fused)}

    @classmethod
    def from_dim_axes(cls, dim_axes: list[tuple[str, ...]] | tuple[tuple[str, ...], ...]) -> PartitionSpec:
        """Build a spec from per-dim axis tuples (a ``Fused`` stays fused), dropping trailing replicated dims."""
        entries = list(dim_axes)
        while entries and not entries[-1]:
            entries.pop()
        return cls(*entries)


def entry_axes(entry: Entry) -> tuple[str, ...]:
    """The mesh axes one spec entry (or one rule's value) names: none for ``None``, a name's own, a
    tuple's (a ``Fused`` entry's included) in order."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


def _repr_entries(entries: tuple) -> str:
    return "P(" + ", ".join(repr(e) for e in entries) + ")"


P = PartitionSpec
