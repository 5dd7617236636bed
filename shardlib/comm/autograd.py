"""The autograd Functions behind the named collectives: each forward is a collective over the
ranks that differ only along ``axes``, each backward the transposed collective (see
``collectives``). Kept apart so that ``vma`` (which inserts ``pbroadcast``) and ``collectives``
(the checked public wrappers) both build on them without importing each other."""

from __future__ import annotations

import torch

from . import core as comm
from .execute import all_to_all_dims, gather_dim, scatter_dim


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A collective over a group of one returns its input; copy it, so that the result is a new
    tensor in every world (in-place ops on it then work, and never write into ``x``)."""
    return out.clone() if out is x else out


class Psum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axes):
        return _fresh(comm.all_reduce(x, mesh, axes), x)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class PBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axes):
        ctx.mesh, ctx.axes = mesh, axes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g.contiguous(), ctx.mesh, ctx.axes), None, None


def _transposes(name: str, there, back, doc: str) -> type[torch.autograd.Function]:
    """An autograd function along a dim that runs ``there`` forward and its transpose ``back`` backward."""

    def forward(ctx, x, mesh, axes, dim):
        ctx.mesh, ctx.axes, ctx.dim = mesh, axes, dim
        return _fresh(there(x, mesh, axes, dim), x)

    def backward(ctx, g):
        return back(g.contiguous(), ctx.mesh, ctx.axes, ctx.dim), None, None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward), "__doc__": doc})


AllGather = _transposes("AllGather", gather_dim, scatter_dim, "All-gather along a dim; backward reduce-scatters.")
PsumScatter = _transposes("PsumScatter", scatter_dim, gather_dim, "Reduce-scatter along a dim; backward all-gathers.")


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axes, split_dim, concat_dim):
        ctx.mesh, ctx.axes, ctx.dims = mesh, axes, (split_dim, concat_dim)
        return _fresh(all_to_all_dims(x, mesh, axes, split_dim, concat_dim), x)

    @staticmethod
    def backward(ctx, g):
        s, c = ctx.dims
        return all_to_all_dims(g.contiguous(), ctx.mesh, ctx.axes, c, s), None, None, None, None


class PPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axes, pairs):
        ctx.mesh, ctx.axes, ctx.pairs = mesh, axes, pairs
        return _fresh(comm.send_recv(x, mesh, axes, pairs), x)

    @staticmethod
    def backward(ctx, g):
        inverse = [(d, s) for s, d in ctx.pairs]
        return comm.send_recv(g.contiguous(), ctx.mesh, ctx.axes, inverse), None, None, None
