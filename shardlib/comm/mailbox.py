"""Point-to-point messages through shared memory, between neighbours of a group on one host (gloo, CPU).

A pipeline stage sends its output to the next stage and its input's gradient to the previous one: one
message of a few hundred KB each way per micro-batch, on the critical path of both ranks. Through gloo
each costs a socket write and gloo's own thread on both sides (``isend`` ~0.1 ms, ``irecv`` ~0.05 ms
posted inside a step on the reference machine, and the receiving thread's work on a core the other
rank computes on); through the files below it is one copy in and one copy out (``comm/shm.py`` does the
same for collectives, and its ``Files`` are the set-up used here).

**Receiver-driven, like gloo.** A receive is *posted*: the receiver takes a free slot of its own file
(``POSTS`` per neighbour), writes the message's tag and size in the slot's words and raises its post
number; the sender copies a message into the oldest posted slot of its tag and sets the slot's fill
number to that post number. A message whose receive is not posted yet waits in the sender's queue, and
a receive with no free slot waits in the receiver's (both move at the member's next send, receive or
wait, below), so the files hold no message nobody asked for; messages match as gloo's do, by peer and
tag, in order. Waiting spins briefly,
then sleeps on the member's *doorbell* word, which a neighbour rings after filling a slot for it or
posting a receive from it (each neighbour counts in its own 16-bit half, so every header word and half
has one writer); every wait moves the member's queues first and looks again at least every 20 ms, so a
sender blocked on a receive still delivers what its peer asks for meanwhile. A dead neighbour fails a
wait within about a second, a silent one at the group's timeout (``DistBackendError``, what gloo
raises); a message of another size than its receive fails both sides' waits.

**Progress needs a call.** Gloo moves messages on its own thread; here a queued message moves at its
member's next send, receive or wait. The pipeline runtime (the one user that opens mailboxes) always
waits for its sends before anything else can block on its peers, so that is latency only (GPipe at
p = 4: about one queued send per step); a program that sends on an axis with mailboxes open and then
blocks in a collective its receiver needs first must wait for the send before it.

**What takes it.** Messages between ring neighbours (member ``i`` and ``i +/- 1`` mod ``k``: a
pipeline's stages), of CPU tensors that are contiguous and at most ``shm.SLOT_BYTES``, on a group whose
``Mailboxes`` were set up (``open``: collective, by every member alike, as the pipeline runtime does
when it is built), with ``SHARDLIB_SHM`` not ``0``. Sender and receiver decide from what they share
(the pair, the size, the switch), so both pick the same transport; everything else goes through gloo.
Measured: ``benchmarks/bench_pipeline.py`` (``benchmarks/README.md``).
"""

from __future__ import annotations

import collections
import os

import torch

from ..algebra.mesh import Mesh
from ..errors import CollectiveError, ShardingTypeError
from . import shm

POSTS = 8                    # slots a member keeps for messages from each neighbour
_BELL = 24                   # header word (its own cache line): the doorbell, a 16-bit count per neighbour
_SLOTS = 32                  # header word where the slots' words start, 8 (a cache line) per slot
_POST, _FILL, _TAG, _NBYTES = 0, 1, 2, 3


def neighbours(me: int, k: int) -> list[int]:
    """The members ``me`` exchanges with through the files: ``me - 1`` and ``me + 1`` around the group."""
    return sorted({(me - 1) % k, (me + 1) % k} - {me})


def open(group) -> Mailboxes | None:   # noqa: A001 — the module's verb, as shm.Channel.open
    """Set up the group's mailboxes (collective over the group); None on every member where it keeps gloo."""
    k = torch.distributed.get_world_size(group)
    if not 2 <= k <= shm.MAX_MEMBERS:
        return None
    files = shm.Files.open(group, shm._HEADER + 2 * POSTS * shm.SLOT_BYTES)
    return None if files is None else Mailboxes(files)


def open_mailboxes(mesh, axis: str) -> bool:
    """Let ``comm.send``/``comm.recv`` between neighbours along ``axis`` go through the files where the
    group's members share a host. A collective over ``axis`` on every rank, once per mesh (later calls
    return at once; the mesh holds them, so they close with it); True where the group took them."""
    if not isinstance(mesh, Mesh):
        raise ShardingTypeError(f"open_mailboxes: expected a Mesh over running processes — got {type(mesh).__name__}.")
    held = mesh.__dict__.setdefault("_mailboxes", {})
    if axis not in held:
        group = mesh.group((axis,))
        backend = (mesh.backend or "").replace(" ", "")
        gloo = backend == "gloo" or "cpu:gloo" in backend.split(",")      # the CPU's messages on gloo
        held[axis] = open(group) if group is not None and gloo else None  # (Files.open: every host agrees)
    return held[axis] is not None


def takes(box: Mailboxes | None, peer: int, x: torch.Tensor) -> bool:
    """Whether a message of ``x`` to or from group member ``peer`` goes through ``box`` (else gloo)."""
    return (box is not None and peer in box.region and x.device.type == "cpu" and x.is_contiguous()
            and 0 < x.numel() * x.element_size() <= shm.SLOT_BYTES and os.environ.get("SHARDLIB_SHM", "1") != "0")


class _Message:
    __slots__ = ("peer", "tag", "x", "nbytes", "slot", "seq", "done", "error")

    def __init__(self, peer: int, tag: int, x: torch.Tensor):
        self.peer, self.tag, self.x = peer, tag, x
        self.nbytes = x.numel() * x.element_size()
        self.slot = self.seq = None
        self.done = False
        self.error: str | None = None       # set with done: the message could not be delivered


class Handle:
    """A posted send or receive: ``wait()`` completes it and returns its tensor (a send's may then be
    written again; a receive's holds the message)."""

    def __init__(self, box: Mailboxes, msg: _Message):
        self._box, self._msg = box, msg

    def wait(self) -> torch.Tensor:
        if not self._msg.done:
            self._box.complete(self._msg)
        if self._msg.error is not None:
            raise CollectiveError(self._msg.error)
        return self._msg.x

    def is_completed(self) -> bool:
        return self._msg.done


class Mailboxes:
    """One member's side: its slots for each neighbour's messages, its queues of sends and receives."""

    def __init__(self, files: shm.Files):
        self.f, self.me, self.k = files, files.me, files.k
        near = neighbours(self.me, self.k)
        # region (index among the owner's neighbours) of this member's slots for j, and of j's for this one
        self.region = {j: near.index(j) for j in near}
        self.theirs = {j: neighbours(j, self.k).index(self.me) for j in near}
        self.free = {j: list(range(POSTS - 1, -1, -1)) for j in near}
        self.posts = {j: 0 for j in near}
        self.unposted: dict[int, collections.deque[_Message]] = {j: collections.deque() for j in near}
        self.posted: dict[int, list[_Message]] = {j: [] for j in near}
        self.sends: dict[int, collections.deque[_Message]] = {j: collections.deque() for j in near}
        self.reserved = [0] * (2 * POSTS)
        # the doorbells as 16-bit halves: this member rings ``j`` in half ``theirs[j]`` of j's word
        self.bells = [memoryview(m).cast("B")[:shm._HEADER].cast("H") for m in files.maps]
        with torch.inference_mode(False):
            self.data = [[b[shm._HEADER + s * shm.SLOT_BYTES:shm._HEADER + (s + 1) * shm.SLOT_BYTES]
                          for s in range(2 * POSTS)] for b in files.bytes]

    # ---- posting --------------------------------------------------------------------------------
    def send(self, x: torch.Tensor, peer: int, tag: int) -> Handle:
        msg = _Message(peer, tag, x)
        self.sends[peer].append(msg)
        self._push(peer)
        if msg.error is not None:
            raise CollectiveError(msg.error)
        return Handle(self, msg)

    def recv(self, out: torch.Tensor, peer: int, tag: int) -> Handle:
        msg = _Message(peer, tag, out)
        self.unposted[peer].append(msg)
        self._post(peer)
        return Handle(self, msg)

    def complete(self, msg: _Message) -> None:
        """Move the queues until ``msg`` is done; between tries, spin on the doorbell, then sleep on it
        (20 ms at most: every try looks at the slots again). One clock for the whole wait."""
        f, bell = self.f, self.f.heads[self.me]
        sleeper = None
        with shm._unseen():
            while True:
                rung = bell[_BELL]
                for j in self.region:
                    self._push(j)
                    self._take(j)
                    self._post(j)
                if msg.done:
                    return
                for _ in range(shm.SPIN):
                    if bell[_BELL] != rung:
                        break
                else:
                    if sleeper is None:
                        what = (f"to post the receive of tag {msg.tag} (a send of {msg.nbytes} bytes)"
                                if msg in self.sends[msg.peer] else
                                f"to send the message of tag {msg.tag} ({msg.nbytes} bytes)")
                        sleeper = shm.Sleeper(f, msg.peer, what)
                    sleeper.sleep(self.me, _BELL, rung)

    # ---- the slots ------------------------------------------------------------------------------
    @staticmethod
    def _words(region: int, m: int) -> int:
        return _SLOTS + (region * POSTS + m) * 8

    def _ring(self, j: int) -> None:
        half = _BELL * 4 + self.theirs[j]           # this member's 16-bit count in j's doorbell word
        self.bells[j][half] = (self.bells[j][half] + 1) & 0xFFFF
        self.f.wake(j, _BELL)

    def _post(self, j: int) -> None:
        """Publish queued receives from ``j`` into free slots, in order, and ring ``j``."""
        queue, free = self.unposted[j], self.free[j]
        if not queue or not free:
            return
        head, q = self.f.heads[self.me], self.region[j]
        while queue and free:
            self._reserve(q * POSTS + free[-1], queue[0].nbytes)     # before taking them: nothing lost if full
            msg, m = queue.popleft(), free.pop()
            w = self._words(q, m)
            self.posts[j] += 1
            msg.slot, msg.seq = m, self.posts[j]
            head[w + _TAG], head[w + _NBYTES] = msg.tag, msg.nbytes
            head[w + _POST] = msg.seq                 # last: the sender may fill it from here on
            self.posted[j].append(msg)
        self._ring(j)

    def _push(self, j: int) -> None:
        """Copy queued sends to ``j`` into ``j``'s posted slots of their tags (each tag's oldest send into
        its oldest post), and ring ``j``."""
        queue = self.sends[j]
        if not queue:
            return
        head, q = self.f.heads[j], self.theirs[j]
        open_: dict[int, tuple[int, int, int]] = {}
        for m in range(POSTS):
            w = self._words(q, m)
            post, fill = head[w + _POST], head[w + _FILL]
            if post != fill and post != -fill:         # posted, neither filled nor refused (-post: sizes differ)
                tag = head[w + _TAG]
                if tag not in open_ or post < open_[tag][0]:
                    open_[tag] = (post, m, w)
        if not open_:
            return
        filled = False
        for msg in list(queue):
            hit = open_.pop(msg.tag, None)
            if hit is None:
                continue
            post, m, w = hit
            queue.remove(msg)
            msg.done = filled = True
            if head[w + _NBYTES] != msg.nbytes:        # both sides fail: the receive is told by its fill
                msg.error = (f"send to group member {j}, tag {msg.tag}: {msg.nbytes} bytes, but its receive holds "
                             f"{head[w + _NBYTES]} — expected the same shape and dtype on both sides.")
                head[w + _FILL] = -post
                continue
            self.data[j][q * POSTS + m][:msg.nbytes].copy_(msg.x.view(-1).view(torch.uint8))
            head[w + _FILL] = post
        if filled:
            self._ring(j)

    def _take(self, j: int) -> None:
        """Copy out the filled messages from ``j``, free their slots."""
        posted = self.posted[j]
        if not posted:
            return
        head, q = self.f.heads[self.me], self.region[j]
        for msg in list(posted):
            w = self._words(q, msg.slot)
            fill = head[w + _FILL]
            if fill == msg.seq or fill == -msg.seq:
                if fill == msg.seq:
                    msg.x.view(-1).view(torch.uint8).copy_(self.data[self.me][q * POSTS + msg.slot][:msg.nbytes])
                else:
                    msg.error = (f"recv from group member {j}, tag {msg.tag}: the message sent is not of this "
                                 f"receive's {msg.nbytes} bytes — expected the same shape and dtype on both sides.")
                posted.remove(msg)
                self.free[j].append(msg.slot)
                msg.done = True

    def _reserve(self, s: int, nbytes: int) -> None:
        """This member's slot ``s`` reserved (``posix_fallocate``) as far as its messages reach."""
        if nbytes > self.reserved[s]:
            self.f.reserve_range(shm._HEADER + s * shm.SLOT_BYTES, nbytes)
            self.reserved[s] = nbytes
