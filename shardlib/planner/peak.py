"""The peak memory of a rank in a training step: model states + the largest transient + activations.

``Plan.memory_per_rank`` counts the model states a rank keeps between steps (the ZeRO-paper
terms). A step needs more for a while, and what it needs depends on where in the step it is, so
the peak is the largest of four moments, each ``states + what lives only then`` (bytes per rank;
``c``/``g`` the compute/reduce dtype's bytes, ``N`` the data degree, a *group* a ZeRO-3 unit or a
gradient bucket, laid flat: ``planner/flat.py``):

* **build** — the engine copies this rank's states out of the model as built: states at rest
  without optimizer state (created at the first update) plus the built model where the engine
  does not keep its tensors — the whole model (4-byte elements) when parameters are sharded at
  rest or cast to a compute dtype; with a model built on the meta device
  (``runtime/materialize.py``) only the largest unit, one unit at a time.
* **backward** — states at rest + the activations of one micro-batch (``activation_bytes``) +
  what the gradient reduction holds:

  - ZeRO-3: the gathered units and the all-gather buffer of ``transient_per_rank`` (the root unit
    stays gathered through backward), plus the gradients on their way to the reduce-scatter
    (``runtime/units.py``): the root's gradients (``c``, kept as tensors: they arrive at both
    ends of backward) and the one persistent reduce-scatter input (``N`` chunks of the largest
    non-root unit's trainable segment, ``g``; reduced in place, its output a chunk of it:
    ``runtime/comm_buffers.py``) — a unit's gradients are laid into it as autograd makes them,
    after the previous unit's reduce-scatter is waited for — plus one fresh gradient (the largest
    trainable parameter, ``c``); or, at the end, the root's own input where it is larger (in
    the idle buffer's place: freed for it, allocated again by the next step's first block);
  - ZeRO-1/2: bucket ``b`` being packed — its local gradients (ZeRO-2; ZeRO-1 keeps them between
    steps: states) and its reduce-scatter input — while bucket ``b-1``'s is in flight (its input;
    ZeRO-1's output too: ZeRO-2 reduces in place, into its chunk of the input), the largest over
    ``b``; ZeRO-1 also keeps every reduced chunk (the masters' gradients at the update), ZeRO-2
    copies them into its gradient shards;
  - DP: a parameter's fresh gradient before it is copied into its bucket (the largest
    parameter); with gradients reduced in another dtype, every bucket's reduced copy as well.
* **update** — states at the update (``memory_per_rank(at="update")``) + the optimizer's
  temporaries (+ what ZeRO-3's persistent collective buffers hold between steps, ``comm_buffers``). Adam's per-tensor step (torch's default on the CPU) holds two fp32 temporaries the
  size of the tensor it updates (``sqrt`` of the second moment, then its quotient): twice the
  largest master piece. The multi-tensor (``foreach``) step, torch's default on GPUs, holds one
  per master at once: all master bytes. With the optimizer on disk the update streams the masters and
  moments through a ring of chunk buffers (``planner/offload.disk_update_bytes``: five chunks of every
  slot, and the temporaries of the chunk it updates); on the host, it adds nothing to the device.
* **publish** (ZeRO-1/2) — after the update the new parameters are all-gathered bucket by bucket:
  states at the update + the largest bucket's all-gather input (its chunk) and output (``c``).

The moments' transients are added as if they coincided (ZeRO-3's gathered peak and its
gradients' peak fall in the same backward, not always at the same instant): the plan is an upper
bound for the runtime's tracked bytes (``engine.peak_transient_bytes``); activations are an
estimate (below). Allocator overhead (glibc's heap keeps freed memory unless big blocks are
mapped on their own: ``shardlib/allocator.py``'s ``set_mmap_threshold``, set in every rank) and a
process's fixed costs (libraries torch loads on first use, ~85 MB on CPU) are not model memory
and not counted.

``activation_bytes(model, batch)`` estimates a micro-batch's activations without computing: the
model's forward runs on fake tensors (shapes only, CPU kernels' choices, e.g. CPU flash
attention), recording the distinct storages autograd saves for backward other than parameters,
plus the largest one again (the gradient that flows back through it when backward starts).
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ShardingError, ShardingTypeError
from ..validate import non_negative_int
from .memory import grad_views
from .offload import disk_update_bytes

if TYPE_CHECKING:
    from .plan import Plan


def _chunks(plan: Plan) -> list[tuple[int, int, int, int]]:
    """Per flat group: (trainable elements, all elements, trainable chunk, all chunks) where a chunk
    is ``ceil(T/N)`` per segment; one group per unit (ZeRO-3) or bucket (ZeRO-1/2)."""
    n = plan.data_size
    flat = getattr(plan, "flat", None)
    out = []
    if flat is not None:
        for grp in flat.groups:
            t = grp.segments["train"].numel
            f = grp.segments["frozen"].numel if "frozen" in grp.segments else 0
            ct = grp.chunk("train")
            cf = grp.chunk("frozen") if f else 0
            out.append((t, t + f, ct, ct + cf))
        return out
    groups = ([plan.unit_params(u.name) for u in plan.units] if plan.states.params is not None
              else plan.buckets())
    for params in groups:
        t = sum(p.numel for p in params if p.trainable)
        a = sum(p.numel for p in params)
        out.append((t, a, -(-t // n), -(-t // n) + -(-(a - t) // n)))
    return out


def _master_pieces(plan: Plan, rank: int) -> list[int]:
    """Elements of each optimizer-visible master tensor on ``rank`` (a parameter's piece)."""
    flat = getattr(plan, "flat", None)
    out = []
    for p in plan.params:
        if not p.trainable:
            continue
        if plan.states.optim is None:
            out.append(p.numel)
            continue
        piece = flat.piece(p.name, rank) if flat is not None else None
        if piece is not None:
            out.append(piece[1] - piece[0])
        else:
            out.append(p.local_numel(p.optim, rank))
    return out


def peak_per_rank(plan: Plan, rank: int | None = None, *, activation_bytes: int = 0,
                  foreach: bool | None = None, meta_build: bool = False) -> dict[str, int]:
    """The most memory ``rank`` holds at once, by the moments of a step (see the module doc):
    ``states`` (at rest), ``activations``, ``transient`` (what the peak moment holds beyond them)
    and ``peak``; and each moment's total: ``build``, ``backward``, ``update``, ``publish``.

    ``activation_bytes``: one micro-batch's activations (``activation_bytes(model, batch)``).
    ``foreach``: whether the optimizer steps all tensors at once (default: on GPUs, as torch's
    Adam does). ``meta_build``: the model was built on the meta device."""
    if problem := non_negative_int(activation_bytes, "peak_per_rank: activation_bytes"):
        raise ShardingError(f"{problem}. Estimate it with activation_bytes(model, batch).")
    rank = plan._rank(rank)
    st = plan.states
    n, c, g = plan.data_size, plan.compute_dtype.itemsize, plan.reduce_dtype.itemsize
    rest = plan.memory_per_rank(rank)
    update = plan.memory_per_rank(rank, at="update")
    states = rest["total"] + rest["buffers"]
    at_update = update["total"] + update["buffers"]
    if foreach is None:
        foreach = getattr(getattr(plan.mesh, "device", None), "type", "cpu") == "cuda"
    groups = _chunks(plan)
    # a group's reduce-scatter input (N chunks of its trainable segment, N its ranks) and output (one chunk)
    ranks = [grp.ranks for grp in plan.flat.groups] if len(plan.flat.groups) == len(groups) else [n] * len(groups)
    rs_in = [k * ct * g for k, (_, _, ct, _) in zip(ranks, groups)]
    rs_out = [ct * g for _, _, ct, _ in groups]
    local = [t * c for t, _, _, _ in groups]          # a group's local gradients
    buffers = 0                                        # ZeRO-3's persistent collective buffers
    if st.params is not None:                          # ZeRO-3: units (runtime/units.py)
        names = [grp.name for grp in plan.flat.groups]
        root = names.index("") if "" in names else None
        fresh = max((p.numel for p in plan.params if p.trainable), default=0) * c
        kept = local[root] if root is not None else 0
        # one persistent reduce-scatter input at the largest non-root unit's size, reduced in place
        # (runtime/comm_buffers.py); the root's own input, where larger, at the end of backward
        others = [rs_in[i] for i in range(len(groups)) if i != root]
        rs_buffer = max(others, default=rs_in[root] if root is not None else 0)
        blocks = rs_buffer + (fresh if others else 0)
        if root is not None and rs_in[root] > rs_buffer:     # the root's own input, in the idle buffer's place
            reduce, rs_held = kept + max(blocks, rs_in[root]), 0
        else:
            reduce, rs_held = kept + blocks, rs_buffer
        buffers = rs_held + plan.transient_per_rank(rank)["buffer"]     # held between steps
    elif st.grads is not None:                         # ZeRO-1/2: buckets, one in flight while the next packs
        # ZeRO-2 (local gradients freed) reduces in place, into its chunk of the input
        packing = [local[b] * (not st.keep_local_grads) + rs_in[b]
                   + (rs_in[b - 1] + rs_out[b - 1] * st.keep_local_grads if b else 0) for b in range(len(groups))]
        reduce = max(packing, default=0) + (sum(rs_out) if st.keep_local_grads else 0)
    else:                                              # replicated: copied into bucket views
        reduce = max((p.numel for p in plan.params if p.trainable), default=0) * c
        if not grad_views(plan):
            reduce += plan.num_trainable * g
    gathered = plan.transient_per_rank(rank)["gathered"] if st.params is not None else 0
    backward = states + activation_bytes + gathered + reduce
    masters = _master_pieces(plan, rank)
    temps = 4 * (sum(masters) if foreach else 2 * max(masters, default=0))
    at_step = at_update + temps
    offload = dict(plan.offload).get("optimizer")
    if offload == "disk":                          # streamed through memory chunk by chunk: its ring of chunks
        at_update = states
        at_step = states + disk_update_bytes(sum(masters), 1 + plan.optimizer_state_bytes // 4)
    elif offload:                                  # the update runs on the host: nothing more on the device
        at_update = at_step = states
    at_step += buffers
    publish = 0
    if st.params is None and st.optim is not None:
        publish = at_update + max(((1 + k) * ct * c for k, (_, _, ct, _) in zip(ranks, groups)), default=0)
    opt_state = plan.optimizer_state_bytes * sum(masters)
    model_bytes = 4 * plan.num_params
    if meta_build:
        built = max((4 * a for _, a, _, _ in groups), default=0) if st.params is not None else 0
    else:
        built = model_bytes if (st.params is not None or plan.mixed) else 0
    build = states - opt_state + built
    moments = {"build": build, "backward": backward, "update": at_step, "publish": publish}
    peak = max(moments.values())
    extra = activation_bytes if peak == backward else 0
    return {"states": states, "activations": extra, "transient": peak - states - extra, "peak": peak,
            **moments, "comm_buffers": buffers}


def activation_bytes(model: nn.Module, batch: Any, *, loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                     device: str | torch.device = "cpu", plan: Any = None) -> int:
    """Estimate one micro-batch's activations: the bytes autograd saves in ``model``'s forward on
    ``batch`` (this rank's micro-batch; tensors, or shapes given as tensors on any device, the meta
    device included), distinct storages other than parameters and buffers, plus the largest of them
    once more (the gradient flowing back through it). Nothing is computed: the forward runs on fake
    tensors on ``device``, so kernels are chosen as there. The model is not changed; it may be on
    the meta device. With ``plan``, its units' recompute policies apply as a step runs them: a
    recomputed unit keeps its input (a checkpoint), a selective one its attention core's inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from .functional import functional_call
    from torch.utils._pytree import tree_map_only

    if not isinstance(model, nn.Module):
        raise ShardingTypeError(f"activation_bytes: expected an nn.Module — got {type(model).__name__}.")
    device = torch.device(device)
    with FakeTensorMode(allow_non_fake_inputs=False):
        def fake(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device=device, requires_grad=grad)

        params = {n: fake(p, p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: fake(b) for n, b in model.named_buffers()}
        fb = tree_map_only(torch.Tensor, fake, batch)
        own = {id(t.untyped_storage()) for t in list(params.values()) + list(buffers.values())}
        saved: dict[int, tuple[torch.UntypedStorage, int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if id(s) not in own:
                saved[id(s)] = (s, s.nbytes())
            return t

        state = {**params, **buffers}
        with _recompute_as_planned(model, plan), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if loss_fn is not None:
                # loss_fn calls the model; route the call through the fake state
                class _Bound(nn.Module):
                    def forward(self, *a, **k):
                        return functional_call(model, state, a, k)
                loss_fn(_Bound(), fb)
            elif isinstance(fb, dict):
                functional_call(model, state, (), fb)
            elif isinstance(fb, (tuple, list)):
                functional_call(model, state, tuple(fb))
            else:
                functional_call(model, state, (fb,))
    sizes = [b for _, b in saved.values()]
    return sum(sizes) + max(sizes, default=0)


@contextlib.contextmanager
def _recompute_as_planned(model: nn.Module, plan: Any):
    """``model``'s units with the plan's recompute wrappers for the time of a measurement (then
    restored): a checkpoint around each recomputed unit, attention's core routed around a selective one."""
    from ..comm.recompute import recomputed
    modules = dict(model.named_modules())
    patched = []
    for u in (plan.units if plan is not None else ()):
        if (u.recompute or u.selective) and u.name in modules:
            mod = modules[u.name]
            patched.append((mod, mod.__dict__.get("forward")))
            mod.forward = recomputed(mod.forward, "full" if u.recompute else "selective")
    try:
        yield
    finally:
        for mod, before in patched:          # back to what it was: the class's forward, or its own wrapper
            if before is None:
                del mod.forward
            else:
                mod.forward = before
