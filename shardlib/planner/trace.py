"""Tracing the tensor axis's activation collectives at plan time.

The boundary hooks that a step runs (``comm/boundaries.py``) are installed on the model with an
``Ops`` that records instead of communicating, and one micro-batch's forward runs on the meta
device (``torch.func.functional_call`` with meta tensors of each rank's shard shapes: nothing is
allocated, the model is not touched). Each boundary records its forward collective and the
transposed one its backward will run; a unit that recomputes records its forward collectives
again in backward. Traced once per tensor coordinate (uneven widths give uneven shards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..algebra.layout import Layout
from ..comm import core as comm
from ..comm.boundaries import Boundaries, check_seq
from ..errors import ShardingError
from .traffic import CommEntry

if TYPE_CHECKING:
    from .plan import Plan


class RecordingOps:
    """``comm.boundaries.Ops`` that records each collective (with the one its backward runs) and
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

    def _seq(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        shape = list(x.shape)
        shape[self.seq_dim] = int(shape[self.seq_dim] * factor)
        return x.new_empty(shape)

    def f(self, x):
        self._rec("backward", "all_reduce", self._bytes("all_reduce", x))
        return x

    def g(self, y):
        self._rec("forward", "all_reduce", self._bytes("all_reduce", y))
        return y

    def gather_seq(self, x):
        self._rec("forward", "all_gather", self._bytes("all_gather", x))
        self._rec("backward", "reduce_scatter", self._bytes("reduce_scatter", x))
        return self._seq(x, self.size)

    def scatter_seq(self, y):
        self._check(y)
        out = self._seq(y, 1 / self.size)
        self._rec("forward", "reduce_scatter", self._bytes("reduce_scatter", out))
        self._rec("backward", "all_gather", self._bytes("all_gather", out))
        return out

    def slice_seq(self, x):
        self._check(x)
        out = self._seq(x, 1 / self.size)
        self._rec("backward", "all_gather", self._bytes("all_gather", out))
        return out

    def unslice_seq(self, x):
        self._rec("forward", "all_gather", self._bytes("all_gather", x))
        return self._seq(x, self.size)

    def param_f(self, p):
        self._rec("backward", "all_reduce", self._bytes("all_reduce", p), what="sp-grads")
        return p

    def coord(self) -> int:
        return self._coord

    def _check(self, x: torch.Tensor) -> None:
        check_seq(x, self.seq_dim, self.size, "plan")


def _micro_batch(plan: Plan, batch: Any, device: str) -> Any:
    def cut(t: torch.Tensor) -> torch.Tensor:
        n = plan.dp_size * plan.grad_accum
        if t.dim() == 0 or t.shape[0] % n:
            raise ShardingError(f"plan: batch= has a tensor of shape {tuple(t.shape)} whose dim 0 does not split "
                                f"over data={plan.dp_size} x grad_accum={plan.grad_accum} — expected a multiple of {n}.")
        t = t.to(device)[: t.shape[0] // n]
        return t.to(plan.compute_dtype) if t.is_floating_point() and plan.mixed else t
    return tree_map_only(torch.Tensor, cut, batch)


def trace_activations(model: nn.Module, plan: Plan, batch: Any) -> tuple[tuple[int, tuple[CommEntry, ...]], ...]:
    """Per tensor coordinate, the activation collectives of one micro-step (see module doc).

    On the meta device first; a model whose forward reads values (``.item()``, data-dependent
    control flow: ``transformers``' mask helpers do) is traced again on zero-filled CPU tensors of
    the shard shapes, which holds one tensor-local copy of the model while it runs."""
    try:
        return tuple(_trace(model, plan, batch, coord, "meta") for coord in range(plan.tensor.size))
    except (RuntimeError, NotImplementedError) as e:
        if "meta" not in str(e):
            raise
    return tuple(_trace(model, plan, batch, coord, "cpu") for coord in range(plan.tensor.size))


def _trace(model: nn.Module, plan: Plan, batch: Any, coord: int, device: str) -> tuple[int, tuple[CommEntry, ...]]:
    tp, mesh = plan.tensor, plan.mesh
    mb = _micro_batch(plan, batch, device)
    coords = [0] * mesh.ndim
    coords[mesh.axis_index(tp.axis)] = coord
    rank = mesh.rank_at(coords)
    values: dict[str, torch.Tensor] = {}
    for p in plan.params:
        shape = tuple(Layout(mesh, p.spec).local_shape(p.shape, rank)) if p.shape else ()
        values[p.name] = torch.zeros(shape, dtype=plan.compute_dtype, device=device)
    for name, b in model.named_buffers():
        dt = plan.compute_dtype if b.is_floating_point() and plan.mixed else b.dtype
        values[name] = b.to(device=device, dtype=dt) if device != "meta" else torch.empty(b.shape, dtype=dt,
                                                                                            device=device)
    ops = RecordingOps(tp.axis, tp.size, coord, tp.seq_dim, {u.name for u in plan.units if u.recompute})

    def logits(output: torch.Tensor, site) -> torch.Tensor:
        # vocab-parallel cross-entropy (runtime/vocab.py): max, then sum-exp and target logit; the
        # code after the head sees full-width logits, as the runtime's ShardedLogits makes it see
        n = output.numel() // max(output.shape[-1], 1)
        ops._rec("forward", "all_reduce", comm.all_reduce_bytes(n, ops.size, 4), what="loss")
        ops._rec("forward", "all_reduce", comm.all_reduce_bytes(2 * n, ops.size, 4), what="loss")
        return output.new_zeros((*output.shape[:-1], site.width))
    bounds = Boundaries(model, tp, ops, [u.name for u in plan.units], on_logits=logits)
    try:
        with torch.no_grad():
            if isinstance(mb, dict):
                args, kwargs = (), mb
            else:
                args, kwargs = (tuple(mb) if isinstance(mb, (tuple, list)) else (mb,)), {}
            torch.func.functional_call(model, values, args, kwargs, strict=False, tie_weights=True)
    finally:
        bounds.remove()
    return coord, tuple(ops.entries)
