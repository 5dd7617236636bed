"""Offloaded ZeRO-3 parameter shards (``sl.plan(zero=3, offload={"params": "host" | "disk"})``):
ZeRO-Infinity's parameter offload.

Under ZeRO-3 a rank holds, at rest, its piece of every unit in the compute dtype (``ParamState.shard``);
with ``params`` offloaded those pieces live on the host or in files and come to the device only to be
all-gathered:

* ``host`` — each shard is a host tensor; a unit's gather packs its pieces into the device's all-gather
  input (``h2d``, counted per gather);
* ``disk`` — each unit's packed all-gather input (its train chunk, then its frozen chunk, padding
  included) lies in the rank's file, two generations like the optimizer's (``runtime/offload/core.py``): a
  gather reads the unit's chunk (``disk_read``) and copies it to the device (``h2d``), and the reader
  thread has already started on the unit after it in the same direction (read-ahead: forward goes up
  the units, backward down). After the update the new pieces are written into the next generation
  (``disk_write``), which becomes the current one once the step is done; the frozen pieces are written
  to both at set-up and never change.

The masters are never the shards here (in fp32 too): the update writes its master pieces into the
shards' kind after the step (``publish``). Outside the step ``mapped()`` gives every shard as a view
of the current generation, file-backed, written through to the other generation on exit.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from .core import HOST, host_like
from .files import DiskStore, OffloadError


class ParamsOffload:
    def __init__(self, engine, kind: str, offload_dir: str | None):
        self.engine, self.kind = engine, kind
        self.copies = engine.copies
        self.cdt = engine.cdt
        runner = engine.units
        self.units = runner.all                     # root first, then in forward order
        self.index = {id(u): k for k, u in enumerate(self.units)}
        self.root = 0 if runner.root is not None else None
        # where each state's piece lies: (unit index, element offset in the unit's packed chunk)
        self.where: dict[int, tuple[int, int]] = {}
        for k, u in enumerate(self.units):
            fl = u.flat
            for states, base in ((fl.train, 0), (fl.frozen, fl.ct)):
                pos = base
                for s in states:
                    self.where[id(s)] = (k, pos)
                    pos += s.hi - s.lo
        for s in engine.states:
            if s.shard is not None and s.master is not None and \
                    s.shard.untyped_storage().data_ptr() == s.master.untyped_storage().data_ptr():
                s.shard = s.shard.clone()               # fp32: the shard was the master itself
        self.placeholder = None
        self._depth = 0
        if kind == "host":
            for s in engine.states:
                if s.shard is not None:
                    s.shard = host_like(s.shard)
            return
        sizes = [u.flat.ct + u.flat.cf for u in self.units]
        self.store = DiskStore(offload_dir, engine.mesh.rank, sizes, 1, dtype=self.cdt, name="params")
        for k, u in enumerate(self.units):
            packed = u.flat.pack(lambda s: s.shard, self.cdt, HOST)
            for gen in (0, 1):
                self.store.write(gen, k, 0, 0, packed)
        self.placeholder = torch.zeros((), dtype=self.cdt, device=HOST)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="shardlib-offload-params")
        self.pending: dict[int, object] = {}      # unit index -> its read in flight
        self.last = None                          # the unit gathered last (the direction of travel)
        self.written: set[int] = set()            # trainable states published into the next generation
        self.timeline: list[tuple[str, int, float, float]] = []
        self._rest()

    def _rest(self) -> None:
        for s in self.engine.states:
            if s.shard is not None:
                s.shard = self.placeholder.expand(s.hi - s.lo)

    # ---- gathers -----------------------------------------------------------------------------------
    def packed(self, u, device, out: torch.Tensor | None = None) -> torch.Tensor:
        """``u``'s all-gather input on the device (written into ``out`` where given)."""
        fl = u.flat
        if self.kind == "host":
            out = fl.pack(lambda s: s.shard, self.cdt, device, out=out)
            self.copies.add("h2d", "params", sum(s.hi - s.lo for s in fl.train + fl.frozen) * self.cdt.itemsize)
            return out
        k = self.index[id(u)]
        fut = self.pending.pop(k, None)
        waited = time.perf_counter()
        host = fut.result() if fut is not None else self._read(k)
        self.timeline.append(("wait params", k, waited, time.perf_counter()))
        # read-ahead in the direction of travel (forward up the units, backward down; the same unit again
        # turns it: backward begins where forward ended); never the root, gathered once from forward's
        # start to backward's end
        nxt = k + (1 if self.last is None or k > self.last else -1)
        self.last = k
        if (0 <= nxt < len(self.units) and nxt != self.root and nxt not in self.pending
                and self.units[nxt].group == u.group):          # (a pipeline stage's units only)
            self.pending[nxt] = self.reader.submit(self._read, nxt)
        if out is None:
            out = torch.empty(host.shape, dtype=self.cdt, device=device)
        out.copy_(host)
        self.copies.add("h2d", "params", host.numel() * host.element_size())
        return out

    def _read(self, k: int) -> torch.Tensor:
        start = time.perf_counter()
        buf = torch.empty(self.store.sizes[k], dtype=self.cdt)
        self.store.read(self.store.current, k, 0, 0, buf)
        self.copies.add("disk_read", "params", buf.numel() * buf.element_size())
        self.timeline.append(("read params", k, start, time.perf_counter()))
        return buf

    def settle(self) -> None:
        """Drop reads in flight (a step's end: the next step's gathers read the new generation)."""
        for fut in self.pending.values():
            fut.result()
        self.pending = {}
        self.last = None

    # ---- after the update ----------------------------------------------------------------------------
    def publish(self, s, values: torch.Tensor, lo: int, src: str) -> None:
        """Elements ``[lo, lo + len(values))`` of ``s``'s new master into its shard (``src``: the memory
        kind ``values`` are in)."""
        n = values.numel()
        nbytes = n * self.cdt.itemsize
        if src == "device":
            self.copies.add("d2h", "params", nbytes)
        if self.kind == "host" or self._depth:
            s.shard[lo:lo + n].copy_(values)              # the host tensor, or the mapped current generation
            return
        k, pos = self.where[id(s)]
        self.store.write(1 - self.store.current, k, 0, pos + lo, values.to(device=HOST, dtype=self.cdt))
        self.copies.add("disk_write", "params", nbytes)
        self.written.add(id(s))

    def commit(self) -> None:
        """The step's shards are all written: the next generation becomes the current one (trainable
        pieces no update touched are carried over first)."""
        if self.kind != "disk" or self._depth:
            return
        self.settle()
        new = 1 - self.store.current
        for s in self.engine.states:
            if s.trainable and id(s) not in self.written:
                k, pos = self.where[id(s)]
                buf = torch.empty(s.hi - s.lo, dtype=self.cdt)
                self.store.read(self.store.current, k, 0, pos, buf)
                self.store.write(new, k, 0, pos, buf)
        self.written = set()
        self.store.current = new

    def abort(self) -> None:
        self.written = set()

    # ---- outside the step ----------------------------------------------------------------------------
    @contextmanager
    def mapped(self):
        """Every shard a file-backed view of the current generation; written through to the other on exit."""
        if self.kind != "disk" or self._depth:
            self._depth += self.kind == "disk"
            try:
                yield
            finally:
                self._depth -= self.kind == "disk"
            return
        self.settle()
        data = self.store.map(self.store.current)
        for s in self.engine.states:
            if s.shard is not None:
                k, pos = self.where[id(s)]
                s.shard = self.store.view(data, k, 0, pos, s.hi - s.lo)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._rest()
            other = 1 - self.store.current
            for k in range(len(self.units)):
                self.store.write(other, k, 0, 0, self.store.view(data, k, 0))
            del data

    def held(self) -> int:
        """The shards' bytes on disk (one generation, its chunks' padding aside: as planned)."""
        if self.kind != "disk":
            return 0
        return sum(s.hi - s.lo for s in self.engine.states if s.shard is not None) * self.cdt.itemsize

    def close(self) -> None:
        if self.kind == "disk":
            self.settle()
            self.reader.shutdown()
            self.store.close()


def params_offload(engine):
    kind = dict(engine.plan.offload).get("params")
    if kind is None:
        return None
    if engine.units is None:
        raise OffloadError("parallelize: offload['params'] needs ZeRO-3's units — expected zero=3.")
    return ParamsOffload(engine, kind, engine.plan.offload_dir)
