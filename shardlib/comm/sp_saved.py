"""Sequence parallelism's saved activations at Megatron's bytes: a region's gathered input is kept as this
rank's chunk, and gathered again in backward.

An SP region (the attention or MLP module holding column projections) gathers the sequence at its entry
(``comm/boundaries.py``'s ``_region_pre``), and its column matmuls save that whole-sequence input for their
weight gradients — ``2·s·b·h`` bytes (16-bit) per region where Megatron keeps the ``2·s·b·h/t`` chunk and
all-gathers it again in backward (``LinearWithGradAccumulationAndAsyncCommunication`` under
``sequence_parallel``; Korthikanti et al. 2022, Table 2's ``34·sbh/t``). Here the same, without touching the
model's code: while the region's forward runs, ``saved_tensors_hooks`` replace every tensor autograd saves that
is a view of the gathered input by the chunk and the view's geometry; the first unpack in backward gathers the
chunk once more (one all-gather, no autograd: the saved value is data for a weight gradient) and every view of
that region reads it, freed after the last. Everything else saved passes to the hooks outside (activation offload,
the planner's byte counting), the chunk too, once per region — so those count and move the chunk, not the whole
sequence.

Off inside a unit recomputed whole (its checkpoint keeps nothing of the region), and where the gathered input
does not fill a storage of its own. The tracer records the backward all-gather at the region's first such save
(``Ops.note_regather``), so the plan counts what a step sends.
"""

from __future__ import annotations

from typing import Any

import torch


class _Saved:
    """A view of the region's gathered input, saved as the chunk (``inner``: what the outer hooks made of it)."""

    __slots__ = ("inner", "size", "stride", "offset")

    def __init__(self, inner: Any, t: torch.Tensor):
        self.inner, self.size, self.stride, self.offset = inner, t.size(), t.stride(), t.storage_offset()


class RegionSaving:
    """One region's forward, from ``enter`` (its pre-hook, after the gather) to ``exit`` (its post-hook)."""

    def __init__(self, ops: Any, chunk: torch.Tensor, full: torch.Tensor, dim: int):
        self.ops, self.chunk, self.dim = ops, chunk, dim
        self.key = full.untyped_storage()._cdata
        self.dtype, self.geometry = full.dtype, (full.size(), full.stride())
        self.saved = 0             # views saved (each unpacked once in backward)
        self.full: torch.Tensor | None = None
        self.inner: Any = None     # the chunk as the outer hooks packed it
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()

    def exit(self) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None
            self.chunk = None       # (what backward reads is ``inner``: an offloaded chunk leaves the device)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.dtype == self.dtype and not t.is_sparse and t.untyped_storage()._cdata == self.key:
            if self.saved == 0:     # the chunk goes to the outer hooks once (offloaded once, counted once)
                self.ops.note_regather(self.chunk)
                self.inner = self.outer[0](self.chunk) if self.outer else self.chunk
            self.saved += 1
            return _Saved(self.inner, t)
        return self.outer[0](t) if self.outer else t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return self.outer[1](packed) if self.outer else packed
        if self.full is None:
            chunk = self.outer[1](packed.inner) if self.outer else packed.inner
            full = self.ops.gather_saved(chunk, self.dim)
            if (full.size(), full.stride()) != self.geometry:        # laid out as the forward's gather was
                full = torch.empty_strided(*self.geometry, dtype=full.dtype, device=full.device).copy_(full)
            self.full = full
        view = self.full.as_strided(packed.size, packed.stride, packed.offset)
        self.saved -= 1
        if self.saved == 0:        # the region's last saved view: the gathered input goes with it
            self.full = self.inner = None
        return view


def regather_applies(chunk: torch.Tensor, full: torch.Tensor) -> bool:
    """The gathered input starts its own storage (its saved views' geometry holds in a copy laid out alike)."""
    return full.storage_offset() == 0 and full.dtype == chunk.dtype and \
        full.untyped_storage().nbytes() == full.numel() * full.element_size()
