"""Helpers for worker functions on the ``world`` pools (``tests/conftest.py``): bad input refused on every
rank alike, before any collective, leaves the world in step."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def in_step() -> float:
    """An all-reduce of one over the whole world: its size, reached only while every rank is still in step
    (whatever raised before it raised before any collective, on every rank alike)."""
    import torch.distributed as dist

    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def raised(calls: Mapping[object, Callable[[], object]], errors) -> tuple[dict, float]:
    """Each call in turn: ``None`` where it returned, ``(type name, message)`` where it raised one of ``errors``
    (anything else propagates); then ``in_step()``."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except errors as e:
            out[name] = (type(e).__name__, str(e))
    return out, in_step()
