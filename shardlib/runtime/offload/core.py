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
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn

from ...planner.offload import DISK_RESIDENT, disk_chunk_elems
from .files import DiskStore, OffloadError
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


class DiskOptimizer(OptimizerOffload):
    """The ``disk`` kind: masters and per-element optimizer state in ``DiskStore`` files, streamed
    through the update chunk by chunk."""

    kind = "disk"

    def __init__(self, engine, offload_dir: str, *, chunk_elems: int | None = None):
        super().__init__(engine)
        plan = engine.plan
        slots = 1 + plan.optimizer_state_bytes // 4     # the master, then the moments (fp32 each)
        self.slots = slots
        self.store = DiskStore(offload_dir, engine.mesh.rank, [s.master.numel() for s in self.states], slots)
        self.shapes = [tuple(s.master.shape) for s in self.states]
        total = sum(s.master.numel() for s in self.states)
        self.chunk = chunk_elems or disk_chunk_elems(total)
        self.keys: dict[int, list[str]] = {}          # per state: its element-state keys, in slot order
        self.scalars: dict[int, dict] = {}            # per state: its per-parameter scalars (step counts)
        self.timeline: list[tuple[str, int, float, float]] = []
        self._depth = 0
        self._data: torch.Tensor | None = None
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="shardlib-offload-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="shardlib-offload-write")
        # at rest a master holds no values: its shape over one shared element (gradients can be set on it)
        self.placeholder = torch.zeros((), dtype=torch.float32, device=HOST)
        for i, s in enumerate(self.states):            # the initial masters to the current generation
            self.store.write(self.store.current, i, 0, 0, s.master.detach().view(-1))
            self._rest(i)

    def _rest(self, i: int) -> None:
        self.states[i].master.data = self.placeholder.expand(self.shapes[i])

    def held(self) -> int:
        """Bytes of one generation of this rank's states on disk (the planned ``disk`` bytes)."""
        return self.store.gen_bytes

    # ---- the chunked update ------------------------------------------------------------------------
    def _chunks(self, live: list[int]) -> list[list[tuple[int, int, int]]]:
        """``[(state index, lo, hi), ...]`` per chunk: the live states' elements in order, at most
        ``chunk`` per chunk."""
        out, cur, room = [], [], self.chunk
        for i in live:
            n, lo = self.store.sizes[i], 0
            while lo < n:
                k = min(room, n - lo)
                cur.append((i, lo, lo + k))
                lo += k
                room -= k
                if room == 0:
                    out.append(cur)
                    cur, room = [], self.chunk
        if cur:
            out.append(cur)
        return out

    def _read(self, gen: int, chunk: list[tuple[int, int, int]], known: dict[int, list[str]], t0: float, c: int,
              pool: torch.Tensor):
        """Chunk ``c``'s masters and moments from generation ``gen``, read into its ring buffer of
        ``pool`` (``[DISK_RESIDENT, slots, chunk]``: chunk ``c`` takes row ``c % DISK_RESIDENT``, whose
        previous chunk's write is done by then — ``step`` waits each write two chunks later)."""
        start = time.perf_counter()
        out, off, ring = [], 0, pool[c % DISK_RESIDENT]
        for i, lo, hi in chunk:
            slots = 1 + len(known.get(i, ()))
            bufs = [ring[k, off:off + hi - lo] for k in range(slots)]
            off += hi - lo
            for k, b in enumerate(bufs):
                self.store.read(gen, i, k, lo, b)
            self.copies.add("disk_read", "optimizer", slots * (hi - lo) * 4)
            out.append(bufs)
        self.timeline.append(("read", c, start, time.perf_counter()))
        return out

    def _write(self, gen: int, chunk, bufs, t0: float, c: int) -> None:
        start = time.perf_counter()
        for (i, lo, _), bs in zip(chunk, bufs):
            for k, b in enumerate(bs):
                self.store.write(gen, i, k, lo, b)
            self.copies.add("disk_write", "optimizer", sum(b.numel() for b in bs) * 4)
        self.timeline.append(("write", c, start, time.perf_counter()))

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        states = self.states
        grads = {i: s.master.grad for i, s in enumerate(states)}
        live = [i for i, g in grads.items() if g is not None]
        for s in states:
            s.master.grad = None
        chunks = self._chunks(live)
        old, new = self.store.current, 1 - self.store.current
        t0 = time.perf_counter()
        self.timeline = []
        before = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.scalars.get(i, {}).items()}
                  for i in live}
        after: dict[int, dict] = {}
        known = dict(self.keys)           # the element state that exists before this step (none before the first)
        # read-ahead two chunks deep: the reader thread always has the next read queued
        # the chunks' buffers: one allocation a step (handed back to the kernel when the step ends), never
        # more than DISK_RESIDENT chunks — two read ahead, the one updated, two written behind
        pool = torch.empty(min(DISK_RESIDENT, len(chunks)), self.slots, max((sum(h - l for _, l, h in ch)
                                                                              for ch in chunks), default=0))
        reads = [self.reader.submit(self._read, old, chunks[c], known, t0, c, pool) for c in range(min(2, len(chunks)))]
        writes = []
        published: list[tuple[int, int, int]] = []
        failure = None
        try:
            for c, chunk in enumerate(chunks):
                waited = time.perf_counter()
                bufs = reads[c].result()
                reads[c] = None                   # (a done future keeps its result: the chunk would stay)
                self.timeline.append(("wait", c, waited, time.perf_counter()))
                if c + 2 < len(chunks):
                    reads.append(self.reader.submit(self._read, old, chunks[c + 2], known, t0, c + 2, pool))
                start = time.perf_counter()
                for (i, lo, hi), bs in zip(chunk, bufs):
                    s = states[i]
                    s.master.data = bs[0]
                    s.master.grad = grads[i].view(-1)[lo:hi]
                    st = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in before[i].items()}
                    st.update(zip(known.get(i, ()), bs[1:]))
                    optimizer.state[s.master] = st
                optimizer.step()
                for (i, lo, hi), bs in zip(chunk, bufs):
                    s = states[i]
                    st = optimizer.state.pop(s.master)
                    keys = [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0
                            and v.numel() == hi - lo]
                    self._check_keys(i, keys, optimizer)
                    bs[1:] = [st[k] for k in self.keys[i]]
                    after[i] = {k: v for k, v in st.items() if k not in self.keys[i]}
                    self._publish(s, bs[0], lo)
                    published.append((i, lo, hi))
                    s.master.grad = None
                    self._rest(i)
                self.timeline.append(("update", c, start, time.perf_counter()))
                writes.append(self.writer.submit(self._write, new, chunk, bufs, t0, c))
                del bufs
                if len(writes) > 1:
                    writes[-2].result()
            for w in writes:
                w.result()
        except OSError as e:
            failure = e
        if failure is not None:
            for f in [f for f in reads + writes if f is not None]:   # the threads settle before anything goes back
                try:
                    f.result()
                except OSError:
                    pass
            if self.engine.params_offload is not None:
                self.engine.params_offload.abort()        # the device holds no shards at rest: nothing to put back
            else:
                self._roll_back(old, published)
            for i, g in grads.items():
                states[i].master.grad = g
            raise OffloadError(
                f"step: the offloaded optimizer state could not be {'written' if writes else 'read'} under "
                f"{self.store.folder} — {failure}. The step was not applied: the parameters and the optimizer "
                "state are those of the previous step. Free space or fix the disk under offload_dir, then step "
                "again (or resume from the last checkpoint).") from None
        self.scalars.update(after)
        self.store.current = new
        if self.engine.params_offload is not None:
            self.engine.params_offload.commit()
        for i, g in grads.items():
            states[i].master.grad = g                # the engine releases them as without offload
        self._finish_publish()

    def _check_keys(self, i: int, keys: list[str], optimizer) -> None:
        known = self.keys.get(i)
        if known is None:
            if 1 + len(keys) > self.slots:
                raise OffloadError(
                    f"step: {type(optimizer).__name__} keeps {len(keys)} per-element tensors per parameter "
                    f"({', '.join(keys)}), but the plan reserved {self.slots - 1} on disk (optimizer_state_bytes="
                    f"{4 * (self.slots - 1)}) — expected the optimizer the plan was made for. Plan with "
                    f"optimizer_state_bytes={4 * len(keys)}.")
            self.keys[i] = keys
        elif set(keys) != set(known):
            raise OffloadError(f"step: the optimizer's per-element state changed from {known} to {keys} — "
                               "expected the same tensors every step.")

    def _roll_back(self, gen: int, published: list[tuple[int, int, int]]) -> None:
        """The device copies updated before a failure, put back from generation ``gen`` (the last
        complete one)."""
        for i, lo, hi in published:
            buf = torch.empty(hi - lo, dtype=torch.float32)
            self.store.read(gen, i, 0, lo, buf)
            self.device_piece(self.states[i])[lo:hi].copy_(buf)

    # ---- outside the step: the current generation mapped ---------------------------------------------
    @contextmanager
    def mapped(self):
        """The masters and their element state as file-backed tensors of the current generation (read
        and written in place); on exit state a caller created (a checkpoint load) is written into the
        file, the scalars kept, and the mapping dropped."""
        if self._depth:                  # re-entrant: the outer mapping serves
            yield
            return
        opt = self.engine.optimizer
        gen = self.store.current
        data = self.store.map(gen)
        self._data = data
        self._depth += 1
        try:
            for i, s in enumerate(self.states):
                shape = self.shapes[i]
                s.master.data = self.store.view(data, i, 0).view(shape)
                st = dict(self.scalars.get(i, {}))
                for k, key in enumerate(self.keys.get(i, ()), start=1):
                    st[key] = self.store.view(data, i, k).view(shape)
                if st:
                    opt.state[s.master] = st
            yield
        finally:
            self._depth -= 1
            for i, s in enumerate(self.states):
                st = opt.state.pop(s.master, {})
                shape = self.shapes[i]
                keys = list(self.keys.get(i, []))
                fresh = [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in keys
                         and v.numel() == self.store.sizes[i]]
                if fresh:
                    self._check_keys(i, keys + fresh, opt)
                for k, key in enumerate(self.keys.get(i, ()), start=1):
                    v = st.get(key)
                    dst = self.store.view(data, i, k).view(shape)
                    if v is not None and v.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr():
                        dst.copy_(v.view(shape))
                self.scalars[i] = {k: v for k, v in st.items() if k not in self.keys.get(i, ())}
                self._rest(i)
            self._data = None
            del data

    def fresh(self, s: ParamState, key: str) -> torch.Tensor | None:
        """Inside ``mapped()``: state ``key`` of ``s`` that does not exist yet, as a zeroed file-backed view
        of its slot (a checkpoint load fills it in place: nothing of it in the process's memory)."""
        if not self._depth or self._data is None:
            return None
        i = self.states.index(s)
        keys = self.keys.get(i, [])
        if key not in keys:
            if 1 + len(keys) + 1 > self.slots:
                return None                       # more state than reserved: the caller's tensor, checked on exit
            self.keys[i] = keys = keys + [key]
        view = self.store.view(self._data, i, 1 + keys.index(key)).view(self.shapes[i])
        view.zero_()
        return view

    def close(self) -> None:
        self.reader.shutdown()
        self.writer.shutdown()
        self.store.close()
