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


def test_contract_examples():
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


def test_partial_and_memory_and_short_form():
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
