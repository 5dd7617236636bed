"""Gradient reduction for replicated parameters (DP, ZeRO-1, ZeRO-2), overlapped with backward.

Gradients are grouped into buckets (in reverse registration order, as they tend to become
ready in backward). A bucket is reduced, asynchronously, as soon as the last of its gradients
is accumulated — and only on the micro-step that synchronizes; earlier micro-steps only
accumulate locally. Buckets launch strictly in index order, so every rank issues the same
collectives in the same order even if gradients become ready in a different order.

* grads replicated (DP): all-reduce the bucket. With matching dtypes the gradients end up as
  views into the bucket buffer: each step starts with no gradients (no zeroing), autograd
  writes fresh ones, and the hook copies each into its place in the bucket as it is ready —
  one pass over the gradients, where zeroing a persistent buffer and accumulating into it
  takes two. The optimizer then reads the views.
* one data rank, grads replicated in the reduce dtype (a pipeline or tensor axis at data 1, one
  process): nothing to reduce and nothing copied; the reduced gradients are autograd's own
  ``.grad``, kept to the next step's start as the views would be (``direct``).
* grads sharded (ZeRO-1/2): reduce-scatter the bucket as a flat group (``flat.py``: its
  gradients laid end to end, split evenly), each rank keeping its chunk — its piece of every
  parameter; without ``keep_local_grads`` (ZeRO-2) the full local gradients are freed once
  copied in. Launching a bucket's reduce-scatter first waits for the one launched
  ``MAX_IN_FLIGHT`` buckets before it, which frees that one's input (its output, this rank's
  chunk, is kept): the inputs do not pile up to a whole model's gradients over the backward.
  ZeRO-2 reduces in place, into its own chunk of the input, and copies that chunk into the
  gradient shards when it waits; ZeRO-1 keeps the chunks (views of them are its gradients until
  the update), so its output is a chunk of its own.
* optimizer state sharded (ZeRO-1/2): after the update, ``publish`` all-gathers each bucket's
  updated pieces into the full compute-dtype parameters.
"""

from __future__ import annotations

import torch

from .grad_sync import GradSync
from ..comm import core as comm
from .flat import flat_runs
from .state import ParamState

MAX_IN_FLIGHT = 1     # reduce-scatters in flight at once when a bucket's is launched


class GradBuckets(GradSync):
    """``riders``: how many fp32 scalars travel in the last bucket's all-reduce (0: none; only with
    replicated gradients); the engine sets ``rider_values`` (a callable giving them) before the
    backward that syncs, and reads their sums from ``rider_sums`` after ``finish``."""

    def __init__(self, engine, buckets: list[list[ParamState]], riders: int = 0):
        self.engine = engine
        plan = engine.plan
        self.mesh, self.axis = engine.mesh, plan.data_axis
        # HSDP: replicated gradients are all-reduced over replica x data at once; a sharded bucket's
        # reduce-scattered chunk is then summed over the replicas
        self.dp = plan.dp_axes
        self.replica = plan.replica_axis if plan.replica_size > 1 else None
        self.buckets = buckets
        # each bucket's gradients summed over its axes: the batch's, an expert's over data alone (Plan.grad_axes)
        self.axes_of = [plan.grad_axes(states[0].name) if states else self.dp for states in buckets]
        # ZeRO-1/2: each bucket's states split over its shard axes (data, or data x expert: Plan.shard_axes)
        self.shard_of = [plan.shard_axes(states[0].name) if states else (self.axis,) for states in buckets]
        self.sharded = plan.states.grads is not None
        self.rdt = plan.reduce_dtype
        # one data rank, gradients replicated in their own dtype: nothing to reduce, so the reduced
        # gradients are autograd's own (kept to the next step as the buckets' views would be)
        self.direct = (not self.sharded and plan.dp_size == 1 and plan.replica_size == 1 and not riders
                       and plan.reduce_dtype == plan.compute_dtype)
        self.views = plan.states.keep_local_grads and plan.reduce_dtype == plan.compute_dtype and not self.direct
        self.riders = riders
        self.rider_values = None
        self.rider_sums: torch.Tensor | None = None
        self.buffers: list[torch.Tensor | None] = [None] * len(buckets)
        self.grad_views: list[list[torch.Tensor]] = []
        if self.views:
            for b, states in enumerate(buckets):
                extra = riders if b == len(buckets) - 1 else 0
                buf = torch.zeros(sum(s.param.numel() for s in states) + extra, dtype=self.rdt,
                                  device=engine.mesh.device)
                off, views = 0, []
                for s in states:
                    views.append(buf[off:off + s.param.numel()].view(s.param.shape))
                    off += s.param.numel()
                self.buffers[b] = buf
                self.grad_views.append(views)
            self._attach_views()
        self.bucket_of = {id(s): b for b, states in enumerate(buckets) for s in states}
        # each bucket as a flat group (its states in plan order): where states are sharded
        by_name = {s.name: s for states in buckets for s in states}
        self.flats = flat_runs(plan.flat.groups, by_name, engine.mesh.rank) if plan.states.optim is not None else []
        # DP: copy each fresh gradient into its view instead of accumulating into a zeroed buffer
        self.copy_in = self.views and not self.sharded
        self.view_of = {id(s): v for states, views in zip(buckets, self.grad_views) for s, v in zip(states, views)}
        # a hook per parameter (~8 us a call, every micro-batch) launches buckets during backward and
        # notes which parameters got a gradient; with one data rank there is nothing to overlap, and
        # where gradients start each step as None whether one came is read after backward instead
        self.hooked = plan.dp_size > 1 or self.views and not self.copy_in
        self.handles = [s.param.register_post_accumulate_grad_hook(self._make_hook(s))
                        for states in buckets for s in states] if self.hooked else []
        self.sync = False
        self.counts = [0] * len(buckets)
        self.next = 0
        self.pending: list = [None] * len(buckets)
        self.results: list = [None] * len(buckets)
        # ZeRO-2: a reduced chunk goes straight into the gradient shards (kept between steps)
        self.into_shards = self.sharded and not plan.states.keep_local_grads

    def _make_hook(self, state: ParamState):
        def hook(_param: torch.Tensor) -> None:
            state.used = True
            if self.copy_in and self.sync:
                self._copy_in(state)
            self._ready(self.bucket_of[id(state)])
        return hook

    def _copy_in(self, state: ParamState) -> None:
        """Put ``state``'s gradient in its bucket view (zeros if it got none this step)."""
        view = self.view_of[id(state)]
        g = state.param.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
        state.param.grad = view

    def _attach_views(self) -> None:
        for states, views in zip(self.buckets, self.grad_views):
            for s, v in zip(states, views):
                s.param.grad = v

    # ---- per step / micro-step -----------------------------------------------------------------
    def begin_step(self) -> None:
        if self.copy_in or self.direct:
            for states in self.buckets:
                for s in states:
                    s.param.grad = None
        elif self.views:
            for buf in self.buffers:
                buf.zero_()
            # (re)attach: a parameter left out of an update (no gradient anywhere) or a user's
            # zero_grad() sets .grad to None, and a fresh .grad would not be what is reduced
            self._attach_views()
        else:
            for states in self.buckets:
                for s in states:
                    s.param.grad = None

    def begin_micro(self, first: bool, last: bool) -> None:
        """Reduce on the last micro-batch only (the others accumulate); under a pipe the schedule begins
        one micro-batch that is not the last: everything is reduced by ``finish``."""
        self.sync = last
        self.counts = [0] * len(self.buckets)
        self.next = 0
        self.pending = [None] * len(self.buckets)
        self.results = [None] * len(self.buckets)

    def _ready(self, b: int) -> None:
        if not self.sync:
            return
        self.counts[b] += 1
        while self.next < len(self.buckets) and self.counts[self.next] >= len(self.buckets[self.next]):
            self._launch(self.next)
            self.next += 1

    def _launch(self, b: int) -> None:
        states = self.buckets[b]
        tail = self.rider_values() if self.riders and b == len(self.buckets) - 1 else None
        if not self.sharded:
            if self.views:
                if self.copy_in:        # parameters whose hook did not copy (no gradient this micro-step)
                    for s in states:
                        if s.param.grad is None or s.param.grad.data_ptr() != self.view_of[id(s)].data_ptr():
                            self._copy_in(s)
                buf = self.buffers[b]
                if tail is not None:
                    buf[-self.riders:].copy_(tail)
            else:
                parts = [(s.param.grad if s.param.grad is not None else torch.zeros_like(s.param))
                         .reshape(-1).to(self.rdt) for s in states]
                buf = torch.cat(parts + ([tail.to(self.rdt)] if tail is not None else []))
            self.pending[b] = comm.all_reduce(buf, self.mesh, self.axes_of[b], async_op=True, inplace=True)
        else:
            flat = self.flats[b].pack_grads([s.param.grad for s in self.flats[b].train], self.rdt,
                                            self.engine.mesh.device)
            if not self.engine.plan.states.keep_local_grads:
                for s in states:
                    s.param.grad = None       # ZeRO-2: the full local gradient is not kept
            for older in range(max(0, b - MAX_IN_FLIGHT), b):
                self._wait(older)                 # frees its input
            # ZeRO-2 copies the reduced chunk into the gradient shards when it waits: reduce in place,
            # into this rank's chunk of the packed input (on gloo the all-reduce its reduce-scatter
            # would run on a clone of the input, without the clone and the chunk's copy)
            self.pending[b] = comm.reduce_scatter(flat, self.mesh, self.shard_of[b], async_op=True,
                                                  out=self._own_chunk(flat, b) if self.into_shards else None)
            del flat

    def _own_chunk(self, flat: torch.Tensor, b: int) -> torch.Tensor:
        """This rank's chunk of bucket ``b``'s packed reduce-scatter input (its segment is split evenly over
        its shard axes)."""
        axes = self.mesh.canonical_axes(self.shard_of[b])
        c = flat.numel() // comm.group_size(self.mesh, axes)
        i = self.mesh.group_index(self.mesh.rank, axes)
        return flat[i * c:(i + 1) * c]

    def finish(self) -> list[list[torch.Tensor]]:
        """Launch what is left (unused parameters), wait for all; the reduced gradient of each
        parameter: full (DP) or this rank's piece (ZeRO-1/2), in bucket order."""
        if not self.hooked:
            for states in self.buckets:
                for s in states:
                    s.used = s.used or s.param.grad is not None
        if self.direct:
            for b, states in enumerate(self.buckets):
                self.results[b] = [self._own_grad(s) for s in states]
            self.next = len(self.buckets)
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for b in range(len(self.buckets)):
            self._wait(b)
        out, self.results = self.results, [None] * len(self.buckets)
        return out

    @staticmethod
    def _own_grad(s: ParamState) -> torch.Tensor:
        """``direct``: the parameter's gradient, in storage of its own (a view into a larger tensor, as a
        fused layer's backward may leave, is copied out: what is kept is the gradient's bytes); zeros
        where it got none."""
        g = s.param.grad
        if g is None:
            return torch.zeros_like(s.param)
        if g.untyped_storage().nbytes() != g.numel() * g.element_size():
            g = s.param.grad = g.clone()
        return g

    def _wait(self, b: int) -> None:
        """Wait for bucket ``b``'s collective (once) and keep its reduced gradients in ``results``:
        full views (DP), this rank's pieces (ZeRO-1: views of the chunk), or the gradient shards
        the chunk was copied into (ZeRO-2: the chunk is dropped)."""
        if self.pending[b] is None:
            return
        reduced = self.pending[b].wait()
        self.pending[b] = None
        if self.sharded and self.replica is not None:
            reduced = comm.all_reduce(reduced, self.mesh, self.replica, inplace=True)
        if self.riders and b == len(self.buckets) - 1:
            self.rider_sums = reduced[-self.riders:].float()
        if not self.sharded:
            if self.views:
                self.results[b] = self.grad_views[b]
            else:
                views, off = [], 0
                for s in self.buckets[b]:
                    views.append(reduced[off:off + s.param.numel()].view(s.param.shape))
                    off += s.param.numel()
                self.results[b] = views
        elif self.into_shards:
            fl = self.flats[b]
            off = self.engine.offload
            with torch.no_grad():
                for s, piece in zip(fl.train, fl.reduced(reduced)):
                    if off is not None:          # to the host shard, as backward goes (runtime/offload/core.py)
                        off.shard_in(s, piece, add=False)
                    else:
                        s.grad_shard.copy_(piece)
            self.results[b] = [s.grad_shard for s in fl.train]
        else:
            self.results[b] = self.flats[b].reduced(reduced)

    @torch.no_grad()
    def publish(self, dtype: torch.dtype, source=None) -> None:
        """After a sharded update: all-gather each bucket's updated fp32 pieces (the masters, or
        ``source(state)``), in ``dtype``, into the full parameters every rank computes with. Each
        gather is issued asynchronously and waited for at once (one bucket in flight, as before), so
        that on gloo it runs as pairwise exchanges (``comm/pairwise.py``): ZeRO-2 steps 0.95-1.00 of
        gloo's gather's at 2 and 4 ranks."""
        source = source or (lambda s: s.master)
        for fl, axes in zip(self.flats, self.shard_of):
            out = comm.all_gather(fl.pack(source, dtype, self.engine.mesh.device), self.mesh, axes,
                                  async_op=True).wait()
            fl.unpack(out, lambda s: s.param.data)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
