"""The collectives at the tensor axis's module boundaries (``comm/boundaries.py`` installs them): Megatron's ``f``
and ``g``, sequence parallelism's gathers and scatters of the stream (or of a block's flattened tokens), and
the checks on what they split. ``Ops`` runs them on a running mesh; the planner's recording ``Ops``
(``planner/trace.py``) count them instead, with the same signatures.
"""

from __future__ import annotations

import torch

from ..algebra.mesh import Mesh
from ..errors import ShardingError
from . import core as comm
from .autograd import AllGather, PBroadcast, Psum, PsumScatter
from .execute import gather_dim
from .seq_edges import Regathered


class _SliceSeq(torch.autograd.Function):
    """Keep this rank's chunk of ``dim`` of a replicated tensor; backward all-gathers the chunks'
    gradients (each rank's gradient covers only its chunk)."""

    @staticmethod
    def forward(ctx, x, mesh, axes, dim):
        ctx.mesh, ctx.axes, ctx.dim = mesh, axes, dim
        k, i = comm.group_size(mesh, axes), mesh.group_index(mesh.rank, axes)
        return x.chunk(k, dim)[i].contiguous()

    @staticmethod
    def backward(ctx, g):
        return gather_dim(g.contiguous(), ctx.mesh, ctx.axes, ctx.dim), None, None, None


class _GatherInvariant(torch.autograd.Function):
    """All-gather ``dim`` into a tensor every rank then uses identically; backward keeps this
    rank's chunk of the (identical) gradient — no collective."""

    @staticmethod
    def forward(ctx, x, mesh, axes, dim):
        ctx.mesh, ctx.axes, ctx.dim = mesh, axes, dim
        return gather_dim(x.contiguous(), mesh, axes, dim)

    @staticmethod
    def backward(ctx, g):
        k, i = comm.group_size(ctx.mesh, ctx.axes), ctx.mesh.group_index(ctx.mesh.rank, ctx.axes)
        return g.chunk(k, ctx.dim)[i].contiguous(), None, None, None


class Ops:
    """The boundary collectives over ``axis`` of ``mesh`` (running processes)."""

    def __init__(self, mesh, axis: str, seq_dim: int = 1):
        self.mesh, self.axes, self.seq_dim = mesh, (axis,), seq_dim
        self.size = mesh.axis_size(axis)
        self.unit = ""                       # the unit running (set by the unit hooks)
        self.abstract = not isinstance(mesh, Mesh)     # planning on an AbstractMesh: shapes only

    # On meta tensors (a stage working out the shape of the stream it will receive, before any
    # data arrives), or on an AbstractMesh (the planner measuring a block on zeros where meta
    # kernels are missing: MoE's ``nonzero``), each op only reshapes: nothing is communicated.
    def _shapes(self, x: torch.Tensor) -> bool:
        return x.is_meta or self.abstract

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._shapes(x) else PBroadcast.apply(x, self.mesh, self.axes)

    def g(self, y: torch.Tensor) -> torch.Tensor:
        return y if self._shapes(y) else Psum.apply(y, self.mesh, self.axes)

    def gather_seq(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        dim = token_dim(x, self.seq_dim) if dim is None else dim
        return self._meta_seq(x, self.size, 1, dim) if self._shapes(x) else \
            AllGather.apply(x, self.mesh, self.axes, dim)

    def scatter_seq(self, y: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        dim = token_dim(y, self.seq_dim) if dim is None else dim
        check_seq(y, dim, self.size, "sequence_parallel")
        # (contiguous: the chunk comes back with its dims permuted, and a block that views its input —
        # a MoE block's ``view(-1, hidden)`` — needs it laid out as the stream is)
        return self._meta_seq(y, 1, self.size, dim) if self._shapes(y) else \
            PsumScatter.apply(y, self.mesh, self.axes, dim).contiguous()

    def slice_seq(self, x: torch.Tensor) -> torch.Tensor:
        self._check_seq(x)
        return self._meta_seq(x, 1, self.size) if self._shapes(x) else \
            _SliceSeq.apply(x, self.mesh, self.axes, self.seq_dim)

    def unslice_seq(self, x: torch.Tensor) -> torch.Tensor:
        return (self._meta_seq(x, self.size, 1) if self._shapes(x)
                else _GatherInvariant.apply(x, self.mesh, self.axes, self.seq_dim))

    def regather(self, x: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``full`` (this rank's all-gather of ``x``, already run) again, reduce-scattering into
        ``x`` in backward: no forward collective."""
        return self._meta_seq(x, self.size, 1) if self._shapes(x) else Regathered.apply(
            x, full.detach(), self.mesh, self.axes, self.seq_dim)

    def param_f(self, p: torch.Tensor) -> torch.Tensor:
        return p if self._shapes(p) else PBroadcast.apply(p, self.mesh, self.axes)

    def gather_saved(self, chunk: torch.Tensor, dim: int) -> torch.Tensor:
        """An SP region's input gathered again in backward from the chunk it saved (``comm/sp_saved.py``):
        data for a weight gradient, no autograd."""
        return self._meta_seq(chunk, self.size, 1, dim) if self._shapes(chunk) else \
            gather_dim(chunk, self.mesh, self.axes, dim)

    def note_regather(self, chunk: torch.Tensor) -> None:
        """A region saved its gathered input as the chunk (the tracer records the backward all-gather)."""

    def _meta_seq(self, x: torch.Tensor, mul: int, div: int, dim: int | None = None) -> torch.Tensor:
        dim = self.seq_dim if dim is None else dim
        shape = list(x.shape)
        shape[dim] = shape[dim] * mul // div
        return x.new_empty(shape)

    def coord(self) -> int:
        return self.mesh.group_index(self.mesh.rank, self.axes)

    def _check_seq(self, x: torch.Tensor) -> None:
        check_seq(x, self.seq_dim, self.size, "sequence_parallel")


def token_dim(x: torch.Tensor, seq_dim: int) -> int:
    """The dim a sequence-split tensor is split on: the stream's sequence dim, or dim 0 of the tokens a block
    flattened (``[T, H]``: a MoE block's rows, in the rank-major order the gather gives and the scatter takes
    back — per-token work inside needs no other)."""
    return 0 if x.dim() == 2 else seq_dim


def check_seq(x: torch.Tensor, dim: int, size: int, api: str) -> None:
    """The residual stream's sequence dim must split evenly over the tensor ranks."""
    if x.dim() <= dim or x.shape[dim] % size:
        raise ShardingError(
            f"{api}: sequence_parallel splits the residual stream {tuple(x.shape)} on its sequence dim {dim} over "
            f"tensor={size} ranks — expected a sequence length divisible by {size}. Use such a sequence length, "
            "or sequence_parallel=False.")


def vocab_range(width: int, size: int, coord: int) -> tuple[int, int]:
    """Ids ``[lo, hi)`` of a ``width``-row table that tensor coordinate ``coord`` holds (ceil chunks)."""
    c = -(-width // size)
    return min(coord * c, width), min((coord + 1) * c, width)
