"""ZeRO-3's persistent collective buffers: one all-gather output and one reduce-scatter input,
allocated once and reused by every unit, so a steady-state step allocates no flat buffers.

Each unit's gather used to allocate its all-gather input and output, and each reduce-scatter its
input and output, every step: blocks of a unit's size freed and allocated again with the
parameters, gradients and activations of other sizes between them. On the host that churn
fragments glibc's heap (``shardlib/allocator.py``); FSDP2 and DeepSpeed keep such buffers for the
same reason (on a GPU the caching allocator does it for them). Here:

* **gather**: one buffer of the largest unit's all-gather output (``N`` chunks of ``c_train +
  c_frozen`` elements, compute dtype), the root unit left out: it is gathered once a step, when
  the model's forward starts, into a buffer of its own (held while it is unpacked), so the
  persistent one is a block's, not the embeddings' and head's. A unit's gather packs this rank's chunk straight into its
  block of the buffer's front and all-gathers in place (the input is the output's own block), so
  there is no separate input; the wait unpacks the parameters out of it and gives it back.
* **reduce**: one buffer of the largest trainable segment's reduce-scatter input (``N·c_train``
  elements, reduce dtype), the root left out likewise (reduced once, at the end of backward). Gradients are laid into its front as autograd makes them; the
  reduce-scatter runs in place, its output (this rank's chunk) a view of the input, held until the
  chunk is added into the gradient shards.

``UnitRunner`` never holds two gathers' or two reduce-scatters' buffers at once in a plain step
(``runtime/units.py``: a prefetch starts after the previous wait; a unit's input is taken after
the previous reduce-scatter is done). Where a schedule does (a pipeline stage's ``UNSHARD`` gathers
all its units, then waits), the buffer is busy and the extra gather gets a buffer of its own size
for the while — as before. A unit larger than the buffer (the root) gets one of its own size in
the idle buffer's place: the buffer is freed first and allocated again at the next block's use
(once a step), so the root's gather at the forward's start holds two of the root's size and no
block's, and its reduce-scatter at the backward's end the root's input alone. Each buffer is
allocated at its first use, at the plan's size (``Plan.transient_per_rank`` and
``planner/peak.py`` replay it), and kept. A model whose only unit is the root sizes them by it.
"""

from __future__ import annotations

import torch


class Buffer:
    """One persistent buffer, lent to one collective at a time."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device | str | None):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.tensor: torch.Tensor | None = None
        self.busy = False

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def held(self) -> int:
        """Bytes held now: its size while allocated, else 0."""
        return self.nbytes if self.tensor is not None else 0

    def acquire(self, numel: int) -> tuple[torch.Tensor, int]:
        """A 1-D tensor of ``numel`` elements, and the change in bytes held: the persistent buffer's
        front (its size when it is allocated, then 0); a tensor of its own while the buffer is lent
        (``numel`` elements' bytes, released with it); for a request larger than the buffer (the
        root's), a tensor of its own in the idle buffer's place — the buffer is given back first and
        allocated again at its next use, so the two are never held at once."""
        if self.busy or numel > self.numel:
            delta = numel * self.dtype.itemsize
            if not self.busy and self.tensor is not None:
                self.tensor, delta = None, delta - self.nbytes
            return torch.empty(numel, dtype=self.dtype, device=self.device), delta
        self.busy = True
        new = 0
        if self.tensor is None:
            self.tensor = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            new = self.nbytes
        return self.tensor[:numel], new

    def release(self, t: torch.Tensor) -> int:
        """Give ``t`` back; the bytes no longer held (0 for the persistent buffer)."""
        if self.tensor is not None and self.busy and t.data_ptr() == self.tensor.data_ptr():
            self.busy = False
            return 0
        return t.numel() * t.element_size()
