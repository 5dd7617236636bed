"""Collectives through shared memory (``comm/shm.py``) on real gloo ranks of one host, and the
channel's failures in one process.

References are plain torch ops on the full tensors (same seed on every rank): members' values
folded in member order — over two members exactly gloo's ``a + b``."""

from __future__ import annotations

import glob
import mmap
import os
import subprocess
import time

import pytest
import torch

from shardlib.comm import core as comm
from shardlib.comm import shm
import torch.distributed as dist

SHAPE = {"data": 2, "tensor": 2}
FOLD = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
CASES = [("data", torch.float32, "sum"), ("tensor", torch.bfloat16, "sum"), ("data", torch.int64, "sum"),
         ("tensor", torch.float32, "max"), ("data", torch.float64, "min"), (("tensor", "data"), torch.float32, "sum")]
pytestmark = pytest.mark.skipif(not shm.supported(), reason="the shared-memory channel runs on x86-64 Linux only")


def _values(seed: int, world: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, n, generator=g) * 100
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


def _channels(mesh) -> list:
    return [ch for ch in mesh.__dict__.get("_shm_channels", {}).values() if ch is not None]


def _collectives() -> dict:
    """Every case as an all-reduce in place, an all-gather in place and a reduce-scatter in place (all
    synchronous); then asynchronous all-reduces, more than ``SLOTS`` in flight on one group waited in
    reverse order; then one input of several slots (split into pieces) of each kind; then all again
    with the channel off (gloo's). Returns, per pass, the results and the collectives the channels took."""
    from shardlib.testing import get_mesh
    mesh = get_mesh(SHAPE)
    rank, issued, real = mesh.rank, [], shm.Channel.issue

    def spy(self, kind, *a):
        issued.append(kind)
        return real(self, kind, *a)

    def run() -> tuple[list, list]:
        start, out = len(issued), []
        for t, (axes, dtype, op) in enumerate(CASES):
            members = mesh.group_ranks(rank, mesh.canonical_axes(axes))
            i, k, c = members.index(rank), len(members), 3 + t
            x = _values(100 + t, mesh.size, k * c, dtype)
            mine = x[rank].clone()
            ar = comm.all_reduce(mine, mesh, axes, op=op, inplace=True).clone()
            buf = torch.zeros(k * c, dtype=dtype)
            buf[i * c:(i + 1) * c] = x[rank][:c]
            ag = comm.all_gather(buf[i * c:(i + 1) * c], mesh, axes, out=buf)
            inp = x[rank].clone()
            rs = comm.reduce_scatter(inp, mesh, axes, op=op, out=inp[i * c:(i + 1) * c])
            out.append((ar, ag.clone(), rs.clone(), ag.data_ptr() == buf.data_ptr(),
                        rs.data_ptr() == inp.data_ptr() + i * c * inp.element_size()))
        xs = [_values(200 + j, mesh.size, 3 + j, torch.float32) for j in range(shm.SLOTS + 3)]
        pend = [comm.all_reduce(x[rank], mesh, "data", async_op=True) for x in xs]
        out.append([p.wait().clone() for p in reversed(pend)][::-1])
        n = 3 * shm.SLOT_BYTES // 4 + 5          # pieces of every kind, the last one short
        big = _values(300, mesh.size, 2 * n, torch.float32)
        i = mesh.group_index(rank, ("data",))
        out.append((comm.all_reduce(big[rank], mesh, "data", async_op=True).wait(),
                    comm.all_gather(big[rank][:n], mesh, "data"),
                    comm.reduce_scatter(big[rank], mesh, "data", async_op=True).wait(), i))
        return out, issued[start:]

    from shardlib.comm import pairwise
    filled = pairwise.cores_filled

    def cores_filled(value: bool) -> None:
        """What the group's members agreed at set-up (channels made later, and those made already)."""
        pairwise.cores_filled = lambda: value
        for ch in _channels(mesh):
            ch.filled = value

    shm.Channel.issue = spy
    try:
        cores_filled(True)         # this host's ranks fill its cores (4 ranks on 2: the reference machine)
        on, kinds_on = run()
        # with a core to spare, an asynchronous reduce-scatter stays gloo's (it folds on gloo's thread beside
        # the caller's work); a synchronous one, and an asynchronous all-reduce, take the channel
        cores_filled(False)
        x = _values(400, mesh.size, 8, torch.float32)
        start = len(issued)
        spare = [comm.reduce_scatter(x[rank].clone(), mesh, "data", async_op=True).wait(),
                 comm.reduce_scatter(x[rank].clone(), mesh, "data"),
                 comm.all_reduce(x[rank], mesh, "data", async_op=True).wait()]
        kinds_spare = issued[start:]
        os.environ["SHARDLIB_SHM"] = "0"
        off, kinds_off = run()
    finally:
        shm.Channel.issue = real
        cores_filled(filled())
        pairwise.cores_filled = filled
        os.environ.pop("SHARDLIB_SHM", None)
    names = [ch.f.name for ch in _channels(mesh)]
    left = [p for name in names for p in glob.glob(f"/dev/shm/{name}-*")]
    # a mesh's channels close with it (torch keeps its process groups alive)
    import gc
    import weakref

    import shardlib as sl
    other = sl.Mesh(SHAPE)
    comm.all_reduce(torch.ones(3), other, "data")
    held = [weakref.ref(ch) for ch in _channels(other)]
    del other
    gc.collect()
    closed = bool(held) and all(r() is None for r in held)
    return {"on": on, "off": off, "kinds": (kinds_on, kinds_off), "left": left, "spare": (spare, kinds_spare),
            "closed": closed,
            "members": {
        repr(axes): mesh.group_ranks(rank, mesh.canonical_axes(axes)) for axes, _, _ in CASES}}


def test_collectives_through_shared_memory_equal_the_reference_and_gloo(world):
    """On one host, gloo groups' all-reduces, all-gathers and reduce-scatters (sync and async, in place,
    sum/max/min, fp32/bf16/fp64/int64, groups of 2 and 4) go through shared memory: every member gets
    the members' values folded in member order, the same bits on every member; over two members gloo's
    own result bit for bit, over four gloo's within round-off; more than ``SLOTS`` in flight complete
    whatever order they are waited in; inputs of several slots go in pieces; on a host with cores to spare
    an asynchronous reduce-scatter keeps gloo; ``SHARDLIB_SHM=0`` keeps gloo; no file stays in /dev/shm; a mesh's
    channels close when the mesh is collected."""
    results = world(4, _collectives)
    for r, res in enumerate(results):
        n_cases = len(CASES)
        kinds_on, kinds_off = res["kinds"]
        assert kinds_on == ["ar", "ag", "rs"] * n_cases + ["ar"] * (shm.SLOTS + 3) + ["ar", "ag", "rs"], kinds_on
        assert kinds_off == [] and res["left"] == [] and res["closed"], res
        (rs_async, rs_sync, ar_async), kinds_spare = res["spare"]
        assert kinds_spare == ["rs", "ar"], kinds_spare
        x = _values(400, 4, 8, torch.float32)
        dm = res["members"][repr("data")]
        i = dm.index(r)
        assert torch.equal(rs_async, rs_sync) and torch.equal(rs_sync, (x[dm[0]] + x[dm[1]])[i * 4:(i + 1) * 4])
        assert torch.equal(ar_async, x[dm[0]] + x[dm[1]])
        for t, (axes, dtype, op) in enumerate(CASES):
            members = res["members"][repr(axes)]
            k, c = len(members), 3 + t
            i = members.index(r)
            x = _values(100 + t, 4, k * c, dtype)
            want = x[members[0]]
            for m in members[1:]:
                want = FOLD[op](want, x[m])
            ar, ag, rs, ag_in_place, rs_in_place = res["on"][t]
            assert ar.dtype == dtype and ag_in_place and rs_in_place
            assert torch.equal(ar, want), (r, t, ar, want)
            assert torch.equal(ag, torch.cat([x[m][:c] for m in members])), (r, t)
            assert torch.equal(rs, want[i * c:(i + 1) * c]), (r, t)
            assert torch.equal(ar, results[members[0]]["on"][t][0])      # every member: the same bits
            off = res["off"][t]
            assert torch.equal(off[1], ag)
            for a, b in ((off[0], ar), (off[2], rs)):
                if k == 2 or op != "sum":
                    assert torch.equal(a, b), (r, t)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
        dm = res["members"][repr("data")]
        for j, (a, b) in enumerate(zip(res["on"][n_cases], res["off"][n_cases])):
            x = _values(200 + j, 4, 3 + j, torch.float32)
            assert torch.equal(a, x[dm[0]] + x[dm[1]]) and torch.equal(a, b), (r, j)
        big = _values(300, 4, 2 * (3 * shm.SLOT_BYTES // 4 + 5), torch.float32)
        n = big.shape[1] // 2
        (ar, ag, rs, i), (ar_off, ag_off, rs_off, _) = res["on"][-1], res["off"][-1]
        assert torch.equal(ar, big[dm[0]] + big[dm[1]]) and torch.equal(ar, ar_off)
        assert torch.equal(ag, torch.cat([big[m][:n] for m in dm])) and torch.equal(ag, ag_off)
        assert torch.equal(rs, ar[i * n:(i + 1) * n]) and torch.equal(rs, rs_off)


def _lonely_channel(peer_pid: int, timeout: float) -> shm.Channel:
    """A two-member channel whose other member never arrives (anonymous maps: nothing shared)."""
    size = 4096 + shm.SLOTS * shm.SLOT_BYTES
    return shm.Channel(shm.Files(0, 2, [mmap.mmap(-1, size), mmap.mmap(-1, size)], [os.getpid(), peer_pid], timeout))


def test_a_peer_that_is_gone_or_silent_fails_the_wait_naming_it():
    """A member whose peer's process has exited fails within about a second, naming the peer's pid; one
    whose peer lives but never arrives fails at the group's timeout — neither hangs; both raise what
    gloo raises for a lost peer (``DistBackendError``, a ``RuntimeError``)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    x = torch.ones(4)
    op = _lonely_channel(dead.pid, timeout=60.0).issue("ar", x, x, "sum", x)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=rf"member 1 \(pid {dead.pid}\) exited"):
        op.wait()
    assert time.monotonic() - start < 10
    op = _lonely_channel(os.getpid(), timeout=1.5).issue("ar", x, x, "sum", x)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"did not arrive at piece #1 within 2 s"):
        op.wait()
    assert 1.5 <= time.monotonic() - start < 10


def _set_up_refusals_and_modes() -> dict:
    """Fresh groups {0, 1} and {2, 3}: rank 1's /dev/shm has no room (``_room`` says no), rank 3 cannot
    reserve its file's pages (``posix_fallocate`` fails, as on a full tmpfs). Then fresh groups again,
    first used under ``torch.inference_mode()``, then outside it and on a tensor that requires grad."""
    import torch.distributed as dist
    rank = dist.get_rank()

    def total(group, x: torch.Tensor) -> torch.Tensor:
        issued = shm.all_reduce(x, "sum", group)
        if issued is None:                 # the group kept gloo: what core does then
            dist.all_reduce(x, group=group)
            return x
        return issued.wait()

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]     # every rank takes part in both
    group = groups[rank // 2]
    room, fallocate = shm._room, os.posix_fallocate

    def no_space(*a):
        raise OSError(28, "No space left on device")

    if rank == 1:
        shm._room = lambda nbytes: False
    if rank == 3:
        os.posix_fallocate = no_space
    try:
        refused = total(group, torch.full((5,), float(rank + 1))).tolist()
    finally:
        shm._room, os.posix_fallocate = room, fallocate
    fresh = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    with torch.inference_mode():
        first = total(fresh, torch.full((3,), float(rank + 1))).tolist()
    y = (torch.full((3,), float(rank + 1), requires_grad=True) * 2).contiguous()
    later = total(fresh, y)
    return {"channels": (shm._CHANNELS[group] is not None, shm._CHANNELS[fresh] is not None), "refused": refused,
            "first": first, "later": later.detach().tolist()}


def test_set_up_refusals_keep_the_whole_group_on_gloo_and_modes_do_not_break_it(world):
    """A member whose /dev/shm cannot hold the group's files — no room, or its pages cannot be reserved —
    says so in the set-up's collective: every member of that group keeps gloo (no member waits on a
    channel its peer lacks), and the sums are right. A group first used under inference mode takes the
    channel and keeps working outside it, on a tensor that requires grad too (the channel's fold is
    outside autograd, as gloo's is: the result keeps the tensor's own history)."""
    res = world(4, _set_up_refusals_and_modes)
    assert [r["channels"] for r in res] == [(False, True)] * 4, res
    assert [r["refused"] for r in res] == [[3.0] * 5] * 2 + [[7.0] * 5] * 2, res
    assert [r["first"] for r in res] == [[3.0] * 3] * 2 + [[7.0] * 3] * 2, res
    assert [r["later"] for r in res] == [[6.0] * 3] * 2 + [[14.0] * 3] * 2, res


def test_a_full_dev_shm_is_an_error_that_names_the_fix(monkeypatch, tmp_path):
    """A member reserves its slots' pages before its first write there: when /dev/shm has filled up since
    the set-up, the collective raises what gloo raises for a lost peer, naming the fixes (a larger
    /dev/shm, or SHARDLIB_SHM=0) — not a SIGBUS that kills the rank without a word."""
    ch = _lonely_channel(os.getpid(), timeout=60.0)
    ch.f.fd = os.open(tmp_path / "slots", os.O_CREAT | os.O_RDWR)

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    x = torch.ones(4)
    with pytest.raises(dist.DistBackendError, match=r"no room .*No space left on device.*--shm-size.*SHARDLIB_SHM=0"):
        ch.issue("ar", x, x, "sum", x)
    os.close(ch.f.fd)

