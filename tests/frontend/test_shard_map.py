"""``sl.shard_map`` on real gloo worlds of 2, 4 and 8 ranks, and in a world of one.

Inputs are global tensors, the same on every rank (one seed); outputs come back global on every
rank, so the loss after ``shard_map`` is an ordinary single-process loss computed on every rank.
Every output and every gradient is compared with the same computation done by plain torch on
the full tensors in one process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import shardlib as sl
from shardlib import P

MESHES = {
    2: {"data": 2},
    4: {"data": 2, "tensor": 2},
    8: {"data": 2, "pipe": 2, "tensor": 2},
}


def _randn(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _grads(fn, inputs: list[torch.Tensor], cotangents) -> tuple:
    """Outputs of ``fn(*inputs)`` (a tensor or a tuple) and the gradients of ``sum(out * cot)``."""
    leaves = [_leaf(t) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    cots = cotangents if isinstance(cotangents, tuple) else (cotangents,)
    sum((o * c).sum() for o, c in zip(outs, cots)).backward()
    return tuple(o.detach() for o in outs), tuple(t.grad for t in leaves)


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w)


def _ops(counter) -> dict[str, int]:
    """Collectives by op; tagged ones (shard_map's shape all-gather) apart, as ``op[tag]``."""
    out: dict[str, int] = {}
    for r in counter.records:
        key = f"{r.op}[{r.tag}]" if r.tag else r.op
        out[key] = out.get(key, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------

def _dp_matmul(shape: dict, data_axes) -> dict:
    """Data parallel: batch sharded, weight replicated; grads of the weight AND the input."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W, C = _randn(1, 8, 5), _randn(2, 5, 3), _randn(3, 8, 3)

    def body(x, w):
        return torch.tanh(x @ w)

    f = sl.shard_map(body, mesh, in_specs=(P(data_axes), P()), out_specs=P(data_axes))
    with sl.count_collectives() as counter:
        got = _grads(f, [X, W], C)
    want = _grads(lambda x, w: torch.tanh(x @ w), [X, W], C)
    _assert_same(got[0], want[0])
    _assert_same(got[1], want[1])
    return _ops(counter)


def _dp_weight_used_twice(shape: dict) -> dict:
    """A replicated weight used by two ops on the batch gets one summed gradient (counted once)."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W, C = _randn(4, 8, 5), _randn(5, 5, 5), _randn(6, 8, 5)

    def body(x, w):
        return (x @ w) @ w + x @ w

    f = sl.shard_map(body, mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    with sl.count_collectives() as counter:
        got = _grads(f, [X, W], C)
    _assert_same(got, _grads(body, [X, W], C))
    return _ops(counter)


def _mlp_reference(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 6)).double()


def _megatron(shape: dict, batch_spec) -> None:
    """Column- then row-parallel MLP with weights sharded on 'tensor' (nn.Linear layout: [out, in])."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    ref = _mlp_reference(11)
    X, T = _randn(12, 8, 6), _randn(13, 8, 6)
    params = [p.detach() for p in (ref[0].weight, ref[0].bias, ref[2].weight, ref[2].bias)]

    def body(x, w1, b1, w2, b2):
        h = F.gelu(F.linear(x, w1, b1))              # x is invariant over 'tensor': pbroadcast (f) inserted
        return sl.psum(F.linear(h, w2), "tensor") + b2   # g

    specs = (P(batch_spec), P("tensor", None), P("tensor"), P(None, "tensor"), P())
    f = sl.shard_map(body, mesh, in_specs=specs, out_specs=P(batch_spec))

    def loss(y):
        return ((y - T) ** 2).mean()

    xs = [_leaf(X)] + [_leaf(p) for p in params]
    loss(f(*xs)).backward()
    xr = _leaf(X)
    loss(ref(xr)).backward()
    torch.testing.assert_close(f(X, *params), ref(X).detach())
    torch.testing.assert_close(xs[0].grad, xr.grad)
    for got, p in zip(xs[1:], (ref[0].weight, ref[0].bias, ref[2].weight, ref[2].bias)):
        torch.testing.assert_close(got.grad, p.grad)


def _column_parallel_output(shape: dict) -> None:
    """An output sharded on two dims: batch on 'data', features on 'tensor' (no psum needed)."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W, C = _randn(20, 6, 4), _randn(21, 4, 6), _randn(22, 6, 6)
    f = sl.shard_map(lambda x, w: x @ w, mesh, in_specs=(P("data"), P(None, "tensor")),
                     out_specs=P("data", "tensor"))
    _assert_same(_grads(f, [X, W], C), _grads(lambda x, w: x @ w, [X, W], C))


def _psum_of_sharded_sum(shape: dict, spec) -> None:
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    axes = spec[0]
    X, C = _randn(30, 8, 3), _randn(31, 3)
    f = sl.shard_map(lambda x: sl.psum(x.sum(0), axes), mesh, in_specs=spec, out_specs=P())
    _assert_same(_grads(f, [X], C), _grads(lambda x: x.sum(0), [X], C))
    # a mean over the batch: psum, then divide by the global size the body cannot see
    g = sl.shard_map(lambda x: sl.psum((x ** 2).sum(0), axes) / 8, mesh, in_specs=spec, out_specs=P())
    _assert_same(_grads(g, [X], C), _grads(lambda x: (x ** 2).mean(0), [X], C))


def _uneven(shape: dict, spec) -> None:
    """5 rows over 4 or 8 shards: shards of 2, 2, 1, 0 rows (ceil chunking); empty shards too."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W, C = _randn(40, 5, 3), _randn(41, 3, 2), _randn(42, 5, 2)

    def body(x, w):
        return torch.sin(x @ w) + 1

    f = sl.shard_map(body, mesh, in_specs=(spec, P()), out_specs=spec)
    _assert_same(_grads(f, [X, W], C), _grads(body, [X, W], C))
    # and a psum of the uneven shards' sums
    axes = spec[0]
    g = sl.shard_map(lambda x: sl.psum(x.sum(0, keepdim=True), axes), mesh, in_specs=spec, out_specs=P())
    _assert_same(_grads(g, [X], C[:1, :1].expand(1, 3).contiguous()),
                 _grads(lambda x: x.sum(0, keepdim=True), [X], C[:1, :1].expand(1, 3).contiguous()))


def _tuple_axes(shape: dict, axes: tuple[str, ...]) -> tuple:
    """P((a, b)) shards one dim over two axes, ``a`` major, also when not in mesh order."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    k = int(np.prod([shape[a] for a in axes]))
    X, C = _randn(50, 2 * k, 3), _randn(51, 2 * k, 3)

    def body(x):
        i = sl.axis_index(axes)
        return x * (i + 1), torch.full_like(x, float(mesh.rank))

    f = sl.shard_map(body, mesh, in_specs=P(axes), out_specs=(P(axes), P(axes)))
    (y, owner), (gx,) = _grads(lambda x: f(x), [X], (C, torch.zeros_like(C)))
    factor = torch.arange(1, k + 1, dtype=torch.float64).repeat_interleave(2)[:, None]
    torch.testing.assert_close(y, X * factor)
    torch.testing.assert_close(gx, C * factor)
    return owner[::2, 0].tolist()


def _pytree(shape: dict) -> None:
    """Dict and tuple inputs and outputs; a non-tensor argument passes through untouched."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W, B, C1, C2 = _randn(60, 8, 4), _randn(61, 4, 4), _randn(62, 4), _randn(63, 8, 4), _randn(64, 4)

    def body(inp, wb, scale):
        x = inp["x"]
        w, b = wb
        y = (x @ w + b) * scale
        return {"y": y, "stats": (sl.psum(y.sum(0), "data"),)}

    f = sl.shard_map(body, mesh, in_specs=({"x": P("data")}, (P(), P()), None),
                     out_specs={"y": P("data"), "stats": (P(),)})

    def run(x, w, b):
        out = f({"x": x}, (w, b), 0.5)
        return out["y"], out["stats"][0]

    def ref(x, w, b):
        y = (x @ w + b) * 0.5
        return y, y.sum(0)

    _assert_same(_grads(run, [X, W, B], (C1, C2)), _grads(ref, [X, W, B], (C1, C2)))
    # a single P applies to every leaf of its subtree (a prefix tree, as in JAX)
    g = sl.shard_map(lambda xs: (xs[0] + xs[1]) * 2, mesh, in_specs=P("data"), out_specs=P("data"))
    torch.testing.assert_close(g((X, C1)), (X + C1) * 2)
    # ... and a bare P in in_specs applies to every argument
    h = sl.shard_map(lambda x, c: x - c, mesh, in_specs=P("data"), out_specs=P("data"))
    torch.testing.assert_close(h(X, C1), X - C1)


def _invariant_only(shape: dict) -> dict:
    """A replicated input used only in replicated computation: its gradient is not multiplied."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W, C1, C2 = _randn(70, 8, 3), _randn(71, 3, 3), _randn(72, 8, 3), _randn(73, 3, 3)

    def only(w):
        return torch.exp(w) * 3

    f = sl.shard_map(only, mesh, in_specs=P(), out_specs=P())
    with sl.count_collectives() as counter:
        got = _grads(f, [W], C2)
    _assert_same(got, _grads(only, [W], C2))
    assert counter.count("all_reduce") == 0, counter.summary()

    def mixed(x, w):           # w feeds both a per-rank value and a replicated one
        return x @ w, (w ** 2) @ w

    g = sl.shard_map(mixed, mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
    _assert_same(_grads(g, [X, W], (C1, C2)), _grads(mixed, [X, W], (C1, C2)))

    # an invariant output under a sharding out_spec is tiled (JAX): the global output holds copies
    k = shape["data"]
    h = sl.shard_map(lambda w: w * 2, mesh, in_specs=P(), out_specs=P("data"))
    Ck = _randn(74, 3 * k, 3)
    _assert_same(_grads(h, [W], Ck), _grads(lambda w: torch.cat([w * 2] * k), [W], Ck))
    # an explicit pbroadcast over an axis the value already varies over changes nothing
    e = sl.shard_map(lambda x, w: sl.pbroadcast(x, "data") @ sl.pbroadcast(w, "data"), mesh,
                     in_specs=(P("data"), P()), out_specs=P("data"))
    _assert_same(_grads(e, [X, W], C1), _grads(lambda x, w: x @ w, [X, W], C1))
    # psum of a replicated value sums its copies (JAX: psum(1, axis) is the axis size)
    p = sl.shard_map(lambda w: sl.psum(w, "data"), mesh, in_specs=P(), out_specs=P())
    _assert_same(_grads(p, [W], C2), _grads(lambda w: w * k, [W], C2))
    return _ops(counter)


def _module_closure(shape: dict) -> None:
    """nn.Module parameters closed over by the body are replicated (invariant) values."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    torch.manual_seed(80)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    torch.manual_seed(80)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    X, T = _randn(81, 8, 5), _randn(82, 8, 2)

    def body(x, t):
        return sl.psum(((model(x) - t) ** 2).sum(), "data") / 8

    f = sl.shard_map(body, mesh, in_specs=(P("data"), P("data")), out_specs=P())
    loss = f(X, T)
    loss.backward()
    loss_ref = ((ref(X) - T) ** 2).mean(0).sum()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _write_through_view(x):
    buf = torch.zeros(2, x.shape[1], dtype=x.dtype)
    buf[0].add_(x.sum(0))
    return buf


def _errors(shape: dict) -> list[str]:
    """An output that varies over an axis its out_spec does not shard is an error (before any
    collective: every rank raises alike, the world stays in step)."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W = _randn(90, 8, 4), _randn(91, 4, 4)
    cases = [
        (sl.shard_map(lambda x: x * 2, mesh, in_specs=P("data"), out_specs=P()), (X,)),
        # varies over 'tensor' through the weight, but the out_spec shards 'data' only
        (sl.shard_map(lambda x, w: x @ w, mesh, in_specs=(P("data"), P(None, "tensor")), out_specs=P("data")),
         (X, W)),
        # a scalar that varies: P() is the only spec a scalar can have
        (sl.shard_map(lambda x: x.sum(), mesh, in_specs=P(("data", "tensor")), out_specs=P()), (X,)),
        # a buffer made per-rank by an in-place op on a view of it
        (sl.shard_map(_write_through_view, mesh, in_specs=P("data"), out_specs=P()), (X,)),
    ]
    messages = []
    with sl.count_collectives() as counter:
        for f, args in cases:
            try:
                f(*args)
            except sl.ShardingError as e:
                messages.append(str(e))
            else:
                raise AssertionError("expected a ShardingError")
    assert counter.count() == 0, counter.summary()
    return messages


def _same_tensor_two_specs(shape: dict) -> None:
    """One tensor returned twice under two out_specs comes back twice, each assembled by its spec."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, C1, C2 = _randn(110, 4, 4), _randn(111, 4, 2), _randn(112, 2, 4)

    def body(x):
        return torch.cos(x)[:2, :2] * (sl.axis_index("tensor") + 1)

    # each rank returns a 2x2 block; stacked on dim 0 or on dim 1 by the 'tensor' shards
    f = sl.shard_map(lambda x: (body(x),) * 2, mesh, in_specs=P(None, "tensor"),
                     out_specs=(P("tensor"), P(None, "tensor")))

    def ref(x):
        k = shape["tensor"]
        blocks = [torch.cos(c)[:2, :2] * (i + 1) for i, c in enumerate(x.chunk(k, 1))]
        return torch.cat(blocks, 0), torch.cat(blocks, 1)

    _assert_same(_grads(f, [X], (C1, C2)), _grads(ref, [X], (C1, C2)))


def _inplace_and_no_grad(shape: dict) -> None:
    """In-place writes of per-rank values into fresh buffers, inputs without grad, no_grad bodies."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X, W, C = _randn(120, 8, 3), _randn(121, 3, 3), _randn(122, 8, 3)

    def body(x, w):
        out = torch.zeros_like(x)          # a fresh buffer: becomes per-rank once written
        out[:, 0] = (x @ w)[:, 0]
        out[:, 1:] += x[:, 1:] * w[0, 1:]
        out.mul_(2)
        return out

    f = sl.shard_map(body, mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    _assert_same(_grads(f, [X, W], C), _grads(body, [X, W], C))

    # only the weight needs a gradient
    w = _leaf(W)
    (f(X, w) * C).sum().backward()
    wr = _leaf(W)
    (body(X, wr) * C).sum().backward()
    torch.testing.assert_close(w.grad, wr.grad)

    # an invariant value that needs a gradient, made per-rank by an in-place op (a residual add)
    k = shape["data"]

    def residual(x, w):
        h = w * 3
        h += x.sum(0)
        return sl.psum(h, "data")

    r = sl.shard_map(residual, mesh, in_specs=(P("data"), P()), out_specs=P())
    _assert_same(_grads(r, [X, W[0]], C[0]), _grads(lambda x, w: 3 * k * w + x.sum(0), [X, W[0]], C[0]))

    def through_view(x, w):    # only row 0 is written, yet all of h varies from then on
        h = w * 3
        h[0].add_(x.sum(0))
        return sl.psum(h, "data")

    def through_view_ref(x, w):
        h = 3 * k * w
        return torch.cat([h[:1] + x.sum(0), h[1:]])

    v = sl.shard_map(through_view, mesh, in_specs=(P("data"), P()), out_specs=P())
    _assert_same(_grads(v, [X, W], C[:3]), _grads(through_view_ref, [X, W], C[:3]))

    # a replicated output is a new tensor: in-place ops on it work
    q = sl.shard_map(lambda x: sl.psum(x.sum(0), "data"), mesh, in_specs=P("data"), out_specs=P())
    x = _leaf(X)
    y = q(x)
    y /= 8
    (y * C[0]).sum().backward()
    torch.testing.assert_close(x.grad, C[0].expand(8, 3) / 8)

    # inference: no graph, same values
    with torch.no_grad():
        torch.testing.assert_close(f(X, W), body(X, W))
    g = sl.shard_map(lambda x, w: _no_grad_body(x, w), mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    torch.testing.assert_close(g(_leaf(X), _leaf(W)), X @ W)


def _no_grad_body(x, w):
    with torch.no_grad():
        return (x @ w) * 2 + 0 * x - (x @ w)


def _bad_output_chunks(shape: dict) -> str:
    """Output shards that are not the ceil chunking of one tensor: every rank raises alike."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    X = _randn(130, 5, 2)
    f = sl.shard_map(lambda x: torch.cat([x, x]), mesh, in_specs=P(("data", "tensor")),
                     out_specs=P(("data", "tensor")))
    try:
        f(X)
    except sl.ShardingError as e:
        msg = str(e)
    else:
        raise AssertionError("expected a ShardingError")
    # the world is still in step
    torch.testing.assert_close(sl.psum(torch.ones(1), ("data", "tensor"), mesh=mesh), torch.full((1,), 4.0))
    return msg


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, data_axes", [(2, "data"), (4, "data"), (4, ("data", "tensor")),
                                          (8, ("pipe", "data"))])
def test_data_parallel_matmul_matches_one_process_with_one_all_reduce(world, n, data_axes):
    counts = world(n, _dp_matmul, MESHES[n], data_axes)
    # backward: the weight's gradient is summed over the batch axes (one all-reduce) and the input's
    # gradient shards are gathered back to the global input (one all-gather); forward: the output
    # shards are gathered into the global output (one all-gather), after one small all-gather of the
    # output shard shapes (tagged "metadata": shard_map cannot know uneven global shapes otherwise)
    assert counts == [{"all_gather": 2, "all_reduce": 1, "all_gather[metadata]": 1}] * n


def test_replicated_weight_used_twice_is_reduced_once(world):
    counts = world(4, _dp_weight_used_twice, MESHES[4])
    assert counts[0]["all_reduce"] == 1, counts[0]


@pytest.mark.parametrize("n, batch", [(2, None), (4, "data"), (8, ("data", "pipe"))])
def test_megatron_mlp_matches_the_single_process_mlp(world, n, batch):
    shape = MESHES[n] if n != 2 else {"tensor": 2}
    world(n, _megatron, shape, batch)


def test_output_sharded_on_two_dims_matches_one_process(world):
    world(4, _column_parallel_output, MESHES[4])


@pytest.mark.parametrize("n, spec", [(2, P("data")), (4, P(("data", "tensor"))), (8, P(("tensor", "data", "pipe")))])
def test_psum_of_shard_sums_equals_the_full_sum_and_mean(world, n, spec):
    world(n, _psum_of_sharded_sum, MESHES[n], spec)


@pytest.mark.parametrize("n, spec", [(4, P(("data", "tensor"))), (4, P(("tensor", "data"))),
                                     (8, P(("data", "pipe", "tensor")))])
def test_uneven_and_empty_row_shards_match_one_process(world, n, spec):
    world(n, _uneven, MESHES[n], spec)


@pytest.mark.parametrize("n, axes", [(4, ("data", "tensor")), (4, ("tensor", "data")),
                                     (8, ("tensor", "data")), (8, ("pipe", "tensor", "data"))])
def test_tuple_axes_shard_one_dim_first_axis_major(world, n, axes):
    shape = MESHES[n]
    owners = world(n, _tuple_axes, shape, axes)[0]
    # chunk c of the global output came from the rank whose index along ``axes`` is c
    names, sizes = list(shape), list(shape.values())
    want = []
    for c in range(int(np.prod([shape[a] for a in axes]))):
        idx = np.unravel_index(c, [shape[a] for a in axes])
        coords = [0] * len(names)
        for a, i in zip(axes, idx):
            coords[names.index(a)] = int(i)
        want.append(float(np.ravel_multi_index(coords, sizes)))
    assert owners == want


def test_pytree_inputs_and_outputs_match_one_process(world):
    world(2, _pytree, MESHES[2])


@pytest.mark.parametrize("n", [2, 4])
def test_replicated_input_gradient_not_overcounted(world, n):
    world(n, _invariant_only, MESHES[n])


def test_closed_over_module_parameters_get_one_process_gradients(world):
    world(4, _module_closure, MESHES[4])


def test_output_varying_over_unsharded_axis_is_an_error(world):
    messages = world(4, _errors, MESHES[4])[0]
    assert "varies over mesh axes ('data',)" in messages[0] and "psum" in messages[0]
    assert "varies over mesh axes ('tensor',)" in messages[1] and "P('data')" in messages[1]
    assert "varies over mesh axes ('data', 'tensor')" in messages[2]
    assert "varies over mesh axes ('data',)" in messages[3]


def test_one_tensor_under_two_out_specs_is_assembled_by_each(world):
    world(4, _same_tensor_two_specs, MESHES[4])


def test_in_place_ops_grad_free_inputs_and_no_grad_match_one_process(world):
    world(4, _inplace_and_no_grad, MESHES[4])


def test_output_shards_not_ceil_chunked_is_an_error(world):
    messages = world(4, _bad_output_chunks, MESHES[4])
    assert all("shard sizes [4, 4, 2, 0]" in m and "[3, 3, 3, 1]" in m for m in messages), messages[0]


# ---------------------------------------------------------------------------------------------
# World of one (no process group) and argument errors, in the test process itself
# ---------------------------------------------------------------------------------------------

def test_world_of_one_runs_no_collective_and_matches_torch():
    mesh = sl.Mesh({"data": 1})
    X, W, C = _randn(100, 5, 3), _randn(101, 3, 2), _randn(102, 5, 2)

    def body(x, w):
        y = torch.tanh(x @ w)
        return y, sl.psum(y.sum(), "data")

    f = sl.shard_map(body, mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
    with sl.count_collectives() as counter:
        got = _grads(f, [X, W], (C, torch.tensor(2.0, dtype=torch.float64)))
    want = _grads(lambda x, w: (torch.tanh(x @ w), torch.tanh(x @ w).sum()), [X, W],
                  (C, torch.tensor(2.0, dtype=torch.float64)))
    _assert_same(got, want)
    assert counter.count() == 0, counter.summary()
    # outputs are new tensors: in-place ops on them work (also where no gather was needed)
    for spec in (P(), P("data")):
        g = sl.shard_map(lambda x: x, mesh, in_specs=spec, out_specs=spec)
        x = _leaf(X)
        y = g(x)
        y *= 3
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(X, 3.0))
        torch.testing.assert_close(x, X)


def test_bad_arguments_are_refused_naming_the_spec_or_mesh():
    mesh = sl.Mesh({"data": 1})
    X = torch.ones(4, 2)
    with pytest.raises(sl.ShardingTypeError, match="one entry per argument"):
        sl.shard_map(lambda x, y: x, mesh, in_specs=(P(),), out_specs=P())(X, X)
    with pytest.raises(sl.SpecError, match="'tensor'"):
        sl.shard_map(lambda x: x, mesh, in_specs=P("tensor"), out_specs=P())(X)
    with pytest.raises(sl.SpecError, match="'tensor'"):
        sl.shard_map(lambda x: x, mesh, in_specs=P(), out_specs=P("tensor"))(X)
    with pytest.raises(sl.SpecError, match="rank 2"):
        sl.shard_map(lambda x: x, mesh, in_specs=P(None, None, "data"), out_specs=P())(X)
    with pytest.raises(sl.ShardingTypeError, match="does not match its spec"):
        sl.shard_map(lambda x: x, mesh, in_specs=((P(), P()),), out_specs=P())((X, X, X))
    with pytest.raises(sl.ShardingTypeError, match="Mesh"):
        sl.shard_map(lambda x: x, sl.AbstractMesh({"data": 2}), in_specs=P(), out_specs=P())
    with pytest.raises(sl.ShardingError, match="nested"):
        inner = sl.shard_map(lambda x: x, mesh, in_specs=P(), out_specs=P())
        sl.shard_map(lambda x: inner(x), mesh, in_specs=P(), out_specs=P())(X)
