"""``shard_map``: run a function on local shards, JAX semantics.

``sl.shard_map(f, mesh, in_specs, out_specs)(*args)``: each argument is a *global* tensor (the
same on every rank, as in a single-process program); ``f`` receives this rank's shard of it by
``in_specs``, runs with the mesh in scope (so ``sl.psum(x, 'data')`` needs no mesh argument), and
its outputs — shards by ``out_specs`` — are assembled into global tensors on every rank.

Gradients equal the single-process ones: inputs' gradients are gathered back to global; values
replicated over an axis that meet per-rank values get ``pbroadcast`` automatically (see
``shardlib.vma``). An output that varies over an axis its ``out_specs`` entry does not shard on is
an error, as in JAX: ``psum`` it, or shard an output dim on that axis.

Uneven shapes work: inputs are split by ceil chunking, and outputs whose shards follow ceil
chunking are reassembled (one small all-gather of shard shapes tells the global shape).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..algebra.layout import Layout, chunk_bounds
from ..algebra.mesh import Mesh, use_mesh
from ..algebra.spec import PartitionSpec
from ..comm import core as comm
from ..comm.redistribute import plan_redistribute
from ..comm.vma import tracking
from ..errors import ShardingError, ShardingTypeError

SpecTree = Any


def _map_spec(value: Any, spec: SpecTree, fn: Callable[[Any, PartitionSpec | None, str], Any], path: str) -> Any:
    """Apply ``fn(leaf, spec, path)`` to every leaf of ``value``; ``spec`` is a prefix tree of it."""
    if spec is None or isinstance(spec, PartitionSpec):
        if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple, dict)):
            return fn(value, spec, path)
        if isinstance(value, dict):
            return {k: _map_spec(v, spec, fn, f"{path}[{k!r}]") for k, v in value.items()}
        return type(value)(_map_spec(v, spec, fn, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(spec, dict) and isinstance(value, dict) and set(spec) == set(value):
        return {k: _map_spec(value[k], spec[k], fn, f"{path}[{k!r}]") for k in value}
    if isinstance(spec, (list, tuple)) and isinstance(value, (list, tuple)) and len(spec) == len(value):
        return type(value)(_map_spec(v, s, fn, f"{path}[{i}]") for i, (v, s) in enumerate(zip(value, spec)))
    raise ShardingTypeError(f"shard_map: {path} does not match its spec — got a {type(value).__name__} "
                            f"against spec {spec!r}; expected a PartitionSpec, None, or a list/tuple/dict "
                            "of them with the value's structure.")


class _ShardInput(torch.autograd.Function):
    """Global tensor -> this rank's shard; backward gathers the shard gradients to global."""

    @staticmethod
    def forward(ctx, x, layout: Layout, mesh: Mesh):
        ctx.plan = plan_redistribute(layout, layout.replace(spec=PartitionSpec()), tuple(x.shape), x.dtype)
        ctx.mesh = mesh
        return x[layout.local_slices(x.shape, mesh.rank)].clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.plan.execute(g.contiguous(), ctx.mesh), None, None


class _GatherOutput(torch.autograd.Function):
    """This rank's output shard -> global tensor; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, y, layout: Layout, shape: tuple[int, ...], mesh: Mesh):
        ctx.slices = layout.local_slices(shape, mesh.rank)
        plan = plan_redistribute(layout, layout.replace(spec=PartitionSpec()), shape, y.dtype)
        y = y.contiguous()
        out = plan.execute(y, mesh)
        # a replicated output needs no gather: copy it, so that the result is a new tensor in every
        # world and in-place ops on it work (autograd forbids them on a custom Function's view)
        return out.clone() if out is y else out

    @staticmethod
    def backward(ctx, g):
        return g[ctx.slices].contiguous(), None, None, None


def shard_map(fn: Callable, mesh: Mesh, in_specs: SpecTree, out_specs: SpecTree) -> Callable:
    """Wrap ``fn`` to run on local shards of global arguments (see the module docstring)."""
    if not isinstance(mesh, Mesh):
        raise ShardingTypeError(f"shard_map: needs a Mesh over running processes — got {type(mesh).__name__}.")
    if not callable(fn):
        raise ShardingTypeError(f"shard_map: fn must be callable — got {type(fn).__name__}.")

    @functools.wraps(fn)
    def wrapped(*args):
        # a bare spec is a prefix of the argument tuple: it applies to every argument (JAX)
        specs = (in_specs,) * len(args) if in_specs is None or isinstance(in_specs, PartitionSpec) else in_specs
        if not isinstance(specs, (tuple, list)) or isinstance(specs, PartitionSpec) or len(specs) != len(args):
            raise ShardingTypeError(
                f"shard_map: in_specs must have one entry per argument — got {len(args)} arguments and "
                f"in_specs {in_specs!r}. Write in_specs=(P('data'), P()) for two arguments.")

        with tracking(mesh) as tracker, use_mesh(mesh):
            def to_local(x, spec, path):
                if not isinstance(x, torch.Tensor):
                    return x
                lay = Layout(mesh, spec if spec is not None else PartitionSpec(), name=f"in_specs{path}")
                lay.check(x.shape, name=f"argument{path}")
                local = _ShardInput.apply(x, lay, mesh)
                tracker.set(local, frozenset(a for a in lay.spec.axes if mesh.axis_size(a) > 1))
                return local

            local_args = [_map_spec(a, s, to_local, f"[{i}]") for i, (a, s) in enumerate(zip(args, specs))]
            out = fn(*local_args)

            pending: list[tuple[torch.Tensor, Layout, str]] = []

            def check_out(y, spec, path):
                if not isinstance(y, torch.Tensor):
                    return y
                lay = Layout(mesh, spec if spec is not None else PartitionSpec(), name=f"out_specs{path}")
                lay.check(y.shape, name=f"output{path}")
                vma = tracker.vma(y)
                sharded = frozenset(a for a in lay.spec.axes if mesh.axis_size(a) > 1)
                extra = vma - sharded
                if extra:
                    axes = tuple(a for a in mesh.axis_names if a in extra)
                    raise ShardingError(
                        f"shard_map: output{path} varies over mesh axes {axes}, but out_specs{path} = "
                        f"{lay.spec} says it is replicated over them — expected every axis the value varies "
                        f"over to shard an output dim. psum it over {axes[0]!r}, or put {axes[0]!r} in the "
                        "out_spec of a dim.")
                missing = sharded - vma
                if missing and y.requires_grad:
                    y = tracker.pvary(y, missing)
                pending.append((y, lay, path))
                return y

            out = _map_spec(out, out_specs, check_out, "")

        return _assemble(out, pending, mesh)

    return wrapped


def _assemble(out: Any, pending: list, mesh: Mesh) -> Any:
    """Gather every output shard to its global tensor (one small collective for the shapes)."""
    shapes = [tuple(y.shape) for y, _, _ in pending]
    need = [i for i, (_, lay, _) in enumerate(pending) if lay.sharded_axes]
    if need:
        local = torch.tensor([s for i in need for s in shapes[i]], dtype=torch.int64)
        everyone = comm.all_gather(local.to(mesh.device), mesh, mesh.axis_names,
                                   tag="metadata").cpu().view(mesh.size, -1)
        offset = 0
        for i in need:
            y, lay, path = pending[i]
            sizes = everyone[:, offset:offset + y.dim()]
            offset += y.dim()
            shapes[i] = _global_shape(sizes, lay, mesh, path)
    # in the order the leaves were visited: the same tensor may be returned twice under two specs
    results = iter([_GatherOutput.apply(y, lay, shape, mesh) for (y, lay, _), shape in zip(pending, shapes)])

    def swap(v, spec, path):
        return next(results) if isinstance(v, torch.Tensor) else v

    return _map_spec(out, None, swap, "")


def _global_shape(sizes: torch.Tensor, lay: Layout, mesh: Mesh, path: str) -> tuple[int, ...]:
    """The global shape from every rank's shard shape, checked the same way on every rank (so that
    all ranks raise together, before any of them enters the gather)."""
    shape = []
    for d in range(sizes.shape[1]):
        axes = lay.dim_axes(d)
        groups = mesh.all_groups(axes) if axes else [[r] for r in range(mesh.size)]
        totals = []
        for members in groups:
            got = [int(sizes[r, d]) for r in members]
            n = sum(got)
            want = [hi - lo for lo, hi in (chunk_bounds(n, len(members), j) for j in range(len(members)))]
            if got != want:
                raise ShardingError(
                    f"shard_map: output{path} dim {d} has shard sizes {got} along {axes} (ranks {members}) — "
                    f"expected {want}, the ceil chunking of its total {n}. Make the function return shards "
                    "of ceil(n/k) elements (trailing ones smaller), or return it replicated.")
            totals.append(n)
        if len(set(totals)) != 1:
            where = f"along {axes}" if axes else "on the ranks"
            raise ShardingError(
                f"shard_map: output{path} dim {d} has different global sizes {sorted(set(totals))} {where} — "
                f"expected one size: out_specs{path} = {lay.spec} says dim {d} is "
                + (f"split over {axes} only" if axes else "replicated")
                + ". Return shards of one global tensor, or shard the dim over the axes it differs on.")
        shape.append(totals[0])
    return tuple(shape)
