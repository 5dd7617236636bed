"""The ``disk`` kind of the optimizer's offload (ZeRO-Infinity's states in files): ``DiskOptimizer``, the
host offload (``core.py``) whose masters and moments live in ``DiskStore`` files and whose update streams them
chunk by chunk — read-ahead, update, write-behind (``core.py``'s module doc, "Disk")."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from ...planner.offload import DISK_RESIDENT, disk_chunk_elems
from .core import HOST, OptimizerOffload
from .files import DiskStore, OffloadError
from ..state import ParamState


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
