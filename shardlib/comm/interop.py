"""Interop with ``torch.distributed.tensor.DTensor``.

A local shard plus its ``Layout`` converts to a ``DTensor`` and back, exactly, where DTensor can
express the layout. It cannot when a dim is split over several mesh axes out of mesh order, or
when such a multi-axis split is uneven and the two chunkings differ (DTensor splits hierarchically,
axis by axis; shardlib, like JAX, chunks the product), or (from a DTensor) for a ``Partial`` whose
reduce op is not a sum: those raise ``SpecError`` with the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..algebra.layout import Layout, chunk_bounds
from ..algebra.mesh import Mesh
from ..algebra.spec import PartitionSpec
from ..errors import ShardingError, ShardingTypeError, SpecError


def _dtensor_slices(shape: Sequence[int], lay: Layout, rank: int) -> tuple[slice, ...]:
    """The slice DTensor's hierarchical splitting gives ``rank`` (mesh axes in order, ceil chunks)."""
    lo = [0] * len(shape)
    hi = list(shape)
    for a in lay.mesh.axis_names:
        for d, axes in lay.spec.dims():
            if a in axes:
                n = hi[d] - lo[d]
                s, e = chunk_bounds(n, lay.mesh.axis_size(a), lay.mesh.coord(rank, a))
                lo[d], hi[d] = lo[d] + s, lo[d] + e
    return tuple(slice(a, b) for a, b in zip(lo, hi))


def check_dtensor_expressible(lay: Layout, shape: Sequence[int], name: str | None = None,
                              api: str = "to_dtensor") -> None:
    """Raise ``SpecError`` unless DTensor places every element exactly where ``lay`` does."""
    lay.placements()  # out-of-order multi-axis dims
    shape = lay.check(shape, name)
    for d, axes in lay.spec.dims():
        if len(axes) > 1 and shape[d] % lay.mesh.axis_size(axes):
            ours = {r: lay.local_slices(shape, r)[d] for r in range(lay.mesh.size)}
            theirs = {r: _dtensor_slices(shape, lay, r)[d] for r in range(lay.mesh.size)}
            if ours != theirs:
                who = f" of {name!r}" if name else ""
                raise SpecError(
                    f"{api}: dim {d}{who} (size {shape[d]}) is split over {axes} = "
                    f"{lay.mesh.axis_size(axes)} shards unevenly — DTensor splits it axis by axis "
                    "(ceil chunks of ceil chunks), shardlib ceil-chunks the product, and here they differ. "
                    f"Pad dim {d} to a multiple of {lay.mesh.axis_size(axes)}, or split it over one axis.")


def to_dtensor(local: torch.Tensor, layout: Layout, shape: Sequence[int]):
    """This rank's shard (global ``shape``) in ``layout`` -> a ``DTensor`` (no communication)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(local, torch.Tensor):
        raise ShardingTypeError(f"to_dtensor: expected this rank's shard as a torch.Tensor — got "
                                f"{type(local).__name__}.")
    if not isinstance(layout, Layout):
        raise ShardingTypeError(f"to_dtensor: expected a Layout — got {type(layout).__name__}.")
    mesh = layout.mesh
    if not isinstance(mesh, Mesh) or mesh.device_mesh is None:
        raise ShardingTypeError("to_dtensor: needs a Mesh over an initialized process group (DTensor needs a "
                                "DeviceMesh) — got " + repr(mesh) + ". Start the program with sl.launch or "
                                "torchrun, even for one process.")
    shape = tuple(int(s) for s in shape)
    check_dtensor_expressible(layout, shape)
    expect = layout.local_shape(shape, mesh.rank)
    if tuple(local.shape) != expect:
        raise ShardingError(f"to_dtensor: local shard has shape {tuple(local.shape)} — expected {expect} for "
                            f"global shape {list(shape)} in {layout}.")
    stride = torch.empty(shape, device="meta").stride() if shape else ()
    return DTensor.from_local(local, mesh.device_mesh, layout.placements(), run_check=False,
                              shape=torch.Size(shape), stride=stride)


def from_dtensor(dt, mesh: Mesh | None = None) -> tuple[torch.Tensor, Layout]:
    """A ``DTensor`` -> ``(local shard, Layout)`` on ``mesh`` (default: the one of ``sl.use_mesh``).

    ``mesh`` must be the grid of the DTensor's ``DeviceMesh``: same axis names and sizes, and rank
    ``r`` at ``numpy.unravel_index(r, shape)``. Placements map back one to one: ``Shard(d)`` on
    several axes is a tuple entry in mesh order, ``Partial("sum")`` a partial axis.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from ..algebra.mesh import current_mesh

    if not isinstance(dt, DTensor):
        raise ShardingTypeError(f"from_dtensor: expected a DTensor — got {type(dt).__name__}.")
    if mesh is None:
        mesh = current_mesh("from_dtensor")
    if not isinstance(mesh, Mesh):
        raise ShardingTypeError(f"from_dtensor: mesh must be a Mesh over the DTensor's process world — got "
                                f"{type(mesh).__name__}.")
    dm = dt.device_mesh
    names = dm.mesh_dim_names
    if not names:
        raise SpecError("from_dtensor: the DTensor's DeviceMesh has no mesh_dim_names — expected named "
                        "axes. Build it with init_device_mesh(..., mesh_dim_names=(...)).")
    if tuple(mesh.axis_names) != tuple(names) or tuple(mesh.shape) != tuple(dm.shape):
        raise SpecError(f"from_dtensor: the DTensor lives on mesh {dict(zip(names, dm.shape))} but mesh= is "
                        f"{mesh.axis_sizes} — expected the same axes and sizes.")
    grid = dm.mesh.flatten().tolist()
    if grid != list(range(mesh.size)):
        raise SpecError(f"from_dtensor: the DTensor's DeviceMesh holds ranks {grid} in row-major order — "
                        f"expected {list(range(mesh.size))}, the order of sl.Mesh {mesh.axis_sizes}. "
                        "Redistribute onto mesh.device_mesh first.")
    dims: list[list[str]] = [[] for _ in range(dt.dim())]
    partial = []
    for name, p in zip(names, dt.placements):
        if type(p) is Shard:
            dims[p.dim % max(dt.dim(), 1)].append(name)
        elif type(p) is Partial:
            if p.reduce_op != "sum":
                raise SpecError(f"from_dtensor: axis {name!r} is Partial({p.reduce_op!r}) — shardlib's partial "
                                "axes are pending sums. Redistribute to Replicate or Partial('sum') first.")
            partial.append(name)
        elif type(p) is Replicate:
            pass
        else:
            raise SpecError(f"from_dtensor: placement {p} on axis {name!r} has no shardlib equivalent — "
                            "expected Shard, Replicate or Partial('sum'). Redistribute the DTensor first.")
    lay = Layout(mesh, PartitionSpec.from_dim_axes([tuple(x) for x in dims]), partial=partial)
    check_dtensor_expressible(lay, tuple(dt.shape), api="from_dtensor")
    return dt.to_local(), lay
