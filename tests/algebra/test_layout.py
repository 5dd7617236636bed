"""Layout: shard shapes and slices (JAX semantics, ceil chunking), placements, validation."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import shardlib as sl
from shardlib import P

MESH = sl.AbstractMesh({"data": 2, "tensor": 2})


def test_contract_example_gives_local_shape_slices_and_placements():
    lay = sl.Layout(MESH, P(None, "tensor"))
    assert lay.local_shape((8, 12), rank=3) == (8, 6)
    slices = lay.shard_slices((8, 12))
    assert set(slices) == {0, 1, 2, 3}
    assert slices[3] == (slice(0, 8), slice(6, 12))
    assert slices[2] == (slice(0, 8), slice(0, 6))
    assert lay.placements() == (Replicate(), Shard(1))


def test_tuple_axes_are_data_major():
    lay = sl.Layout(MESH, P(("data", "tensor")))
    # rank r = (data, tensor) coordinate; chunk index = data * 2 + tensor
    assert [lay.shard_slices((8,))[r][0] for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    rev = sl.Layout(MESH, P(("tensor", "data")))
    # chunk index = tensor * 2 + data: rank 1 (data 0, tensor 1) holds chunk 2
    assert [rev.shard_slices((8,))[r][0] for r in range(4)] == [slice(0, 2), slice(4, 6), slice(2, 4), slice(6, 8)]


def test_uneven_uses_ceil_chunks_trailing_smaller_or_empty():
    lay = sl.Layout(MESH, P(("data", "tensor")))
    assert [lay.local_shape((5,), r) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    assert [lay.local_shape((6,), r) for r in range(4)] == [(2,), (2,), (2,), (0,)]
    assert [lay.local_shape((1,), r) for r in range(4)] == [(1,), (0,), (0,), (0,)]
    assert lay.padded_local_shape((5,)) == (2,)
    assert not lay.is_even((5,)) and lay.is_even((8,))


def test_short_form_and_placements_show_partial_memory_and_axis_order():
    lay = sl.Layout(MESH, P("data"), partial="tensor", memory="cpu")
    assert lay.short() == "S(0)P@cpu"
    assert lay.placements() == (Shard(0), Partial())
    assert lay.replicated_axes == ()
    assert sl.Layout(MESH, P(("tensor", "data"))).short() == "S(0)[1]S(0)[0]"


def test_errors_name_the_tensor_dim_axis_and_fix():
    with pytest.raises(sl.SpecError) as info:
        sl.Layout(MESH, P("dat", "tensr"), name="layers.0.weight")
    assert len(info.value.problems) == 2
    assert "layers.0.weight" in str(info.value) and "Did you mean 'data'" in str(info.value)
    with pytest.raises(sl.SpecError, match=r"has rank 1.*Drop the extra entries"):
        sl.Layout(MESH, P("data", "tensor")).check((4,), name="bias")
    with pytest.raises(sl.SpecError, match="For a scalar the spec should be P()"):
        sl.Layout(MESH, P("data")).local_shape((), rank=0)
    with pytest.raises(sl.SpecError, match="both partial and shards"):
        sl.Layout(MESH, P("data"), partial="data")
    with pytest.raises(sl.SpecError, match="memory kind"):
        sl.Layout(MESH, P(), memory="nvme")
    with pytest.raises(sl.MeshError, match="outside the mesh"):
        sl.Layout(MESH, P()).local_shape((4,), rank=4)
    with pytest.raises(sl.SpecError, match="mesh order"):
        sl.Layout(MESH, P(("tensor", "data"))).placements()


def test_normalized_drops_size_one_axes():
    m = sl.AbstractMesh({"data": 2, "pipe": 1, "tensor": 2})
    a = sl.Layout(m, P(("data", "pipe"), None))
    assert a.normalized() == sl.Layout(m, P("data"))
    assert a.equivalent(sl.Layout(m, P("data", None)))


# ---- the tiling property -------------------------------------------------------------------

@st.composite
def mesh_spec_shape(draw):
    ndim_mesh = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 4)) for _ in range(ndim_mesh)]
    names = ["data", "pipe", "tensor"][:ndim_mesh]
    rank = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 9)) for _ in range(rank)]
    free = list(names)
    entries = []
    for _ in range(draw(st.integers(0, rank))):
        take = draw(st.integers(0, min(3, len(free))))
        chosen = draw(st.permutations(free))[:take]
        for a in chosen:
            free.remove(a)
        entries.append(None if not chosen else (chosen[0] if len(chosen) == 1 else tuple(chosen)))
    return dict(zip(names, sizes)), P(*entries), tuple(shape)


def _independent_holders(mesh_sizes, spec, shape):
    """For every element: the set of ranks that must hold it, computed from first principles."""
    names = list(mesh_sizes)
    sizes = [mesh_sizes[n] for n in names]
    holders = {}
    for idx in np.ndindex(*shape) if shape else [()]:
        ranks = set()
        for r in range(math.prod(sizes)):
            coords = dict(zip(names, np.unravel_index(r, sizes)))
            ok = True
            for d, i in enumerate(idx):
                entry = spec[d] if d < len(spec) else None
                axes = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
                if not axes:
                    continue
                k = math.prod(mesh_sizes[a] for a in axes)
                j = 0
                for a in axes:   # first axis major
                    j = j * mesh_sizes[a] + int(coords[a])
                if i // -(-shape[d] // k) != j:
                    ok = False
            if ok:
                ranks.add(r)
        holders[idx] = ranks
    return holders


@settings(max_examples=150, deadline=None)
@given(mesh_spec_shape())
def test_shards_tile_the_tensor_exactly(case):
    mesh_sizes, spec, shape = case
    mesh = sl.AbstractMesh(mesh_sizes)
    lay = sl.Layout(mesh, spec)
    slices = lay.shard_slices(shape)
    got: dict = {idx: set() for idx in (np.ndindex(*shape) if shape else [()])}
    for r, sl_ in slices.items():
        assert lay.local_shape(shape, r) == tuple(s.stop - s.start for s in sl_)
        for idx in np.ndindex(*[s.stop - s.start for s in sl_]) if shape else [()]:
            got[tuple(s.start + i for s, i in zip(sl_, idx))].add(r)
    want = _independent_holders(mesh_sizes, spec, shape)
    assert got == want
    replication = math.prod(s for a, s in mesh_sizes.items() if a not in spec.axes)
    assert all(len(v) == replication for v in got.values())


# ---- Fused dims -----------------------------------------------------------------------------------

def test_fused_shard_is_each_blocks_chunk_in_block_order():
    import torch

    mesh = sl.AbstractMesh({"data": 2, "tensor": 2})
    lay = sl.Layout(mesh, P(None, sl.Fused(3, "tensor")))
    full = torch.arange(4 * 12).view(4, 12)          # q|k|v blocks of 4 columns
    assert lay.local_shape((4, 12), 1) == (4, 6) and lay.padded_local_shape((4, 12)) == (4, 6)
    assert lay.local_part(full, 1).tolist() == full[:, [2, 3, 6, 7, 10, 11]].tolist()
    assert lay.local_part(full, 2).tolist() == full[:, [0, 1, 4, 5, 8, 9]].tolist()
    assert [g for g, _ in lay.local_boxes((4, 12), 1)] == [(slice(0, 4), slice(a, a + 2)) for a in (2, 6, 10)]
    assert [loc for _, loc in lay.local_boxes((4, 12), 1)] == [(slice(0, 4), slice(a, a + 2)) for a in (0, 2, 4)]
    shape2, plain = lay.unfused((4, 12))
    assert shape2 == (4, 3, 4) and plain.spec == P(None, None, "tensor")
    assert lay.short() == "RS(1)x3" and lay.is_even((4, 12))


def test_fused_uneven_blocks_use_ceil_chunks_per_block():
    import torch

    mesh = sl.AbstractMesh({"tensor": 3})
    lay = sl.Layout(mesh, P(sl.Fused(2, "tensor")))
    # blocks of 5: chunks 2, 2, 1 of each
    assert [lay.local_shape((10,), r) for r in range(3)] == [(4,), (4,), (2,)]
    assert lay.shard_boxes((10,))[2] == [(slice(4, 5),), (slice(9, 10),)]
    assert lay.padded_local_shape((10,)) == (4,) and not lay.is_even((10,))
    assert lay.local_numel((10,), 2) == 2
    full = torch.arange(10)
    tiles = torch.cat([lay.local_part(full, r) for r in range(3)])
    assert sorted(tiles.tolist()) == list(range(10))


def test_fused_errors_name_the_dim_parts_and_fix():
    mesh = sl.AbstractMesh({"data": 1, "tensor": 2})
    lay = sl.Layout(mesh, P(None, sl.Fused(3, "tensor")))
    with pytest.raises(sl.SpecError, match=r"dim 1 of tensor 'w' \(shape \(4, 10\)\) is Fused\(3, 'tensor'\) but its "
                                          r"size 10 is not 3 equal blocks.*Declare the number of blocks"):
        lay.check((4, 10), "w")
    for api in ("local_slices", "shard_slices", "local_bounds"):
        with pytest.raises(sl.SpecError, match="local_boxes/shard_boxes"):
            getattr(lay, api)((4, 12), *([0] if api == "local_slices" else []))
    with pytest.raises(sl.SpecError, match="DTensor has no public placement"):
        lay.placements()


def test_fused_normalizes_like_a_plain_split():
    lay = sl.Layout(sl.AbstractMesh({"data": 2, "tensor": 1}), P(sl.Fused(3, ("data", "tensor"))))
    assert lay.normalized().spec == P(sl.Fused(3, "data"))
    assert sl.Layout(sl.AbstractMesh({"data": 2, "tensor": 1}), P(sl.Fused(3, "tensor"))).normalized().spec == P()


def test_piece_boxes_cover_a_fused_shards_flat_ranges():
    """Every flat range [lo, hi) of a rank's fused block, mapped to global boxes with strides, holds
    exactly the range's elements (the checkpoint's and load_pretrained's unit)."""
    import torch

    from shardlib.algebra.boxes import piece_boxes

    mesh = sl.AbstractMesh({"tensor": 3})
    for spec, shape in [(P(None, sl.Fused(3, "tensor")), (2, 12)), (P(sl.Fused(2, "tensor"), None), (10, 3)),
                        (P(None, None, sl.Fused(3, "tensor")), (2, 2, 9)), (P(None, sl.Fused(3, "tensor")), (2, 9, 2))]:
        lay = sl.Layout(mesh, spec)
        full = torch.arange(math.prod(shape)).view(shape)
        for r in range(3):
            local = lay.local_part(full, r).contiguous()
            first, _ = lay.local_boxes(shape, r)[0]
            parts = tuple(lay.fused.get(d, 1) for d in range(len(shape)))
            n = local.numel()
            for lo in range(n + 1):
                for hi in range(lo, n + 1):
                    piece = local.reshape(-1)[lo:hi].clone()
                    seen = torch.full((hi - lo,), -1)
                    for (st, sz), off, strides in piece_boxes(shape, parts, [g.start for g in first], local.shape,
                                                              lo, hi):
                        want = full[tuple(slice(a, a + b) for a, b in zip(st, sz))]
                        assert torch.equal(piece.as_strided(sz, strides, off), want), (spec, r, lo, hi)
                        seen.as_strided(sz, strides, off).copy_(want)
                    assert torch.equal(seen, piece), (spec, r, lo, hi)


def test_redistribution_names_a_fused_layout_it_cannot_plan():
    """sl.plan_redistribute between a plain and a fused layout: a SpecError naming the API and the fix,
    not an internal planner failure."""
    mesh = sl.AbstractMesh({"tensor": 2})
    fused = sl.Layout(mesh, P(sl.Fused(3, "tensor")))
    for src, dst in ((sl.Layout(mesh, P()), fused), (fused, sl.Layout(mesh, P()))):
        with pytest.raises(sl.SpecError, match=r"plan_redistribute: dim 0 of .* is fused .* unfused\(shape\)"):
            sl.plan_redistribute(src, dst, (6,))
