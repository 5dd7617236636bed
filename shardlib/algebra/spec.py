"""``PartitionSpec`` (``P``): which mesh axes shard which tensor dims.

One entry per tensor dim, JAX semantics:

* ``None`` — the dim is replicated;
* ``"data"`` — the dim is split over the ``data`` axis;
* ``("data", "tensor")`` — the dim is split over the product of both axes, ``data`` major
  (rank order is ``data_coord * tensor_size + tensor_coord``).

A spec shorter than the tensor's rank leaves the trailing dims replicated. A spec is a
tuple, so it is immutable and hashable; it prints as itself.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import Problems, ShardingTypeError, SpecError

Entry = str | tuple[str, ...] | None


def _normalize_entry(entry: object, dim: int, bad_types: list[str]) -> Entry:
    if entry is None:
        return None
    if isinstance(entry, str):
        if not entry:
            bad_types.append(f"P: dim {dim} names an empty axis — got ''; expected an axis name. "
                             "Use None for a replicated dim.")
        return entry
    if isinstance(entry, (tuple, list)):
        for name in entry:
            if not isinstance(name, str) or not name:
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
        f"P: dim {dim} is {entry!r} of type {type(entry).__name__} — expected None, an axis name (str) "
        "or a tuple of axis names. Write P('data', None), not P(0, None).")
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
                for axis in _entry_axes(entry):
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
        return _entry_axes(self[dim]) if dim < len(self) else ()

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec uses, in dim order."""
        return tuple(a for e in self for a in _entry_axes(e))

    def dims(self) -> Iterator[tuple[int, tuple[str, ...]]]:
        """``(dim, axes)`` for each dim of the spec."""
        for d, e in enumerate(self):
            yield d, _entry_axes(e)

    @classmethod
    def from_dim_axes(cls, dim_axes: list[tuple[str, ...]] | tuple[tuple[str, ...], ...]) -> PartitionSpec:
        """Build a spec from per-dim axis tuples, dropping trailing replicated dims."""
        entries = list(dim_axes)
        while entries and not entries[-1]:
            entries.pop()
        return cls(*entries)


def _entry_axes(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


def _repr_entries(entries: tuple) -> str:
    return "P(" + ", ".join(repr(e) for e in entries) + ")"


P = PartitionSpec
