"""Token routing as a redistribution: the rows of a token-sharded batch moved to the ranks holding their
experts (dispatch), and the experts' outputs moved back (combine), over an ``expert`` axis.

A rank holds the experts ``[c·E/n, (c+1)·E/n)`` of the ``E`` experts split over the ``n`` ranks of the axis
(``c``: its coordinate; dim 0 of the experts' weights laid out ``P("expert", ...)``). Each of its tokens
chose ``k`` experts; the ``T·k`` (token, expert) pairs sorted by expert are, in that order, grouped by the
rank that holds their expert. Dispatch exchanges the rows per expert first (an all-to-all of ``E`` ints, as
torchtitan's does), then moves the rows and their routing weights with ragged all-to-alls: rank ``c``
receives, from every rank in turn, the rows for its experts in expert order, so each row's local expert id
follows from the counts (no move of its own). Combine is the transposed all-to-all, and each
returned row is added into its token's output in the same expert order one process adds them, so
outputs match one process to the bit where the experts' own arithmetic does. Both moves are autograd
functions whose backward is the transposed move: the gradient of the rows, the routing weights (hence the
router) and the experts' weights come out as one process computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import core as comm

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh


class RaggedAllToAll(torch.autograd.Function):
    """``x``'s rows ``in_splits[g]`` at a time to group member ``g``; ``out_splits[g]`` arrive from each.
    Backward: the transposed move (splits swapped)."""

    @staticmethod
    def forward(ctx, x, mesh, axis, in_splits, out_splits):
        ctx.mesh, ctx.axis, ctx.splits = mesh, axis, (in_splits, out_splits)
        return comm.all_to_all(x.contiguous(), mesh, axis, in_splits=in_splits, out_splits=out_splits)

    @staticmethod
    def backward(ctx, g):
        in_splits, out_splits = ctx.splits
        return comm.all_to_all(g.contiguous(), ctx.mesh, ctx.axis, in_splits=out_splits,
                               out_splits=in_splits), None, None, None, None


class Attached(torch.autograd.Function):
    """``y`` unchanged, with ``inputs`` attached to it: their backward runs (with zero gradients) wherever
    ``y``'s does. An experts module that skips the experts no row chose (transformers' loops over the experts
    hit) returns zeros with no path to the rows dispatched to it when none were: without this, that rank would
    never run the dispatch's backward all-to-all its peers wait in."""

    @staticmethod
    def forward(ctx, y, *inputs):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return (g, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


@dataclass
class Routed:
    """What dispatch sent, for combine to bring back: the (token, expert) pairs' tokens in the order sent,
    the rows sent to and received from each member, and the batch's shape."""

    token: torch.Tensor
    in_splits: list[int]
    out_splits: list[int]
    rows: int
    mesh: Mesh
    axis: str


def dispatch(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, n_experts: int, mesh: Mesh,
             axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Routed]:
    """``x [T, H]`` routed by ``index [T, k]`` (global expert ids; ``n_experts``: a row dropped by a capacity,
    sent nowhere) with ``weights [T, k]``: returns the rows this rank's experts get ``[R, H]``, each row's local expert id ``[R]`` and weight ``[R]``, and what
    combine needs."""
    n = mesh.axis_size(axis)
    if n_experts % n:
        raise ValueError(f"dispatch: {n_experts} experts do not split over {axis}={n} — expected a multiple of {n}.")
    per = n_experts // n
    k = index.shape[1]
    expert = index.reshape(-1)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    w = weights.reshape(-1)
    kept = expert < n_experts                                 # a row dropped by a capacity names no expert
    if not bool(kept.all()):
        expert, token, w = expert[kept], token[kept], w[kept]
    order = torch.argsort(expert, stable=True)               # by expert: grouped by the rank that holds it
    token, expert = token[order], expert[order]
    counts = torch.bincount(expert, minlength=n_experts)     # rows per expert, grouped by the rank holding it
    got = comm.all_to_all(counts, mesh, axis).view(n, per)     # each member's rows for each of this rank's experts
    ins, outs = counts.view(n, per).sum(dim=1).tolist(), got.sum(dim=1).tolist()
    rows = RaggedAllToAll.apply(x[token], mesh, axis, ins, outs)
    # each member sent its rows sorted by expert: their local expert ids follow from its counts
    local = torch.repeat_interleave(torch.arange(per, device=x.device).repeat(n), got.reshape(-1))
    w = RaggedAllToAll.apply(w[order], mesh, axis, ins, outs)
    return rows, local, w, Routed(token, ins, outs, x.shape[0], mesh, axis)


def combine(y: torch.Tensor, routed: Routed, *dispatched: torch.Tensor) -> torch.Tensor:
    """The experts' outputs ``y [R, H]`` (in the order dispatch delivered the rows) back to their tokens:
    ``[T, H]``, each token's outputs added in expert order. ``dispatched``: what dispatch returned that the
    experts read (rows, weights), attached to ``y`` so its backward runs on every rank (``Attached``)."""
    grads = [t for t in dispatched if t.requires_grad]
    if grads and torch.is_grad_enabled():
        y = Attached.apply(y, *grads)
    back = RaggedAllToAll.apply(y, routed.mesh, routed.axis, routed.out_splits, routed.in_splits)
    out = back.new_zeros((routed.rows,) + tuple(back.shape[1:]))
    return out.index_add(0, routed.token, back)


def batch_sum(t: torch.Tensor, mesh: Mesh, axes: tuple[str, ...]) -> torch.Tensor:
    """``t`` summed over the ranks the batch is split over, for a statistic of the whole batch inside each
    rank's loss (the router's load-balancing loss: Megatron's global aux loss). Each rank's loss holds its
    share of the term, so the backward sums the cotangents over those ranks too (all-reduce both ways)."""
    from .collectives import pbroadcast, psum
    return psum(pbroadcast(t, axes, mesh=mesh), axes, mesh=mesh)


def statistics_sum(t: torch.Tensor, mesh: Mesh, axes: tuple[str, ...], tokens_axis: str | None = None) -> torch.Tensor:
    """A router statistic of this rank's tokens summed over every rank holding some of the step's tokens: over
    the batch's ``axes`` both ways (``batch_sum``), and over ``tokens_axis`` — sequence parallelism's tensor axis,
    whose ranks compute one loss from the whole statistics — forward only (its backward leaves each rank its own
    tokens' share)."""
    from .autograd import Psum
    if mesh.axis_size(mesh.canonical_axes(axes)) > 1:
        t = batch_sum(t, mesh, axes)
    return Psum.apply(t, mesh, (tokens_axis,)) if tokens_axis is not None else t
