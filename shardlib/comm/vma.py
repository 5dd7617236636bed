"""Varying-axes tracking inside ``shard_map`` (JAX's ``check_vma``), for correct gradients.

Every tensor in a ``shard_map`` body either *varies* over a mesh axis (each rank holds its own
value: a shard, or something computed from one) or is *invariant* over it (the same on every
rank: a replicated input, a parameter, a ``psum`` result). The cotangent of a varying value is
the rank's own contribution; that of an invariant value is the whole cotangent, on every rank.

Where an invariant value meets a varying one in an op, the invariant one is passed through
``pbroadcast`` (identity forward, sum backward), so its gradient adds up the contributions of
all ranks — exactly what JAX inserts as ``pvary``. A ``TorchFunctionMode`` sees each torch op;
the side table maps tensors (weakly) to the axes they vary over.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import ShardingError
from .autograd import PBroadcast

_TRACKER: contextvars.ContextVar[VmaTracker | None] = contextvars.ContextVar("shardlib_vma", default=None)


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__setitem__",) or (name.startswith("__i") and name.endswith("__")
                                    and name not in ("__init__", "__index__", "__iter__", "__int__", "__invert__")):
        return True
    return name.endswith("_") and not name.endswith("__")


class VmaTracker(TorchFunctionMode):
    """Propagates varying axes through torch ops and inserts ``pbroadcast`` where needed."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.table = WeakTensorKeyDictionary()
        # t -> {axes: (t's version, pbroadcast of t)}: an invariant value used by several ops on
        # per-rank values is broadcast once, so its gradient is all-reduced once, not once per use
        self.broadcasts = WeakTensorKeyDictionary()
        self.suspended = 0

    def vma(self, t: torch.Tensor) -> frozenset[str]:
        return self.table.get(t, frozenset())

    def set(self, t: torch.Tensor, vma: frozenset[str]) -> None:
        if vma:
            self.table[t] = frozenset(vma)
        elif t in self.table:
            del self.table[t]

    def pvary(self, t: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
        """``pbroadcast(t, axes)``, made once per (tensor, axes) while ``t`` is not modified in place."""
        axes = frozenset(axes)
        cache = self.broadcasts.get(t)
        hit = cache.get(axes) if cache is not None else None
        if hit is not None and hit[0] == t._version:
            return hit[1]
        ordered = tuple(a for a in self.mesh.axis_names if a in axes)
        self.suspended += 1
        try:
            out = PBroadcast.apply(t, self.mesh, ordered)
        finally:
            self.suspended -= 1
        self.set(out, self.vma(t) | axes)
        if cache is None:
            cache = self.broadcasts[t] = {}
        cache[axes] = (t._version, out)
        return out

    def pvary_inplace(self, t: torch.Tensor, axes: frozenset[str]) -> None:
        """Make ``t`` itself a ``pbroadcast`` of its old value (``t.copy_(pbroadcast(t.clone()))``)."""
        ordered = tuple(a for a in self.mesh.axis_names if a in axes)
        self.suspended += 1
        try:
            t.copy_(PBroadcast.apply(t.clone(), self.mesh, ordered))
        finally:
            self.suspended -= 1
        self.set(t, self.vma(t) | frozenset(axes))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        if not idx:
            return func(*args, **kwargs)
        vmas = [self.vma(flat[i]) for i in idx]
        union = frozenset().union(*vmas)
        inplace = _is_inplace(func)
        if union and torch.is_grad_enabled():
            changed = False
            for pos, i in enumerate(idx):
                if inplace and pos == 0:
                    # the mutated tensor cannot be swapped for another: put the pbroadcast into the
                    # history of the tensor that owns the memory (the base of a view), so that its
                    # gradient is summed over the axes it now varies on
                    t = flat[i]
                    root = t._base if t._base is not None else t
                    missing = union - self.vma(root)
                    if missing and root.requires_grad:
                        self.pvary_inplace(root, missing)
                    continue
                missing = union - vmas[pos]
                if missing and flat[i].requires_grad:
                    flat[i] = self.pvary(flat[i], missing)
                    changed = True
            if changed:
                args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
        if union:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.set(o, union)
            if inplace:
                t = flat[idx[0]]
                self.set(t, self.vma(t) | union)
                if t._base is not None:   # writing into a view writes into its base
                    self.set(t._base, self.vma(t._base) | union)
        return out


def current_tracker() -> VmaTracker | None:
    return _TRACKER.get()


@contextlib.contextmanager
def tracking(mesh) -> Iterator[VmaTracker]:
    """Track varying axes for the ``with`` body (used by ``shard_map``)."""
    if _TRACKER.get() is not None:
        raise ShardingError("shard_map: nested shard_map is not supported — call the inner function "
                            "directly; it already sees per-rank shards.")
    tracker = VmaTracker(mesh)
    token = _TRACKER.set(tracker)
    try:
        with tracker:
            yield tracker
    finally:
        _TRACKER.reset(token)


@contextlib.contextmanager
def tracked(x: torch.Tensor, needs: tuple[str, ...], *, drop: tuple[str, ...] = (), add: tuple[str, ...] = ()):
    """For a collective on ``x``: make ``x`` vary over ``needs`` (pbroadcast if it does not), run the
    collective untracked, and give its result the varying set ``(vma(x) - drop) | add``.

    Yields ``(x, done)``; ``done(out)`` records ``out`` and returns it. Without an active tracker
    this is a no-op."""
    tr = _TRACKER.get()
    if tr is None:
        yield x, (lambda out: out)
        return
    vma = tr.vma(x)
    missing = frozenset(needs) - vma
    if missing:
        x = tr.pvary(x, missing) if (x.requires_grad and torch.is_grad_enabled()) else x
        vma = vma | missing
    out_vma = (vma - frozenset(drop)) | frozenset(add)

    def done(out: torch.Tensor) -> torch.Tensor:
        tr.set(out, out_vma)
        return out

    tr.suspended += 1
    try:
        yield x, done
    finally:
        tr.suspended -= 1
