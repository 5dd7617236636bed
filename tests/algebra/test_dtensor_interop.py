"""DTensor interop: a local shard + Layout <-> DTensor, exactly, where DTensor can express the layout.

References are torch's own: a dim split ``k`` ways is ``torch.chunk`` (missing trailing chunks are
empty), DTensor's multi-axis split is ``torch.chunk`` applied axis by axis, ``full_tensor()`` gathers,
and ``distribute_tensor`` makes DTensors shardlib did not.
"""

import itertools

import numpy as np
import pytest
import torch

import shardlib as sl
from shardlib import P
from worlds import raised

MESHES = {2: {"data": 2}, 4: {"data": 2, "tensor": 2}, 8: {"data": 2, "pipe": 2, "tensor": 2}}


# ---- independent references ------------------------------------------------------------------------

def _chunk(x, k, i, dim):
    """Chunk ``i`` of ``torch.chunk(x, k, dim)``, empty where torch.chunk makes fewer than k chunks."""
    chunks = torch.chunk(x, k, dim) if x.shape[dim] else ()
    if i < len(chunks):
        return chunks[i]
    return x.narrow(dim, x.shape[dim], 0)


def _coords(shape, rank):
    return dict(zip(shape, (int(c) for c in np.unravel_index(rank, tuple(shape.values())))))


def _product_shard(g, shape, rank, dim_axes):
    """shardlib's contract: each dim chunked over the product of its axes, first axis major."""
    c = _coords(shape, rank)
    for d, axes in enumerate(dim_axes):
        k, i = 1, 0
        for a in axes:
            k, i = k * shape[a], i * shape[a] + c[a]
        g = _chunk(g, k, i, d)
    return g


def _dtensor_shard(g, shape, rank, dim_axes):
    """DTensor's split: mesh axes in mesh order, each chunking what the previous left."""
    c = _coords(shape, rank)
    for a in shape:
        for d, axes in enumerate(dim_axes):
            if a in axes:
                g = _chunk(g, shape[a], c[a], d)
    return g


def _expressible(gshape, shape, dim_axes):
    g = torch.arange(int(np.prod(gshape))).reshape(gshape)
    n = int(np.prod(tuple(shape.values())))
    return all(torch.equal(_product_shard(g, shape, r, dim_axes), _dtensor_shard(g, shape, r, dim_axes))
               for r in range(n))


def _dim_axes(spec, ndim):
    out = []
    for d in range(ndim):
        e = spec[d] if d < len(spec) else None
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return out


def _cases(shape):
    """(global shape, spec entries, partial axes) for a mesh: every form the issue names."""
    names = list(shape)
    cases = [((5, 3), (), ()), ((), (), ()), ((4, 3), (), tuple(names))]       # replicated; scalar; all partial
    for a in names:
        cases += [((4, 3), (a,), ()), ((5, 3), (a,), ()), ((1, 3), (a,), ()),   # even, uneven, empty shard
                  ((3, 5), (None, a), ()), ((5, 2), (a, None), ())]             # dim 1; trailing None
    if len(names) >= 2:
        a, b = names[0], names[-1]
        cases += [((5, 7), (a, b), ()), ((7, 5), (b, a), ()),                   # two dims, uneven, any order
                  ((8, 2), ((a, b),), ()), ((7, 3), ((a, b),), ()),             # several axes on one dim
                  ((2, 6), (None, (a, b)), ()),
                  ((6, 3), (b,), (a,)), ((2, 2), (), (b,))]                     # partial beside a shard
    if len(names) >= 3:
        cases += [((8, 3), (tuple(names),), ()), ((15,), (tuple(names),), ()), ((4, 6), (names[0], names[1:]), ()),
                  ((4, 2), (names[1],), (names[0], names[2]))]
    return cases


def _refused(problems: list, case: str, convert, needle: str, differs: str) -> None:
    """``convert()`` must raise a SpecError that says ``needle``; a problem is noted where it converts or says else."""
    try:
        convert()
        problems.append(f"{case}: converted although {differs}")
    except sl.SpecError as e:
        if needle not in str(e):
            problems.append(f"{case}: unclear error {e}")


def _every_rank_clean(per_rank: list, n: int, min_ran: int) -> None:
    """No rank noted a problem, each converted at least ``min_ran`` cases, and refused some exactly on the meshes
    where DTensor's split and shardlib's can differ (more than one axis)."""
    for rank, (problems, ran, refused) in enumerate(per_rank):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)
        assert ran >= min_ran
        assert (refused > 0) == (n > 2)   # e.g. (2, 6) over 2x2: DTensor splits it 2,1,2,1, shardlib 2,2,2,0


# ---- to_dtensor / from_dtensor round trips --------------------------------------------------------------

def _round_trips(shape):
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard

    from shardlib.testing import get_mesh

    mesh = get_mesh(shape)
    rank = dist.get_rank()
    c = _coords(shape, rank)
    problems, ran, refused = [], 0, 0
    for gshape, entries, partial in _cases(shape):
        case = f"{gshape} P{entries} partial={partial}"
        g = torch.arange(int(np.prod(gshape)), dtype=torch.float64).reshape(gshape) * 3 + 1
        dim_axes = _dim_axes(entries, len(gshape))
        lay = sl.Layout(mesh, P(*entries), partial=partial)
        local = _product_shard(g, shape, rank, dim_axes).clone()
        k, i = 1, 0                  # a partial value: rank i of k holds (i+1) x its shard
        for a in partial:
            k, i = k * shape[a], i * shape[a] + c[a]
        local = local * (i + 1)
        expect_full = g * (k * (k + 1) // 2)
        if not _expressible(gshape, shape, dim_axes):
            refused += 1
            _refused(problems, case, lambda: sl.to_dtensor(local, lay, gshape), "Pad dim",
                     "DTensor splits it differently")
            continue
        ran += 1
        dt = sl.to_dtensor(local, lay, gshape)
        want = tuple(Partial() if a in partial else
                     next((Shard(d) for d, ax in enumerate(dim_axes) if a in ax), Replicate()) for a in shape)
        if tuple(dt.placements) != want:
            problems.append(f"{case}: placements {dt.placements}, expected {want}")
        if tuple(dt.shape) != tuple(gshape) or not torch.equal(dt.to_local(), local):
            problems.append(f"{case}: DTensor shape {tuple(dt.shape)} / local shard differ")
        full = dt.full_tensor()
        if not torch.equal(full, expect_full):
            problems.append(f"{case}: full_tensor {full.tolist()} != {expect_full.tolist()}")
        back, lay2 = sl.from_dtensor(dt, mesh)
        if not torch.equal(back, local):
            problems.append(f"{case}: from_dtensor gave a different local shard")
        if not lay2.equivalent(lay) or (lay2 != lay and entries and entries[-1] is not None):
            problems.append(f"{case}: from_dtensor gave {lay2}, expected {lay}")
        with sl.use_mesh(mesh):   # the mesh may come from scope
            if sl.from_dtensor(dt)[1] != lay2:
                problems.append(f"{case}: scoped mesh gave another layout")
    return problems, ran, refused


@pytest.mark.parametrize("n", [2, 4, 8])
def test_to_dtensor_and_back_is_exact_or_refused_where_dtensor_differs(world, n):
    _every_rank_clean(world(n, _round_trips, MESHES[n]), n, min_ran=8)


def _torch_made(shape):
    """DTensors from torch's distribute_tensor, every Shard/Replicate mix: the local shard is the one
    shardlib's Layout predicts, or a clear SpecError where its multi-axis split differs."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from shardlib.testing import get_mesh

    mesh = get_mesh(shape)
    rank = dist.get_rank()
    problems, ran, refused = [], 0, 0
    for gshape in ((4, 6), (5, 7), (1, 2)):
        g = torch.arange(int(np.prod(gshape)), dtype=torch.float32).reshape(gshape)
        for placements in itertools.product([Replicate(), Shard(0), Shard(1), Shard(-1)], repeat=len(shape)):
            case = f"{gshape} {placements}"
            dt = distribute_tensor(g, mesh.device_mesh, placements, src_data_rank=None)
            dim_axes = [tuple(a for a, p in zip(shape, placements) if isinstance(p, Shard) and p.dim % 2 == d)
                        for d in range(2)]
            if not _expressible(gshape, shape, dim_axes):
                refused += 1
                _refused(problems, case, lambda: sl.from_dtensor(dt, mesh), "from_dtensor",
                         "shardlib chunks it differently")
                continue
            ran += 1
            local, lay = sl.from_dtensor(dt, mesh)
            if lay.spec != P.from_dim_axes(dim_axes) or lay.partial:
                problems.append(f"{case}: layout {lay}, expected {P.from_dim_axes(dim_axes)}")
            if not torch.equal(local, g[lay.local_slices(gshape)]):
                problems.append(f"{case}: local {local.tolist()} is not the slice shardlib predicts")
            if not torch.equal(local, _product_shard(g, shape, rank, dim_axes)):
                problems.append(f"{case}: local {local.tolist()} is not the torch.chunk reference")
    # a torch-made Partial("sum") (distribute_tensor divides the value among the ranks)
    first = next(iter(shape))
    dt = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh.device_mesh,
                           [Partial() if a == first else Replicate() for a in shape], src_data_rank=None)
    local, lay = sl.from_dtensor(dt, mesh)
    if lay.partial != (first,) or lay.spec != P():
        problems.append(f"Partial: layout {lay}")
    if not torch.equal(sl.to_dtensor(local, lay, (2, 3)).full_tensor(), torch.arange(6.0).reshape(2, 3)):
        problems.append("Partial: the sum of the local values is not the tensor")
    return problems, ran, refused


@pytest.mark.parametrize("n", [2, 4, 8])
def test_torch_made_dtensors_give_the_predicted_shard_or_are_refused(world, n):
    _every_rank_clean(world(n, _torch_made, MESHES[n]), n, min_ran=10)


# ---- what DTensor cannot express: clear errors, before any collective ------------------------------------

def _inexpressible():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from shardlib.testing import get_mesh

    mesh = get_mesh({"data": 2, "tensor": 2})
    out_of_order = sl.Layout(mesh, P(("tensor", "data")))
    lay = sl.Layout(mesh, P(("data", "tensor")))
    partial = {op: DTensor.from_local(torch.ones(2), mesh.device_mesh, [Partial(op), Replicate()], run_check=False)
               for op in ("max", "avg")}
    dt = DTensor.from_local(torch.ones(2), mesh.device_mesh, [Shard(0), Replicate()], run_check=False)
    # same names and sizes, but ranks laid out column-major (no groups built: nothing to communicate)
    dm = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).T.contiguous(), mesh_dim_names=("data", "tensor"),
                    _init_backend=False)
    # every error comes before any collective: the world is still in step after them
    return raised({
        "out of mesh order": lambda: sl.to_dtensor(torch.zeros(2), out_of_order, (8,)),
        "uneven multi-axis": lambda: sl.to_dtensor(torch.zeros(lay.local_shape((6,))), lay, (6,)),
        "wrong local shape": lambda: sl.to_dtensor(torch.zeros(3), lay, (8,)),
        "Partial(max)": lambda: sl.from_dtensor(partial["max"], mesh),
        "Partial(avg)": lambda: sl.from_dtensor(partial["avg"], mesh),
        "not a DTensor": lambda: sl.from_dtensor(torch.ones(2), mesh),
        "other mesh": lambda: sl.from_dtensor(dt, get_mesh({"data": 4})),
        "no mesh": lambda: sl.from_dtensor(dt),
        "permuted ranks": lambda: sl.from_dtensor(DTensor.from_local(torch.ones(2), dm, [Shard(0), Replicate()],
                                                                     run_check=False), mesh),
    }, (sl.SpecError, sl.ShardingError, sl.ShardingTypeError))


def test_inexpressible_layouts_raise_clear_errors(world):
    for errors, total in world(4, _inexpressible):
        assert total == 4.0
        kind = {k: v[0] for k, v in errors.items() if v}
        assert None not in errors.values(), errors
        assert kind == {"out of mesh order": "SpecError", "uneven multi-axis": "SpecError",
                        "wrong local shape": "ShardingError", "Partial(max)": "SpecError",
                        "Partial(avg)": "SpecError", "not a DTensor": "ShardingTypeError",
                        "other mesh": "SpecError", "no mesh": "MeshError", "permuted ranks": "SpecError"}
        msg = {k: v[1] for k, v in errors.items()}
        assert "Reorder the tuple to ('data', 'tensor')" in msg["out of mesh order"]
        assert "size 6" in msg["uneven multi-axis"] and "Pad dim 0 to a multiple of 4" in msg["uneven multi-axis"]
        assert "(2,)" in msg["wrong local shape"] and "(3,)" in msg["wrong local shape"]
        assert "Partial('max')" in msg["Partial(max)"] and "Replicate or Partial('sum')" in msg["Partial(max)"]
        assert "{'data': 4}" in msg["other mesh"]
        assert "sl.use_mesh" in msg["no mesh"]
        assert "[0, 2, 1, 3]" in msg["permuted ranks"]


def test_to_dtensor_needs_a_process_group():
    mesh = sl.Mesh({"data": 1})   # a world of one with no process group: DTensor has no DeviceMesh
    with pytest.raises(sl.ShardingTypeError, match="sl.launch or torchrun"):
        sl.to_dtensor(torch.ones(2), sl.Layout(mesh, P()), (2,))
    with pytest.raises(sl.ShardingTypeError, match="as a torch.Tensor — got list"):
        sl.to_dtensor([1.0, 2.0], sl.Layout(mesh, P()), (2,))
    with pytest.raises(sl.ShardingTypeError, match="expected a Layout — got PartitionSpec"):
        sl.to_dtensor(torch.ones(2), P(), (2,))
    with pytest.raises(sl.ShardingTypeError, match="expected a DTensor — got Tensor"):
        sl.from_dtensor(torch.ones(2), mesh)


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3), (3, 2), (2, 2, 2)])
def test_expressibility_matches_the_axis_by_axis_reference(sizes):
    """No processes: check_dtensor_expressible agrees with nested torch.chunk for every length."""
    from shardlib.comm.interop import check_dtensor_expressible

    shape = dict(zip(("a", "b", "c"), sizes))
    mesh = sl.AbstractMesh(shape)
    lay = sl.Layout(mesh, P(tuple(shape)))
    for n in range(0, 30):
        try:
            check_dtensor_expressible(lay, (n,))
            ok = True
        except sl.SpecError:
            ok = False
        assert ok == _expressible((n,), shape, [tuple(shape)]), n
