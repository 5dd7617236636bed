"""``Layout``: where a tensor lives on a mesh.

A layout is a ``PartitionSpec`` on a mesh, plus

* ``partial`` — mesh axes over which the local values are pending a sum (DTensor's ``Partial``,
  JAX's ``unreduced``): the true value is the sum of the shards along those axes;
* ``memory`` — ``"device"`` or ``"cpu"`` (the memory kind, for offload).

Shard arithmetic is ceil chunking over the product of the axes that shard a dim, exactly as
``torch.chunk`` and JAX: a dim of size ``n`` split ``k`` ways gives every shard ``ceil(n/k)``
elements except trailing ones, which may be smaller or empty.

A ``Fused(parts, axis)`` dim of size ``n`` is ``parts`` blocks of ``n/parts``, each ceil-chunked
``k`` ways; a rank's shard is its chunk of every block, concatenated in block order. That is the
plain layout of the tensor viewed with the dim as ``(parts, n/parts)`` and the axes on the second
(``unfused``): every fused computation here reduces to the plain one through that view. A rank's
shard is then ``parts`` boxes of the global tensor, not one slice: ``local_boxes``/``shard_boxes``
give them (``local_slices``/``shard_slices``/``local_bounds`` refuse a fused layout), and
``local_part`` cuts it out of a full value. DTensor has no public placement for it
(``placements`` refuses; convert the ``unfused`` view instead).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import Problems, ShardingTypeError, SpecError
from .mesh import AbstractMesh, unknown_axis_message
from .shape import check_shape
from .spec import Fused, PartitionSpec

MEMORY_KINDS = ("device", "cpu")


def chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` when ``n`` elements are ceil-chunked ``k`` ways."""
    c = -(-n // k)
    start = min(i * c, n)
    return start, min(start + c, n)


def chunk_size(n: int, k: int) -> int:
    """The (padded) chunk size: ``ceil(n/k)``."""
    return -(-n // k)


def _as_spec(spec: object, api: str) -> PartitionSpec:
    if isinstance(spec, PartitionSpec):
        return spec
    if isinstance(spec, (tuple, list)):
        return PartitionSpec(*spec)
    if spec is None:
        return PartitionSpec()
    raise ShardingTypeError(f"{api}: expected a PartitionSpec such as P('data', None) — got {spec!r} "
                            f"of type {type(spec).__name__}.")


@dataclass(frozen=True, init=False)
class Layout:
    """A ``PartitionSpec`` on a mesh, with partial axes and a memory kind."""

    mesh: AbstractMesh
    spec: PartitionSpec
    partial: tuple[str, ...]
    memory: str

    def __init__(self, mesh: AbstractMesh, spec: PartitionSpec | Sequence = PartitionSpec(), *,
                 partial: str | Iterable[str] = (), memory: str = "device", name: str | None = None):
        api = "Layout" if name is None else f"Layout of {name!r}"
        if not isinstance(mesh, AbstractMesh):
            raise ShardingTypeError(f"{api}: expected a Mesh or AbstractMesh — got {type(mesh).__name__}.")
        spec = _as_spec(spec, api)
        partial = (partial,) if isinstance(partial, str) else tuple(partial)
        with Problems(api, SpecError) as problems:
            for d, axes in spec.dims():
                for a in axes:
                    if a not in mesh.axis_names:
                        problems.add(unknown_axis_message(a, mesh, f"{api}: dim {d} of {spec}"))
            for a in partial:
                if a not in mesh.axis_names:
                    problems.add(unknown_axis_message(a, mesh, f"{api}: partial"))
                elif a in spec.axes:
                    problems.add(f"{api}: axis {a!r} is both partial and shards dim "
                                 f"{next(d for d, ax in spec.dims() if a in ax)} of {spec} — expected each "
                                 "axis to be sharding, partial or replicated. Reduce the partial sum first.")
            if len(set(partial)) != len(partial):
                problems.add(f"{api}: partial axes repeat — got {partial}; expected each axis once.")
            if memory not in MEMORY_KINDS:
                problems.add(f"{api}: memory kind {memory!r} is unknown — expected one of {MEMORY_KINDS}.")
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "partial", tuple(a for a in mesh.axis_names if a in partial))
        object.__setattr__(self, "memory", memory)

    # ---- per-dim facts -------------------------------------------------------------------------
    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """Axes sharding ``dim``, major first."""
        return self.spec.dim_axes(dim)

    def dim_shards(self, dim: int) -> int:
        """How many ways ``dim`` is split: the product of its axes' sizes."""
        return self.mesh.axis_size(self.dim_axes(dim)) if self.dim_axes(dim) else 1

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return self.spec.axes

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """Axes that neither shard a dim nor hold a partial sum: every rank along them holds a copy."""
        used = set(self.spec.axes) | set(self.partial)
        return tuple(a for a in self.mesh.axis_names if a not in used)

    def check(self, shape: Sequence[int], name: str | None = None, *, api: str = "Layout.check"
              ) -> tuple[int, ...]:
        """Validate a global ``shape`` (integer sizes >= 0, no more spec entries than dims) for
        ``api``; return it as a tuple of ints."""
        shape = check_shape(shape, api, name)
        if len(self.spec) > len(shape):
            who = f"tensor {name!r}" if name else "the tensor"
            raise SpecError(
                f"{api}: spec {self.spec} has {len(self.spec)} entries but {who} has rank {len(shape)} "
                f"(shape {shape}) — expected at most one entry per dim. "
                + ("For a scalar the spec should be P()." if not shape else
                   f"Drop the extra entries: P{tuple(self.spec)[:len(shape)]!r}."))
        bad = [(d, p) for d, p in self.spec.fused().items() if shape[d] % p]
        if bad:
            who = f"tensor {name!r}" if name else "the tensor"
            raise SpecError(f"{api}: " + "; ".join(
                f"dim {d} of {who} (shape {shape}) is {self.spec[d]!r} but its size {shape[d]} is not {p} equal "
                f"blocks" for d, p in bad) + f" — expected parts dividing the dim's size. Declare the number of "
                "blocks the dim really holds (q|k|v: 3, gate|up: 2), or split it plainly "
                f"({self.spec[bad[0][0]].axes[0]!r}) where its blocks are not equal.")
        return shape

    # ---- shard arithmetic ----------------------------------------------------------------------
    def _rank_arg(self, rank: int | None, api: str) -> int:
        if rank is None:
            rank = getattr(self.mesh, "rank", None)
            if rank is None:
                raise ShardingTypeError(f"{api}: rank is required on an AbstractMesh — got rank=None; "
                                        "expected 0 <= rank < mesh.size. Pass rank=...")
        self.mesh._check_rank(rank)
        return rank

    @property
    def fused(self) -> dict[int, int]:
        """``{dim: parts}`` of the spec's ``Fused`` dims."""
        return self.spec.fused()

    def require_plain(self, api: str) -> None:
        """Refuse a layout with ``Fused`` dims where ``api`` works on single slices (a clear error naming the fix)."""
        if self.fused:
            d, p = next(iter(self.fused.items()))
            raise SpecError(f"{api}: dim {d} of {self.spec} is fused ({p} blocks, each split) — a rank's shard is "
                            f"{p} boxes of the tensor, not one slice; expected a layout without Fused entries. Use "
                            "local_boxes/shard_boxes, local_part, or unfused(shape) (the plain layout of the "
                            "blocked view).")

    def _slices(self, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
        """Plain dims: the slice; a fused dim: the slice within each block."""
        out = []
        for d, n in enumerate(shape):
            axes = self.dim_axes(d)
            if not axes:
                out.append(slice(0, n))
                continue
            k = self.mesh.axis_size(axes)
            n = n // axes.parts if isinstance(axes, Fused) else n
            start, stop = chunk_bounds(n, k, self.mesh.group_index(rank, axes))
            out.append(slice(start, stop))
        return tuple(out)

    def _sizes(self, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        fused = self.fused
        return tuple((s.stop - s.start) * fused.get(d, 1) for d, s in enumerate(self._slices(shape, rank)))

    def local_slices(self, shape: Sequence[int], rank: int | None = None) -> tuple[slice, ...]:
        """The slice of the global tensor that ``rank`` holds (this process's rank by default)."""
        self.require_plain("Layout.local_slices")
        shape = self.check(shape, api="Layout.local_slices")
        return self._slices(shape, self._rank_arg(rank, "Layout.local_slices"))

    def local_shape(self, shape: Sequence[int], rank: int | None = None) -> tuple[int, ...]:
        """Shape of ``rank``'s shard of a tensor of global ``shape`` (a fused dim: ``parts`` chunks)."""
        shape = self.check(shape, api="Layout.local_shape")
        return self._sizes(shape, self._rank_arg(rank, "Layout.local_shape"))

    def local_boxes(self, shape: Sequence[int], rank: int | None = None
                    ) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """``rank``'s shard as ``(global slices, local slices)`` pairs, in the shard's order: one pair
        for a plain layout, one per combination of blocks of its fused dims otherwise."""
        shape = self.check(shape, api="Layout.local_boxes")
        inner = self._slices(shape, self._rank_arg(rank, "Layout.local_boxes"))
        out: list[tuple[tuple[slice, ...], tuple[slice, ...]]] = [((), ())]
        fused = self.fused
        for d, (n, s) in enumerate(zip(shape, inner)):
            p, c = fused.get(d, 1), s.stop - s.start
            width = n // p
            out = [(g + (slice(j * width + s.start, j * width + s.stop),), loc + (slice(j * c, (j + 1) * c),))
                   for g, loc in out for j in range(p)]
        return out

    def shard_boxes(self, shape: Sequence[int]) -> dict[int, list[tuple[slice, ...]]]:
        """``{rank: [global slices, ...]}`` for every rank: the boxes of its shard, in its order."""
        shape = self.check(shape, api="Layout.shard_boxes")
        return {r: [g for g, _ in self.local_boxes(shape, r)] for r in range(self.mesh.size)}

    def unfused(self, shape: Sequence[int]) -> tuple[tuple[int, ...], Layout]:
        """The blocked view: each fused dim of size ``n`` becomes ``(parts, n/parts)`` with the axes on
        the second. A rank's shard of ``x`` is its plain shard of ``x.reshape(shape')`` reshaped to
        ``local_shape``; gathering or redistributing runs on that view. Unchanged without Fused."""
        shape = self.check(shape, api="Layout.unfused")
        fused = self.fused
        if not fused:
            return shape, self
        dims: list[int] = []
        entries: list = []
        for d, n in enumerate(shape):
            e = self.spec[d] if d < len(self.spec) else None
            if d in fused:
                dims += [fused[d], n // fused[d]]
                entries += [None, tuple(e)]
            else:
                dims.append(n)
                entries.append(e)
        return tuple(dims), Layout(self.mesh, PartitionSpec(*entries), partial=self.partial, memory=self.memory)

    def local_part(self, full, rank: int | None = None):
        """``rank``'s shard cut out of the full value ``full`` (a torch tensor or numpy array): a view
        for a plain layout, the blocks' chunks concatenated (a copy) for a fused one."""
        shape = tuple(full.shape)
        if not self.fused:
            return full[self.local_slices(shape, rank)]
        shape2, plain = self.unfused(shape)
        return full.reshape(shape2)[plain.local_slices(shape2, rank)].reshape(self.local_shape(shape, rank))

    def local_bounds(self, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's shard at once: ``(starts, stops)``, two int64 arrays of shape
        ``(ndim, mesh.size)`` — ``local_slices(shape, r)[d]`` is ``slice(starts[d, r], stops[d, r])``.

        Vectorized over ranks (numpy), so whole-mesh arithmetic stays cheap on 10,000 devices.
        """
        self.require_plain("Layout.local_bounds")
        shape = self.check(shape, api="Layout.local_bounds")
        starts = np.zeros((len(shape), self.mesh.size), dtype=np.int64)
        stops = np.empty((len(shape), self.mesh.size), dtype=np.int64)
        for d, n in enumerate(shape):
            axes = self.dim_axes(d)
            if not axes:
                stops[d] = n
                continue
            c = chunk_size(n, self.mesh.axis_size(axes))
            starts[d] = np.minimum(self.mesh.group_indices(axes) * c, n)
            stops[d] = np.minimum(starts[d] + c, n)
        return starts, stops

    def shard_slices(self, shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """``{rank: slices}`` for every rank of the mesh."""
        self.require_plain("Layout.shard_slices")
        shape = self.check(shape, api="Layout.shard_slices")
        starts, stops = self.local_bounds(shape)
        cols = list(zip(*starts.tolist(), *stops.tolist())) if shape else [()] * self.mesh.size
        nd = len(shape)
        return {r: tuple(slice(c[d], c[nd + d]) for d in range(nd)) for r, c in enumerate(cols)}

    def padded_local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shard shape every rank would have if trailing shards were padded to ``ceil(n/k)``."""
        shape = self.check(shape, api="Layout.padded_local_shape")
        fused = self.fused
        return tuple(fused.get(d, 1) * chunk_size(n // fused.get(d, 1), self.dim_shards(d)) for d, n in enumerate(shape))

    def is_even(self, shape: Sequence[int]) -> bool:
        """True when every sharded dim (every block of a fused one) divides evenly."""
        shape = self.check(shape, api="Layout.is_even")
        fused = self.fused
        return all((n // fused.get(d, 1)) % self.dim_shards(d) == 0 for d, n in enumerate(shape))

    def local_numel(self, shape: Sequence[int], rank: int | None = None) -> int:
        shape = self.check(shape, api="Layout.local_numel")
        return math.prod(self._sizes(shape, self._rank_arg(rank, "Layout.local_numel")))

    # ---- interop -------------------------------------------------------------------------------
    def placements(self) -> tuple:
        """torch ``DTensor`` placements, one per mesh axis: ``Shard(d)``, ``Partial()`` or ``Replicate()``.

        DTensor splits a dim over several mesh axes in mesh order only; a spec that orders them
        otherwise (``P(('tensor', 'data'))`` on a ``data, tensor`` mesh) raises ``SpecError``, and so
        does a fused dim (torch's ``_StridedShard`` is private): convert the ``unfused`` view.
        """
        from torch.distributed.tensor import Partial, Replicate, Shard

        for d, e in enumerate(self.spec):
            if isinstance(e, Fused):
                raise SpecError(
                    f"Layout.placements: dim {d} of {self.spec} is {e!r} — DTensor has no public placement for a "
                    f"dim of {e.parts} blocks each split over {e.axes}. Convert the blocked view instead: "
                    "shape2, plain = layout.unfused(shape); to_dtensor(local.reshape(plain.local_shape(shape2)), "
                    "plain, shape2).")
        for d, axes in self.spec.dims():
            order = [self.mesh.axis_index(a) for a in axes]
            if order != sorted(order):
                raise SpecError(
                    f"Layout.placements: dim {d} of {self.spec} is split over {axes} in an order other "
                    f"than the mesh's {self.mesh.axis_names} — DTensor places several mesh axes on one "
                    "dim in mesh order only (major to minor). Reorder the tuple to "
                    f"{tuple(sorted(axes, key=self.mesh.axis_index))}, or declare the mesh axes in the "
                    "order you need.")
        out = []
        for a in self.mesh.axis_names:
            if a in self.partial:
                out.append(Partial())
            elif a in self.spec.axes:
                out.append(Shard(next(d for d, ax in self.spec.dims() if a in ax)))
            else:
                out.append(Replicate())
        return tuple(out)

    # ---- variants ------------------------------------------------------------------------------
    def replace(self, *, spec: PartitionSpec | Sequence | None = None, partial: Iterable[str] | None = None,
                memory: str | None = None) -> Layout:
        return Layout(self.mesh, self.spec if spec is None else spec,
                      partial=self.partial if partial is None else partial,
                      memory=self.memory if memory is None else memory)

    def normalized(self) -> Layout:
        """The same layout without axes of size 1 (which split nothing)."""
        live = {a for a in self.mesh.axis_names if self.mesh.axis_size(a) > 1}

        def keep(axes):
            kept = tuple(a for a in axes if a in live)
            return Fused(axes.parts, kept) if isinstance(axes, Fused) and kept else kept
        dims = [keep(axes) for _, axes in self.spec.dims()]
        return Layout(self.mesh, PartitionSpec.from_dim_axes(dims),
                      partial=[a for a in self.partial if a in live], memory=self.memory)

    def equivalent(self, other: Layout) -> bool:
        """Same placement of data (ignoring size-1 axes and trailing ``None`` entries)."""
        return self.normalized() == other.normalized()

    # ---- printing ------------------------------------------------------------------------------
    def short(self) -> str:
        """Per-mesh-axis form like DTensor's: ``S(0)R`` = axis 0 shards dim 0, axis 1 replicates.

        ``P`` marks a partial axis. Where a dim is split over several axes out of mesh order the
        position in its tuple follows: ``S(0)[1]``; a fused dim of 3 blocks prints ``S(0)x3``.
        ``@cpu`` marks host memory.
        """
        parts = []
        for a in self.mesh.axis_names:
            if a in self.partial:
                parts.append("P")
                continue
            for d, axes in self.spec.dims():
                if a in axes:
                    order = [self.mesh.axis_index(x) for x in axes]
                    pos = f"[{axes.index(a)}]" if order != sorted(order) else ""
                    blocks = f"x{axes.parts}" if isinstance(axes, Fused) else ""
                    parts.append(f"S({d}){blocks}{pos}")
                    break
            else:
                parts.append("R")
        return "".join(parts) + ("@cpu" if self.memory == "cpu" else "")

    def __repr__(self) -> str:
        extra = ""
        if self.partial:
            extra += f", partial={self.partial}"
        if self.memory != "device":
            extra += f", memory={self.memory!r}"
        return f"Layout({self.spec}, mesh={self.mesh.axis_sizes}{extra})"

    def __reduce__(self):
        return (_rebuild_layout, (self.mesh.abstract() if hasattr(self.mesh, "_groups") else self.mesh,
                                  tuple(self.spec), self.partial, self.memory))


def _rebuild_layout(mesh, spec, partial, memory):
    return Layout(mesh, PartitionSpec(*spec), partial=partial, memory=memory)
