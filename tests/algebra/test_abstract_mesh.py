"""AbstractMesh: pure coordinate arithmetic and validation (no processes)."""

import itertools

import numpy as np
import pytest

import shardlib as sl


def test_shape_names_and_size_and_equality_depends_on_axis_order():
    m = sl.AbstractMesh({"data": 2, "pipe": 3, "tensor": 4})
    assert m.axis_names == ("data", "pipe", "tensor")
    assert tuple(m.shape) == (2, 3, 4)
    assert m.shape["pipe"] == 3
    assert m.size == 24
    assert m == sl.AbstractMesh((2, 3, 4), ("data", "pipe", "tensor"))
    assert m != sl.AbstractMesh({"data": 2, "tensor": 4, "pipe": 3})


@pytest.mark.parametrize("shape", [(2,), (2, 2), (2, 2, 2), (3, 1, 4), (1, 1)])
def test_coords_follow_jax_row_major(shape):
    names = tuple(f"a{i}" for i in range(len(shape)))
    m = sl.AbstractMesh(dict(zip(names, shape)))
    grid = np.arange(m.size).reshape(shape)   # JAX: Mesh(np.arange(n).reshape(shape), names)
    for idx in itertools.product(*map(range, shape)):
        r = int(grid[idx])
        assert m.coords(r) == idx
        assert tuple(int(c) for c in np.unravel_index(r, m.shape)) == idx
        assert m.rank_at(idx) == r


def test_group_ranks_share_other_coordinates():
    m = sl.AbstractMesh({"data": 2, "pipe": 2, "tensor": 2})
    grid = np.arange(8).reshape(2, 2, 2)
    assert m.group_ranks(0, ("tensor",)) == [0, 1]
    assert m.group_ranks(5, ("data",)) == list(grid[:, 0, 1])
    assert m.group_ranks(0, ("data", "tensor")) == [0, 1, 4, 5]
    # a tuple out of mesh order lists members by that order (first axis major)
    assert m.group_ranks(0, ("tensor", "data")) == [0, 4, 1, 5]
    assert sorted(map(sorted, m.all_groups(("pipe",)))) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_bad_meshes_collect_every_problem():
    with pytest.raises(sl.MeshError) as info:
        sl.AbstractMesh([("data", 0), ("data", 2), ("tensor", 1.5)])
    msgs = info.value.problems
    assert len(msgs) == 3
    assert any("size 0" in m for m in msgs) and any("twice" in m for m in msgs) and any("1.5" in m for m in msgs)
    with pytest.raises(sl.MeshError, match="at least one axis"):
        sl.AbstractMesh({})
    with pytest.raises(sl.MeshError, match="positive integer"):
        sl.AbstractMesh({"data": True})
    with pytest.raises(TypeError):
        sl.AbstractMesh(4)


def test_unknown_axis_suggests_the_close_name():
    m = sl.AbstractMesh({"data": 2, "tensor": 2})
    with pytest.raises(sl.SpecError, match="Did you mean 'tensor'"):
        m.axis_size("tensr")


def test_use_mesh_scopes_and_restores():
    a, b = sl.AbstractMesh({"data": 2}), sl.AbstractMesh({"data": 4})
    with pytest.raises(sl.MeshError, match="use_mesh"):
        sl.current_mesh()
    with sl.use_mesh(a):
        assert sl.current_mesh() is a
        with sl.use_mesh(b):
            assert sl.current_mesh() is b
        assert sl.current_mesh() is a
