"""Memory kinds: where each training state's bytes live — ``device`` (default), ``host`` or ``disk``.

``sl.plan(..., offload={"optimizer": "host", "params": "disk", "activations": "host"}, offload_dir=path)``
(JAX's ``memory_kind``, DeepSpeed's ``offload_optimizer``/``offload_param``, as a layout):

==============  ==========================================================================================
state           what moves to its kind
==============  ==========================================================================================
``optimizer``   the fp32 masters (a copy of their own, in fp32 too) and the optimizer's moments (the update
                runs there), and the gradients the update reads where they persist as shards (ZeRO-2/3;
                on the host when the rest is on disk); ZeRO-0/1's local gradients are accumulated by
                backward on the device and copied out for the update
``params``      ZeRO-3's at-rest shards (each unit's shard comes to the device before its gather);
                without ZeRO-3 every rank computes with its whole parameters on the device: refused
``activations`` what each block saves for backward (not a model state: ``peak_per_rank``'s part);
                refused with recompute, which saves nothing of those blocks to move
==============  ==========================================================================================

``Plan.memory_per_rank(rank, kind=...)`` splits the model states by kind: ``device`` (the default) is
what must fit the accelerator. On a machine without an accelerator ``host`` is the same memory as
``device`` (the kinds are still planned apart); ``disk`` is files under ``offload_dir``, one set per rank.

This module checks the arguments (every problem at once, by key), holds the split and lists the copies
a step makes between kinds (``traffic.copy_entries``, part of ``Plan.comm_per_step``). The engine runs
every kind: ``runtime/offload/core.py`` (optimizer), ``runtime/offload/params.py``, ``runtime/offload/activations.py``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from .names import closest

STATES = ("optimizer", "params", "activations")
KINDS = ("device", "host", "disk")


def offload_problems(offload: Any, offload_dir: Any, *, zero3: bool, recompute: bool) -> tuple[tuple, list[str]]:
    """``(the offload map as sorted (state, kind) pairs without device ones, problems)``."""
    if offload is None:
        offload = {}
    if not isinstance(offload, Mapping):
        return (), [f"plan: offload must be a mapping of state to memory kind — got {type(offload).__name__} "
                    f"{offload!r}; expected e.g. offload={{'optimizer': 'host'}}. States: {', '.join(STATES)}; "
                    f"kinds: {', '.join(KINDS)}."]
    problems, pairs = [], []
    for state, kind in offload.items():
        if state not in STATES:
            problems.append(f"plan: offload names the state {state!r} — expected one of {', '.join(STATES)}; "
                            f"{closest(str(state), list(STATES))}. Fix the key.")
            continue
        if kind not in KINDS:
            problems.append(f"plan: offload[{state!r}] is {kind!r} — expected a memory kind among "
                            f"{', '.join(KINDS)}. Fix the value.")
            continue
        if kind != "device":
            pairs.append((state, kind))
    kinds = dict(pairs)
    if "params" in kinds and not zero3:
        problems.append(f"plan: offload['params']={kinds['params']!r} moves ZeRO-3's at-rest parameter shards, but "
                        "without zero=3 every rank computes with its whole parameters on the device, so there is "
                        "nothing at rest to move — expected zero=3 with params offload. Use zero=3, or offload "
                        "only 'optimizer'.")
    if "activations" in kinds and recompute:
        problems.append(f"plan: offload['activations']={kinds['activations']!r} with recompute — a recomputed block "
                        "saves only its input, so there is nothing of it to move; expected one or the other. Drop "
                        "recompute=, or the activations offload.")
    if "disk" in kinds.values():
        if offload_dir is None:
            problems.append("plan: offload puts " + ", ".join(s for s, k in pairs if k == "disk") + " on 'disk' but "
                            "offload_dir is not given — expected a folder for each rank's files. Pass "
                            "offload_dir='/path/to/fast/disk'.")
        elif not isinstance(offload_dir, (str, os.PathLike)):
            problems.append(f"plan: offload_dir must be a path — got {type(offload_dir).__name__} {offload_dir!r}.")
    elif offload_dir is not None:
        problems.append(f"plan: offload_dir={str(offload_dir)!r} is given but nothing is offloaded to 'disk' — "
                        "expected offload={'optimizer': 'disk', ...} with it. Drop offload_dir, or put a state on disk.")
    return tuple(sorted(pairs)), problems


def disk_problems(offload_dir: str | os.PathLike, need: int) -> list[str]:
    """Problems of ``offload_dir`` on the running machine: missing, not writable, or with less free
    space than ``need`` bytes (the disk bytes of every rank this plan puts on one machine)."""
    path = os.fspath(offload_dir)
    if not os.path.isdir(path):
        return [f"plan: offload_dir={path!r} is not a folder — expected an existing folder on a fast disk. Create "
                "it, or fix the path."]
    if not os.access(path, os.W_OK | os.X_OK):
        return [f"plan: offload_dir={path!r} is not writable by this process — expected a folder it can write. "
                "Fix its permissions, or pick another."]
    free = shutil.disk_usage(path).free
    if free < need:
        return [f"plan: offload_dir={path!r} has {free / 2**30:.2f} GiB free, but the plan puts {need / 2**30:.2f} "
                "GiB there (every rank's disk bytes, all on this machine) — expected at least that much free. Free "
                "space, pick a larger disk, or offload less to 'disk'."]
    return []


def split_by_kind(mem: dict[str, int], offload: tuple, kind: str, *, sharded_grads: bool,
                  delayed: int = 0) -> dict[str, int]:
    """The part of model-state bytes ``mem`` (``memory_per_rank``'s kinds) that lives in memory kind
    ``kind`` under ``offload`` (see the module doc). ``delayed``: bytes of ``mem['grads']`` that are the
    delayed update's own copy of the gradients it applies, which lives with the optimizer whatever the stage."""
    where = dict(offload)
    opt = where.get("optimizer", "device")
    # gradient shards go with the optimizer's states, but not to disk: the update reads them from the host
    at = {"params": where.get("params", "device"), "optimizer": opt,
          "grads": ("host" if opt == "disk" else opt) if sharded_grads else "device", "buffers": "device"}
    out = {k: (v if at[k] == kind else 0) for k, v in mem.items() if k in at}
    if delayed:
        out["grads"] += (delayed if kind == opt else 0) - (delayed if at["grads"] == kind else 0)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


# the disk optimizer's streamed update (``runtime/offload/disk.py``: ``DiskOptimizer``): the masters and
# moments in chunks of ``disk_chunk_elems`` elements, read into a ring of ``DISK_RESIDENT`` chunk buffers
# (two read ahead, the one updated, two written behind), allocated once a step
DISK_RESIDENT = 5


def disk_chunk_elems(total: int) -> int:
    """Elements per chunk of the disk optimizer's update, for ``total`` master elements on a rank: a 64th
    of them, within 64 Ki and 16 Mi."""
    return max(1 << 16, min(1 << 24, -(-total // 64)))


def disk_update_bytes(total: int, slots: int) -> int:
    """The bytes the disk optimizer's update holds beyond the states, for ``total`` master elements and
    ``slots`` fp32 tensors per element (the master and the moments): its ring of chunk buffers
    (``DISK_RESIDENT`` chunks of every slot, fewer where there are fewer chunks), and the optimizer's
    temporaries on the chunk it updates (two of its size, as a step over one tensor: ``planner/peak.py``)."""
    if total <= 0:
        return 0
    chunk = min(disk_chunk_elems(total), total)
    return 4 * (slots * min(DISK_RESIDENT, -(-total // chunk)) * chunk + 2 * chunk)


# the copies between memory kinds, entries of ``Plan.comm_per_step`` beside the collectives (no axis):
# ``traffic.copy_entries``
COPY_OPS = ("d2h", "h2d", "disk_read", "disk_write")
