"""``Mesh`` over real processes: groups for every axis and combination, this rank's view, world checks.

References are independent of shardlib: group members are found by brute force over
``numpy.unravel_index`` coordinates, and torch itself reports each group's ranks and timeout.
"""

import datetime
import itertools

import numpy as np
import pytest
import torch

import shardlib as sl
from worlds import raised

# world size -> mesh; world 2 keeps a size-1 axis in front, so strides matter
MESHES = {2: {"data": 1, "tensor": 2}, 4: {"data": 2, "tensor": 2}, 8: {"data": 2, "pipe": 2, "tensor": 2}}
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _expected_members(shape, rank, axes_idx):
    """Ranks that share ``rank``'s coordinates on every axis outside ``axes_idx``, ascending."""
    coords = np.stack(np.unravel_index(np.arange(int(np.prod(shape))), shape), axis=1)
    keep = [i for i in range(len(shape)) if i not in axes_idx]
    return [int(q) for q in range(len(coords)) if all(coords[q][i] == coords[rank][i] for i in keep)]


def _timeout_s(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _group_facts(shape):
    """Per rank: for every non-empty set of axes (both orders), the group torch built and a psum over it."""
    import torch.distributed as dist

    from shardlib.testing import get_mesh

    mesh = get_mesh(shape)
    rank = dist.get_rank()
    world_timeout = _timeout_s(dist.group.WORLD)
    out = {}
    for k in range(1, len(shape) + 1):
        for combo in itertools.combinations(mesh.axis_names, k):
            g = mesh.group(combo)
            same = mesh.group(tuple(reversed(combo))) is g
            if g is None:
                out[combo] = None
                continue
            x = torch.tensor([2.0 ** rank], dtype=torch.float64)   # the sum names its members
            dist.all_reduce(x, group=g)
            out[combo] = {"ranks": dist.get_process_group_ranks(g), "group_rank": dist.get_rank(g),
                          "sum": x.item(), "same_any_order": same, "backend": dist.get_backend(g),
                          "timeout": _timeout_s(g), "world_timeout": world_timeout}
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_axis_combination_groups_the_ranks_sharing_other_coords(world, n):
    shape = MESHES[n]
    sizes = tuple(shape.values())
    names = tuple(shape)
    for rank, facts in enumerate(world(n, _group_facts, shape)):
        for combo, got in facts.items():
            idx = [names.index(a) for a in combo]
            if all(sizes[i] == 1 for i in idx):
                assert got is None, (rank, combo)        # nothing to communicate over
                continue
            members = _expected_members(sizes, rank, idx)
            assert got["ranks"] == members, (rank, combo)
            assert got["group_rank"] == members.index(rank), (rank, combo)
            assert got["sum"] == sum(2.0 ** q for q in members), (rank, combo)
            assert got["same_any_order"], (rank, combo)
            assert got["backend"] == "gloo"
            # every group keeps the world's collective timeout, not torch's 30-minute default
            assert got["timeout"] == got["world_timeout"] < 1800, (rank, combo)


def _my_view(shape):
    import torch.distributed as dist

    from shardlib.testing import get_mesh

    mesh = get_mesh(shape)
    return {"rank": mesh.rank, "dist_rank": dist.get_rank(), "my_coords": mesh.my_coords,
            "coords": [mesh.coords(r) for r in range(mesh.size)], "device": mesh.device,
            "backend": mesh.backend, "shape": tuple(mesh.shape), "size": mesh.size,
            "dm_names": mesh.device_mesh.mesh_dim_names, "dm_mesh": mesh.device_mesh.mesh.tolist()}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_rank_coords_are_row_major_and_the_device_is_the_cpu(world, n):
    shape = MESHES[n]
    sizes = tuple(shape.values())
    for rank, v in enumerate(world(n, _my_view, shape)):
        assert v["rank"] == v["dist_rank"] == rank
        assert v["my_coords"] == tuple(int(c) for c in np.unravel_index(rank, sizes))
        assert v["coords"] == [tuple(int(c) for c in np.unravel_index(r, sizes)) for r in range(n)]
        assert v["device"] == torch.device("cpu")
        assert v["backend"] == "gloo"
        assert v["shape"] == sizes and v["size"] == n
        assert v["dm_names"] == tuple(shape)
        assert v["dm_mesh"] == np.arange(n).reshape(sizes).tolist()


def _wrong_sizes():
    # the errors come before any collective: the world is still in step after them
    shapes = {2: {"data": 2}, 8: {"data": 4, "tensor": 2}, 1: {"data": 1}}
    return raised({size: lambda shape=shape: sl.Mesh(shape) for size, shape in shapes.items()}, sl.MeshError)


def test_mesh_size_must_equal_world_size(world):
    for errors, total in world(4, _wrong_sizes):
        assert total == 4.0
        assert None not in errors.values()
        for size, (_, msg) in errors.items():
            assert f"has {size} devices but the process world has 4" in msg
            assert "product is 4" in msg and f"nprocs={size}" in msg   # the fix, both ways


def _existing_world_without_env():
    """The program called init_process_group itself (no torchrun variables): Mesh builds on it."""
    import os

    import torch.distributed as dist

    saved = {k: os.environ.pop(k) for k in RENDEZVOUS if k in os.environ}
    try:
        mesh = sl.Mesh({"data": 2}, timeout=7)
        x = torch.tensor([float(mesh.rank + 1)])
        dist.all_reduce(x, group=mesh.group("data"))
        return mesh.rank, x.item(), _timeout_s(mesh.group("data"))
    finally:
        os.environ.update(saved)


def test_mesh_builds_on_a_world_the_program_started(world):
    assert world(2, _existing_world_without_env) == [(0, 3.0, 7.0), (1, 3.0, 7.0)]


def _backend_override():
    import torch.distributed as dist

    from shardlib.testing import get_mesh

    mesh = get_mesh({"data": 2}, backend="gloo")
    x = torch.ones(1)
    dist.all_reduce(x, group=mesh.group("data"))
    errors = {}
    for bad in ("nccl", "carrier-pigeon", 3):
        try:
            sl.Mesh({"data": 2}, backend=bad)
        except (sl.MeshError, sl.ShardingTypeError) as e:
            errors[bad] = (type(e).__name__, str(e))
    return mesh.backend, dist.get_backend(mesh.group("data")), mesh.device, x.item(), errors


def test_backend_override_is_honoured_and_bad_backends_refused(world):
    for backend, group_backend, device, total, errors in world(2, _backend_override):
        assert (backend, group_backend, device, total) == ("gloo", "gloo", torch.device("cpu"), 2.0)
        assert errors["nccl"][0] == "MeshError" and "'gloo'" in errors["nccl"][1]
        assert errors["carrier-pigeon"][0] == "MeshError" and "unknown backend" in errors["carrier-pigeon"][1]
        assert errors[3][0] == "ShardingTypeError"


def test_backend_is_chosen_from_the_hardware(monkeypatch):
    from shardlib.algebra.mesh import auto_backend

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert auto_backend() == "nccl"                 # a GPU per rank
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert auto_backend() == "gloo"                 # two ranks sharing one GPU: NCCL would refuse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_backend() == "gloo"


# ---- in the plain pytest process: no process group at all ----------------------------------------

@pytest.fixture
def no_world(monkeypatch):
    import torch.distributed as dist

    for k in RENDEZVOUS:
        monkeypatch.delenv(k, raising=False)
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()   # nothing here may start a world


def test_world_of_one_needs_no_process_group(no_world):
    for shape in ({"data": 1}, {"data": 1, "tensor": 1}):
        mesh = sl.Mesh(shape)
        assert (mesh.rank, mesh.size, mesh.my_coords) == (0, 1, (0,) * len(shape))
        assert mesh.device == torch.device("cpu")
        assert mesh.device_mesh is None and mesh.backend is None
        assert mesh.group("data") is None and mesh.group(tuple(shape)) is None


def test_mesh_without_a_world_says_how_to_launch(no_world):
    with pytest.raises(sl.MeshError) as info:
        sl.Mesh({"data": 2, "tensor": 2})
    msg = str(info.value)
    assert "4 devices" in msg and "not initialized" in msg
    assert "sl.launch(fn, nprocs=4)" in msg and "torchrun --nproc-per-node 4" in msg


def test_env_world_checks_come_before_any_rendezvous(no_world, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(sl.MeshError, match="has 2 devices but the process world has 4"):
        sl.Mesh({"data": 2})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(sl.MeshError, match="MASTER_ADDR and MASTER_PORT are not"):
        sl.Mesh({"data": 2})


@pytest.mark.parametrize("shape, words", [
    ({"data": 0}, ["'data' has size 0", "positive integer"]),
    ({"data": 2.0}, ["'data' has size 2.0", "positive integer"]),
    ({"data": True}, ["'data' has size True", "positive integer"]),
    ({"data": -2, "tensor": 2}, ["'data' has size -2"]),
    ([("data", 2), ("data", 2)], ["'data' is declared twice", "Rename one axis"]),
    ({"": 2}, ["not a valid name"]),
])
def test_bad_axes_fail_before_any_world_check(no_world, shape, words):
    with pytest.raises(sl.MeshError) as info:
        sl.Mesh(shape)
    for w in words:
        assert w in str(info.value)
    assert "process world" not in str(info.value)   # the shape is judged first


def test_mesh_is_not_picklable_but_its_abstract_mesh_is(no_world):
    import pickle

    mesh = sl.Mesh({"data": 1})
    with pytest.raises(TypeError, match="mesh.abstract"):
        pickle.dumps(mesh)
    assert pickle.loads(pickle.dumps(mesh.abstract())) == sl.AbstractMesh({"data": 1})


def test_default_timeout_reads_the_environment(monkeypatch):
    from shardlib.algebra.mesh import default_timeout

    monkeypatch.setenv("SHARDLIB_TIMEOUT", "12.5")
    assert default_timeout() == datetime.timedelta(seconds=12.5)


def _tensor_only_mesh():
    """A column/row MLP on sl.Mesh({'tensor': 2}) — no 'data' axis — trains like one process."""
    from shardlib.models.mlp import MLP, regression_batch
    from shardlib.testing import get_mesh

    sizes = (6, 10, 6)
    mesh = get_mesh({"tensor": 2})
    losses = []
    for split in (False, True):
        model = MLP(sizes)
        if split:
            sl.shard({"layers.0.weight": sl.P("tensor", None), "layers.0.bias": sl.P("tensor"),
                      "layers.1.weight": sl.P(None, "tensor")})(model)
            plan = sl.plan(model, mesh, zero=1)
            step = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), mesh=mesh).step
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def step(b, model=model, opt=opt):
                opt.zero_grad()
                loss = model(*b)
                loss.backward()
                opt.step()
                return float(loss.detach())
        losses.append([step(regression_batch(sizes, 4, s)) for s in range(3)])
    return losses, plan.mesh.axis_sizes


def test_a_mesh_without_a_data_axis_trains_with_data_one(world):
    for (ref, got), axes in world(2, _tensor_only_mesh):
        assert axes == {"data": 1, "tensor": 2}
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
