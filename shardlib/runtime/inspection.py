"""Looking into a running engine: the storage it holds (``memory_held``, checked against the
plan) and ZeRO-3's gathered peak — functions of the engine's public state, beside it (``Engine``'s
``memory_held`` and ``peak_*`` call them). Full parameter values: ``access.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..quant.layout import inner_tensors

if TYPE_CHECKING:
    from .engine import Engine


def memory_held(engine: Engine, kind: str = "device") -> dict[str, int]:
    """Bytes of storage this rank holds for model states, by kind (as ``Plan.memory_per_rank``):
    ``params`` (compute-dtype copies, gathered or not), ``grads`` (kept gradients, and the
    gradients the optimizer reads while it steps), ``optimizer`` (fp32 masters that are not
    the parameters themselves, and per-element optimizer state; step counters excluded).
    Shared storage is counted once. Between steps it equals ``plan.memory_per_rank()``;
    inside ``optimizer.step`` (e.g. from a step pre-hook), ``plan.memory_per_rank(at="update")``.

    ``kind``: with offloaded states, the part in one memory kind (as ``memory_per_rank(kind=)``):
    the tensors are put in their kind by what they hold (on a machine without an accelerator host
    and device are one memory), and ``disk`` is the bytes of this rank's current file generation."""
    from ..planner.offload import split_by_kind
    seen: set[int] = set()
    for off in (engine.offload, engine.params_offload):      # offloaded to disk, at rest: no values
        if getattr(off, "placeholder", None) is not None:
            seen.add(off.placeholder.untyped_storage().data_ptr())
    out = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0, "delayed": 0}

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return
        seen.add(st.data_ptr())
        out[kind] += st.nbytes()

    for s in engine.states:
        # a quantized weight: its components (or, under ZeRO-3, the buffer they view)
        for t in inner_tensors([s.param]) if s.plan.quant is not None and s.store is None else [s.storage]:
            add("params", t)
        add("params", s.shard)
    if engine.buckets is not None and engine.buckets.views:
        for buf in engine.buckets.buffers:
            add("grads", buf)
        # the last bucket's tail holds the step's scalars, not gradients
        out["grads"] -= 4 * engine.buckets.riders
        out["buffers"] += 4 * engine.buckets.riders
    for s in engine.states:
        add("grads", s.param.grad)
        add("grads", s.grad_shard)
    if engine.offload is not None and engine.offload.streamed.in_flight:   # a streamed update toggles the
        engine.offload.wait()                                              # masters' gradients: done first
    # what the optimizer reads, where it is another tensor: the delayed update's (in flight between steps, with
    # the optimizer on the host) in the optimizer's kind, as the plan counts it
    flight = "delayed" if engine.plan.delayed and engine.offload is not None and engine.offload.in_flight else "grads"
    for s in engine.states:
        add(flight, s.master.grad if s.master is not None else None)
    for s in engine.states:
        add("optimizer", s.master)
    for state in engine.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                add("optimizer", v)
    delayed = out.pop("delayed")
    out["grads"] += delayed
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    offload = engine.plan.offload
    if not offload:
        return out if kind in ("device", "all") else {k: 0 for k in out}
    on_disk = engine.offload.held() if engine.offload is not None else 0
    params_disk = engine.params_offload.held() if engine.params_offload is not None else 0
    if kind == "all":
        out["optimizer"] += on_disk
        out["params"] += params_disk
        out["total"] += on_disk + params_disk
        return out
    st = engine.plan.states
    part = split_by_kind(out, offload, kind, sharded_grads=st.grads is not None and not st.keep_local_grads,
                         delayed=delayed)
    if kind == "disk":
        part["optimizer"] += on_disk
        part["params"] += params_disk
        part["total"] += on_disk + params_disk
    return part

def peak_gathered_bytes(engine: Engine) -> int:
    """ZeRO-3: the most bytes of gathered parameters (and gather buffers) held at once."""
    return engine.units.peak if engine.units is not None else 0

def peak_transient_bytes(engine: Engine) -> dict[str, int]:
    """ZeRO-3: the most bytes held at once of ``gathered`` parameters and gather buffers, of
    ``grads`` on their way to a reduce-scatter (its inputs being filled or in flight, and
    outputs not yet added into the shards), and of ``both`` together — what
    ``plan.peak_per_rank`` bounds by its backward transient. Zeros when parameters are replicated."""
    u = engine.units
    if u is None:
        return {"gathered": 0, "grads": 0, "both": 0}
    return {"gathered": u.peak, "grads": u.grad_peak, "both": u.total_peak}
