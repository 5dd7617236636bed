"""Tracing the tensor axis's activation collectives at plan time.

The boundary hooks that a step runs (``comm/boundaries.py``) are installed on the model with an
``Ops`` that records instead of communicating, and one micro-batch's forward runs on the meta
device (``torch.func.functional_call`` with meta tensors of each rank's shard shapes: nothing is
allocated, the model is not touched). Each boundary records its forward collective and the
transposed one its backward will run (where what it moves requires a gradient: the values of
trainable parameters are traced as requiring one); a unit that recomputes records its forward collectives
again in backward. Traced once per tensor coordinate (uneven widths give uneven shards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..algebra.layout import Layout
from ..comm import core as comm
from ..comm.boundaries import Boundaries
from ..comm.boundary_ops import check_seq, token_dim
from ..errors import ShardingError
from .functional import functional_call
from .traffic import CommEntry

if TYPE_CHECKING:
    from .plan import Plan


class RecordingOps:
    """``comm.boundary_ops.Ops`` that records each collective (with the one its backward runs) and
    returns tensors of the right shapes."""

    def __init__(self, axis: str, size: int, coord: int, seq_dim: int, recompute: set[str]):
        self.axes, self.size, self._coord, self.seq_dim = (axis,), size, coord, seq_dim
        self.recompute = recompute
        self.unit = ""
        self.entries: list[CommEntry] = []

    def _rec(self, phase: str, op: str, nbytes: int, what: str = "activations") -> None:
        self.entries.append(CommEntry(phase, what, op, self.axes, nbytes, 1, self.unit or "<root>"))
        if phase == "forward" and self.unit in self.recompute:
            self.entries.append(CommEntry("backward", "recompute", op, self.axes, nbytes, 1, self.unit))

    def _bytes(self, op: str, x: torch.Tensor, numel: int | None = None) -> int:
        n = x.numel() if numel is None else numel
        fn = {"all_reduce": comm.all_reduce_bytes, "all_gather": comm.all_gather_bytes,
              "reduce_scatter": comm.reduce_scatter_bytes}[op]
        return fn(n, self.size, x.element_size())

    def _seq(self, x: torch.Tensor, factor: float, dim: int | None = None) -> torch.Tensor:
        dim = token_dim(x, self.seq_dim) if dim is None else dim
        shape = list(x.shape)
        shape[dim] = int(shape[dim] * factor)
        return x.new_empty(shape)

    def f(self, x):
        if x.requires_grad:           # autograd runs no backward for what needs no gradient
            self._rec("backward", "all_reduce", self._bytes("all_reduce", x))
        return x

    def g(self, y):
        self._rec("forward", "all_reduce", self._bytes("all_reduce", y))
        return y

    def gather_seq(self, x, dim=None):
        self._rec("forward", "all_gather", self._bytes("all_gather", x))
        if x.requires_grad:
            self._rec("backward", "reduce_scatter", self._bytes("reduce_scatter", x))
        return self._seq(x, self.size, dim).requires_grad_(x.requires_grad)

    def scatter_seq(self, y, dim=None):
        check_seq(y, token_dim(y, self.seq_dim) if dim is None else dim, self.size, "plan")
        out = self._seq(y, 1 / self.size, dim)
        self._rec("forward", "reduce_scatter", self._bytes("reduce_scatter", out))
        if y.requires_grad:
            self._rec("backward", "all_gather", self._bytes("all_gather", out))
        return out.requires_grad_(y.requires_grad)

    def slice_seq(self, x):
        self._check(x)
        out = self._seq(x, 1 / self.size)
        if x.requires_grad:
            self._rec("backward", "all_gather", self._bytes("all_gather", out))
        return out.requires_grad_(x.requires_grad)

    def unslice_seq(self, x):
        self._rec("forward", "all_gather", self._bytes("all_gather", x))
        return self._seq(x, self.size).requires_grad_(x.requires_grad)

    def regather(self, x, full):
        if x.requires_grad:
            self._rec("backward", "reduce_scatter", self._bytes("reduce_scatter", x))
        return self._seq(x, self.size).requires_grad_(x.requires_grad)

    def param_f(self, p):
        if p.requires_grad:
            self._rec("backward", "all_reduce", self._bytes("all_reduce", p), what="sp-grads")
        return p

    def note_regather(self, chunk):
        """An SP region kept its gathered input as the chunk: backward gathers it again (comm/sp_saved.py)."""
        self._rec("backward", "all_gather", self._bytes("all_gather", chunk))

    def full_logits(self, output: torch.Tensor, width: int) -> torch.Tensor:
        """What the code after a vocab-split head sees: logits of the full width."""
        return output.new_zeros((*output.shape[:-1], width))

    def coord(self) -> int:
        return self._coord

    def _check(self, x: torch.Tensor) -> None:
        check_seq(x, token_dim(x, self.seq_dim), self.size, "plan")


def _micro_batch(plan: Plan, batch: Any, device: str) -> Any:
    def cut(t: torch.Tensor) -> torch.Tensor:
        n = plan.dp_size * plan.grad_accum
        if t.dim() == 0 or t.shape[0] % n:
            raise ShardingError(f"plan: batch= has a tensor of shape {tuple(t.shape)} whose dim 0 does not split "
                                f"over data={plan.dp_size} x grad_accum={plan.grad_accum} — expected a multiple of {n}.")
        t = t[: t.shape[0] // n]
        # a batch given on the meta device (a dry run) traced again on CPU: zeros of its shape, as the weights are
        t = torch.zeros(t.shape, dtype=t.dtype, device=device) if t.is_meta and device != "meta" else t.to(device)
        return t.to(plan.compute_dtype) if t.is_floating_point() and plan.mixed else t
    return tree_map_only(torch.Tensor, cut, batch)


def trace_activations(model: nn.Module, plan: Plan, batch: Any) -> tuple[tuple[int, tuple[CommEntry, ...]], ...]:
    """Per tensor coordinate, the activation collectives of one micro-step (see module doc).

    On the meta device first; a model whose forward reads values (``.item()``, data-dependent
    control flow: ``transformers``' mask helpers do) is traced again on zero-filled CPU tensors of
    the shard shapes, which holds one tensor-local copy of the model while it runs.

    Coordinates whose shards all have the same shapes trace the same (one is traced for each kind),
    and a layer stack of identical blocks is traced as its first, second and last block, the second's
    collectives standing for every middle block's (falling back to the whole stack if that forward
    fails): planning a 80-block, tensor-8 model traces 3 blocks once, not 640."""
    groups: dict[tuple, list[int]] = {}
    for coord in range(plan.tensor.size):
        groups.setdefault(_shard_signature(plan, coord), []).append(coord)
    stack = uniform_stack(model, plan)
    for device in ("meta", "cpu"):
        try:
            out: dict[int, tuple[CommEntry, ...]] = {}
            for coords in groups.values():
                entries = _trace_short(model, plan, batch, coords[0], device, stack)
                out.update((c, entries) for c in coords)
            return tuple(sorted(out.items()))
        except (RuntimeError, NotImplementedError) as e:
            if device == "cpu" or "meta" not in str(e):
                raise
    raise AssertionError("unreachable")


def _shard_signature(plan: Plan, coord: int) -> tuple:
    """The local shapes of every parameter on tensor coordinate ``coord`` (equal ones trace alike)."""
    mesh, tp = plan.mesh, plan.tensor
    coords = [0] * mesh.ndim
    coords[mesh.axis_index(tp.axis)] = coord
    rank = mesh.rank_at(coords)
    layouts: dict = {}
    out = []
    for p in plan.params:
        if not p.shape or not any(e == tp.axis or (isinstance(e, tuple) and tp.axis in e) for e in tuple(p.spec)):
            continue
        key = (p.spec, p.shape)
        if key not in layouts:
            layouts[key] = tuple(Layout(mesh, p.spec).local_shape(p.shape, rank))
        out.append(layouts[key])
    return tuple(out)


def uniform_stack(model: nn.Module, plan: Plan) -> tuple[str, list[str]] | None:
    """The largest ``nn.ModuleList`` of at least 4 units of one class with the same parameter names
    and shapes and recompute flags (a transformer's blocks): ``(its name, its children's keys)``."""
    units = {u.name: u for u in plan.units}
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 4:
            continue
        kids = list(mod._modules.items())
        full = [f"{name}.{k}" if name else k for k, _ in kids]
        if not all(f in units for f in full) or len({type(m) for _, m in kids}) != 1:
            continue
        shapes = {tuple((n, tuple(p.shape)) for n, p in m.named_parameters()) for _, m in kids}
        if len(shapes) != 1 or len({units[f].recompute for f in full}) != 1:
            continue
        if best is None or len(kids) > len(best[1]):
            best = (name, [k for k, _ in kids])
    return best


@contextlib.contextmanager
def short_stack(model: nn.Module, stack: tuple[str, list[str]]) -> Iterator[list[str]]:
    """``model`` with its uniform stack ``stack`` cut to its first, second and last block while the
    block runs; yields the keys kept."""
    name, keys = stack
    lst = dict(model.named_modules())[name]
    saved = lst._modules
    keep = [keys[0], keys[1], keys[-1]]
    lst._modules = type(saved)((k, saved[k]) for k in keep)
    try:
        yield keep
    finally:
        lst._modules = saved


def _trace_short(model: nn.Module, plan: Plan, batch: Any, coord: int, device: str,
                 stack: tuple[str, list[str]] | None) -> tuple[CommEntry, ...]:
    """``_trace`` with the uniform stack cut to its first, second and last block; the second's
    entries repeated for each middle block. The whole stack where it cannot be cut."""
    if stack is None:
        return _trace(model, plan, batch, coord, device)
    name, keys = stack
    try:
        with short_stack(model, stack):
            entries = _trace(model, plan, batch, coord, device, partial=True)
    except Exception:
        entries = None
    if entries is None:                   # the model's forward needs its whole stack (indexes it, ...)
        return _trace(model, plan, batch, coord, device)
    prefix = f"{name}." if name else ""
    middle = f"{prefix}{keys[1]}"
    out = []
    for e in entries:
        out.append(e)
        if e.where == middle:
            out += [replace(e, where=f"{prefix}{k}") for k in keys[2:-1]]
    return tuple(out)


def trace_values(model: nn.Module, plan: Plan, batch: Any, coord: int, device: str, *,
                 partial: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """The micro-batch and the ``functional_call`` values (tensor coordinate ``coord``'s shard shapes,
    zero-filled, trainable ones requiring a gradient) of one traced forward."""
    tp, mesh = plan.tensor, plan.mesh
    mb = _micro_batch(plan, batch, device)
    coords = [0] * mesh.ndim
    coords[mesh.axis_index(tp.axis)] = coord
    rank = mesh.rank_at(coords)
    values: dict[str, torch.Tensor] = {}
    present = {n for n, _ in model.named_parameters(remove_duplicate=False)} if partial else None
    for p in plan.params:
        if present is not None and p.name not in present:
            continue
        shape = tuple(Layout(mesh, p.spec).local_shape(p.shape, rank)) if p.shape else ()
        values[p.name] = torch.zeros(shape, dtype=plan.compute_dtype, device=device, requires_grad=p.trainable)
    for name, b in model.named_buffers():
        dt = plan.compute_dtype if b.is_floating_point() and plan.mixed else b.dtype
        if device == "meta" or b.is_meta:      # a meta build's buffers (rotary tables) trace as zeros on the CPU
            values[name] = torch.zeros(b.shape, dtype=dt, device=device)
        else:       # a copy: a forward that updates its own buffers (a router's load) leaves the model's alone
            values[name] = b.to(device=device, dtype=dt, copy=True)
    return mb, values


@contextlib.contextmanager
def _meta_autocast() -> Iterator[None]:
    """``torch.autocast`` on the meta device (which has none) as a no-op while the trace runs: PEFT's LoRA of a
    3-D weight builds its delta inside ``torch.autocast(device_type=W.device.type, enabled=False)``."""
    real = torch.autocast

    def autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *args, **kwargs)
    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = real


def run_traced(model: nn.Module, plan: Plan, mb: Any, values: dict[str, torch.Tensor], ops: Any, *,
               partial: bool = False) -> set[str]:
    """One forward of ``model`` on ``values`` with the tensor plan's boundaries installed over ``ops``
    (a ``RecordingOps``): the vocab-split logits become full-width zeros, as ``ShardedLogits`` makes
    the code after the head see them. Returns the split regions whose column input another region reads
    too (``TensorPlan.shared_input``)."""
    tp = plan.tensor

    def logits(output: torch.Tensor, site) -> torch.Tensor:
        # vocab-parallel cross-entropy (runtime/vocab.py): max, then sum-exp and target logit; the
        # code after the head sees full-width logits, as the runtime's ShardedLogits makes it see
        n = output.numel() // max(output.shape[-1], 1)
        ops._rec("forward", "all_reduce", comm.all_reduce_bytes(n, ops.size, 4), what="loss")
        ops._rec("forward", "all_reduce", comm.all_reduce_bytes(2 * n, ops.size, 4), what="loss")
        return ops.full_logits(output, site.width)
    bounds = Boundaries(model, tp, ops, [u.name for u in plan.units], on_logits=logits, partial=partial,
                        recomputed=[u.name for u in plan.units if u.recompute])
    try:
        # with autograd on (the values of trainable parameters require gradients): a backward
        # collective is recorded only where the step's backward will run it — not for what needs no
        # gradient (the stream before the first trainable parameter of a frozen base, say)
        with torch.enable_grad(), _meta_autocast():
            if isinstance(mb, dict):
                args, kwargs = (), mb
            else:
                args, kwargs = (tuple(mb) if isinstance(mb, (tuple, list)) else (mb,)), {}
            functional_call(model, values, args, kwargs, strict=False, tie_weights=True)
    finally:
        bounds.remove()
    return bounds.shared_regions


def _trace(model: nn.Module, plan: Plan, batch: Any, coord: int, device: str, *,
           partial: bool = False) -> tuple[CommEntry, ...]:
    tp = plan.tensor
    mb, values = trace_values(model, plan, batch, coord, device, partial=partial)
    ops = RecordingOps(tp.axis, tp.size, coord, tp.seq_dim, {u.name for u in plan.units if u.recompute})
    run_traced(model, plan, mb, values, ops, partial=partial)
    return tuple(ops.entries)
