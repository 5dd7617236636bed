"""The host allocator: glibc's mmap threshold, fixed so that freed tensors go back to the system.

Layer 0 (no shardlib imports besides errors): every rank process calls ``set_mmap_threshold``
when its world starts (``frontend/launcher.init_world``, ``algebra/mesh.Mesh``).
"""

from __future__ import annotations

import os

from .errors import ShardingError, ShardingTypeError
from .validate import non_negative_int

MMAP_THRESHOLD = 4 * 1024 * 1024   # bytes; see set_mmap_threshold
_M_MMAP_THRESHOLD = -3            # glibc's mallopt parameter number (malloc.h)
_APPLIED: int | None = None


def set_mmap_threshold(threshold: int | None = None) -> int | None:
    """Fix glibc's mmap threshold in this process, so that a freed tensor's memory goes back to the
    system; return the threshold set, or None where nothing was changed.

    glibc serves an allocation of at least the *mmap threshold* (128 KiB at start) with its own
    ``mmap``, unmapped on ``free``; smaller ones come from the heap, which keeps freed memory for
    reuse. The threshold is dynamic: freeing an mmapped block raises it to that block's size (up
    to 32 MiB). A training step frees blocks of up to a parameter's size, so after a step or two
    every tensor up to 32 MiB lives on the heap, where freed gradients, gather buffers and
    activations fragment it and the process keeps them: on a 69M-parameter GPT at data=2 the
    peak resident memory of a ZeRO-3 rank rose 1753 MB above the post-import baseline, against
    993 MB with a fixed threshold (the plan's states: 529 MiB). Setting the threshold with
    ``mallopt(M_MMAP_THRESHOLD, t)`` fixes it (and the heap's trim threshold) for the process.
    Blocks of at least ``t`` are then mapped and unmapped each time (page faults: a cost in step
    time, measured by ``benchmarks/bench_memory.py``).

    The default, 4 MiB, maps the large blocks whose churn fragments the heap (gradients of big
    layers as autograd produces them, logits, optimizer temporaries) and leaves small activations
    on the heap. ZeRO-3's gather and reduce-scatter buffers are persistent now
    (``runtime/comm_buffers.py``), yet the knob still holds the peak: measured again on that GPT at
    data 2 (``benchmarks/results/data_axis_69m-2026-11-26.md``), every form's rise is 0.97-1.02x
    the planned peak with it and 1.23-1.37x without; its cost in step time is within this
    machine's run-to-run noise (medians about +12% CPU, the page faults it adds at most ~3%;
    8/16 MiB thresholds, transparent huge pages and a raised trim threshold bought nothing
    measurable). A 64 KiB threshold saves little more memory and, mapping every activation, costs
    up to ~45% step time on small models (``bench_data_parallel.py``: DP at data 2, 185 vs 127
    ms/step).

    ``threshold``: bytes (default ``SHARDLIB_MMAP_THRESHOLD`` from the environment, else
    ``MMAP_THRESHOLD`` = 4 MiB); 0 leaves the allocator alone. Nothing is changed where glibc's
    ``MALLOC_MMAP_THRESHOLD_`` environment variable already sets it, on a C library other than
    glibc (musl, macOS, Windows), or where ``mallopt`` refuses. Called in every rank process when its
    world starts (``init_world`` for ``sl.launch``'s ranks and ``Mesh`` when it starts the world
    itself, as under ``torchrun``), before the model is built; on a GPU the
    model's tensors are not on this heap, and the call is harmless."""
    import ctypes
    import ctypes.util
    import platform

    if threshold is None:
        env = os.environ.get("SHARDLIB_MMAP_THRESHOLD", "")
        try:
            threshold = int(env) if env.strip() else MMAP_THRESHOLD
        except ValueError:
            raise ShardingError(f"SHARDLIB_MMAP_THRESHOLD: not an integer — got {env!r}; expected bytes "
                                "(e.g. 65536) or 0 to leave the allocator alone. Fix the variable.") from None
    if problem := non_negative_int(threshold, "set_mmap_threshold: threshold"):
        raise ShardingTypeError(f"{problem}. Pass bytes, e.g. 65536, or 0 to leave the allocator alone.")
    if threshold == 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return None
    global _APPLIED
    _APPLIED = threshold
    return threshold


def applied() -> int | None:
    """The threshold this process set (``set_mmap_threshold``), or None if it set none."""
    return _APPLIED
