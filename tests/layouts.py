"""Test helpers shared by worker functions: enumerate layouts, build partial inputs."""

from __future__ import annotations

import itertools

import torch

import shardlib as sl
from shardlib import P


def all_layouts(mesh, ndim: int, partial: bool = True) -> list[sl.Layout]:
    """Every layout of an ``ndim`` tensor on ``mesh``: each axis replicates, is partial, or shards a
    dim, and axes sharing a dim come in every order."""
    names = mesh.axis_names
    opts = (["R", "P"] if partial else ["R"]) + [f"S{d}" for d in range(ndim)]
    out = []
    for assign in itertools.product(opts, repeat=len(names)):
        dims = [[a for a, o in zip(names, assign) if o == f"S{d}"] for d in range(ndim)]
        part = [a for a, o in zip(names, assign) if o == "P"]
        for orders in itertools.product(*[list(itertools.permutations(d)) for d in dims]):
            out.append(sl.Layout(mesh, P.from_dim_axes([tuple(o) for o in orders]), partial=part))
    return out


def local_input(full: torch.Tensor, lay: sl.Layout, rank: int) -> torch.Tensor:
    """This rank's shard of ``full`` in ``lay``; for partial axes, a share whose sum over the axis is
    the true value (share ``(i+1) / (k(k+1)/2)`` for index ``i`` of ``k``)."""
    local = full[lay.local_slices(full.shape, rank)].clone()
    for a in lay.partial:
        k = lay.mesh.axis_size(a)
        i = lay.mesh.coord(rank, a)
        local = local * ((i + 1) / (k * (k + 1) / 2))
    return local
