"""Offloaded optimizer states (``sl.plan(offload={"optimizer": "host" | "disk"})``): ZeRO-Offload's
update on the host, ZeRO-Infinity's states in files.

**What moves.** Each trainable parameter's fp32 master (its piece under ZeRO) and the optimizer's
per-element state (Adam's moments) live in the optimizer's memory kind, and so do the gradient shards
the update reads where they persist (ZeRO-2/3; under ``disk`` they stay on the host). The device keeps
the compute-dtype copies it computes with — also in fp32, where without offload the master *is* the
parameter: the two are separate tensors here.

**The schedule.** Backward's gradients leave the device as their bucket (ZeRO-2) or unit (ZeRO-3) is
reduced, during backward, each reduced piece copied into its host gradient shard (``copies``
counts ``d2h``); DP and ZeRO-1 keep gradients on the device until the update, which copies each
reduced gradient out. The norm for clipping is computed where the gradients are. The update runs
on the host (``torch.optim.AdamW(fused=True)`` is the fastest CPU path: ``benchmarks/bench_cpu_adam.py``),
and each updated master is copied back into the device's compute copy (``h2d``) — under ZeRO-1/2
into this rank's piece of the full parameter, which the bucket all-gather then spreads.

**Disk.** ``DiskStore`` (``runtime/offload/files.py``): one file set per rank under ``offload_dir``, two generations preallocated
(a step reads the last one and writes the next; the last stays whole until every write of the step
is done, so a failed write leaves the state of the previous step, and the device copies are put
back from it). The update streams: the masters and moments are cut into chunks of at most
``chunk_elems`` elements (a parameter's piece may span several), a reader thread reads chunk ``i+1``
and ``i+2`` while chunk ``i`` is updated (read-ahead), a writer thread writes chunk ``i`` while ``i+1``
is (write-behind): at most five chunks are resident (of 64 or more), never the whole state. The
optimizer is stepped on one chunk at a time, its tensors swapped in; an elementwise optimizer gives the same values as
one step over the whole tensor — its per-parameter scalars (Adam's step count) are taken from before
the step for every chunk of a parameter. ``timeline`` records each chunk's read, update and write
and how long the update waited for each read (``perf_counter`` seconds) for the benchmark. Outside
the step (checkpoints, ``gathered()``, ``load_pretrained``) ``engine.offload_mapped()`` maps the current generation: the masters and
moments become file-backed tensors (page cache, not the process's anonymous memory), read and
written in place.

On a machine without an accelerator the host is the device's memory: the host path runs and its
copies are counted, nothing is saved; ``disk`` does free memory.

**Delayed** (``sl.plan(..., offload={"optimizer": "host"}, delayed=True)``, DeepSpeed's delayed parameter
update): the host update of step ``t`` runs on a thread beside step ``t+1``'s forward and backward, which
compute with the parameters of update ``t-1``; step ``t+1`` waits for it after its backward (before its own
gradients reach the masters), publishes it, then starts its own. So ``w_t = w_{t-1} - U(g_t)`` with ``g_t`` taken
at ``w_{t-2}`` (``w_{-1} = w_0``). The update reads its own copy of the gradients the next backward overwrites
(ZeRO-2/3's host gradient shards: one more gradient shard on the host while it runs). Every access outside the
step (``offload_mapped``: checkpoints, ``full_state_dict``) finishes the update in flight first.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn

from .streamed import StreamedUpdate
from ..state import ParamState

HOST = torch.device("cpu")


class Copies:
    """The bytes a step moved between memory kinds: ``(op, what) -> [bytes, count]`` with ``op`` in
    ``d2h``, ``h2d`` (device <-> host), ``disk_read``, ``disk_write`` (host <-> disk)."""

    def __init__(self):
        self.step: dict[tuple[str, str], list[int]] = {}
        self._lock = threading.Lock()

    def add(self, op: str, what: str, nbytes: int) -> None:
        with self._lock:
            e = self.step.setdefault((op, what), [0, 0])
            e[0] += nbytes
            e[1] += 1

    def reset(self) -> None:
        self.step = {}

    def totals(self) -> dict[tuple[str, str], int]:
        return {k: v[0] for k, v in self.step.items()}


_TRIM = None


def release_host_heap() -> None:
    """Hand the host memory a step freed back to the kernel (glibc's ``malloc_trim``): the update's chunks,
    read and write buffers and the optimizer's temporaries are freed into malloc's heaps (the reader
    thread's arena among them), where they would stay resident — the process would hold what the plan
    says left it. A no-op where the C library has no ``malloc_trim``."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        try:
            _TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


def host_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of ``t`` (pinned where an accelerator can copy from it asynchronously)."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=HOST,
                      pin_memory=torch.cuda.is_available() and t.device.type == "cuda")
    out.copy_(t)
    return out


class OptimizerOffload:
    """The ``host`` kind (and the base of ``disk``): masters, moments and gradient shards on the host."""

    kind = "host"

    def __init__(self, engine):
        self.engine = engine
        self.copies: Copies = engine.copies
        # an accelerator copies to and from pinned host buffers asynchronously, on the compute stream;
        # the host reads what arrived after ``sync()``
        self.pinned = engine.mesh.device.type == "cuda"
        plan = engine.plan
        self.states = [s for s in engine.states if s.trainable]
        for s in self.states:
            self._move(s, plan)
        self.streamed = StreamedUpdate(self)     # ZeRO-3's update streamed into the next forward (streamed.py)
        self.stream_update = True                # (False: the update runs whole before the step returns)

    @torch.no_grad()
    def _move(self, s: ParamState, plan) -> None:
        """Give ``s`` a host master of its own (and host gradient shards); the device keeps the
        compute copy — separate from the master even in fp32."""
        piece = s.master.detach()
        if s.shard is not None and s.shard.untyped_storage().data_ptr() == piece.untyped_storage().data_ptr():
            s.shard = piece.clone()                # ZeRO-3 fp32: the shard was the master itself
        master = nn.Parameter(host_like(piece, torch.float32))
        s.master = master
        if s.grad_shard is not None:
            s.grad_shard = torch.zeros(s.grad_shard.shape, dtype=s.grad_shard.dtype, device=HOST,
                                       pin_memory=self.pinned)
            if self.engine.grad_is_master:
                master.grad = s.grad_shard

    # ---- the step ----------------------------------------------------------------------------------
    def to_host(self, g: torch.Tensor) -> torch.Tensor:
        """A device gradient the update reads, copied to the host in fp32 (counted in its own dtype)."""
        self.copies.add("d2h", "grads", g.numel() * g.element_size())
        out = torch.empty(g.shape, dtype=g.dtype, device=HOST, pin_memory=self.pinned)
        out.copy_(g, non_blocking=self.pinned)       # in its own dtype; fp32 on the host after sync()
        return out

    def sync(self) -> None:
        """Wait for the asynchronous device-to-host copies of this step (before the host reads them)."""
        if self.pinned:
            torch.cuda.current_stream(self.engine.mesh.device).synchronize()

    def shard_in(self, s: ParamState, piece: torch.Tensor, add: bool) -> None:
        """A reduced gradient piece (on the device) into ``s``'s host gradient shard."""
        self.copies.add("d2h", "grads", piece.numel() * piece.element_size())
        if add:
            s.grad_shard.add_(piece.to(s.grad_shard.device))
        else:
            s.grad_shard.copy_(piece, non_blocking=self.pinned)

    @property
    def streams(self) -> bool:
        """Whether the update streams into the next forward (``streamed.py``): ZeRO-3 (a unit's device shard is
        the only copy of its values the next step reads, filled by a local copy), the states on the host, no
        delayed update, no pipeline (a stage's units gathered once per step), parameters not offloaded."""
        eng = self.engine
        return (self.stream_update and type(self) is OptimizerOffload and eng.plan.states.params is not None
                and not eng.plan.delayed
                and eng.units is not None and eng.pipe is None and eng.params_offload is None)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.publish_all()
        if self.engine.params_offload is not None:
            self.engine.params_offload.commit()

    # ---- the delayed update (module doc) ---------------------------------------------------------------
    _thread: threading.Thread | None = None
    _failed: BaseException | None = None

    def begin(self, optimizer: torch.optim.Optimizer, then) -> None:
        """Start this step's update (``optimizer.step()``, then ``then()``: the learning-rate schedule) on a
        thread; ``wait`` finishes and publishes it. The gradients it reads are its own: those in storage the
        next backward writes (the host gradient shards) are copied first."""
        kept = {s.grad_shard.untyped_storage().data_ptr() for s in self.states if s.grad_shard is not None}
        for s in self.states:
            g = s.master.grad
            if g is not None and g.untyped_storage().data_ptr() in kept:
                s.master.grad = g.clone()

        def run() -> None:
            try:
                optimizer.step()
                then()
            except BaseException as e:        # noqa: BLE001 — raised by wait() on the engine's thread
                self._failed = e

        self._failed = None
        self._thread = threading.Thread(target=run, name="shardlib-delayed-update", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """A delayed or streamed update is running (or done but not yet joined): it holds the gradients it
        applies."""
        return self._thread is not None or self.streamed.in_flight

    def wait(self) -> bool:
        """Finish the update in flight, if any: a streamed one (joined: it published its units itself); a
        delayed one: join it, drop the gradients it read, and put its values into the device copies (ZeRO-1/2:
        the bucket all-gathers, a collective every rank runs here alike). Returns whether one was in flight."""
        if self.streamed.join():
            self.engine.masters.release()       # the gradients that lived only for the update
            return True
        t = self._thread
        if t is None:
            return False
        self._thread = None
        t.join()
        for s in self.states:
            s.master.grad = None if s.grad_shard is None or not self.engine.grad_is_master else s.grad_shard
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        self.publish_all()
        return True

    @torch.no_grad()
    def publish_all(self) -> None:
        for s in self.states:
            self._publish(s, s.master.detach().view(-1), 0)
        self._finish_publish()

    def publish_one(self, s: ParamState) -> None:
        """``s``'s master into its device copy, not counted (the streamed update counts its copies when it starts)."""
        self._publish(s, s.master.detach().view(-1), 0, count=False)

    def device_piece(self, s: ParamState) -> torch.Tensor:
        """The device tensor (1-D) the master's values go to: ZeRO-3's shard, or this rank's piece of
        the full compute copy (the whole parameter without ZeRO)."""
        if s.shard is not None:
            return s.shard.view(-1)
        return s.local_piece(s.param.data)

    def _publish(self, s: ParamState, values: torch.Tensor, lo: int, count: bool = True) -> None:
        """Elements ``[lo, lo + len(values))`` of ``s``'s master into its device copy (h2d), or into its
        offloaded shard (``runtime/offload/params.py``)."""
        if self.engine.params_offload is not None:
            self.engine.params_offload.publish(s, values, lo, "host")
            return
        dst = self.device_piece(s)[lo:lo + values.numel()]
        dst.copy_(values, non_blocking=self.pinned and values.is_pinned())
        if count:
            self.copies.add("h2d", "params", dst.numel() * dst.element_size())

    def _finish_publish(self) -> None:
        """ZeRO-1/2: every rank updated its piece of the full parameters; the bucket all-gathers
        spread them (from the device pieces)."""
        eng = self.engine
        if eng.plan.states.params is None and eng.plan.states.optim is not None:
            eng.buckets.publish(eng.cdt, source=lambda s: s.local_piece(s.param.data))

    @contextmanager
    def mapped(self):
        self.wait()                  # a delayed update in flight: done before anything reads the states
        yield

    def held(self) -> int:
        return 0

    def fresh(self, s: ParamState, key: str) -> torch.Tensor | None:
        """Where a load puts optimizer state this engine has not created yet: None (allocate it)."""
        return None

    def close(self) -> None:
        pass
