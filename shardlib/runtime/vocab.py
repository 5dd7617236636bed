"""Vocab-parallel cross-entropy, and the mode that routes a model's own ``F.cross_entropy`` to it.

An LM head whose weight is ``P("tensor", None)`` gives rank ``i`` of the ``tensor`` axis the logits
of vocab ids ``[i·c, min((i+1)·c, V))``, ``c = ceil(V/k)`` (trailing shards may be short or empty).
The loss of row ``n`` with target ``t`` is ``log Σ_v exp(x_v) - x_t``; with ``m = max_v x_v``::

    loss = log Σ_ranks Σ_local exp(x_v - m) - (x_t - m)

so each rank needs three numbers per row from the others: the max (one all-reduce MAX, no
gradient: the loss does not depend on ``m``), and the sum of exponentials plus the target logit
(held by exactly one rank; the others contribute 0) — ONE all-reduce SUM of both stacked (Megatron
issues three all-reduces; two suffice). With label smoothing ``ε`` the loss is
``(1-ε)·nll + ε/V·Σ_v -log p_v`` and ``Σ_v -log p_v = V·log S - Σ_v (x_v - m)`` adds one more row
to the same all-reduce. The gradient ``∂loss/∂x_v = p_v - (1-ε)·[v = t] - ε/V`` is local: backward
issues no collective. Nothing of size ``N × V`` ever exists on a rank; the math runs in fp32 (fp64
for fp64 input) and the result has the input's dtype, as ``F.cross_entropy``'s has.

``ShardedLogits`` is a ``TorchFunctionMode`` the engine holds around a model's forward and loss.
``mode.mark(t, ...)`` records that ``t``'s last dim is this rank's vocab shard. Inside the mode,
``F.cross_entropy`` (so ``nn.CrossEntropyLoss`` too) on a marked tensor is the vocab-parallel loss;
ops that keep the vocab dim last and act on it element by element (casts, views that flatten the
leading dims — also ``view(-1, V)`` written with the FULL vocab size, as ``transformers`` does —
indexing that leaves the last dim alone, ``x / c``, ``tanh``...) run on the shard and mark their
result; every other op that reads a marked tensor (softmax, argmax, matmul, ...) first all-gathers
it (``gather_vocab``: backward keeps this rank's slice, no collective) — correct, not memory-saving.
Size queries (``t.size(-1)``, ``t.shape``) answer with the shard's size.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from ..algebra.layout import chunk_bounds, chunk_size
from ..algebra.mesh import Mesh
from ..comm import core as comm
from ..comm.execute import gather_dim
from ..errors import Problems, ShardingError, ShardingTypeError
from ..validate import positive_int

_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, stop)`` of a vocab of ``vocab_size`` ids split over ``axis``."""

    mesh: Mesh
    axis: str
    vocab_size: int
    start: int
    stop: int

    @property
    def local(self) -> int:
        return self.stop - self.start


def vocab_shard(mesh: Mesh, axis: str, vocab_size: int, api: str = "vocab_shard") -> VocabShard:
    """The vocab ids this rank holds when ``vocab_size`` is ceil-chunked over ``axis``."""
    if not isinstance(mesh, Mesh):
        raise ShardingTypeError(f"{api}: expected a Mesh over running processes — got {type(mesh).__name__}.")
    if not isinstance(axis, str):
        raise ShardingTypeError(f"{api}: axis must be one mesh axis name — got {axis!r}.")
    if problem := positive_int(vocab_size, f"{api}: vocab_size"):
        raise ShardingError(f"{problem}; expected the "
                            "FULL vocab size (the LM head's out_features before sharding).")
    k = mesh.axis_size(axis)   # SpecError for an unknown axis
    start, stop = chunk_bounds(vocab_size, k, mesh.coord(mesh.rank, axis))
    return VocabShard(mesh, axis, vocab_size, start, stop)


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------

class _VocabParallelCE(torch.autograd.Function):
    """Forward: 2 all-reduces (max; sum-exp + target logit [+ Σ logits]). Backward: local."""

    @staticmethod
    def forward(ctx, logits, target, shard: VocabShard, ignore_index: int, reduction: str, eps: float):
        n, vl = logits.shape
        cdt = torch.promote_types(logits.dtype, torch.float32)
        valid = target != ignore_index
        local_t = target - shard.start
        hit = valid & (local_t >= 0) & (local_t < vl)            # the target id lives on this rank
        idx = torch.where(hit, local_t, 0).unsqueeze(1)
        # 1. the row max over the whole vocab (a shift for stability; the loss does not depend on it)
        m = logits.amax(-1).to(cdt) if vl else torch.full((n,), -math.inf, dtype=cdt, device=logits.device)
        m = comm.all_reduce(m.contiguous(), shard.mesh, shard.axis, op="max", inplace=True)
        # 2. z = x - m in the compute dtype (type promotion: one N × V_local buffer, reused below)
        z = logits - m.unsqueeze(1)
        picked = torch.where(hit, z.gather(1, idx).squeeze(1), 0.0) if vl else z.new_zeros(n)
        rows = [None, picked] + ([z.sum(-1)] if eps else [])
        e = z.exp_()
        rows[0] = e.sum(-1)
        stats = comm.all_reduce(torch.stack(rows), shard.mesh, shard.axis, op="sum", inplace=True)
        log_s = stats[0].log()
        loss = log_s - stats[1]                                       # -log p_t
        if eps:   # Σ_v -log p_v = V·log S - Σ_v z_v
            loss = (1 - eps) * loss + (eps / shard.vocab_size) * (shard.vocab_size * log_s - stats[2])
        loss = torch.where(valid, loss, 0.0)
        count = valid.sum()
        out = {"mean": lambda: loss.sum() / count, "sum": loss.sum, "none": lambda: loss}[reduction]()
        e.div_(stats[0].unsqueeze(1))                                 # softmax of this rank's slice
        ctx.save_for_backward(e, idx, hit, valid, count)
        ctx.opts = (shard.vocab_size, reduction, eps, logits.dtype)
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        p, idx, hit, valid, count = ctx.saved_tensors
        vocab, reduction, eps, dtype = ctx.opts
        scale = g.to(p.dtype)
        if reduction == "mean":
            scale = scale / count
        scale = torch.where(valid, scale.expand(valid.shape), 0.0)
        grad = p * scale.unsqueeze(1)
        if eps:
            grad.sub_((scale * (eps / vocab)).unsqueeze(1))
        if grad.shape[1]:
            grad.scatter_add_(1, idx, torch.where(hit, scale * -(1 - eps), 0.0).unsqueeze(1))
        return grad.to(dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, mesh: Mesh, axis: str = "tensor",
                                 vocab_size: int, ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0, weight: None = None) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, ...)`` from this rank's vocab shard of the logits.

    ``logits``: ``(N, V_local)`` or ``(V_local,)``, this rank's slice of the last dim of full
    logits ``(N, vocab_size)`` ceil-chunked over ``axis``; ``target``: ``(N,)`` (or ``()``) full
    vocab ids, the same on every rank of the axis. Issues two all-reduces over ``axis`` forward,
    none backward; never builds an ``N × vocab_size`` tensor.
    """
    api = "vocab_parallel_cross_entropy"
    shard = vocab_shard(mesh, axis, vocab_size, api)
    with Problems(api) as p:
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            p.add(f"{api}: logits must be a floating-point tensor — got {_kind(logits)}.")
        elif logits.dim() not in (1, 2):
            p.add(f"{api}: logits has shape {tuple(logits.shape)} — expected (N, V_local) or (V_local,): beyond 2 "
                  "dims F.cross_entropy reads dim 1 as the class dim. Flatten first: "
                  "logits.view(-1, logits.size(-1)), target.view(-1).")
        elif logits.shape[-1] != shard.local:
            p.add(f"{api}: the last dim of logits is {logits.shape[-1]} — expected {shard.local}, this rank's shard "
                  f"[{shard.start}, {shard.stop}) of vocab {vocab_size} ceil-chunked over {axis!r} "
                  f"(size {mesh.axis_size(axis)}). Pass the local shard, not the full logits.")
        if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.dtype == torch.bool:
            p.add(f"{api}: target must hold class indices (an integer tensor) — got {_kind(target)}; "
                  "class-probability targets are not supported. Use F.cross_entropy on gathered logits.")
        elif isinstance(logits, torch.Tensor) and logits.dim() in (1, 2) and target.shape != logits.shape[:-1]:
            p.add(f"{api}: target has shape {tuple(target.shape)} — expected {tuple(logits.shape[:-1])}, the "
                  "logits' shape without the vocab dim.")
        if reduction not in _REDUCTIONS:
            p.add(f"{api}: reduction={reduction!r} — expected one of {_REDUCTIONS}.")
        if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
            p.add(f"{api}: label_smoothing={label_smoothing!r} — expected a float in [0, 1].")
        if weight is not None:
            p.add(f"{api}: weight= is not supported by the vocab-parallel loss — got a {_kind(weight)}. "
                  "Drop it, or compute the loss on gathered logits (gather_vocab).")
    squeeze = logits.dim() == 1
    if squeeze:
        logits, target = logits.unsqueeze(0), target.unsqueeze(0)
    bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
    if target.device.type == "cpu":
        if bad.any():
            raise ShardingError(f"{api}: target holds ids outside the vocab — got {target[bad][:5].tolist()}; "
                                f"expected 0 <= id < {vocab_size} or ignore_index={ignore_index}.")
    else:
        torch._assert_async(~bad.any(), f"{api}: a target id is outside [0, {vocab_size})")
    out = _VocabParallelCE.apply(logits, target, shard, int(ignore_index), reduction, float(label_smoothing))
    return out.squeeze(0) if squeeze and reduction == "none" else out


def _kind(x: object) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


# ---------------------------------------------------------------------------------------------
# Gathering the full logits (the fallback)
# ---------------------------------------------------------------------------------------------

class _GatherVocab(torch.autograd.Function):
    """All-gather the vocab shards (padded to ``ceil(V/k)``, then trimmed). The result is used
    the same way on every rank, so its gradient is the same on every rank: backward keeps this
    rank's slice and communicates nothing."""

    @staticmethod
    def forward(ctx, x, shard: VocabShard):
        ctx.bounds = (shard.start, shard.stop)
        k = shard.mesh.axis_size(shard.axis)
        if k == 1:
            return x.clone()
        c, d = chunk_size(shard.vocab_size, k), x.dim() - 1
        if x.shape[d] != c:
            x = torch.cat([x, x.new_zeros(x.shape[:d] + (c - x.shape[d],))], dim=d)
        return gather_dim(x, shard.mesh, (shard.axis,), d).narrow(d, 0, shard.vocab_size).contiguous()

    @staticmethod
    def backward(ctx, g):
        lo, hi = ctx.bounds
        return g.narrow(-1, lo, hi - lo).contiguous(), None


def gather_vocab(t: torch.Tensor, *, mesh: Mesh, axis: str = "tensor", vocab_size: int) -> torch.Tensor:
    """The full ``(..., vocab_size)`` tensor from each rank's ``(..., V_local)`` shard (autograd-aware)."""
    shard = vocab_shard(mesh, axis, vocab_size, "gather_vocab")
    if t.dim() == 0 or t.shape[-1] != shard.local:
        raise ShardingError(f"gather_vocab: last dim of shape {tuple(t.shape)} — expected {shard.local}, this "
                            f"rank's vocab shard [{shard.start}, {shard.stop}).")
    return _GatherVocab.apply(t, shard)


# ---------------------------------------------------------------------------------------------
# Which ops keep the vocab dim last (and may run on the shard)
# ---------------------------------------------------------------------------------------------

_CE_SIG = inspect.signature(F.cross_entropy)
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "element_size", "data_ptr",
    "storage_offset", "get_device", "is_floating_point", "is_complex", "__len__", "__hash__", "retain_grad",
    "register_hook", "backward", "untyped_storage", "_is_view"})
_VALUE_PROPS = frozenset({"T", "mT", "H", "mH", "real", "imag"})   # property reads that reorder or read values
_CASTS = frozenset({"float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone",
                    "detach", "detach_", "cpu", "cuda", "requires_grad_", "prop:data"})
_ELEMENTWISE = frozenset({
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "rsub", "pow", "neg",
    "negative", "abs", "tanh", "sigmoid", "exp", "log", "sqrt", "rsqrt", "square", "reciprocal", "clamp",
    "clip", "clamp_min", "clamp_max", "nan_to_num", "relu", "masked_fill", "maximum", "minimum", "eq", "ne",
    "lt", "le", "gt", "ge", "isfinite", "isnan", "isinf", "sign", "logical_not",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__div__", "__rdiv__", "__idiv__", "__pow__", "__rpow__",
    "__ipow__", "__neg__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__setitem__"})


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":   # a property read: Tensor.shape.__get__
        return "prop:" + getattr(getattr(func, "__self__", None), "__name__", "")
    return name


def _arg(args, kwargs, pos: int, key: str, default=None):
    return args[pos] if len(args) > pos else kwargs.get(key, default)


def _is_full(s) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _index_keeps_last(idx, nd: int) -> bool:
    """Whether ``t[idx]`` leaves the last dim of an ``nd``-dim ``t`` alone (and last)."""
    items = idx if isinstance(idx, tuple) else (idx,)

    def takes(it) -> int:   # dims of t an index item consumes
        if it is None or isinstance(it, bool):
            return 0
        if isinstance(it, torch.Tensor) and it.dtype in (torch.bool, torch.uint8):
            return it.dim()
        return 1

    ellipsis = [i for i, it in enumerate(items) if it is Ellipsis]
    if ellipsis:
        tail = items[ellipsis[0] + 1:]
    elif sum(takes(it) for it in items) < nd:
        return True
    else:
        tail = items
    for it in reversed(tail):   # the last dim is the last consuming item's; a None after it adds a new last dim
        return takes(it) == 1 and _is_full(it) if takes(it) else False
    return True


def _reshape_local(req, lead: tuple[int, ...], shard: VocabShard):
    """The local shape for ``view/reshape(req)`` when it keeps the vocab dim last — ``req``'s last
    entry being the shard's size, the FULL vocab size or -1 — else None."""
    if not req or not all(isinstance(s, int) for s in req):
        return None
    *rl, last = req
    if last not in (shard.local, shard.vocab_size, -1) or (last == -1 and -1 in rl):
        return None
    n_lead, known = math.prod(lead), math.prod(s for s in rl if s != -1)
    holes = [i for i, s in enumerate(rl) if s == -1]
    if len(holes) > 1 or any(s < -1 for s in rl):
        return None
    if holes:
        if known == 0 or n_lead % known:
            return None
        rl[holes[0]] = n_lead // known
    elif known != n_lead:
        return None
    return (*rl, shard.local)


def _shape_rule(name: str, t: torch.Tensor, args, kwargs, shard: VocabShard):
    """``(args, kwargs)`` to run shape op ``name`` on the shard, or None if it moves the vocab dim."""
    nd = t.dim()
    last = nd - 1

    def off_last(*dims) -> bool:
        return all(isinstance(d, int) and d % nd != last for d in dims)

    if name in ("view", "reshape"):
        rest = args[1:] or (kwargs.get("shape", kwargs.get("size")),)
        if len(rest) == 1 and isinstance(rest[0], torch.dtype):
            return (args, kwargs) if rest[0].itemsize == t.dtype.itemsize else None
        req = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else list(rest)
        new = _reshape_local(req, tuple(t.shape[:-1]), shard)
        return None if new is None else ((t, new), {})
    if name == "__getitem__":
        return (args, kwargs) if _index_keeps_last(args[1], nd) else None
    if name == "flatten":
        s, e = _arg(args, kwargs, 1, "start_dim", 0) % nd, _arg(args, kwargs, 2, "end_dim", -1) % nd
        return (args, kwargs) if e < last or s == last else None
    if name == "unsqueeze":
        d = _arg(args, kwargs, 1, "dim")
        return (args, kwargs) if (d if d >= 0 else d + nd + 1) < nd else None
    if name == "squeeze":
        d = _arg(args, kwargs, 1, "dim")
        if d is None:
            return (args, kwargs) if shard.local != 1 and shard.vocab_size != 1 else None
        return (args, kwargs) if off_last(*(d if isinstance(d, (tuple, list)) else (d,))) else None
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = _arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1")
        return (args, kwargs) if off_last(d0, d1) or d0 % nd == d1 % nd else None
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:] or kwargs.get("dims")
        return (args, kwargs) if dims and dims[-1] % nd == last else None
    if name in ("unflatten", "narrow", "select"):
        return (args, kwargs) if off_last(_arg(args, kwargs, 1, "dim")) else None
    if name in ("chunk", "split"):
        return (args, kwargs) if off_last(_arg(args, kwargs, 2, "dim", 0)) else None
    if name == "unbind":
        return (args, kwargs) if off_last(_arg(args, kwargs, 1, "dim", 0)) else None
    return None


_SHAPE_OPS = frozenset({"view", "reshape", "__getitem__", "flatten", "unsqueeze", "squeeze", "transpose", "swapaxes",
                        "swapdims", "permute", "unflatten", "narrow", "select", "chunk", "split", "unbind"})


_INPLACE_DUNDER = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__",
                             "__ipow__", "__ifloordiv__", "__imod__", "__iand__", "__ior__", "__ixor__"})


def _is_inplace(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDER


# ---------------------------------------------------------------------------------------------
# The mode
# ---------------------------------------------------------------------------------------------

class ShardedLogits(TorchFunctionMode):
    """Routes ops on vocab-sharded logits (see the module docstring). Use::

        mode = ShardedLogits()
        with mode:
            logits = model(x)   # the LM head's hook calls mode.mark(out, mesh=, axis=, vocab_size=)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        mode.clear()

    Marks hold weak references: a marked tensor dies when nothing else holds it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._marks: dict[int, tuple[weakref.ref, VocabShard]] = {}

    # ---- marks ---------------------------------------------------------------------------------
    def mark(self, t: torch.Tensor, *, mesh: Mesh, axis: str = "tensor", vocab_size: int) -> torch.Tensor:
        """Record that ``t``'s last dim is this rank's shard of a ``vocab_size`` vocab over ``axis``."""
        shard = vocab_shard(mesh, axis, vocab_size, "ShardedLogits.mark")
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] != shard.local:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShardingError(f"ShardedLogits.mark: the last dim must be this rank's vocab shard — got {got}; "
                                f"expected (..., {shard.local}) for ids [{shard.start}, {shard.stop}) of "
                                f"{vocab_size} over {axis!r}. Mark the output of the vocab-sharded LM head.")
        self._put(t, shard)
        return t

    def shard_of(self, t: object) -> VocabShard | None:
        """The vocab shard ``t`` holds, or None if it is not marked."""
        entry = self._marks.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def clear(self) -> None:
        """Forget every mark (the engine calls this at the end of each forward)."""
        self._marks.clear()

    def unshard(self, tree):
        """``tree`` with every marked tensor replaced by the full, gathered tensor (for outputs
        that leave the engine)."""
        return tree_map_only(torch.Tensor, self._full, tree)

    def _put(self, t: torch.Tensor, shard: VocabShard) -> None:
        key = id(t)
        self._marks[key] = (weakref.ref(t, lambda ref, key=key: self._forget(key, ref)), shard)

    def _forget(self, key: int, ref: weakref.ref) -> None:
        entry = self._marks.get(key)
        if entry is not None and entry[0] is ref:
            del self._marks[key]

    def _full(self, x):
        shard = self.shard_of(x)
        return x if shard is None else _GatherVocab.apply(x, shard)

    def _found(self, args, kwargs) -> list[tuple[torch.Tensor, VocabShard]]:
        out = []
        for a in (*args, *kwargs.values()):
            for x in (a if isinstance(a, (tuple, list)) else (a,)):
                if isinstance(x, torch.Tensor) and (s := self.shard_of(x)) is not None:
                    out.append((x, s))
        return out

    # ---- dispatch ------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._marks:
            return func(*args, **kwargs)
        found = self._found(args, kwargs)
        if not found:
            return func(*args, **kwargs)
        if func is F.cross_entropy:
            loss = self._cross_entropy(args, kwargs)
            if loss is not None:
                return loss
        name = _name(func)
        if name in _METADATA or (name.startswith("prop:") and name not in _VALUE_PROPS and name != "prop:data"):
            return func(*args, **kwargs)
        call = self._local_call(name, args, kwargs, found)
        if call is not None:
            out = func(*call[0], **call[1])
            self._mark_outputs(out, found[0][1])
            return out
        if _is_inplace(name) and args and self.shard_of(args[0]) is not None:
            raise ShardingError(f"ShardedLogits: in-place {name} on vocab-sharded logits of shape "
                                f"{tuple(args[0].shape)} — got an op that needs the whole vocab; expected an "
                                "element-wise op, or indexing that leaves the last (vocab) dim alone. "
                                "Use the out-of-place op.")
        return func(*tree_map_only(torch.Tensor, self._full, args), **tree_map_only(torch.Tensor, self._full, kwargs))

    def _local_call(self, name: str, args, kwargs, found):
        shard = found[0][1]
        if name in _CASTS or name in _SHAPE_OPS:
            if len(found) != 1 or not args or found[0][0] is not args[0]:
                return None
            return (args, kwargs) if name in _CASTS else _shape_rule(name, args[0], args, kwargs, shard)
        base = name[:-1] if name.endswith("_") and not name.startswith("__") else name
        if base not in _ELEMENTWISE or "out" in kwargs or any(s != shard for _, s in found):
            return None
        if name == "__setitem__" and not _index_keeps_last(args[1], args[0].dim()):
            return None
        values = (*args[2:], *kwargs.values()) if name == "__setitem__" else (*args, *kwargs.values())
        for x in values:
            if isinstance(x, torch.Tensor) and self.shard_of(x) is None and x.dim() and x.shape[-1] != 1:
                return None   # broadcasts along the vocab dim: needs the full vocab
        return args, kwargs

    def _mark_outputs(self, out, shard: VocabShard) -> None:
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                assert t.dim() and t.shape[-1] == shard.local, (tuple(t.shape), shard)
                self._put(t, shard)

    def _cross_entropy(self, args, kwargs):
        """The vocab-parallel loss where ``F.cross_entropy``'s arguments allow it, else None."""
        b = _CE_SIG.bind(*args, **kwargs)
        b.apply_defaults()
        a = b.arguments
        x, target = a["input"], a["target"]
        shard = self.shard_of(x)
        if (shard is None or x.dim() not in (1, 2) or not isinstance(target, torch.Tensor)
                or target.is_floating_point() or self.shard_of(target) is not None or a["weight"] is not None
                or a["size_average"] is not None or a["reduce"] is not None):
            return None
        return vocab_parallel_cross_entropy(x, target, mesh=shard.mesh, axis=shard.axis, vocab_size=shard.vocab_size,
                                            ignore_index=a["ignore_index"], reduction=a["reduction"],
                                            label_smoothing=a["label_smoothing"])
