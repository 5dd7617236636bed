"""Named, autograd-aware collectives on real gloo worlds of 2, 4 and 8 ranks.

Every check compares against a single-process reference written here with plain torch ops on
the full tensor (the same seed on every rank), never against numbers the code under test made.

The reference for per-shard code is one loss over all ranks. Rank ``r`` holds ``B[r]`` (a slice
of one global tensor ``B``) and computes a loss term; the single-process loss is the sum of the
terms of all ranks, except where the value is *invariant* over the collective's axes (``psum``'s
output): every rank of a group then computes the same term, and a single process counts it once.
Autograd on ``B`` gives the reference gradient of every rank's shard.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import shardlib as sl

MESHES = {
    2: {"data": 2},
    4: {"data": 2, "tensor": 2},
    8: {"data": 2, "pipe": 2, "tensor": 2},
    "4p": {"data": 2, "pipe": 1, "tensor": 2},     # an axis of size 1 splits nothing
}

# axis arguments to test on each mesh: single axes, tuples in mesh order and out of it
AXES = {
    2: ["data", ("data",)],
    4: ["data", "tensor", ("data", "tensor"), ("tensor", "data")],
    8: ["data", "pipe", "tensor", ("data", "tensor"), ("tensor", "data"), ("pipe", "data", "tensor"),
        ("tensor", "pipe", "data"), ("tensor", "pipe")],
    "4p": ["pipe", ("pipe", "data"), ("tensor", "pipe", "data"), ("tensor", "pipe")],
}
WORLDS = [(2, 2), (4, 4), (8, 8), (4, "4p")]


# ---------------------------------------------------------------------------------------------
# An independent model of the mesh (numpy's row-major unravel), for the references
# ---------------------------------------------------------------------------------------------

def _as_tuple(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _members(rank: int, shape: dict, axes) -> list[int]:
    """Ranks that share ``rank``'s coordinates off ``axes``, listed first axis major."""
    names, sizes = list(shape), list(shape.values())
    axes = _as_tuple(axes)
    coords = list(np.unravel_index(rank, sizes))
    out = []
    for idx in itertools.product(*[range(shape[a]) for a in axes]):
        c = list(coords)
        for a, i in zip(axes, idx):
            c[names.index(a)] = i
        out.append(int(np.ravel_multi_index(c, sizes)))
    return out


def _index(rank: int, shape: dict, axes) -> int:
    return _members(rank, shape, axes).index(rank)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ops(counter) -> dict[str, int]:
    return {op: n for op, (n, _) in counter.by_op().items()}


def _one(op: str, k: int) -> dict[str, int]:
    """One ``op`` when the group has more than one member; over a group of one, nothing runs."""
    return {op: 1} if k > 1 else {}


def _run(mesh, op, x: torch.Tensor, cot: torch.Tensor):
    """Forward and backward of ``op`` on this rank's ``x`` with cotangent ``cot``, counting both."""
    x = x.clone().requires_grad_(True)
    with sl.count_collectives() as fwd:
        y = op(x)
    with sl.count_collectives() as bwd:
        (y * cot).sum().backward()
    return y.detach(), x.grad, fwd, bwd


def _reference(B: torch.Tensor, C: torch.Tensor, ref_op, world: int, weight=lambda r: 1.0):
    """Single-process outputs and gradient of ``sum_r weight(r) * (ref_op(B, r) * C[r]).sum()``."""
    B = B.clone().requires_grad_(True)
    ys = [ref_op(B, r) for r in range(world)]
    loss = sum(weight(r) * (ys[r] * C[r]).sum() for r in range(world))
    if loss.requires_grad:
        loss.backward()
    return [y.detach() for y in ys], B.grad if B.grad is not None else torch.zeros_like(B)


def _matches_one_process(mesh, op, ref_op, B: torch.Tensor, C: torch.Tensor, weight=lambda r: 1.0):
    """``op`` on this rank's ``B[rank]`` with cotangent ``C[rank]``: its output and input gradient are the
    single-process ``_reference``'s for this rank. Returns the forward and backward counters."""
    y, gx, fwd, bwd = _run(mesh, op, B[mesh.rank], C[mesh.rank])
    ys, gB = _reference(B, C, ref_op, mesh.size, weight)
    torch.testing.assert_close(y, ys[mesh.rank])
    torch.testing.assert_close(gx, gB[mesh.rank])
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# Workers (module level: they are pickled by reference into the pool)
# ---------------------------------------------------------------------------------------------

def _check_psum(shape: dict, axes_list: list) -> None:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    world = mesh.size
    for t, axes in enumerate(axes_list):
        k = len(_members(0, shape, axes))
        B = _randn(10 + t, world, 3, 2)
        # psum's output is invariant over the group: one cotangent per group, the loss counted once
        Cg = _randn(100 + t, world, 3, 2)
        C = torch.stack([Cg[min(_members(r, shape, axes))] for r in range(world)])
        with sl.use_mesh(mesh):
            fwd, bwd = _matches_one_process(mesh, lambda x: sl.psum(x, axes),
                                            lambda B, r: B[_members(r, shape, axes)].sum(0), B, C,
                                            weight=lambda r: 1 / k)
        assert _ops(fwd) == _one("all_reduce", k) and _ops(bwd) == {}, (fwd.summary(), bwd.summary())
        assert fwd.bytes == min(2 * (k - 1) * (-(-6 // k)), 2 * 6) * 8          # ring all-reduce, no padding sent
        if k > 1:   # the group's axes, in mesh order, size-1 axes dropped
            assert fwd.records[0].axes == tuple(a for a in shape if a in _as_tuple(axes) and shape[a] > 1)

        # psum then per-rank use: pbroadcast makes the cotangent per rank, psum's sum comes back
        C2 = _randn(200 + t, world, 3, 2)
        fwd, bwd = _matches_one_process(mesh, lambda x: sl.pbroadcast(sl.psum(x, axes, mesh=mesh), axes, mesh=mesh),
                                        lambda B, r: B[_members(r, shape, axes)].sum(0), B, C2)
        assert _ops(fwd) == _one("all_reduce", k) and _ops(bwd) == _one("all_reduce", k)


def _check_pbroadcast(shape: dict, axes_list: list) -> None:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    rank, world = mesh.rank, mesh.size
    for t, axes in enumerate(axes_list):
        # W is replicated over the group (the same on every member); A differs per rank
        Wg = _randn(20 + t, world, 4)
        W = torch.stack([Wg[min(_members(r, shape, axes))] for r in range(world)])
        A = _randn(120 + t, world, 4)
        y, gw, fwd, bwd = _run(mesh, lambda w: sl.pbroadcast(w, axes, mesh=mesh) * A[rank], W[rank],
                               torch.ones(4, dtype=torch.float64))
        # single process: one W per group, used by every member with its own A
        Wref = Wg.clone().requires_grad_(True)
        loss = sum((Wref[min(_members(r, shape, axes))] * A[r]).sum() for r in range(world))
        loss.backward()
        torch.testing.assert_close(y, (W[rank] * A[rank]))
        torch.testing.assert_close(gw, Wref.grad[min(_members(rank, shape, axes))])
        assert _ops(fwd) == {} and _ops(bwd) == _one("all_reduce", len(_members(0, shape, axes)))


def _check_all_gather(shape: dict, axes_list: list) -> None:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    world = mesh.size
    for t, (axes, dim) in enumerate(itertools.product(axes_list, (0, 1, -1))):
        k = len(_members(0, shape, axes))
        B = _randn(30 + t, world, 2, 3)
        y0 = torch.cat([B[m] for m in _members(0, shape, axes)], dim)
        C = _randn(130 + t, world, *y0.shape)
        fwd, bwd = _matches_one_process(mesh, lambda x: sl.all_gather(x, axes, dim, mesh=mesh),
                                        lambda B, r: torch.cat([B[m] for m in _members(r, shape, axes)], dim), B, C)
        assert _ops(fwd) == _one("all_gather", k) and _ops(bwd) == _one("reduce_scatter", k)
        assert fwd.bytes == (k - 1) * 6 * 8 and bwd.bytes == (k - 1) * 6 * 8


def _check_psum_scatter(shape: dict, axes_list: list) -> None:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    world = mesh.size
    for t, (axes, dim) in enumerate(itertools.product(axes_list, (0, 1))):
        k = len(_members(0, shape, axes))
        full = [3, 2]
        full[dim] *= k
        B = _randn(40 + t, world, *full)
        out = [3, 2]
        C = _randn(140 + t, world, *out)

        def ref(B, r):
            total = B[_members(r, shape, axes)].sum(0)
            return total.chunk(k, dim)[_index(r, shape, axes)]

        fwd, bwd = _matches_one_process(mesh, lambda x: sl.psum_scatter(x, axes, dim, mesh=mesh), ref, B, C)
        # the backward of a reduce-scatter is exactly one all-gather, and nothing else
        assert _ops(fwd) == _one("reduce_scatter", k) and _ops(bwd) == _one("all_gather", k), bwd.summary()
        assert fwd.bytes == (k - 1) * 6 * 8 and bwd.bytes == (k - 1) * 6 * 8


def _check_all_to_all(shape: dict, axes_list: list) -> None:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    world = mesh.size
    cases = [(0, 1), (1, 0), (0, 2), (2, 1), (1, 1)]
    for t, (axes, (s, c)) in enumerate(itertools.product(axes_list, cases)):
        k = len(_members(0, shape, axes))
        full = [2, 3, 1]
        full[s] *= k
        B = _randn(50 + t, world, *full)

        def ref(B, r):
            me = _index(r, shape, axes)
            return torch.cat([B[m].chunk(k, s)[me] for m in _members(r, shape, axes)], c)

        C = _randn(150 + t, world, *ref(B, 0).shape)
        fwd, bwd = _matches_one_process(mesh, lambda x: sl.all_to_all(x, axes, s, c, mesh=mesh), ref, B, C)
        assert _ops(fwd) == _one("all_to_all", k) and _ops(bwd) == _one("all_to_all", k)


def _perms(k: int) -> list[list[tuple[int, int]]]:
    if k == 1:
        return [[(0, 0)], []]
    shift = [(i, (i + 1) % k) for i in range(k)]
    back = [(i, (i - 1) % k) for i in range(k)]
    partial = [(i, i + 1) for i in range(k - 1)]            # index 0 receives nothing: zeros
    swap_self = [(0, k - 1), (k - 1, 0)] + [(i, i) for i in range(1, k - 1)]
    return [shift, back, partial, swap_self, [(k - 1, 0)]]


def _check_ppermute(shape: dict, axes_list: list) -> None:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    world = mesh.size
    for t, axes in enumerate(axes_list):
        k = len(_members(0, shape, axes))
        for u, perm in enumerate(_perms(k)):
            B = _randn(60 + 10 * t + u, world, 2, 3)
            C = _randn(160 + 10 * t + u, world, 2, 3)

            def ref(B, r):
                src = {d: s for s, d in perm}.get(_index(r, shape, axes))
                return B[_members(r, shape, axes)[src]] if src is not None else B.new_zeros(2, 3)

            with sl.use_mesh(mesh):
                fwd, bwd = _matches_one_process(mesh, lambda x: sl.ppermute(x, axes, perm), ref, B, C)
            assert set(_ops(fwd)) <= {"send_recv"} and set(_ops(bwd)) <= {"send_recv"}


def _mlp_reference(seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 6)).to(dtype)
    X = torch.randn(8, 6, dtype=dtype)
    T = torch.randn(8, 6, dtype=dtype)
    return model, X, T


def _check_megatron(shape: dict, dp_axes, tp_axis: str) -> dict:
    """Column- then row-parallel MLP on ``tp_axis``, batch split on ``dp_axes``, built from pbroadcast
    (Megatron f) and psum (Megatron g), against a plain nn.Sequential on one process."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    rank = mesh.rank
    model, X, T = _mlp_reference(7)
    # single-process reference: an independent copy of the same model on the whole batch
    ref = _mlp_reference(7)[0]
    Xref = X.clone().requires_grad_(True)
    loss_ref = ((ref(Xref) - T) ** 2).sum() / X.shape[0]
    loss_ref.backward()

    tp, dp = _index(rank, shape, tp_axis), _index(rank, shape, dp_axes)
    ktp, kdp = shape[tp_axis], len(_members(0, shape, dp_axes))
    fc1, fc2 = model[0], model[2]
    w1 = fc1.weight.detach().chunk(ktp, 0)[tp].clone().requires_grad_(True)   # column parallel: out-features
    b1 = fc1.bias.detach().chunk(ktp, 0)[tp].clone().requires_grad_(True)
    w2 = fc2.weight.detach().chunk(ktp, 1)[tp].clone().requires_grad_(True)   # row parallel: in-features
    b2 = fc2.bias.detach().clone().requires_grad_(True)
    x = X.chunk(kdp, 0)[dp].clone().requires_grad_(True)
    t = T.chunk(kdp, 0)[dp]
    with sl.use_mesh(mesh), sl.count_collectives() as counter:
        # weights are replicated over the data axes and meet per-rank batches: pbroadcast over them
        w1d, b1d, w2d, b2d = (sl.pbroadcast(p, dp_axes) for p in (w1, b1, w2, b2))
        h = torch.nn.functional.gelu(torch.nn.functional.linear(sl.pbroadcast(x, tp_axis), w1d, b1d))
        y = sl.psum(torch.nn.functional.linear(h, w2d), tp_axis) + b2d
        loss = ((y - t) ** 2).sum() / X.shape[0]
        loss.backward()
    torch.testing.assert_close(y.detach(), ref(X).detach().chunk(kdp, 0)[dp])
    torch.testing.assert_close(sl.psum(loss.detach(), dp_axes, mesh=mesh), loss_ref.detach())
    torch.testing.assert_close(x.grad, Xref.grad.chunk(kdp, 0)[dp])
    torch.testing.assert_close(w1.grad, ref[0].weight.grad.chunk(ktp, 0)[tp])
    torch.testing.assert_close(b1.grad, ref[0].bias.grad.chunk(ktp, 0)[tp])
    torch.testing.assert_close(w2.grad, ref[2].weight.grad.chunk(ktp, 1)[tp])
    torch.testing.assert_close(b2.grad, ref[2].bias.grad)
    return {op: n for op, (n, _) in counter.by_op().items()}


def _check_errors(shape: dict) -> list[str]:
    """Bad arguments raise before any collective runs (on every rank alike, so the world stays in step)."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    x = torch.ones(4, 3)
    bad = [
        (sl.CollectiveError, lambda: sl.ppermute(x, "data", [(0, 1), (0, 0)], mesh=mesh)),   # source twice
        (sl.CollectiveError, lambda: sl.ppermute(x, "data", [(0, 1), (1, 1)], mesh=mesh)),   # destination twice
        (sl.CollectiveError, lambda: sl.ppermute(x, "data", [(0, 2)], mesh=mesh)),            # out of range
        (sl.CollectiveError, lambda: sl.ppermute(x, "data", [(-1, 0)], mesh=mesh)),
        (sl.ShardingTypeError, lambda: sl.ppermute(x, "data", [(0, 1, 1)], mesh=mesh)),       # not a pair
        (sl.ShardingTypeError, lambda: sl.ppermute(x, "data", [(0.5, 1)], mesh=mesh)),
        (sl.CollectiveError, lambda: sl.psum_scatter(torch.ones(3, 2), "data", 0, mesh=mesh)),
        (sl.CollectiveError, lambda: sl.psum_scatter(torch.ones(4, 3), "data", 1, mesh=mesh)),
        (sl.CollectiveError, lambda: sl.all_to_all(torch.ones(4, 3), "data", 1, 0, mesh=mesh)),
        (sl.SpecError, lambda: sl.psum(x, "dta", mesh=mesh)),                                  # unknown axis
        (sl.SpecError, lambda: sl.all_gather(x, ("data", "model"), 0, mesh=mesh)),
        (sl.CollectiveError, lambda: sl.psum(x, ("data", "data"), mesh=mesh)),                 # repeated axis
        (sl.ShardingTypeError, lambda: sl.psum(x, 0, mesh=mesh)),                              # not a name
        (sl.CollectiveError, lambda: sl.all_gather(x, "data", 2, mesh=mesh)),                  # dim out of range
        (sl.CollectiveError, lambda: sl.all_gather(torch.tensor(1.0), "data", 0, mesh=mesh)),  # scalar
        (sl.CollectiveError, lambda: sl.psum_scatter(torch.tensor(1.0), "data", 0, mesh=mesh)),
        (sl.MeshError, lambda: sl.psum(x, "data")),                                            # no mesh in scope
    ]
    messages = []
    with sl.count_collectives() as counter:
        for err, call in bad:
            try:
                call()
            except err as e:
                messages.append(str(e))
            else:
                raise AssertionError(f"expected {err.__name__} from case {len(messages)}")
    assert counter.count() == 0, counter.summary()
    # the world is still in step; a bool psum counts (JAX sums bools as integers)
    torch.testing.assert_close(sl.psum(torch.ones(2), "data", mesh=mesh), torch.full((2,), 2.0))
    torch.testing.assert_close(sl.psum(torch.ones(2, dtype=torch.bool), "data", mesh=mesh), torch.full((2,), 2))
    return messages


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

# each collective's forward and backward against one process, on every world; the id says what is checked
CHECKS = {
    "psum-matches-one-process-and-sends-the-ring-all-reduce-bytes": _check_psum,
    "pbroadcast-sums-the-gradient-over-the-group-like-one-process": _check_pbroadcast,
    "all_gather-matches-one-process-and-backward-is-a-reduce-scatter": _check_all_gather,
    "psum_scatter-matches-one-process-and-backward-is-an-all-gather": _check_psum_scatter,
    "all_to_all-values-and-gradients-match-one-process": _check_all_to_all,
    "ppermute-matches-one-process-and-zero-fills-unreceived-shards": _check_ppermute,
}


@pytest.mark.parametrize("n, mesh", WORLDS)
@pytest.mark.parametrize("check", list(CHECKS.values()), ids=list(CHECKS))
def test_collective_matches_one_process(world, check, n, mesh):
    world(n, check, MESHES[mesh], AXES[mesh])


@pytest.mark.parametrize("n, dp_axes, tp_axis", [
    (2, (), "data"),                       # pure TP on a 2-rank world
    (4, "data", "tensor"),
    (8, ("pipe", "data"), "tensor"),       # data parallel over two axes, out of mesh order
    (8, "tensor", "data"),                 # the roles swapped
])
def test_megatron_mlp_matches_single_process(world, n, dp_axes, tp_axis):
    counts = world(n, _check_megatron, MESHES[n], dp_axes, tp_axis)
    # forward: one psum (g); backward: pbroadcast of x over tp (f), and the 4 parameter pbroadcasts
    # over the data axes (the data-parallel gradient all-reduce) when there are data axes
    n_dp = 4 if _as_tuple(dp_axes) else 0
    assert counts == [{"all_reduce": 2 + n_dp}] * n


def test_errors_before_any_collective(world):
    messages = world(2, _check_errors, MESHES[2])[0]
    assert "perm" in messages[0] and "0..1" in messages[0]
    assert "(source, destination)" in messages[4]
    assert "does not divide" in messages[6] and "2" in messages[6]
    assert "'dta'" in messages[9] and "'data'" in messages[9]
    assert "'model'" in messages[10]
    assert "out of range" in messages[13]
    assert "scalar" in messages[14]


def _axis_index_all(shape: dict, axes_list: list) -> list[int]:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    return [sl.axis_index(a, mesh=mesh) for a in axes_list]


def test_axis_index_is_the_ranks_position_in_each_group(world):
    got = world(8, _axis_index_all, MESHES[8], AXES[8])
    assert got == [[_index(r, MESHES[8], a) for a in AXES[8]] for r in range(8)]


# ---------------------------------------------------------------------------------------------
# World of one: no process group; collectives are identities (forward and backward)
# ---------------------------------------------------------------------------------------------

def test_world_of_one_collectives_are_noops():
    mesh = sl.Mesh({"data": 1})
    assert mesh.rank == 0 and mesh.size == 1
    x = _randn(1, 4, 2).requires_grad_(True)
    cot = _randn(2, 4, 2)
    with sl.use_mesh(mesh), sl.count_collectives() as counter:
        outs = [sl.psum(x, "data"), sl.pbroadcast(x, "data"), sl.all_gather(x, "data", 1),
                sl.psum_scatter(x, "data", 0), sl.all_to_all(x, "data", 0, 1),
                sl.ppermute(x, "data", [(0, 0)])]
        for y in outs:
            torch.testing.assert_close(y, x.detach())
        sum((y * cot).sum() for y in outs).backward()
        torch.testing.assert_close(x.grad, 6 * cot)
        torch.testing.assert_close(sl.ppermute(x, "data", []), torch.zeros(4, 2, dtype=torch.float64))
        assert sl.axis_index("data") == 0
    assert counter.count() == 0
    # results are new tensors, as in bigger worlds: in-place ops on them work and leave x alone
    x.grad = None
    for op in (lambda v: sl.psum(v, "data", mesh=mesh), lambda v: sl.all_gather(v, "data", 0, mesh=mesh),
               lambda v: sl.psum_scatter(v, "data", 0, mesh=mesh),
               lambda v: sl.all_to_all(v, "data", 0, 1, mesh=mesh)):
        y = op(x)
        y *= 3
        (y * cot).sum().backward()
    torch.testing.assert_close(x.grad, 12 * cot)
    torch.testing.assert_close(x, _randn(1, 4, 2))
    with pytest.raises(sl.CollectiveError):
        sl.ppermute(x, "data", [(0, 1)], mesh=mesh)
    with pytest.raises(sl.SpecError, match="tensor"):
        sl.psum(x, "tensor", mesh=mesh)
