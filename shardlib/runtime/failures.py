"""A pipeline step's failure told to the other ranks, through the process group's store.

A rank that fails mid-step writes why under one key before raising; a peer whose receive then times
out reads it and names that rank (``runtime/pipeline.py``'s ``PipelineError``) instead of reporting a
bare timeout. Every call is best effort: without a store, or with the store gone, it does nothing.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

_FAILED = "shardlib/pipe/failed"


def _store():
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def report_failure(what: str) -> None:
    """Tell the other ranks that this one failed (``what``: the rank and its error)."""
    store = _store()
    if store is not None:
        try:
            store.set(_FAILED, what[:2000])
        except Exception:       # the store is gone: the peers time out on their own
            pass


def reported_failure() -> str | None:
    """What a failed rank reported, or None."""
    store = _store()
    if store is None:
        return None
    try:
        if store.check([_FAILED]):
            return store.get(_FAILED).decode()
    except Exception:
        return None
    return None


def clear_failure() -> None:
    """Forget a reported failure (before the world runs again)."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.delete_key(_FAILED)
