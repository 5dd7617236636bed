"""ZeRO-3's persistent collective buffers (``runtime/comm_buffers.py``) and the in-place collectives
they use (``comm.all_gather(out=)``, ``comm.reduce_scatter(out=)``), and ZeRO-2's bucket
reduce-scatter in place, on real gloo ranks.

References are plain torch ops on the full tensors (same seed on every rank)."""

from __future__ import annotations

import torch

import shardlib as sl
from shardlib.comm import core as comm
from shardlib.runtime.comm_buffers import Buffer

SHAPE = {"data": 2, "tensor": 2}


def _full(seed: int, world: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(world, n, generator=g)


def _in_place(axes_list) -> list[dict]:
    from shardlib.testing import get_mesh
    mesh = get_mesh(SHAPE)
    rank, out = mesh.rank, []
    for t, axes in enumerate(axes_list):
        canon = mesh.canonical_axes(axes)
        members = mesh.group_ranks(rank, canon)
        i, k, c = members.index(rank), len(members), 5
        x = _full(t, mesh.size, c)
        # all-gather in place: the input is this member's block of the output
        buf = torch.full((k * c,), float("nan"))
        buf[i * c:(i + 1) * c] = x[rank]
        with sl.count_collectives() as ag:
            got = comm.all_gather(buf[i * c:(i + 1) * c], mesh, axes, out=buf)
        # into a given buffer, not in place; asynchronously
        other = torch.empty(k * c)
        got2 = comm.all_gather(x[rank], mesh, axes, out=other, async_op=True).wait()
        # reduce-scatter in place (gloo: the all-reduce run on the input itself), and into a buffer
        y = _full(100 + t, mesh.size, k * c)
        inp = y[rank].clone()
        with sl.count_collectives() as rs:
            chunk = comm.reduce_scatter(inp, mesh, axes, out=inp[i * c:(i + 1) * c], async_op=True).wait()
        sep = torch.empty(c)
        chunk2 = comm.reduce_scatter(y[rank].clone(), mesh, axes, out=sep)
        want_rs = sum(y[m] for m in members)[i * c:(i + 1) * c]
        out.append({
            "ag": torch.equal(got, torch.cat([x[m] for m in members])) and got.data_ptr() == buf.data_ptr(),
            "ag2": torch.equal(got2, torch.cat([x[m] for m in members])) and got2.data_ptr() == other.data_ptr(),
            "rs": torch.allclose(chunk, want_rs) and chunk.data_ptr() == inp.data_ptr() + i * c * 4,
            "rs2": torch.allclose(chunk2, want_rs) and chunk2.data_ptr() == sep.data_ptr(),
            # counted as the collectives they are, whatever gloo runs
            "counted": (ag.by_op(), rs.by_op()) == ({"all_gather": (1, (k - 1) * c * 4)},
                                                     {"reduce_scatter": (1, (k - 1) * c * 4)}),
        })
    try:
        comm.all_gather(torch.zeros(3), mesh, "data", out=torch.zeros(5))
        out.append("no error")
    except sl.ShardingError as e:
        out.append(str(e))
    return out


def test_in_place_all_gather_and_reduce_scatter_fill_the_given_buffer(world):
    for per_rank in world(4, _in_place, ["data", "tensor", ("data", "tensor"), ("tensor", "data")]):
        *checks, err = per_rank
        for c in checks:
            assert all(c.values()), c
        assert "out must be a contiguous torch.float32 tensor of shape (6,)" in err


def test_a_buffer_is_lent_to_one_collective_at_a_time():
    b = Buffer(10, torch.float32, "cpu")
    assert b.tensor is None                              # allocated at its first use
    t, held = b.acquire(8)
    assert t.numel() == 8 and held == 40 and b.busy
    u, held_u = b.acquire(6)                             # lent: a tensor of its own, for the while
    assert held_u == 24 and u.data_ptr() != b.tensor.data_ptr()
    assert b.release(u) == 24 and b.busy
    assert b.release(t) == 0 and not b.busy
    t2, held2 = b.acquire(10)                            # the same memory again, nothing new held
    assert held2 == 0 and t2.data_ptr() == t.data_ptr()
    big, held3 = b.acquire(11)                           # larger, while lent: its own tensor
    assert held3 == 44 and b.release(big) == 44
    assert b.release(t2) == 0 and b.held == 40
    big, held4 = b.acquire(11)                           # larger, while idle: in the buffer's place
    assert held4 == 44 - 40 and b.tensor is None and b.held == 0 and b.release(big) == 44
    again, held5 = b.acquire(10)                         # allocated again at its next use
    assert held5 == 40 and b.held == 40 and b.busy


def _steady(zero_args: dict, vocab: int = 64) -> dict:
    from shardlib.models import GPT, GPTConfig, token_batch
    from shardlib.testing import get_mesh
    cfg = GPTConfig(vocab_size=vocab, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    mesh = get_mesh({"data": 2})
    model = GPT(cfg, seed=0)
    plan = sl.plan(model, mesh, zero=3, **zero_args)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    runner = engine.units
    ptrs = []
    for s in range(3):
        engine.step(token_batch(cfg, 4, s))
        ptrs.append(tuple(b.tensor.data_ptr() if b.tensor is not None else None
                          for b in (runner.gather_buffer, runner.reduce_buffer)))
    return {"ptrs": ptrs, "idle": not runner.gather_buffer.busy and not runner.reduce_buffer.busy,
            "lent": [u.name for u in runner.all if u.gather_buf is not None or u.reduce_buf is not None],
            "sizes": (runner.gather_buffer.nbytes, runner.reduce_buffer.nbytes),
            "held": (runner.gather_buffer.held, runner.reduce_buffer.held),
            "planned": (plan.transient_per_rank()["buffer"], plan.peak_per_rank()["comm_buffers"]),
            "gathered": (engine.peak_gathered_bytes, plan.transient_per_rank()["gathered"]),
            "block": 4 * sum(p.numel() for p in model.blocks[0].parameters())}


def test_zero3_steps_reuse_the_same_two_buffers(world):
    """Every step gathers and reduces through the same two buffers, a block's, and gives them back
    by the step's end; what they hold between steps is what the plan states, and the gathered peak
    tracked is the planned one. Where the root is larger (vocab 1024, the blocks named as the units)
    it takes their place for its gather and its reduce-scatter: the reduce buffer, last used by the
    root, is not held between steps (allocated again by each step's first block). With the default
    units at vocab 1024, wte and head are units of their own: the buffers are theirs, and the root
    (wpe, ln_f) fits them."""
    blocks = {"units": ["blocks.0", "blocks.1"]}
    for kw, vocab in (({}, 64), ({"recompute": True}, 64), ({"precision": "bf16"}, 64), (blocks, 1024), ({}, 1024)):
        for r in world(2, _steady, kw, vocab):
            assert r["idle"] and r["lent"] == [], (kw, r)
            assert r["held"][0] == r["planned"][0], (kw, r)
            assert sum(r["held"]) == r["planned"][1], (kw, r)
            assert r["gathered"][0] == r["gathered"][1], (kw, r)
            if kw is blocks:
                assert r["sizes"] == (r["block"], r["block"]) and r["held"] == (r["block"], 0), r
            else:
                assert len(set(r["ptrs"])) == 1 and r["sizes"] == r["held"], (kw, r)
                largest = r["block"] // 4 if vocab == 64 else 1024 * 32        # elements: a block, or wte
                assert r["sizes"][0] == largest * (2 if kw.get("precision") == "bf16" else 4), (kw, r)


def _bucket_outputs(zero: int) -> dict:
    """Every reduce-scatter a ZeRO-1/2 step's buckets run: whether its output is this rank's chunk of
    its input (in place), and the loss of each step."""
    from shardlib.models import GPT, GPTConfig, token_batch
    from shardlib.runtime import buckets
    from shardlib.testing import get_mesh
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    mesh = get_mesh({"data": 2})
    model = GPT(cfg, seed=0)
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=zero, bucket_mb=0.01),
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    seen, real = [], buckets.comm.reduce_scatter

    def spy(x, mesh_, axes, **kw):
        out = kw.get("out")
        own = x.numel() // 2 * mesh_.group_index(mesh_.rank, mesh_.canonical_axes(axes))
        seen.append(out is not None and out.data_ptr() == x.data_ptr() + own * x.element_size())
        return real(x, mesh_, axes, **kw)

    buckets.comm.reduce_scatter = spy
    try:
        losses = [engine.step(token_batch(cfg, 4, s)) for s in range(2)]
    finally:
        buckets.comm.reduce_scatter = real
    return {"in_place": seen, "losses": losses}


def test_zero2_buckets_reduce_scatter_in_place_zero1_apart(world):
    """ZeRO-2 reduce-scatters each bucket into this rank's chunk of the packed input (copied into the
    gradient shards when waited for); ZeRO-1, whose gradients are views of the chunks until the
    update, gets chunks of their own. Both train alike (the same update from the same sums)."""
    two = world(2, _bucket_outputs, 2)
    one = world(2, _bucket_outputs, 1)
    for r2, r1 in zip(two, one):
        assert len(r2["in_place"]) >= 4 and all(r2["in_place"]), r2       # several buckets, every step
        assert len(r1["in_place"]) == len(r2["in_place"]) and not any(r1["in_place"]), r1
        assert r2["losses"] == r1["losses"]


def _exchanges() -> dict:
    """Two-member groups' asynchronous reduce-scatters and all-gathers (``comm/pairwise.py``): several
    in flight at once, waited in reverse order, in place and into buffers, sum/max/min, fp32 and bf16
    — and the same calls with the exchange off (gloo's collectives)."""
    import os

    from shardlib.comm import pairwise
    from shardlib.testing import get_mesh
    mesh = get_mesh(SHAPE)
    rank, posted, real = mesh.rank, [], (pairwise.reduce_scatter, pairwise.all_gather)

    def spy(fn):
        def call(*a):
            posted.append(fn.__name__)
            return fn(*a)
        return call

    def run(exact: bool) -> list:
        results = []
        for t, (axes, dtype, op) in enumerate([("data", torch.float32, "sum"), ("tensor", torch.bfloat16, "sum"),
                                               ("data", torch.float32, "max"), ("tensor", torch.float32, "min"),
                                               (("tensor", "data"), torch.float32, "sum")]):
            canon = mesh.canonical_axes(axes)
            members = mesh.group_ranks(rank, canon)
            i, c, k = members.index(rank), 3 + t, len(members)
            y = _full(200 + t, mesh.size, k * c).to(dtype)
            x = _full(300 + t, mesh.size, c).to(dtype)
            inp = y[rank].clone()
            pend = [comm.reduce_scatter(inp, mesh, axes, op=op, out=inp[i * c:(i + 1) * c], async_op=True),
                    comm.reduce_scatter(y[rank].clone(), mesh, axes, op=op, async_op=True)]
            if op == "sum":
                buf = torch.full((k * c,), float("nan"), dtype=dtype)
                buf[i * c:(i + 1) * c] = x[rank]
                pend += [comm.all_gather(buf[i * c:(i + 1) * c], mesh, axes, out=buf, async_op=True),
                         comm.all_gather(x[rank], mesh, axes, async_op=True)]
            got = [p.wait() for p in reversed(pend)][::-1]
            fold = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
            # this member's part first, then the peers' in member order (one op over two members: commutes)
            want_rs = y[rank][i * c:(i + 1) * c]
            for m in members:
                want_rs = want_rs if m == rank else fold(want_rs, y[m][i * c:(i + 1) * c])
            own = inp.data_ptr() + i * c * inp.element_size()
            same = torch.equal if exact or k == 2 else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)
            results.append([same(got[0], want_rs) and got[0].data_ptr() == own, same(got[1], want_rs)]
                           + ([torch.equal(g, torch.cat([x[m] for m in members])) for g in got[2:]] +
                              [got[2].data_ptr() == buf.data_ptr()] if op == "sum" else []))
        return results

    pairwise.reduce_scatter, pairwise.all_gather = map(spy, real)
    filled = pairwise.cores_filled
    os.environ["SHARDLIB_SHM"] = "0"      # the exchanges are the path where the shared-memory channel is not
    try:
        pairwise.cores_filled = lambda: False     # a core to spare: reduce-scatters stay gloo's, gathers exchange
        spare = run(exact=False)
        n_spare = len(posted)
        pairwise.cores_filled = lambda: True      # this host's ranks fill its cores (2 ranks on 2: the reference)
        on = run(exact=True)
        # a reduce-scatter whose peer's part (the exchange's scratch) passes 4 MiB stays gloo's
        big = torch.full((2 * (pairwise.SCRATCH_MAX_BYTES // 4 + 1),), float(rank + 1))
        half = big.numel() // 2
        i = mesh.group_index(rank, ("data",))
        got = comm.reduce_scatter(big, mesh, "data", out=big[i * half:(i + 1) * half], async_op=True).wait()
        on.append([bool((got == sum(r + 1 for r in mesh.group_ranks(rank, ("data",)))).all())])
        n_on = len(posted)
        os.environ["SHARDLIB_GLOO_PAIRWISE"] = "0"
        off = run(exact=False)
    finally:
        pairwise.reduce_scatter, pairwise.all_gather = real
        pairwise.cores_filled = filled
        os.environ.pop("SHARDLIB_GLOO_PAIRWISE", None)
        os.environ.pop("SHARDLIB_SHM", None)
    return {"on": on, "off": off, "spare": spare, "posted": (n_spare, n_on - n_spare, len(posted) - n_on),
            "names": posted[:n_spare]}


def test_groups_exchange_asynchronous_reduce_scatters_and_gathers_pairwise(world):
    """On gloo, a group's asynchronous reduce-scatter and all-gather are direct pairwise exchanges
    (groups of 2 and 4 here): the results equal the reference bit for bit (this member's part, then the
    peers' in member order), with several in flight waited in reverse order; reduce-scatters only where
    the host's ranks fill its cores; with the exchanges turned off, gloo's collectives give the same (bit for bit over two members, where one add commutes; within
    round-off over four, whose ring sums in another order)."""
    for r in world(4, _exchanges):
        assert all(all(checks) for checks in r["on"]), r
        assert all(all(checks) for checks in r["off"] + r["spare"]), r
        # with the cores filled: 2 reduce-scatters per case and 2 all-gathers per sum; with one to spare
        # the all-gathers alone; turned off, none
        assert r["posted"] == (3 * 2, 5 * 2 + 3 * 2, 0) and set(r["names"]) == {"all_gather"}, r
