"""The pipe axis at run time: this rank's stages, and the executor of its lowered schedule.

Each pipe rank holds only its stages' parameters (the rest of the model is left on the meta
device, shapes only). ``engine.step`` hands the step's micro-batches to ``PipelineRuntime.run``,
which walks the rank's lowered action list (``planner/schedules.py``) in order:

* ``RECV_F`` / ``RECV_B`` post a receive (``comm.recv``, tagged by stage, micro-batch and
  direction, from the pipe neighbour) into a buffer of the shape the plan knows: the stream
  between stages (worked out once per batch shape on the meta device: no per-step handshake),
  or this stage's own output for its gradient;
* ``F`` runs the stage: ``model.pipeline_pre`` on the first stage, its blocks, and
  ``model.pipeline_post`` (the loss) on the last; ``SEND_F`` sends the output. A transformers
  causal LM runs its own forward's parts instead (``planner/hf_stages.py``): each stage computes
  the blocks' keyword arguments (masks, rotary tables) from the micro-batch, once per micro-batch
  for all the stages the rank holds (dropped after the micro-batch's last forward on the rank:
  backward, recomputed or not, reads what autograd and the checkpoint saved, not this context), so
  only the hidden state is sent;
* ``B`` back-propagates the stage (the loss times ``scale / (data · m)`` on the last stage, the
  received gradient elsewhere); ``SEND_B`` sends its input gradient with the micro-batch's loss
  behind it (``planner.pipeline.loss_words``: its fp32 bits), so every stage knows every
  micro-batch's loss when the schedule ends and the step needs no collective for it;
* ``I`` / ``W`` (``zb_h1``; under ``1f1b`` the last stage's last backward alone): the input-gradient
  half of ``B`` now, the weight-gradient half later: the blocks' ``nn.Linear`` weight gradients
  deferred to ``W`` (``runtime/weight_grads.py``), or where the layers are not plain (the tensor
  axis's), torch's ``stage_backward_input`` / ``stage_backward_weight`` (zb_h1 only);
* ``UNSHARD`` / ``REDUCE_GRAD`` (ZeRO-3, ``pipe_gather="step"``): gather the stage's units once per
  step and keep them through all its micro-batches; reduce-scatter its accumulated gradients once
  after its last backward, which frees them (``RESHARD``). With ``pipe_gather="microbatch"`` the
  ZeRO-3 unit hooks stay on (``runtime/units.py``): each unit is gathered for every forward and
  backward and freed after, its gradients reduce-scattered (and added into the shards) after each
  backward; the root (embeddings, head) is gathered once per step and reduced at its end.

Gradients accumulate in ``.grad`` over the micro-batches; the data axis reduces them after the
schedule (DP / ZeRO-1/2 buckets, ``engine.step``). Every action is timed (``timeline``: records of
``(rank, action, start, end)``, ``time.perf_counter`` seconds) for ``frontend/plots/timeline.py``.

A rank that fails mid-step writes why into the process group's store before raising; a peer whose
receive then times out (the process group's timeout) raises a ``PipelineError`` naming that rank
(``runtime/failures.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .experts import ExpertReduction, probing
from .pipe_backward import StageBackward
from .pipe_router import PipeRouterLoss
from .grad_sync import GradSync
from ..comm import core as comm
from ..errors import CollectiveError
from ..planner.pipeline import loss_words, stream_shape, values_from_words, values_to_words
from ..planner.stack import stage_functions
from ..planner.simulate import Record
from .failures import clear_failure, report_failure, reported_failure
from .weight_grads import WeightGradStore, defer_linears, untied_linears

if TYPE_CHECKING:
    from .engine import Engine


class PipelineError(CollectiveError):
    """A pipeline step failed on some rank; raised on every rank, naming the one that failed."""


class PipelineRuntime(StageBackward, GradSync):
    """Installed by the engine when its plan cuts the model into pipeline stages."""

    def __init__(self, engine: Engine):
        self.engine = engine
        gplan = engine.global_plan
        self.pp = pp = gplan.pipeline
        mesh = engine.mesh
        self.mesh, self.axis = mesh, pp.axis
        self.coord = mesh.coord(mesh.rank, pp.axis)
        self.p, self.n_stages, self.m = pp.size, pp.num_stages, pp.microbatches
        self.stages = {s.index: s for s in pp.stages_of(self.coord)}
        modules = dict(engine.model.named_modules())
        self.modules = modules
        self.blocks = {i: [modules[b] for b in s.blocks] for i, s in self.stages.items()}
        self.fns = stage_functions(engine.model, pp.stack)
        if hasattr(self.fns, "tuple_out"):          # what the plan's check found the blocks return
            self.fns.tuple_out = pp.block_tuple
        order = {f"{pp.stack}.{n}": k for k, (n, _) in enumerate(modules[pp.stack].named_children())}
        self.block_index = {i: [order[b] for b in s.blocks] for i, s in self.stages.items()}
        self.ctx: dict[int, Any] = {}      # micro-batch -> the blocks' keyword arguments (this step)
        self.zero3 = engine.plan.states.params is not None
        self.per_step = engine.plan.pipe_unshard          # ZeRO-3's "step" gather policy
        self.actions = pp.lowered(self.coord, unshard=self.per_step)
        zero_bubble = any(a.kind == "I" for a in self.actions)
        # weight gradients can be deferred (runtime/weight_grads.py) except through the tensor axis's
        # parallel layers, ZeRO-3's per-micro-batch gathers, offloaded parameters or a recomputed forward
        deferrable = (engine.tensor is None and (not self.zero3 or self.per_step)
                      and dict(engine.plan.offload).get("params") is None
                      and not any(u.recompute for u in engine.plan.units))
        self.stage_params = {i: self._params_of(s) for i, s in self.stages.items()}
        self.units_of: dict[int, list] = {i: [] for i in self.stages}
        if self.zero3:
            for u in engine.units.all:
                names = [s.name for s in u.states]
                if names:     # (a tied parameter is held by the first and the last stage: this rank's of them)
                    stage = next(s for s in pp.stages_of_param(names[0]) if s in self.stages)
                    self.units_of[stage].append(u)
                    u.group = stage       # prefetch within a stage only
        # the root (pre/post parameters) of the microbatch policy: gathered at its stage's first action
        root = engine.units.root if self.zero3 else None
        self.root_stage = next((i for i, us in self.units_of.items() if root is not None and root in us), None)
        # weights tied across the first and last stage: every pipe rank takes part in each one's sum, in the
        # plan's order — (its place among this rank's gradients, or None where the rank holds none of it; the
        # piece's elements); the first stage's copy counts in the clipping norm
        mine = [s.name for s in engine.states if s.trainable]
        self.tied_sums = [(mine.index(n) if n in mine else None, k) for n, k in engine.plan.tied_pieces if k]
        self.counts_tied = 0 in self.stages
        # the step's scalars: this rank's trainable parameters' places among all of the model's
        trainable = [p.name for p in gplan.params if p.trainable]
        where = {n: i for i, n in enumerate(trainable)}
        self.n_trainable = len(trainable)
        self.global_index = torch.tensor([where[s.name] for s in engine.states if s.trainable], dtype=torch.long)
        self.scalar_axes = engine.plan.pipe_scalar_axes()
        # routers' load-balancing loss in the training loss (PipelinePlan.aux_riding): each router attaches its
        # gradient in its own stage's backward (models/moe.py's AttachAux), and the terms' values ride the forward
        # messages to the last stage's loss
        self.aux_riding = pp.aux_riding
        routers = [m for m in engine.model.modules() if getattr(m, "aux_weight", 0)] if pp.aux_riding else []
        for m in routers:
            m.inject_aux = True
        self.routers = routers
        self.stage_routers = {i: [m for blk in bs for m in blk.modules() if m in routers]
                              for i, bs in self.blocks.items()}
        self.aux_so_far: dict[tuple[int, int], torch.Tensor] = {}
        # a transformers model's router load-balancing loss: its statistics ride the messages
        # (runtime/pipe_router.py; PipelinePlan.router_experts)
        self.router = (PipeRouterLoss(engine.model, mesh, self.blocks, engine.plan.dp_axes,
                                      engine.plan.tensor.sp_axis if engine.plan.tensor is not None else None)
                       if pp.router_experts else None)
        # fp32 values behind each forward message (the aux terms, the router statistics) and each backward
        # one (the loss, the router statistics' cotangent)
        self.floats_f, self.floats_b = pp.forward_floats, pp.backward_floats
        # an expert axis: the norm counts each expert's gradient on every expert coordinate, the rest once
        # (runtime/experts.py); the step's tokens per expert summed over the batch's axes on their own
        self.expert_norm = (ExpertReduction(mesh, engine.plan, engine.states, engine.scalar_vector, engine.experts)
                            if engine.experts is not None else None)
        # the whole-mesh sum counts each replica's loss once: on its pipe and tensor coordinate 0
        self.counts_loss = self.coord == 0 and (engine.tensor is None or engine.tensor.coord == 0)
        self.timeline: list[Record] = []
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self.window = pp.recv_window
        if mesh.device.type == "cpu":           # neighbours' messages through shared memory, where they can
            comm.open_mailboxes(mesh, pp.axis)
        # the split backward: the blocks' Linear weight gradients deferred to W, on stages with an input
        # (the first stage's W runs its whole backward); torch's generic split where that does not apply.
        # Under 1f1b the last stage's last backward only (``split_tail``): its forward alone records
        self.deferred: WeightGradStore | None = None
        self.deferred_layers = 0
        self.split: set[tuple[int, int]] | None = None       # (stage, micro-batch) split; None: all (zb_h1)
        if zero_bubble and engine.tensor is not None:
            engine.tensor.boundaries.unfuse_columns()    # the generic split runs a layer's backward twice
        if deferrable and zero_bubble:
            self.deferred = WeightGradStore()
            self.deferred_layers = sum(defer_linears(self._deferrable(i), self.deferred)
                                       for i, st in self.stages.items() if not st.pre)
        elif deferrable:
            tail = pp.lowered(self.coord, unshard=self.per_step, split_tail=True)
            split = {(a.stage, a.mb) for a in tail if a.kind == "I"}
            store = WeightGradStore()
            store.capture = False
            n = sum(defer_linears(self._deferrable(s), store) for s in {s for s, _ in split})
            if n:
                self.deferred, self.deferred_layers, self.split, self.actions = store, n, split, tail
        # micro-batch -> the stage of its last forward on this rank, after which its context goes
        self.last_forward = {a.mb: a.stage for a in self.actions if a.kind == "F"}
        self.recvs = [k for k, a in enumerate(self.actions) if a.kind in ("RECV_F", "RECV_B")]

    def _deferrable(self, s: int) -> list[nn.Module]:
        """Stage ``s``'s modules whose Linear weight gradients a split backward defers: its blocks, and
        on the last stage ``pipeline_post``'s untied Linear layers (the LM head)."""
        return self.blocks[s] + (untied_linears(self.engine.model, self.pp.post_params) if self.stages[s].post else [])

    def _params_of(self, stage) -> list[nn.Parameter]:
        named = dict(self.engine.model.named_parameters())
        names = [n for n in named if stage.index in self.pp.stages_of_param(n)]
        return [named[n] for n in names if named[n].requires_grad and not named[n].is_meta]

    # ---- the step ------------------------------------------------------------------------------
    def run(self, micro: list[Any], factor: float, loss_sum: torch.Tensor) -> None:
        """Run this rank's actions over the step's micro-batches; add the sum of the micro-batch losses
        (of this data replica) into ``loss_sum``, the same on every stage: the last computes them, the
        others receive them behind the output gradients."""
        eng = self.engine
        if eng.buckets is not None:
            eng.buckets.begin_micro(first=True, last=False)     # reduced after the schedule (finish)
        self.losses: dict[int, torch.Tensor] = {}
        self.micro, self.factor = micro, factor
        for m in self.routers:             # what the step's backward gives each micro-batch's loss
            m.aux_grad_scale = factor
        if self.router is not None:
            self.router.begin_step(factor)
        self.stream = self._stream_shape(micro[0])
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: dict[tuple[str, int, int], comm.Pending] = {}
        self.ready: dict[tuple[str, int, int], torch.Tensor] = {}
        self.grad_in: dict[tuple[int, int], torch.Tensor | None] = {}
        self.weight_work: dict[tuple[int, int], Any] = {}
        self.sends: list[comm.Pending] = []
        self.timeline = []
        self.ctx = {}
        if eng.units is not None:
            eng.units.begin_micro(first=True)
        posted = 0                      # receives posted so far, in list order (self.recvs)
        # receives are posted ahead before a compute action, from the first that needs none (the first
        # stage's first forward) on only once it is done: that forward starts the whole pipeline
        ahead = not (self.actions and self.actions[0].kind == "F" and self.stages[self.actions[0].stage].pre)
        try:
            for k, a in enumerate(self.actions):
                self.current = a
                if a.kind in ("RECV_F", "RECV_B"):    # where the receive completes; posted earlier
                    posted = self._post_receives(posted, through=k)
                    continue
                if a.kind in ("F", "B", "I", "W"):
                    if ahead:
                        posted = self._post_receives(posted, through=-1)
                    ahead = True
                # a compute action's receive is waited for first and timed as that RECV: the wait is
                # the bubble, not the compute's time
                key = ("F" if a.kind == "F" else "B", a.stage, a.mb) if a.kind in ("F", "B", "I") else None
                if key is not None and key in self.pending:
                    start = time.perf_counter()
                    self.ready[key] = self._received(key)
                    self.timeline.append(Record(self.mesh.rank, f"{a.stage}RECV_{key[0]}{a.mb}", start,
                                                time.perf_counter()))
                start = time.perf_counter()
                self._do(a)
                self.timeline.append(Record(self.mesh.rank, str(a), start, time.perf_counter()))
            for w in self.sends:
                self._wait(w, "a send")
            self.sends = []
        except BaseException as e:
            if self.deferred is not None:
                self.deferred.clear()
            if not isinstance(e, PipelineError):
                self._report(e)
            raise
        if eng.units is not None:
            eng.units.end_micro()
        for s in eng.states:      # gradients set by the weight-gradient half bypass the hooks
            if s.trainable and s.param.grad is not None:
                s.used = True
        self.inputs = self.outputs = self.grad_in = {}
        assert len(self.losses) == len(micro), f"rank {self.mesh.rank} knows {sorted(self.losses)} of the losses"
        total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        for i in range(len(micro)):           # in micro-batch order, as one process adds them
            total += self.losses[i]
        self.losses = {}
        loss_sum += total

    def complete(self, grads: list[torch.Tensor]) -> None:
        if self.tied_sums:
            self.sum_tied(grads)         # tied embeddings: the first and last stage's shares summed

    def _post_receives(self, posted: int, through: int) -> int:
        """Post the next receives of the list: every one up to position ``through``, and more while
        fewer than the plan's ``recv_window`` are outstanding (a RECV in the list marks where the
        receive is waited for, not where it is posted). Returns how many are posted now."""
        while posted < len(self.recvs) and (self.recvs[posted] <= through or len(self.pending) < self.window):
            a = self.actions[self.recvs[posted]]
            start = time.perf_counter()
            self._do(a)
            self.timeline.append(Record(self.mesh.rank, str(a), start, time.perf_counter()))
            posted += 1
        return posted

    def _do(self, a) -> None:
        kind, s, i = a.kind, a.stage, a.mb
        if kind in ("F", "B") and self.zero3 and not self.per_step:
            self._microbatch_gather(s, kind)
        if kind == "F":
            self._forward(s, i)
        elif kind == "B":
            self._backward(s, i)
            if self.zero3 and not self.per_step:      # units whose inputs took no gradient
                for u in self.units_of[s]:
                    if u is not self.engine.units.root and not u.reduced:
                        self.engine.units.reduce(u)
        elif kind == "I":
            self._backward_input(s, i)
        elif kind == "W":
            self._backward_weight(s, i)
        elif kind == "RECV_F":
            shape, dtype = self.stream
            buf = torch.empty((shape.numel() + loss_words(dtype) * self.floats_f,) if self.floats_f else shape,
                              dtype=dtype, device=self.mesh.device)
            self.pending[("F", s, i)] = comm.recv(buf, self.mesh, self.axis, (s - 1) % self.p, tag=self._tag(0, s, i))
        elif kind == "SEND_F":
            out = self.outputs[(s, i)].detach()
            riding = ([self.aux_so_far.pop((s, i)).reshape(1)] if self.aux_riding else []) + \
                ([self.router.pack_forward(s, i)] if self.router is not None else [])
            if riding:               # the micro-batch's aux terms and router statistics so far behind the stream
                out = torch.cat([out.reshape(-1), values_to_words(torch.cat(riding), out.dtype)])
            self.sends.append(comm.send(out, self.mesh, self.axis, (s + 1) % self.p, tag=self._tag(0, s + 1, i)))
        elif kind == "RECV_B":       # the output's gradient, the micro-batch's loss behind it
            shape, dtype = self.stream      # a stage that sends its output sends the stream
            buf = torch.empty(shape.numel() + loss_words(dtype) * self.floats_b, dtype=dtype, device=self.mesh.device)
            self.pending[("B", s, i)] = comm.recv(buf, self.mesh, self.axis, (s + 1) % self.p, tag=self._tag(1, s, i))
        elif kind == "SEND_B":
            g = self.grad_in.pop((s, i))
            back = [self.losses[i].reshape(1)] + ([self.router.pack_backward(i)] if self.router is not None else [])
            msg = torch.cat([g.reshape(-1), values_to_words(torch.cat(back), g.dtype)])
            self.sends.append(comm.send(msg, self.mesh, self.axis, (s - 1) % self.p, tag=self._tag(1, s - 1, i)))
        elif kind == "UNSHARD":
            units = self.engine.units
            for u in self.units_of[s]:
                units.gather(u)
            for u in self.units_of[s]:
                units.wait(u)
        elif kind == "REDUCE_GRAD":
            if self.zero3:
                for u in reversed(self.units_of[s]):
                    if not u.reduced:
                        self.engine.units.reduce(u)
        elif kind == "RESHARD":
            pass          # REDUCE_GRAD freed the stage's parameters with its reduce-scatter
        else:
            raise PipelineError(f"pipeline: unknown action {a} on rank {self.mesh.rank}.")

    def _microbatch_gather(self, s: int, kind: str) -> None:
        """ZeRO-3's microbatch policy around stage ``s``'s next compute: the root gathered if the
        stage holds it (kept to the end of the step); before a backward, the stage's units are
        marked unreduced (their hooks gather, reduce and free them as the backward passes)."""
        units = self.engine.units
        if s == self.root_stage:
            units.wait(units.root)
        if kind == "B":
            for u in self.units_of[s]:
                if u is not units.root:
                    u.reduced = False

    def _tag(self, direction: int, stage: int, mb: int) -> int:
        return (direction * self.n_stages + stage) * self.m + mb

    def _received(self, key: tuple[str, int, int]) -> torch.Tensor:
        if key in self.ready:
            return self.ready.pop(key)
        direction, s, i = key
        src = (s - 1) % self.p if direction == "F" else (s + 1) % self.p
        what = f"stage {s}'s {'input' if direction == 'F' else 'output gradient'} of micro-batch {i}"
        got = self._wait(self.pending.pop(key), f"{what} from pipe rank {src}")
        shape = self.stream[0]
        if direction == "F":
            if not self.floats_f:
                return got
            riding = values_from_words(got[shape.numel():])
            if self.aux_riding:
                self.aux_so_far[(s, i)], riding = riding[0], riding[1:]
            if self.router is not None:
                self.router.unpack_forward(s, i, riding)
            return got[:shape.numel()].view(shape)
        back = values_from_words(got[shape.numel():])
        self.losses[i] = back[0]
        if self.router is not None:
            self.router.unpack_backward(i, back[1:])
        return got[:shape.numel()].view(shape)

    def _wait(self, pending: comm.Pending, what: str) -> torch.Tensor:
        try:
            return pending.wait()
        except RuntimeError as e:
            failed = self._failed()
            if failed is not None:
                raise PipelineError(f"pipeline: rank {self.mesh.rank} stopped waiting for {what}: rank {failed}")\
                    from e
            done = " ".join(r.action for r in self.timeline[-6:])
            raise PipelineError(f"pipeline: rank {self.mesh.rank} timed out or lost its peer waiting for {what} "
                                f"(action {self.current}, after ... {done}) — {e}") from e

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, s: int, i: int) -> None:
        eng, st, fns = self.engine, self.stages[s], self.fns
        batch = self.micro[i]
        if st.pre:
            x, self.ctx[i] = fns.pre(batch, eng.cdt)
            inp = None
        else:
            x = inp = self._received(("F", s, i)).requires_grad_(True)
            if i not in self.ctx:
                self.ctx[i] = fns.context(batch, eng.cdt)
        ctx = self.ctx[i]
        if self.deferred is not None:
            self.deferred.capture = self.split is None or (s, i) in self.split
        with self.router.recording() if self.router is not None else contextlib.nullcontext():
            for blk, k in zip(self.blocks[s], self.block_index[s]):
                x = blk(x, **fns.block_kwargs(ctx, k))
                if isinstance(x, tuple):        # a transformers block returning (hidden, ...): GPT-J, BLOOM, MPT
                    x = x[0]
            routed = self.router.captured if self.router is not None else None
        if self.router is not None:          # this stage's router statistics added to the micro-batch's
            self.router.after_blocks(s, i, batch, routed)
        if self.aux_riding:                 # this stage's routers' terms added to the micro-batch's so far
            before = self.aux_so_far.pop((s, i), None) if not st.pre else None
            mine = sum((m.aux_weight * m.aux_loss.detach().float() for m in self.stage_routers[s]),
                       torch.zeros((), dtype=torch.float32, device=self.mesh.device))
            self.aux_so_far[(s, i)] = mine if before is None else before + mine
        if st.post:
            logits = eng.tensor.logits if eng.tensor is not None else None
            try:
                with (logits if logits is not None else contextlib.nullcontext(),
                      self.router.last_stage(s, i) if self.router is not None else contextlib.nullcontext()):
                    loss = fns.post(x, batch)
            finally:
                if logits is not None:
                    logits.clear()
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                what = "the model's loss" if fns.kind == "transformers" else f"{type(eng.model).__name__}.pipeline_post"
                raise PipelineError(f"pipeline: {what} must be the scalar mean loss of the micro-batch — got "
                                    f"{type(loss).__name__}"
                                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.")
            self.losses[i] = loss.detach().float() + (self.aux_so_far.pop((s, i)) if self.aux_riding else 0.0)
            x = loss
        if self.last_forward[i] == s:
            del self.ctx[i]
        self.outputs[(s, i)] = x
        self.inputs[(s, i)] = inp
        if eng.tensor is not None:
            eng.tensor.clear()

    # ---- shapes, scalars, failures -------------------------------------------------------------
    def _stream_shape(self, batch: Any) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the stream between stages for micro-batches shaped like ``batch``
        (``planner.pipeline.stream_shape``: ``pipeline_pre`` and the first block on the meta device,
        nothing computed or communicated), once per batch shape."""
        leaves, spec = tree_flatten(batch)
        key = (str(spec), *((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves))
        hit = self._shapes.get(key)
        if hit is None:         # with the tensor axis's boundaries installed: SP's slice is in the shape
            rows = next(t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim())
            with probing():          # experts on the expert axis: zeros of their input's shape, nothing routed
                shape = stream_shape(self.engine.model, self.pp.stack, batch, rows, self.engine.cdt)
            if self.engine.tensor is not None:
                self.engine.tensor.clear()
            hit = self._shapes[key] = (torch.Size(shape), self.engine.cdt)
        return hit

    def sum_tied(self, grads: list[torch.Tensor]) -> None:
        """Sum the gradients of the weights tied across the first and last stage over the pipe axis, in
        place: each stage computed its own use's share (the embedding's, the head's); both then apply the
        same update to the same values, so the copies stay one tensor (Megatron's embedding group)."""
        for i, k in self.tied_sums:
            g = grads[i] if i is not None else torch.zeros(k, dtype=torch.float32, device=self.mesh.device)
            comm.all_reduce(g, self.mesh, (self.pp.axis,), inplace=True)

    def norm_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` for the clipping norm: a tied weight's summed gradient counted on the first stage only."""
        held = [i for i, _ in self.tied_sums if i is not None]
        if not held or self.counts_tied:
            return grads
        out = list(grads)
        for i in held:
            out[i] = grads[i].new_zeros(())
        return out

    def sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the squared global norm: its stages' gradients (a tied weight's on the
        first stage only), counted as the tensor axis counts them, else on the first rank of the batch's axes
        only (data, and context: its ranks hold the same gradients) when they are replicated over them."""
        eng = self.engine
        grads = self.norm_grads(grads)
        if self.expert_norm is not None:
            return self.expert_norm.sum_of_squares(grads)
        if eng.tensor is not None:
            return eng.tensor.sum_of_squares(grads)
        if eng.plan.states.grads is None and eng.mesh.group_index(eng.mesh.rank, eng.plan.dp_axes) != 0:
            return torch.zeros((), device=self.mesh.device)
        return sum(((g.double() ** 2).sum() for g in grads), torch.zeros((), dtype=torch.float64)).float()

    def reduce(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """Sum ``[scalars..., used flag of each trainable parameter]`` over the plan's
        ``pipe_scalar_axes``: nothing to do at data = 1, this stage's vector over ``data``, or, for
        fp16's overflow count and clipping's norm, every stage's over the whole mesh: the flags then
        sit at each parameter's place among all the model's trainable parameters (each stage fills
        its own), on tensor coordinate 0 only, and the loss on one rank per data replica. Returns
        the vector with this rank's flags, in its states' order."""
        eng = self.engine
        if self.expert_norm is not None:
            self.expert_norm.settle_counts()
        local = eng.scalar_vector(scalars)
        if self.scalar_axes != self.mesh.canonical_axes(self.mesh.axis_names):
            return comm.all_reduce(local, self.mesh, self.scalar_axes) if self.scalar_axes else local
        k = len(scalars)
        vec = torch.zeros(k + self.n_trainable, dtype=local.dtype, device=local.device)
        vec[:k] = local[:k]
        vec[k + self.global_index] = local[k:]
        if not self.counts_loss:
            vec[0] = 0.0
        if eng.tensor is not None and eng.tensor.coord != 0:
            vec[k:] = 0.0
        out = comm.all_reduce(vec, self.mesh, self.mesh.canonical_axes(self.mesh.axis_names))
        return torch.cat([out[:k], out[k + self.global_index]])

    def _report(self, e: BaseException) -> None:
        report_failure(f"{self.mesh.rank} ({type(e).__name__}: {e})")

    def _failed(self) -> str | None:
        return reported_failure()

    def clear_failure(self) -> None:
        clear_failure()
