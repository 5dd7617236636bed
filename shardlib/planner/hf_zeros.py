"""Placeholders for running a transformers model's parts without their values (``planner/hf_stages.py``).

``zeros_for`` reads parameters as zeros of stride 0 (no storage) while the model's own forward runs;
``meta_or_zeros`` runs a function on meta tensors and, where an op has no meta kernel (an MoE block's
``nonzero``, ``grouped_mm`` wanting bf16), again on zeros on the CPU of the same shapes; ``concrete`` and
``shapes_of`` turn an example batch into the rows a probe runs on and summarize block arguments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only


@contextmanager
def zeros_for(model: nn.Module, which: str, dtype: torch.dtype, device: torch.device, *,
               grad: bool = False, memo: dict | None = None) -> Iterator[None]:
    """Read parameters (``which="meta"``: those on the meta device; ``"all"``: every one, and meta
    buffers) as zeros of stride 0 — no storage. Floating ones in ``dtype``; ``grad``: zeros that
    require a gradient, so what is computed from them is seen to be. ``memo`` keeps the found places
    and their zeros between calls (a stage's step: its meta parameters are the other stages', fixed
    at the build; a place whose tensor was replaced since is found again)."""
    key = (which, dtype, device, grad)
    swapped = memo.get(key) if memo is not None else None
    if swapped is None or any(store.get(attr) is not t for store, attr, t, _ in swapped):
        made: dict[int, torch.Tensor] = {}
        swapped = []

        def zeros(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:
                dt = dtype if t.is_floating_point() else t.dtype
                with torch.inference_mode(False):       # kept: usable whatever mode a later call runs in
                    base = torch.zeros((), dtype=dt, device=device, requires_grad=grad and dt.is_floating_point)
                    made[id(t)] = base.expand(t.shape)
            return made[id(t)]
        for mod in model.modules():
            for store, buffers in ((mod._parameters, False), (mod._buffers, True)):
                for attr, t in store.items():
                    if t is None or (buffers and not t.is_meta) or (which == "meta" and not t.is_meta):
                        continue
                    swapped.append((store, attr, t, zeros(t)))
        if memo is not None:
            memo[key] = swapped
    for store, attr, _, z in swapped:
        store[attr] = z
    try:
        yield
    finally:
        for store, attr, t, _ in swapped:
            store[attr] = t


def shapes_of(kwargs: dict[str, Any]) -> dict[str, list[tuple[int, ...]]]:
    return {k: [tuple(t.shape) for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)] for k, v in kwargs.items()}


def concrete(batch: Mapping[str, Any], rows: int) -> dict[str, Any]:
    """The first ``rows`` rows of each tensor of ``batch`` (a 0-dim one, ``num_items_in_batch``, as
    it is); meta tensors (an example batch of shapes only) as ones on the CPU."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v[:rows] if v.dim() else v
            if v.is_meta:
                v = torch.ones(v.shape, dtype=v.dtype)
        out[k] = v
    return out


def meta_or_zeros(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on meta tensors; where that fails for want of a meta kernel (MoE blocks:
    ``nonzero``, ``grouped_mm``), again on zeros on the CPU of the same shapes, dtypes and
    ``requires_grad`` (one micro-batch's worth, allocated while it runs)."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, RuntimeError):
        # no meta kernel (``nonzero``), or one stricter than the CPU's (``grouped_mm``'s asks for bf16): any
        # error on meta is worth a run on zeros — one the model really raises, it raises there too
        pass

    def zeros(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        z = torch.zeros(t.shape, dtype=t.dtype)
        return z.requires_grad_(True) if t.requires_grad and z.is_floating_point() else z
    return fn(*tree_map_only(torch.Tensor, zeros, args), **tree_map_only(torch.Tensor, zeros, kwargs))
