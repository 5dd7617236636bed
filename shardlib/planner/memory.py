"""Memory accounting of a ``Plan``: model-state bytes per rank (the ZeRO-paper terms), ZeRO-3's
gather schedule and the transient bytes of gathered units: functions of a plan, beside it (``Plan``'s methods
call them; a split plan's per-rank figures are its rank's local plan's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ShardingError
from .flat import FROZEN, TRAIN
from .offload import split_by_kind

if TYPE_CHECKING:
    from .plan import Plan, UnitPlan


def memory_per_rank(plan: Plan, rank: int | None = None, *, at: str = "rest", kind: str = "device") -> dict[str, int]:
    """Model-state bytes this rank holds, by kind: ``params`` (compute-dtype copies),
    ``grads``, ``optimizer`` (fp32 master copy where it is not the parameter itself, plus
    optimizer state), and their ``total``; apart from them, ``buffers``: the slots of the
    step's scalars kept at the end of the last gradient bucket when they ride its all-reduce
    (``scalars_ride_gradients``; 4 bytes a scalar).

    ``at="rest"``: between steps (the ZeRO-paper terms). ``at="update"``: while the optimizer
    steps, when ``grads`` also holds the gradients the optimizer reads where they are not
    kept between steps — fp32 copies where gradients are reduced in a 2-byte dtype, and
    with fp32 reduction under ZeRO-1 the reduce-scatter outputs (each bucket's padded chunk)
    that the masters' gradients view. ZeRO-3's gathered units are transient as well: see
    ``transient_per_rank``.

    Sharded states are split as flat segments (``flat.py``): a rank holds ``ceil(T/N)`` or
    fewer of each segment's ``T`` elements, so every rank is within one element per segment
    of the ZeRO formula. O(flat groups) per rank.

    ``kind``: the memory kind (``planner/offload.py``) whose part to give — ``"device"`` (the
    default: what must fit the accelerator), ``"host"`` or ``"disk"``, where ``sl.plan(offload=...)``
    puts states; ``"all"`` gives every kind together."""
    if at not in ("rest", "update"):
        raise ShardingError(f"memory_per_rank: at={at!r} — expected 'rest' or 'update'.")
    if kind not in ("device", "host", "disk", "all"):
        raise ShardingError(f"memory_per_rank: got kind={kind!r}; expected 'device', 'host', 'disk' or 'all'. "
                            "Pass one of them.")
    rank = plan._rank(rank)
    c = plan.compute_dtype.itemsize
    g = plan.reduce_dtype.itemsize
    states, groups = plan.states, plan.flat.groups
    psi, psi_t = plan.num_params, plan.num_trainable
    # this rank's elements of each flat group's segments (ZeRO's shards: flat.py)
    mine = [(grp.local_numel(rank, TRAIN), grp.local_numel(rank, FROZEN)) for grp in groups]
    mine_t = sum(t for t, _ in mine)
    params = (sum(t + f for t, f in mine) * c if states.params is not None else
              (psi - sum(p.numel for p in plan.params if p.quant is not None)) * c
              + sum(p.quant.held_bytes(p.shape) for p in plan.params if p.quant is not None))
    if states.keep_local_grads:
        grads = psi_t * c                             # full local gradients (compute dtype) persist
    else:
        grads = (mine_t if states.grads is not None else psi_t) * g   # only the reduced shard persists
    n_opt = mine_t if states.optim is not None else psi_t
    # in fp32 the parameter is the master, unless offloaded: the master and the compute copy are apart
    master = 4 * n_opt if plan.mixed or {"optimizer", "params"} & set(dict(plan.offload)) else 0
    optim = master + plan.optimizer_state_bytes * n_opt
    if at == "update":
        if plan.reduce_dtype != torch.float32:
            grads += 4 * n_opt                        # fp32 copies of the reduced gradients
        elif states.keep_local_grads and (states.grads is not None or plan.reduce_dtype != plan.compute_dtype):
            # the masters' gradients view the collective's output: ZeRO-1's reduced chunk of
            # each bucket (padded), or a full all-reduced gradient kept apart from the local one
            grads += (sum(grp.chunk(TRAIN) for grp in groups) if states.grads is not None else psi_t) * g
    buffers = 4 * plan.scalars_per_step() if plan.scalars_ride_gradients and grad_views(plan) else 0
    # the delayed update (``delayed=True``) reads its own fp32 copy of the gradients it applies, on the host with
    # the optimizer, from one step's backward until the next step's (``runtime/offload/core.py``): between steps too
    delayed = 4 * n_opt if plan.delayed else 0
    out = {"params": params, "grads": grads + delayed, "optimizer": optim, "total": params + grads + delayed + optim,
           "buffers": buffers}
    if kind == "all" or not plan.offload:
        return out if kind in ("all", "device") else {k: 0 for k in out}
    return split_by_kind(out, plan.offload, kind, sharded_grads=states.grads is not None and not states.keep_local_grads,
                         delayed=delayed)


def delayed_copy_bytes(plan: Plan, rank: int | None = None) -> int:
    """The host bytes of the delayed update's own copy of the gradients it applies (0 without ``delayed``)."""
    if not plan.delayed:
        return 0
    rank = plan._rank(rank)
    n_opt = (sum(grp.local_numel(rank, TRAIN) for grp in plan.flat.groups) if plan.states.optim is not None
             else plan.num_trainable)
    return 4 * n_opt

def grad_views(plan: Plan) -> bool:
    """Replicated-parameter gradients live in persistent bucket buffers (views into them)."""
    return (plan.states.params is None and plan.states.keep_local_grads
            and plan.reduce_dtype == plan.compute_dtype)

def gather_schedule(plan: Plan) -> tuple[str, ...]:
    """ZeRO-3: the order in which one micro-step starts gathering (``G``), waits for and
    unpacks (``W``) and frees (``F``) its units, as the runtime runs it: the root when the
    model's forward starts; each unit just before its forward, then prefetching the next one;
    in backward each unit again (unless it stayed gathered), freed once its gradients are
    reduced, then gathering the one before it — skipping a unit no gradient runs through (a frozen
    embedding), freed at the micro-step's end if it stayed gathered; the root last. Empty when
    parameters are replicated.
    """
    if plan.states.params is None:
        return ()
    if plan.pipe_size > 1 and plan.pipe_coord is not None:
        return _pipe_gather_schedule(plan)
    root = next((u for u in plan.units if u.name == ""), None)
    units = [u for u in plan.units if u.name != ""]
    status = {u.name: "free" for u in plan.units}
    events: list[str] = []

    def name(u: UnitPlan) -> str:
        return u.name or "<root>"

    def gather(u):
        if u is not None and status[u.name] == "free":
            events.append(f"G({name(u)})")
            status[u.name] = "gathering"

    def wait(u):
        if status[u.name] != "gathered":
            gather(u)
            events.append(f"W({name(u)})")
            status[u.name] = "gathered"

    def free(u):
        if status[u.name] == "gathered":
            events.append(f"F({name(u)})")
            status[u.name] = "free"

    if root is not None:
        wait(root)
    if units:
        gather(units[0])
    for i, u in enumerate(units):                       # forward
        wait(u)
        gather(units[i + 1] if i + 1 < len(units) else None)
        if u.reshard_after_forward:
            free(u)
    back = [u for u in units if u.backward]          # a frozen embedding runs no backward
    for i in reversed(range(len(back))):                # backward
        u = back[i]
        wait(u)
        free(u)
        gather(back[i - 1] if i > 0 else None)
    for u in reversed(units):                           # at the micro-step's end (if kept gathered)
        if not u.backward:
            free(u)
    if root is not None:
        free(root)
    return tuple(events)

def _pipe_gather_schedule(plan: Plan) -> tuple[str, ...]:
    """``gather_schedule`` of a stage-local plan under a pipe axis, over the whole step, as
    ``runtime/pipeline.py`` runs its lowered actions. ``"step"`` policy: ``UNSHARD`` starts
    gathering every unit of the stage, then waits for each; ``REDUCE_GRAD`` frees them (reduced
    last unit first). ``"microbatch"``: the root when its stage first computes; each forward gathers the stage's units in order (each waited for, the next
    prefetched, then freed), each backward in reverse (waited for, freed once reduced, the one
    before it prefetched) — ZeRO-3's micro-step, per stage; the root is reduced and freed after
    its stage's last backward (``REDUCE_GRAD``)."""
    pp = plan.pipeline
    by_stage: dict[int, list] = {}
    root = None
    for u in plan.units:
        if u.name == "":
            root = u
        else:
            by_stage.setdefault(pp.stage_of_block(u.name), []).append(u)
    status = {u.name: "free" for u in plan.units}
    events: list[str] = []

    def ev(op: str, u) -> None:
        events.append(f"{op}({u.name or '<root>'})")

    def gather(u) -> None:
        if u is not None and status[u.name] == "free":
            ev("G", u)
            status[u.name] = "gathering"

    def wait(u) -> None:
        if status[u.name] != "gathered":
            gather(u)
            ev("W", u)
            status[u.name] = "gathered"

    def free(u) -> None:
        if status[u.name] == "gathered":
            ev("F", u)
            status[u.name] = "free"

    root_stage = {s.index for s in pp.stages if s.pre or s.post}
    for a in pp.lowered(plan.pipe_coord, unshard=plan.pipe_unshard):
        units = by_stage.get(a.stage, [])
        if a.kind == "UNSHARD":
            mine = ([root] if root is not None and a.stage in root_stage else []) + units
            for u in mine:
                gather(u)
            for u in mine:
                wait(u)
        elif a.kind == "REDUCE_GRAD":          # the stage's last backward is done: reduce and free
            for u in reversed(units):
                free(u)
            if root is not None and a.stage in root_stage:
                free(root)
        elif a.kind in ("F", "B") and not plan.pipe_unshard:
            if root is not None and a.stage in root_stage:
                wait(root)
            order = units if a.kind == "F" else units[::-1]
            for i, u in enumerate(order):
                wait(u)
                if a.kind == "F":
                    gather(order[i + 1] if i + 1 < len(order) else None)
                    free(u)
                else:
                    free(u)
                    gather(order[i + 1] if i + 1 < len(order) else None)
    if root is not None:
        free(root)
    return tuple(events)

def transient_per_rank(plan: Plan, rank: int | None = None) -> dict[str, int]:
    """ZeRO-3: the peak bytes of gathered parameters plus all-gather output buffers, replaying
    ``gather_schedule`` as the runtime's persistent buffer serves it (``runtime/comm_buffers.py``):
    ``buffer`` is the largest non-root unit's output (``N`` chunks of ``ceil(T/N)`` elements per
    segment, ``flat.py``; the root's where it is the only unit), held from its first use on (the
    replay is a step after the first: it starts with the buffer held, where the step uses it); a
    gather takes it (a gather started while it is lent takes a buffer of its unit's size until
    its wait; a larger unit's — the root's — takes the idle buffer's place: it is freed, and
    allocated again by the next gather that fits); a wait unpacks it into the parameters (both
    held for a moment) and gives it back; a free releases the parameters. ``buffer``: the
    bytes of it held between steps. The
    engine tracks the same quantity (``engine.peak_gathered_bytes``). Full-size gradients of a
    unit before its reduce-scatter are not counted (``peak_per_rank``). Zero when parameters are
    replicated."""
    if plan.states.params is None:
        return {"gathered": 0, "buffer": 0}
    c = plan.compute_dtype.itemsize
    full = {u.name: sum(p.stored(c) for p in plan.unit_params(u.name)) * c for u in plan.units}   # quantized: packed
    buf = {grp.name: (grp.chunk(TRAIN) + grp.chunk(FROZEN)) * grp.ranks * c for grp in plan.flat.groups}
    size = max((b for u, b in buf.items() if u != ""), default=buf.get("", 0))
    by_label = {(u.name or "<root>"): u.name for u in plan.units}
    events = [(ev[0], by_label[ev[2:-1]]) for ev in plan.gather_schedule()]
    # the persistent buffer, where a step uses it, is held when the next one starts (steady state)
    held = any(op == "G" and buf[u] <= size for op, u in events)
    live = peak = size if held else 0
    holder = None                # the unit it is lent to
    for op, u in events:
        if op == "G":
            if holder is None and buf[u] <= size:
                holder, live, held = u, live + (0 if held else size), True
            else:
                if holder is None and held:          # a larger unit (the root) in the idle buffer's place
                    live, held = live - size, False
                live += buf[u]
        elif op == "W":
            live += full[u]
            peak = max(peak, live)
            if holder == u:
                holder = None
            else:
                live -= buf[u]
        else:
            live -= full[u]
        peak = max(peak, live)
    return {"gathered": peak, "buffer": size if held else 0}     # "buffer": held between steps

def zero_formula(plan: Plan) -> dict[str, float]:
    """The ZeRO-paper terms for this plan, to compare with ``memory_per_rank``: parameters
    ``cΨ`` (``/N`` when sharded), gradients ``gΨ_t`` (``/N`` when sharded and not kept whole),
    optimizer ``KΨ_t`` (``/N`` when sharded), with Ψ the parameter count and Ψ_t the trainable
    count (equal in the paper). Equal to ``memory_per_rank`` when every flat segment (a unit's or
    bucket's trainable or frozen parameters, laid end to end) divides by N; above it by less than
    one element per segment otherwise."""
    psi, psi_t, n = plan.num_params, plan.num_trainable, plan.data_size
    c, g = plan.compute_dtype.itemsize, plan.reduce_dtype.itemsize
    k = (4 if plan.mixed else 0) + plan.optimizer_state_bytes
    params = c * psi / (n if plan.states.params else 1)
    if plan.states.keep_local_grads:
        grads = c * psi_t
    else:
        grads = g * psi_t / (n if plan.states.grads else 1)
    optim = k * psi_t / (n if plan.states.optim else 1)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
