"""ZeRO-3: parameters sharded at rest, gathered per unit just before use, freed right after.

Each unit (a module subtree, e.g. one transformer block) is a flat group (``flat.py``): this
rank holds its chunk of the unit's parameters laid end to end. Around the unit's forward:

* pre-forward: all-gather the unit (compute dtype) into the module's parameters, then start
  gathering the next unit (prefetch) so it overlaps this unit's compute (after the wait, so a
  rank never holds a unit, its gather buffer and the next one's at once);
* post-forward: free the parameters' storage (unless the unit stays gathered), and hook the
  unit's outputs so that, in backward, the unit is gathered again before its gradients flow;
* in backward, each trainable parameter's gradient is copied, as soon as autograd has it, into
  the unit's reduce-scatter input (allocated with the unit's first gradient) and dropped, so a
  unit never holds its full gradients twice (as tensors and laid flat) — except the root's,
  whose gradients arrive at both ends of backward (head first, embeddings last): they stay
  tensors until its reduce, rather than a whole flat input held through the backward;
* post-backward (when gradients reach the unit's inputs): reduce-scatter that input into this
  rank's chunk, free the parameters, then start gathering the unit before it (in backward a
  rank holds one unit's parameters besides the root's, not two: the gather overlaps the
  reduce-scatter rather than this unit's backward). The reduce-scatter overlaps the backward of the next unit
  until that unit's first gradient, which waits for it and adds its chunk into the gradient
  shards before allocating its own input: one unit's input at a time, where every unit's input
  used to live until the end of backward (a whole model's gradients at once).

The collective buffers are persistent (``comm_buffers.py``): a gather packs this rank's chunk
into its block of the one all-gather output buffer and gathers in place; a unit's gradients are
laid into the one reduce-scatter input buffer, reduced in place (the output is this rank's chunk
of it). Both are sized for the largest unit other than the root (gathered and reduced once a step,
into buffers of its own), allocated at their first use and kept, so steady steps allocate no flat
buffers but the root's.

Storage is freed with ``untyped_storage().resize_(0)`` and re-filled in place, so tensors that
autograd saved in forward stay valid. The root unit (what no other unit holds: embeddings,
head) is gathered when the model's forward starts and freed when its backward ends.

The runner logs what it does (``events``: ``G(unit)`` gather started, ``W(unit)`` waited and
unpacked, ``F(unit)`` freed) for the last micro-step, in the notation of
``Plan.gather_schedule``, and tracks the bytes of gathered parameters plus all-gather output
buffers held (``peak``: the persistent buffer from its first use, one of a unit's own size while
it is lent) — the quantity ``Plan.transient_per_rank`` plans — and the bytes of gradient buffers
(the persistent reduce-scatter input, whose chunk is the output until it is added; another while it
is lent: ``grad_peak``), and of both at once (``total_peak``), which ``planner/peak.py`` bounds.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .grad_sync import GradSync
from ..comm import core as comm
from .comm_buffers import Buffer
from .flat import FlatRun
from .state import ParamState


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is complete."""

    @staticmethod
    def forward(ctx, runner, unit, *tensors):
        ctx.runner, ctx.unit = runner, unit
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.runner.post_backward(ctx.unit)
        return (None, None) + grads


class Unit:
    def __init__(self, name: str, module: nn.Module, states: list[ParamState], reshard: bool, flat: FlatRun,
                 backward: bool = True):
        self.name, self.module, self.states, self.reshard = name, module, states, reshard
        self.backward = backward          # False: no gradient runs through it (a frozen embedding)
        self.flat = flat                  # its parameters laid end to end, this rank's chunk
        self.status = "free"          # free | gathering | gathered
        self.pending = None           # all-gather in flight
        self.gather_buf: torch.Tensor | None = None  # its all-gather output (a lent buffer) until unpacked
        self.reducing = None          # reduce-scatter in flight
        self.grad_buf: torch.Tensor | None = None    # its reduce-scatter input while gradients arrive
        self.reduce_buf: torch.Tensor | None = None  # that input (a lent buffer) until the chunk is added
        self.filled: set[int] = set()                # ids of the states copied into grad_buf
        self.reduced = False          # this micro-step's gradients are reduced
        self.fresh = True             # no reduced gradient added into the shards yet this step
        self.group = 0                # prefetches stay within a group (a pipeline stage)

    @property
    def gathered_bytes(self) -> int:
        return sum(s.storage.numel() * s.storage.element_size() for s in self.states)


class UnitRunner(GradSync):
    def __init__(self, engine, units: list[Unit], root: Unit | None):
        self.engine = engine
        self.mesh, self.axis = engine.mesh, engine.plan.data_axis
        self.replica = engine.plan.replica_axis if engine.plan.replica_size > 1 else None
        self.cdt, self.rdt = engine.plan.compute_dtype, engine.plan.reduce_dtype
        self.units = units                      # non-root, in forward order
        self.root = root
        self.all = ([root] if root else []) + units
        self.live = 0                           # bytes of gathered parameters and gather buffers
        self.peak = 0
        self.grad_live = self.grad_peak = 0     # bytes of gradient buffers (reduce-scatter in/out)
        self.total_peak = 0                     # most of both at once
        self.in_flight: list[Unit] = []         # units whose reduce-scatter is in flight, oldest first
        # each unit's states split over its axes (data, or with an expert axis data x expert for what is not an
        # expert: Plan.shard_axes), this rank's block at its index among them
        device, plan = engine.mesh.device, engine.plan
        for u in self.all:
            u.axes = self.mesh.canonical_axes(plan.shard_axes(u.states[0].name) if u.states else (self.axis,))
            u.ranks = self.mesh.axis_size(u.axes)
            u.index = self.mesh.group_index(self.mesh.rank, u.axes) if u.ranks > 1 else 0
        # the persistent buffers (comm_buffers.py), at the largest non-root unit's sizes
        sized = units or self.all
        self.gather_buffer = Buffer(max((u.ranks * (u.flat.ct + u.flat.cf) for u in sized), default=0), self.cdt,
                                    device)
        self.reduce_buffer = Buffer(max((u.ranks * u.flat.ct for u in sized if u.flat.train), default=0), self.rdt,
                                    device)
        self.events: list[str] = []             # this micro-step's G/W/F actions
        self.handles = []
        model = engine.model
        self.handles.append(model.register_forward_pre_hook(self._root_pre))
        for u in units:
            self.handles.append(u.module.register_forward_pre_hook(self._make_pre(u), with_kwargs=True))
            self.handles.append(u.module.register_forward_hook(self._make_post(u)))
        for u in self.all:
            for s in u.flat.train:
                self.handles.append(s.param.register_post_accumulate_grad_hook(self._make_grad_hook(u, s)))

    # ---- gather / free -------------------------------------------------------------------------
    def _track(self, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)
        self.total_peak = max(self.total_peak, self.live + self.grad_live)

    def _track_grads(self, delta: int) -> None:
        self.grad_live += delta
        self.grad_peak = max(self.grad_peak, self.grad_live)
        self.total_peak = max(self.total_peak, self.live + self.grad_live)

    def gather(self, u: Unit) -> None:
        """Start gathering ``u`` (async) unless it is gathered or on its way."""
        if u.status != "free":
            return
        if self.engine.offload is not None:       # the host update streamed into this forward: this unit's values
            self.engine.offload.streamed.ready(u)
        off = self.engine.params_offload
        c = u.flat.ct + u.flat.cf
        buf, held = self.gather_buffer.acquire(u.ranks * c)
        self._track(held)
        block = buf[u.index * c:(u.index + 1) * c]      # this rank's chunk, gathered in place
        with torch.no_grad():     # offloaded shards: brought to the device (runtime/offload/params.py)
            if off is None:
                u.flat.pack(lambda s: s.shard, self.cdt, out=block)
            else:
                off.packed(u, self.engine.mesh.device, out=block)
        u.gather_buf = buf
        u.pending = comm.all_gather(block, self.mesh, u.axes, async_op=True, out=buf)
        u.status = "gathering"
        self.events.append(f"G({u.name or '<root>'})")

    def wait(self, u: Unit) -> None:
        """Make ``u``'s parameters whole: finish its gather and copy the parameters into place."""
        if u.status == "gathered":
            return
        self.gather(u)
        self.events.append(f"W({u.name or '<root>'})")
        out = u.pending.wait()
        u.pending = None
        for s in u.states:
            s.storage.untyped_storage().resize_(s.storage.numel() * s.storage.element_size())
        self._track(u.gathered_bytes)
        # through .data: autograd's version counters stay as they were, so tensors saved in
        # forward (the same values) remain valid for backward
        u.flat.unpack(out, lambda s: s.storage.data)
        del out
        self._release_gather(u)
        u.status = "gathered"

    def _release_gather(self, u: Unit) -> None:
        self._track(-self.gather_buffer.release(u.gather_buf))
        u.gather_buf = None

    def free(self, u: Unit) -> None:
        if u.status != "gathered":
            return
        for s in u.states:
            s.storage.untyped_storage().resize_(0)
        self._track(-u.gathered_bytes)
        u.status = "free"
        self.events.append(f"F({u.name or '<root>'})")

    # ---- hooks ---------------------------------------------------------------------------------
    def _root_pre(self, module, args):
        if self.root is not None:
            self.wait(self.root)
        if self.units:
            self.gather(self.units[0])        # prefetch the first block under the embeddings

    def _make_pre(self, u: Unit):
        def pre(module, args, kwargs):
            if _on_meta(args):                # a shape probe (the pipeline's stream): nothing to gather
                return None
            self.wait(u)                      # then prefetch: never two gather buffers and a unit at once
            # (not in a recompute inside backward: a unit nested in a recomputed one runs this again there,
            # and the next unit in forward order is done with, freed)
            nxt = self._neighbor(u, +1) if torch._C._current_graph_task_id() == -1 else None
            if nxt is not None:
                self.gather(nxt)
            idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            if idx and torch.is_grad_enabled():
                wrapped = _PostBackward.apply(self, u, *[args[i] for i in idx])
                wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
                args = list(args)
                for i, w in zip(idx, wrapped):
                    args[i] = w
                return tuple(args), kwargs
            return None
        return pre

    def _make_post(self, u: Unit):
        def post(module, args, output):
            if _on_meta(args):
                return None
            if u.reshard:
                self.free(u)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(lambda g, u=u: self.pre_backward(u))
            return None
        return post

    def _neighbor(self, u: Unit, step: int) -> Unit | None:
        """The unit before or after ``u`` in forward order, within ``u``'s group (a pipeline stage:
        the next unit on this rank may be another stage's, not needed now); before it (the backward's
        direction), the nearest one a gradient runs through."""
        i = self.units.index(u) + step
        while step < 0 and 0 <= i and not self.units[i].backward:
            i += step
        nxt = self.units[i] if 0 <= i < len(self.units) else None
        return nxt if nxt is not None and nxt.group == u.group else None

    def pre_backward(self, u: Unit) -> None:
        if u.reduced:
            return
        self.wait(u)

    def post_backward(self, u: Unit) -> None:
        if u.reduced:
            return
        self.reduce(u)

    def _make_grad_hook(self, u: Unit, s: ParamState):
        def hook(param: torch.Tensor) -> None:
            if u is self.root or u.reduced or param.grad is None:
                return       # the root's gradients arrive at both ends of backward: laid flat at its reduce
            if u.grad_buf is None:
                self._new_grad_buffer(u)
            with torch.no_grad():
                u.flat.copy_grad(u.grad_buf, s, param.grad)
            u.filled.add(id(s))
            s.used = True
            param.grad = None                        # laid flat: the tensor itself is not kept
        return hook

    def reduce(self, u: Unit) -> None:
        """Launch the reduce-scatter of unit ``u``'s gradients into this rank's shards: its backward is done."""
        trainable = u.flat.train
        for s in trainable:
            s.used = s.used or s.param.grad is not None
        if trainable:
            if u.grad_buf is None:                   # no gradient arrived through the hooks (the root)
                self._new_grad_buffer(u)
            with torch.no_grad():
                for s in trainable:                  # what the hooks did not copy: a late .grad, or zeros
                    if id(s) not in u.filled:
                        u.flat.copy_grad(u.grad_buf, s, s.param.grad)
                    s.param.grad = None
                u.flat.zero_padding(u.grad_buf)
            flat, u.grad_buf = u.grad_buf, None
            u.filled = set()
            ct = u.flat.ct                           # in place: the output is this rank's chunk of the input
            u.reducing = comm.reduce_scatter(flat, self.mesh, u.axes, async_op=True,
                                             out=flat[u.index * ct:(u.index + 1) * ct])
            del flat                                 # the lent buffer stays held until the chunk is added
            self.in_flight.append(u)
        u.reduced = True
        self.free(u)
        if u is not self.root:
            prev = self._neighbor(u, -1)      # gathered once this unit is freed: one unit's parameters
            if prev is not None and not prev.reduced:     # at a time in backward, beside the root
                self.gather(prev)

    def _new_grad_buffer(self, u: Unit) -> None:
        """Allocate ``u``'s reduce-scatter input, once the reduce-scatter in flight is done (it
        overlapped the backward up to ``u``'s first gradient): never two units' at once."""
        while self.in_flight:
            self._finish_reduce(self.in_flight.pop(0))
        u.reduce_buf, held = self.reduce_buffer.acquire(u.ranks * u.flat.ct)
        u.grad_buf = u.reduce_buf
        self._track_grads(held)

    def _finish_reduce(self, u: Unit) -> None:
        """Wait for ``u``'s reduce-scatter and add its chunk into the persistent gradient shards."""
        chunk = u.reducing.wait()
        u.reducing = None
        if self.replica is not None:             # HSDP: the replicas sum their chunks
            chunk = comm.all_reduce(chunk, self.mesh, self.replica, inplace=True)
        pieces = u.flat.reduced(chunk)
        del chunk
        off = self.engine.offload
        for s, r in zip(u.flat.train, pieces):
            if off is not None:                  # to the host shard, as backward goes (runtime/offload/core.py)
                off.shard_in(s, r, add=not u.fresh)
            elif u.fresh:
                s.grad_shard.copy_(r)
            else:
                s.grad_shard.add_(r)
        u.fresh = False
        del pieces
        self._track_grads(-self.reduce_buffer.release(u.reduce_buf))
        u.reduce_buf = None

    # ---- per micro-step ------------------------------------------------------------------------
    def begin_micro(self, first: bool, last: bool = True) -> None:
        self.events = []
        for u in self.all:
            u.reduced = False
            u.fresh = u.fresh or first

    def end_micro(self) -> None:
        """After backward: reduce the units whose inputs needed no gradient (and the root), wait
        for every reduce-scatter, add the reduced pieces into the persistent gradient shards. A
        unit whose gather was started but which never ran (a prefetched, unused unit) has its
        gather finished and dropped, so no collective stays in flight past the step."""
        for u in reversed(self.all):
            if not u.reduced:
                self.reduce(u)
        for u in self.all:
            if u.status == "gathering":
                u.pending.wait()
                u.pending = None
                self._release_gather(u)
                u.status = "free"
        while self.in_flight:
            self._finish_reduce(self.in_flight.pop(0))

    def freed_use(self, err: RuntimeError) -> str | None:
        """What to say when ``err`` is a freed parameter read: torch's "storage of size 0" after code
        used a unit's parameter outside that module's forward (``F.linear(x, self.wte.weight)``, a
        slice of a weight), when ZeRO-3 has freed it. ``None`` for any other error."""
        text = str(err)
        if "for storage of size 0" not in text:
            return None
        need = re.search(r"requiring a storage size of (\d+)", text)
        free = [(u, s) for u in self.units if u.status == "free" for s in u.states]
        exact = [(u, s) for u, s in free if need and s.storage.numel() * s.storage.element_size() == int(need[1])]
        named = [f"{s.name} (unit {u.name!r})" for u, s in exact or free]
        return (f"step: the model read {' or '.join(named[:4])}{' or another' if len(named) > 4 else ''} outside its "
                "module's forward, while ZeRO-3 had it freed — a unit's parameters are whole only around its own "
                "module's forward and backward. Call the module rather than reading its weight, tie weights by "
                "sharing the Parameter (head.weight = wte.weight: a parameter with two owners stays in the root "
                "unit), or choose the units with sl.plan(..., units=[...]) leaving that module out (by default "
                "the blocks of the layer stacks, and under ZeRO-3 the large embeddings and linear layers outside "
                f"them: planner/units.py). Torch said: {text.splitlines()[0]}")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _on_meta(args) -> bool:
    return any(t.is_meta for t in _tensors(args))


def _tensors(output) -> list[torch.Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
