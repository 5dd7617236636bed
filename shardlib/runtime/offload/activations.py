"""Offloaded activations (``sl.plan(offload={"activations": "host" | "disk"})``): what each block saves
for backward leaves the device during its forward and comes back for its backward.

Each of the plan's units (a transformer block: ``Plan.units`` other than the root) runs its forward
under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves there — except the
module's own parameters, which ZeRO-3 gathers again for backward and which are never copied — is
copied to the host (``d2h activations``) or written to this rank's activation file (``disk_write``,
by a writer thread: the forward goes on while it is written), and brought back when backward needs it
(``h2d`` / ``disk_read``). Before a block's backward its saved tensors are already on their way:
when backward reaches block ``i`` (the gradient of its output), the reader thread starts on block
``i - 1``'s (read-ahead); the last block's are read when asked for.

The file grows by appending while micro-batches are in flight (a pipeline holds several) and starts
over at each step. On a machine without an accelerator ``host`` saves nothing (a copy within one
memory); ``disk`` frees each saved tensor once written. Recompute saves nothing of a block to move:
``sl.plan`` refuses both on one plan.
"""

from __future__ import annotations

import os
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...quant.layout import inner_tensors
from .core import HOST
from .files import OffloadError, close_and_remove


class _OnDisk:
    """A saved tensor in the activation file: where, and its write (and read-ahead) in flight."""

    __slots__ = ("offset", "shape", "stride", "dtype", "device", "write", "read", "tensor", "used")

    def __init__(self, t: torch.Tensor, offset: int):
        self.offset, self.shape, self.stride, self.dtype, self.device = offset, t.shape, t.stride(), t.dtype, t.device
        self.tensor = t                     # held until written
        self.write: Future | None = None
        self.read: Future | None = None
        self.used = False


def _like(t: torch.Tensor, device, shape=None, stride=None, pin: bool = False) -> torch.Tensor:
    """An empty tensor laid out as ``t`` (or ``shape``/``stride``) on ``device``: the same strides, so the
    backward that reads it takes the same kernel paths as without offload (a chunk of a wider row iterated
    row by row and the same values contiguous round differently in vectorized elementwise kernels); an
    overlapping layout (an expanded tensor: a zero stride) contiguous."""
    shape, stride = (t.shape, t.stride()) if shape is None else (shape, stride)
    if any(st == 0 and n > 1 for st, n in zip(stride, shape)):
        return torch.empty(shape, dtype=t.dtype, device=device, pin_memory=pin)
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=device, pin_memory=pin)


class ActivationOffload:
    def __init__(self, engine, kind: str, offload_dir: str | None):
        self.engine, self.kind = engine, kind
        self.copies = engine.copies
        modules = dict(engine.model.named_modules())
        self.blocks = [modules[u.name] for u in engine.plan.units if u.name]
        # block index -> per forward call of it (micro-batches in flight), that call's handles
        self.saved: dict[int, list[list[_OnDisk]]] = {}
        self.handles = []
        for i, mod in enumerate(self.blocks):
            inner = mod.forward

            def forward(*args, _inner=inner, _i=i, **kwargs):
                if not torch.is_grad_enabled():
                    return _inner(*args, **kwargs)
                if self.kind == "disk":
                    self.saved.setdefault(_i, []).append([])
                self._weights = self._weight_storages()
                with torch.autograd.graph.saved_tensors_hooks(lambda t, i=_i: self._pack(i, t), self._unpack):
                    out = _inner(*args, **kwargs)
                for t in tree_leaves(out):          # backward reaching this block: read the one below ahead
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda g, i=_i: self._ahead(i - 1))
                        break
                return out

            mod.forward = forward
        if kind == "disk":
            self.folder = Path(offload_dir) / f"shardlib-offload-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path = self.folder / f"rank{engine.mesh.rank}.activations.bin"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self.end = 0
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="shardlib-offload-act-write")
            self.reader = ThreadPoolExecutor(1, thread_name_prefix="shardlib-offload-act-read")
            self._finalizer = weakref.finalize(self, close_and_remove, [self.fd], [self.path], self.folder)
        self.timeline: list[tuple[str, int, float, float]] = []
        self._weights: set[int] = set()

    # ---- the hooks -----------------------------------------------------------------------------------
    def _weight_storages(self) -> set[int]:
        """The storages of the model's weights as they are now (gathered units, quantized components)."""
        out = set()
        for s in self.engine.states:
            for t in [s.storage] + inner_tensors([s.param]) if s.plan.quant is not None else [s.storage]:
                out.add(t.untyped_storage().data_ptr())
        out.discard(0)
        return out

    def _pack(self, i: int, t: torch.Tensor):
        if (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.numel() == 0
                or t.untyped_storage().data_ptr() in self._weights):
            return ("keep", t)                      # the model's own weights: gathered again, not copied
        nbytes = t.numel() * t.element_size()
        if self.kind == "host":
            out = _like(t, HOST, pin=torch.cuda.is_available() and t.device.type == "cuda")
            out.copy_(t)
            self.copies.add("d2h", "activations", nbytes)
            return ("host", out, t.device)
        # to the host first (on a machine without an accelerator that is the tensor itself), then the file
        h = _OnDisk(t.detach().to(HOST).contiguous(), self.end)
        h.shape, h.stride, h.device = t.shape, t.stride(), t.device
        self.copies.add("d2h", "activations", nbytes)
        self.end += nbytes
        h.write = self.writer.submit(self._write, h)
        self.saved[i][-1].append(h)
        return ("disk", h)

    def _unpack(self, packed):
        how = packed[0]
        if how == "keep":
            return packed[1]
        if how == "host":
            _, t, device = packed
            out = _like(t, device)
            out.copy_(t)
            self.copies.add("h2d", "activations", t.numel() * t.element_size())
            return out
        h = packed[1]
        h.used = True
        if h.read is None:
            h.read = self.reader.submit(self._read, h)
        t = h.read.result()
        h.read = None
        out = _like(t, h.device, h.shape, h.stride)
        out.copy_(t)
        self.copies.add("h2d", "activations", t.numel() * t.element_size())
        return out

    def _ahead(self, i: int) -> None:
        """Start reading block ``i``'s tensors of its oldest forward not yet brought back (backward takes
        the micro-batches in the order their forwards ran)."""
        for call in self.saved.get(i, ()):
            if any(not h.used for h in call):
                for h in call:
                    if not h.used and h.read is None:
                        h.read = self.reader.submit(self._read, h)
                return

    # ---- the file ------------------------------------------------------------------------------------
    def _write(self, h: _OnDisk) -> None:
        start = time.perf_counter()
        data = h.tensor.view(-1).view(torch.uint8).numpy()
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(self.fd, memoryview(data)[done:], h.offset + done)
        except OSError as e:
            raise OffloadError(f"step: saving activations for backward to {self.path} failed — {e}. The step "
                               "was not applied. Free space under offload_dir (the file holds one step's "
                               "activations of this rank), or offload activations to 'host'.") from None
        self.copies.add("disk_write", "activations", len(data))
        h.tensor = None                              # written: the memory is free
        self.timeline.append(("write activations", h.offset, start, time.perf_counter()))

    def _read(self, h: _OnDisk) -> torch.Tensor:
        h.write.result()                             # (raises its failure)
        start = time.perf_counter()
        out = torch.empty(h.shape, dtype=h.dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        got = os.preadv(self.fd, [view], h.offset)
        if got != len(view):
            raise OffloadError(f"step: reading saved activations back from {self.path} failed (a short read: "
                               f"{got} of {len(view)} bytes).")
        self.copies.add("disk_read", "activations", len(view))
        self.timeline.append(("read activations", h.offset, start, time.perf_counter()))
        return out

    def end_step(self) -> None:
        """The step's backward is done: the file starts over (writes still in flight finish first)."""
        if self.kind == "disk":
            for calls in self.saved.values():
                for call in calls:
                    for h in call:
                        h.write.result()
            self.end = 0
        self.saved = {}

    def close(self) -> None:
        if self.kind == "disk":
            self.writer.shutdown()
            self.reader.shutdown()
            self._finalizer()


def activation_offload(engine):
    kind = dict(engine.plan.offload).get("activations")
    return ActivationOffload(engine, kind, engine.plan.offload_dir) if kind is not None else None
