"""Point-to-point messages through shared memory (``comm/mailbox.py``): two members' mailboxes driven from
one process (anonymous maps shared by both), then real gloo ranks of one host, then a pipeline.

A message must arrive as sent (every dtype, any size up to a slot), matched like gloo's — by peer and tag,
the same tag in order — whatever the order of sends and posted receives, with more receives than slots,
and a send that waits for its receive must still be delivered by the sender's next wait."""

from __future__ import annotations

import mmap
import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from shardlib.comm import core as comm
from shardlib.comm import mailbox, shm
from shardlib.errors import CollectiveError

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the shared-memory channel runs on x86-64 Linux only")


def _pair(pids=None, timeout: float = 5.0) -> list[mailbox.Mailboxes]:
    """Members 0 and 1 of a two-member group in this process, over the same two anonymous maps."""
    size = shm._HEADER + 2 * mailbox.POSTS * shm.SLOT_BYTES
    maps = [mmap.mmap(-1, size), mmap.mmap(-1, size)]
    pids = pids or [os.getpid(), os.getpid()]
    return [mailbox.Mailboxes(shm.Files(i, 2, maps, pids, timeout)) for i in range(2)]


def _msg(seed: int, n: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 100
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


def test_messages_match_by_tag_in_order_whatever_comes_first():
    a, b = _pair()
    # posted first: the send goes straight into the posted slot
    out = torch.empty(5)
    hb = b.recv(out, 0, tag=5)
    x = _msg(0, 5)
    assert a.send(x, 1, tag=5).wait() is x
    assert torch.equal(hb.wait(), x) and hb.wait() is out
    # sent first: queued at the sender until the receive is posted, delivered by the sender's next wait
    y = _msg(1, 3, torch.int64)
    ha = a.send(y, 1, tag=7)
    assert not ha.is_completed()
    hb = b.recv(torch.empty(3, dtype=torch.int64), 0, tag=7)
    ha.wait()
    assert torch.equal(hb.wait(), y)
    # one tag twice: in order, posted before and after the sends
    xs = [_msg(10 + i, 4) for i in range(4)]
    hs = [b.recv(torch.empty(4), 0, tag=3) for _ in range(2)]
    sends = [a.send(x, 1, tag=3) for x in xs]
    hs += [b.recv(torch.empty(4), 0, tag=3) for _ in range(2)]
    for s in sends:
        s.wait()
    assert all(torch.equal(h.wait(), x) for h, x in zip(hs, xs))
    # both ways, every dtype, a whole slot, sizes that are not whole words
    cases = [(torch.bfloat16, 7), (torch.float64, 1), (torch.bool, 3), (torch.uint8, shm.SLOT_BYTES),
             (torch.float32, shm.SLOT_BYTES // 4)]
    for t, (dtype, n) in enumerate(cases):
        x = _msg(20 + t, n, dtype) if dtype != torch.bool else torch.tensor([True, False, True])
        back = a.recv(torch.empty(n, dtype=dtype), 1, tag=100 + t)
        fwd = b.recv(torch.empty(n, dtype=dtype), 0, tag=100 + t)
        b.send(x, 0, tag=100 + t).wait()
        a.send(x, 1, tag=100 + t).wait()
        assert torch.equal(back.wait(), x) and torch.equal(fwd.wait(), x), (dtype, n)


def test_more_receives_than_slots_and_sends_in_reverse_order_all_arrive():
    a, b = _pair()
    n = mailbox.POSTS + 4
    xs = [_msg(i, 6) for i in range(n)]
    recvs = [b.recv(torch.empty(6), 0, tag=i) for i in range(n)]       # the last 4 wait for free slots
    assert [r._msg.slot is None for r in recvs] == [False] * mailbox.POSTS + [True] * 4
    sends = [a.send(xs[i], 1, tag=i) for i in reversed(range(n))]     # tags 11..8 find no posted slot yet
    assert [s.is_completed() for s in sends] == [False] * 4 + [True] * mailbox.POSTS
    assert torch.equal(recvs[0].wait(), xs[0])                         # frees slots: the last 4 are posted
    for s in sends:
        s.wait()                                                       # ... and filled by the sender's wait
    assert all(torch.equal(r.wait(), x) for r, x in zip(recvs, xs))
    assert all(len(q) == 0 for q in (*a.sends.values(), *b.unposted.values(), *b.posted.values()))


def test_a_message_of_another_size_than_its_receive_fails_both_sides_and_nothing_else():
    a, b = _pair()
    bad = b.recv(torch.empty(4), 0, tag=9)
    good = b.recv(torch.empty(2), 0, tag=8)
    a.send(torch.ones(2), 1, tag=8)                                   # filled in the same pass, and rung
    with pytest.raises(CollectiveError, match=r"tag 9: 32 bytes, but its receive holds 16 — expected the same shape"):
        a.send(torch.ones(8), 1, tag=9)
    with pytest.raises(CollectiveError, match=r"recv from group member 0, tag 9: the message sent is not of this "
                                              r"receive's 16 bytes"):
        bad.wait()
    assert torch.equal(good.wait(), torch.ones(2))
    again = b.recv(torch.empty(4), 0, tag=9)                          # the refused slot is free again
    assert a.send(torch.arange(4.0), 1, tag=9).wait() is not None and torch.equal(again.wait(), torch.arange(4.0))
    assert not a.sends[1] and not b.posted[0]


def test_a_fill_nobody_rang_for_is_seen_within_a_few_sleeps_and_a_busy_doorbell_still_times_out():
    """A wait looks at its slots again after every sleep (20 ms at most), so a fill whose ring was lost costs
    milliseconds, not the timeout; and a doorbell rung all the time does not keep a wait from its timeout."""
    import threading
    a, b = _pair(timeout=1.5)
    got = b.recv(torch.empty(3), 0, tag=4)
    ring, a._ring = a._ring, lambda j: None                           # the fill's ring lost
    a.send(torch.ones(3), 1, tag=4)
    a._ring = ring
    start = time.monotonic()
    assert torch.equal(got.wait(), torch.ones(3)) and time.monotonic() - start < 1.0
    stop = threading.Event()

    def chatter():                                                   # a neighbour ringing with nothing for it
        while not stop.is_set():
            a._ring(1)
            time.sleep(0.001)
    t = threading.Thread(target=chatter)
    t.start()
    try:
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError, match=r"did not send the message of tag 5"):
            b.recv(torch.empty(3), 0, tag=5).wait()
        assert 1.5 <= time.monotonic() - start < 10
    finally:
        stop.set()
        t.join()


def test_a_peer_that_is_gone_or_silent_fails_the_wait_naming_it():
    """A send whose receiver's process exited fails within about a second, naming its pid; one whose receiver
    lives but never posts fails at the group's timeout (``DistBackendError``, what gloo raises)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    a, _ = _pair([os.getpid(), dead.pid], timeout=60.0)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=rf"member 1 \(pid {dead.pid}\) exited .*post the receive of tag 1"):
        a.send(torch.ones(4), 1, tag=1).wait()
    assert time.monotonic() - start < 10
    _, b = _pair(timeout=1.5)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"did not send the message of tag 2 \(16 bytes\) within 2 s"):
        b.recv(torch.empty(4), 0, tag=2).wait()
    assert 1.5 <= time.monotonic() - start < 10


STEPS = (1, -1, 2)     # to the next rank, the previous one, the one across (not a neighbour)


def _ring() -> dict:
    """On a pipe axis of 4: each rank's messages to both neighbours (several dtypes, posted in the reverse
    order of the sends), to the rank across (not a neighbour: gloo), and one larger than a slot (gloo);
    then the same with the mailboxes off. Returns what arrived and how many went through the files."""
    from shardlib.testing import get_mesh
    mesh = get_mesh({"pipe": 4})
    assert comm.open_mailboxes(mesh, "pipe") and comm.open_mailboxes(mesh, "pipe")     # once per mesh
    me = mesh.coord(mesh.rank, "pipe")
    through, real = [], mailbox.Mailboxes.send

    def spy(self, x, peer, tag):
        through.append((peer, tag))
        return real(self, x, peer, tag)

    mailbox.Mailboxes.send = spy
    dtypes = [torch.float32, torch.bfloat16, torch.int64]
    out = {}
    try:
        for switch in ("1", "0"):
            os.environ["SHARDLIB_SHM"] = switch
            start = len(through)
            plan = [((me + d) % 4, (me - d) % 4, 10 * k + t, dtype, n)
                    for k, d in enumerate(STEPS, 1) for t, (dtype, n) in enumerate(zip(dtypes, (5, 64, 3)))]
            plan.append(((me + 1) % 4, (me - 1) % 4, 99, torch.float32, shm.SLOT_BYTES // 4 + 1))
            recvs = [(src, tag, comm.recv(torch.empty(n, dtype=dtype), mesh, "pipe", src, tag=tag))
                     for _, src, tag, dtype, n in reversed(plan)]
            sends = [comm.send(_msg(100 * me + tag, n, dtype), mesh, "pipe", dst, tag=tag)
                     for dst, _, tag, dtype, n in plan]
            got = {(src, tag): r.wait() for src, tag, r in recvs}
            for s in sends:
                s.wait()
            out[switch] = {"got": got, "through": through[start:]}
    finally:
        os.environ.pop("SHARDLIB_SHM", None)
        mailbox.Mailboxes.send = real
    return {"me": me, **out}


def test_neighbours_messages_go_through_the_files_and_arrive_as_sent(world):
    for got in world(4, _ring):
        me = got["me"]
        for switch in ("1", "0"):
            res = got[switch]
            for (src, tag), x in res["got"].items():
                d = STEPS[tag // 10 - 1] if tag != 99 else 1
                dtype, n = ([torch.float32, torch.bfloat16, torch.int64][tag % 10], (5, 64, 3)[tag % 10]) \
                    if tag != 99 else (torch.float32, shm.SLOT_BYTES // 4 + 1)
                assert src == (me - d) % 4, (src, tag)
                assert torch.equal(x, _msg(100 * src + tag, n, dtype)), (me, switch, src, tag)
            # the neighbours' small messages only, and none with the switch off
            expect = sorted(((me + d) % 4, 10 * k + t) for k, d in enumerate(STEPS[:2], 1) for t in range(3))
            expect = expect if switch == "1" else []
            assert sorted(res["through"]) == expect, (me, switch, res["through"])


def _pipeline(p: int, schedule: str, v: int) -> dict:
    """The GPT on a pipe axis of ``p`` (``schedule``, ``v`` stages per rank), 3 steps from one seed with the
    mailboxes off (gloo) and on: the losses, the final weights and how many messages the files carried."""
    import shardlib as sl
    from shardlib.testing import get_mesh
    from test_engine_data_parallel import make_optimizer
    from test_pipeline_training import PIPE, batches, make_model
    mesh = get_mesh({"data": 1, "pipe": p})
    data = batches(3)
    carried, real = [], mailbox.Mailboxes.send

    def spy(self, *a):
        carried.append(1)
        return real(self, *a)

    out = {}
    mailbox.Mailboxes.send = spy
    try:
        for switch in ("0", "1"):
            os.environ["SHARDLIB_SHM"] = switch
            model = make_model("gpt_pp")
            plan = sl.plan(model, mesh, rules=PIPE, schedule=schedule, virtual_stages=v, microbatches=4,
                           batch=data[0])
            engine = sl.parallelize(model, plan, optimizer=make_optimizer("adamw"))
            start = len(carried)
            losses = [engine.step(b) for b in data]
            out[switch] = {"losses": losses, "state": engine.full_state_dict(), "carried": len(carried) - start}
    finally:
        os.environ.pop("SHARDLIB_SHM", None)
        mailbox.Mailboxes.send = real
    return out


@pytest.mark.parametrize("p, schedule, v", [(2, "interleaved_1f1b", 2), (4, "1f1b", 1)])
def test_a_pipeline_through_the_files_trains_bit_for_bit_as_through_gloo(world, p, schedule, v):
    for r, got in enumerate(world(p, _pipeline, p, schedule, v)):
        off, on = got["0"], got["1"]
        # every stage's output to the next and input gradient to the previous, per micro-batch and step
        sends = 3 * 4 * sum((s < p * v - 1) + (s > 0) for s in range(r, p * v, p))
        assert off["carried"] == 0 and on["carried"] == sends, (r, off["carried"], on["carried"], sends)
        assert on["losses"] == off["losses"], r
        assert all(torch.equal(on["state"][k], off["state"][k]) for k in off["state"]), r
