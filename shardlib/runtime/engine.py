"""``sl.parallelize(model, plan, optimizer=...)``: the training engine that executes a ``Plan``.

``engine.step(batch)`` runs one optimizer step on the *global* batch: each rank takes its rows
by the plan's batch layout (dim 0 over ``data``), splits them into ``grad_accum`` micro-batches,
runs forward and backward on each (gradients reduced on the last micro-step, overlapped with
its backward), then reduces the loss and checks, clips and updates. It returns the mean loss
of the whole batch, the same on every rank.

Feeding per-rank data (a real data loader): give each rank its own rows and call
``engine.step(local_batch, local=True)``; rank ``r`` must hold rows
``plan.batch.local_slices(global_shape, r)`` of the global batch (its ``data`` coordinate's
chunk). ``engine.data_index`` and ``engine.rows_size`` say which chunk of rows that is; with a
context axis a rank gets its rows' whole sequences and the engine cuts its zigzag chunks.

The loss of each micro-batch must be a mean over its rows (as ``F.cross_entropy`` and
``F.mse_loss`` are by default); with equal micro-batches the mean of means is the mean of the
whole batch, which is what makes every layout train like one process. A transformers causal LM
given ``labels`` is the exception that padding makes: its loss is a mean over non-ignored tokens,
so the engine gives each micro-batch ``num_items_in_batch`` (the global batch's token count over
``data · m``) and the step's loss is the whole batch's token mean exactly (``runtime/batches.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..algebra.mesh import Mesh
from ..errors import CollectiveError, ShardingError, ShardingTypeError
from ..planner.plan import Plan
from ..validate import flag
from .access import ParamAccess
from .batches import CONTEXT_KEY, split_batch
from .buckets import GradBuckets
from .context import ContextRuntime
from .experts import ExpertReduction, capacity_layers, dropped_rows, global_statistics, route_experts
from .grad_sync import Accumulate, DataReduction, GradSync, MicroBatches, Riding, StepReduction
from . import inspection, router_loss
from .machine import warn_slow_precision
from .masters import LostStep, Masters
from ..quant.api import pending_weights
from .materialize import is_meta, materialize_stage_
from .parted import Fingerprint, check_agreement
from .offload.core import Copies, OptimizerOffload, release_host_heap
from .offload.disk import DiskOptimizer
from .offload.files import OffloadError
from .offload.activations import activation_offload
from .offload.params import params_offload
from .pipeline import PipelineRuntime
from .pretrained.empty import build_empty, refuse_before_load
from .scaler import LossScaler
from .setup import (StateBuilder, apply_recompute, build_units, check_optimizer, loss_scaler, strip_to_stage,
                    validate)
from .sync import broadcast_buffers, broadcast_module, cast_buffers
from .tensor import TensorRuntime


class NonFiniteLossError(FloatingPointError):
    """The loss became inf or NaN in a run with no loss scaling to absorb it."""


class Engine:
    """The training engine: composed parts, each built with what it reads — the states (``setup.py``), the
    gradient syncs (``grad_sync.py``: buckets, ZeRO-3 units, the tensor and pipe runtimes), how micro-batches
    run and the step's scalars are summed, offload, the masters' side of the update (``masters.py``), and
    parameter access between steps (``access.py``). It is the ``TrainingState`` (``state.py``) that checkpoints,
    pretrained loading and export take."""

    def __init__(self, model: nn.Module, plan: Plan, optimizer, *, lr_scheduler=None, loss_fn=None,
                 loss_scale: LossScaler | None = None, mesh: Mesh | None = None, init: bool = True,
                 check_replicas: bool = False):
        if mesh is None:
            mesh = plan.mesh
        elif plan.data_axis not in mesh.axis_names:      # planned as data = 1 (sl.plan's reading)
            mesh = mesh.with_axis(plan.data_axis)
        validate(model, plan, optimizer, mesh, loss_fn)
        if problem := flag(init, "parallelize: init") or flag(check_replicas, "parallelize: check_replicas"):
            raise ShardingTypeError(f"{problem}.")
        self.check_replicas = check_replicas      # after every step: replicated masters bit-equal (replicas.py)
        # the whole-mesh plan; the engine runs this rank's tensor-local plan (the plan itself when
        # nothing is split over tensor): data parallel and ZeRO act on the tensor shards
        self.global_plan = plan
        check_agreement(plan, mesh)         # every rank built the same plan: one set-up all-gather (parted.py)
        plan = plan.local(mesh.rank)
        self.model, self.plan, self.mesh = model, plan, mesh
        self.loss_fn = loss_fn
        # the batch's chunks: data ranks (times replicas under HSDP), and this rank's chunk
        # (with a context axis the rows split over the others, each row's sequence over it: rows_size rows)
        self.data_size = plan.dp_size
        self.rows_size = plan.dp_size // plan.context_size
        self.data_index = mesh.group_index(mesh.rank, plan.row_axes)
        # HSDP: gradients are replicated over the replica axis; only its first replica counts them
        # in the clipping norm (the overflow count only needs to be > 0 somewhere)
        self.replica_coord = mesh.coord(mesh.rank, plan.replica_axis) if plan.replica_axis else 0
        builder = StateBuilder(model, plan, mesh)
        self.cdt, self.rdt, self.grad_is_master = builder.cdt, builder.rdt, builder.grad_is_master
        self.step_count = 0
        self.samples_seen = 0           # rows of the global batches stepped on (a data position)
        self.grad_norm: float | None = None
        self.scaler = loss_scaler(loss_scale, plan)
        self.copies = Copies()           # bytes moved between memory kinds in the last step
        warn_slow_precision(plan.precision, mesh.device)
        rng = None
        piped = self.global_plan.pipe_size > 1
        meta = is_meta(model)
        if init and (pending := list(pending_weights(model))):
            raise ShardingError(f"parallelize: {len(pending)} weight(s) marked by sl.quantize on a meta-device model "
                                f"(e.g. {pending[0]}) have no values — got init=True; expected their values from a "
                                "folder. Parallelize with init=False and call engine.load_pretrained(folder), which "
                                "quantizes each rank's slices.")
        if piped:              # this rank keeps its stages' parameters; the rest stays shapes only
            strip_to_stage(model, {p.name for p in plan.params})
        # values from a load (init=False): none now, and a step is refused until one
        self.needs_load: bool | str = not init
        # the persistent buffers init=False zeroed: a load must bring each of them (load_pretrained empties it)
        self.awaited: frozenset[str] = frozenset()
        if not init:
            self.states, self.awaited = build_empty(builder)
        else:
            if meta and piped:     # rank 0's values replayed for this rank's stages only, then as built
                materialize_stage_(model, mesh, {p.name for p in plan.params})
            elif meta:      # built on the meta device: rank 0's values, replayed (see _materialize)
                rng = builder.materialize()
            else:   # every replica starts from rank 0's model, as DDP (split over tensor: the whole mesh does)
                axes = (tuple(a for a in mesh.axis_names if not piped or a != self.global_plan.pipeline.axis)
                        if plan.tensor_size > 1 else plan.dp_axes)
                broadcast_module(model, mesh, axes)
            self.states = builder.build(rng)
        if plan.mixed:
            cast_buffers(model, self.cdt)
        apply_recompute(model, plan)
        self.act_offload = activation_offload(self)     # saved activations to the host or a file
        trainable = [s for s in self.states if s.trainable]
        if plan.states.params is None:
            by_name = {s.name: s for s in trainable}
            by_bucket = [[by_name[p.name] for p in bucket] for bucket in plan.buckets()]
            riders = plan.scalars_per_step() if plan.scalars_ride_gradients else 0
            self.buckets, self.units = GradBuckets(self, by_bucket, riders), None
        else:
            self.buckets, self.units = None, build_units(self)
        if piped and self.units is not None and plan.pipe_unshard:
            self.units.remove()       # the pipeline gathers and reduces a stage's units once per step
        # the expert axis (runtime/experts.py): experts run on their rows, routed to them and back (inside the
        # tensor axis's f and g where their widths split over tensor too)
        self.experts = route_experts(model, plan, self.global_plan, mesh) if plan.expert_size > 1 else None
        # the context axis (runtime/context.py): attention over every rank's keys, global positions
        self.context = ContextRuntime(model, mesh, plan.context_axis, plan.position_tables, plan.context_attention) \
            if plan.context_size > 1 else None
        # after the units: its unit hooks run after ZeRO-3's gathers
        self.tensor = TensorRuntime(self) if plan.tensor_size > 1 else None
        self.pipe = PipelineRuntime(self) if piped else None
        # the parts that touch gradients, told of each moment of the step (runtime/grad_sync.py); how the
        # micro-batches run; how the step's scalars are summed
        self.syncs: list[GradSync] = [p for p in (self.buckets, self.tensor, self.units, self.pipe) if p is not None]
        self.micro_batches: MicroBatches = self.pipe if self.pipe is not None else Accumulate(
            self.syncs, self.tensor.loss if self.tensor is not None else self.loss_of,
            self.units.freed_use if self.units is not None else None)
        # the axis sequence parallelism splits the tokens over, besides the batch's (None: no SP)
        self.router_chunks = plan.tensor.sp_axis if plan.tensor is not None else None
        # a router's balance statistics: the whole batch's (and under SP every tensor rank's chunk's)
        global_statistics(model, mesh, plan.dp_axes, self.router_chunks)
        # a transformers model's router loss: its statistics summed over the batch's ranks inside loss_of
        self.router_loss = router_loss.install(model) and (
            mesh.axis_size(mesh.canonical_axes(plan.dp_axes)) > 1 or self.router_chunks is not None)
        self.capacity_layers = capacity_layers(model)
        self.dropped: dict[str, int] = {}
        base = self.pipe or (ExpertReduction(mesh, plan, self.states, self.scalar_vector, self.experts)
                             if self.experts is not None else self.tensor or DataReduction(mesh, plan.dp_axes,
                                                                                           self.scalar_vector))
        self.reduction: StepReduction = Riding(base, self.buckets) if self.buckets and self.buckets.riders else base
        # the gradients differ across ranks (each holds a part): their overflow count and norm are summed
        self.grads_sharded = (plan.states.grads is not None or self.tensor is not None or self.pipe is not None
                              or self.experts is not None)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=mesh.device)   # this rank's, this step
        self.fingerprint = Fingerprint(plan, mesh)    # ranks that part ways fail the step (runtime/parted.py)
        if self.buckets is not None and self.buckets.riders:
            # read when the last bucket launches (end of the last backward): the loss of every micro-step
            # is in by then, and so is every parameter's "got a gradient" flag
            self.buckets.rider_values = lambda: self.scalar_vector([self.loss_sum, *self.fingerprint.values()])
        self.params_offload = params_offload(self)   # ZeRO-3's shards to the host or to files (runtime/offload/params.py)
        self.offload = _offload(self)           # masters and moments to the host or to files (runtime/offload/core.py)
        self.masters = Masters(plan, self.states, self.buckets, self.offload, self.params_offload,
                               self.offload_mapped)
        self.optimizer = optimizer([s.master for s in trainable])
        check_optimizer(self.optimizer, [s.master for s in trainable], plan, model)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.access = ParamAccess(model, plan, self.global_plan, mesh, self.states, self.units, self.offload_mapped)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, batch: Any, *, local: bool = False) -> float:
        """One optimizer step on ``batch`` (the global batch, or this rank's rows with ``local=True``);
        returns the mean loss of the whole batch."""
        refuse_before_load(self.needs_load, "step")
        if self.pipe is not None and self.pipe.fns.kind == "transformers":    # every rank, before any collective
            problems = self.pipe.fns.batch_problems(batch, "step", "batch")
            if problems:
                raise ShardingTypeError("\n".join(problems))
        micro, rows = split_batch(self, batch, local)    # validates before any collective
        with self.access.stepping():
            loss = self._step(micro)
        if self.offload is not None or self.params_offload is not None:
            release_host_heap()          # what the plan sent to the host or disk leaves the process too
        if self.capacity_layers:                        # a capacity's overflow: the rows each MoE layer dropped
            self.dropped = dropped_rows(self.capacity_layers)
        self.samples_seen += rows
        if self.check_replicas:
            from .replicas import check_replicas
            check_replicas(self)
        return loss

    # ---- parameter access between steps (runtime/access.py) -------------------------------------
    def gathered(self, writable: bool = False):
        """Inside, the model holds every parameter as a full fp32 tensor (FSDP's ``summon_full_params``);
        ``writable=True`` writes edits back on exit. A collective (``ParamAccess.gathered``)."""
        return self.access.gathered(writable)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` of the unsharded model, full fp32 tensors, the same on every rank; loads
        with ``strict=True`` into a fresh single-process model. A collective (``ParamAccess.full_state_dict``)."""
        return self.access.full_state_dict()

    # ---- inspection (runtime/inspection.py: functions of the engine's public state) --------------
    def memory_held(self, kind: str = "device") -> dict[str, int]:
        """Bytes of storage this rank holds for model states, by kind (as ``Plan.memory_per_rank``):
        ``params``, ``grads``, ``optimizer``, ``total``, and ``buffers`` (``inspection.memory_held``)."""
        return inspection.memory_held(self, kind)

    @property
    def peak_gathered_bytes(self) -> int:
        """ZeRO-3: the most bytes of gathered parameters (and gather buffers) held at once."""
        return inspection.peak_gathered_bytes(self)

    @property
    def peak_transient_bytes(self) -> dict[str, int]:
        """ZeRO-3: the most bytes held at once of ``gathered`` parameters, of ``grads`` on their way to a
        reduce-scatter, and of ``both`` together (``inspection.peak_transient_bytes``)."""
        return inspection.peak_transient_bytes(self)

    # ---- checkpoints (runtime/checkpoint/core.py) -------------------------------------------------------
    def save(self, path, *, extra: dict | None = None, frozen: bool = True):
        """Write the whole training state (parameters, optimizer state, step, scheduler, loss scale,
        RNG, samples seen, ``extra``) to the folder ``path``: every rank its own pieces, in parallel
        (DCP), moved into place once complete. Loadable on any mesh. ``frozen=False`` leaves the
        frozen parameters out (a fine-tune's base is not rewritten every save): ``load`` keeps the
        engine's own frozen values then. A collective."""
        from .checkpoint.core import save
        with self.offload_mapped():
            return save(self, path, extra=extra, frozen=frozen)

    def load(self, path) -> dict:
        """Restore the state ``save`` wrote — on any mesh, plan and world size; returns its ``extra``.
        A collective."""
        from .checkpoint.core import load
        with self.offload_mapped():
            extra = load(self, path)
        self.needs_load = False
        return extra

    def load_pretrained(self, path, *, strict: bool = True) -> None:
        """Read a transformers folder (``config.json`` with ``model.safetensors``, or shards with
        ``model.safetensors.index.json``; bf16/fp16/fp32, cast to fp32) or one ``.safetensors`` file into
        the shards: each rank reads only its pieces. Everything is checked before any value is written;
        ``strict=False`` ignores tensors the model lacks. Before the first step. A collective."""
        from .pretrained.core import load_pretrained
        with self.offload_mapped():
            load_pretrained(self, path, strict=strict)

    def save_pretrained(self, path, *, max_shard_size: int | str = "50GB", dtype: torch.dtype = torch.float32,
                        merged: bool = False):
        """Write what ``model.save_pretrained(path)`` writes in one process (config, generation config,
        safetensors sharded above ``max_shard_size`` with an index), tensors assembled on rank 0 one at a
        time. A model with no transformers config gets the safetensors files only. A PEFT model: its
        adapter folder, or with ``merged=True`` the plain base model with the adapters folded in
        (``runtime/pretrained/peft_export.py``). A collective."""
        from ..planner.peft import is_peft
        from .pretrained.peft_export import refuse_quantized, save_peft
        from .pretrained.core import save_pretrained
        refuse_before_load(self.needs_load, "save_pretrained")
        with self.offload_mapped():
            if merged or is_peft(self.model):
                return save_peft(self, path, merged=merged, max_shard_size=max_shard_size, dtype=dtype)
            refuse_quantized(self)
            return save_pretrained(self, path, max_shard_size=max_shard_size, dtype=dtype)

    def export(self, path):
        """The full model (``full_state_dict()``) as one safetensors file, for a plain model."""
        from .checkpoint.core import export
        with self.offload_mapped():
            return export(self, path)

    @contextlib.contextmanager
    def offload_mapped(self):
        """Offloaded to disk: the masters and moments readable and writable in place (file-backed,
        ``runtime/offload/core.py``) inside; otherwise nothing to do."""
        with contextlib.ExitStack() as stack:
            for off in (self.params_offload, self.offload):
                if off is not None:
                    stack.enter_context(off.mapped())
            yield

    def _step(self, micro: list[Any]) -> float:
        """One step: forward and backward of every micro-batch (gradients reduced as they fill), the step's
        scalars reduced in one collective, the non-finite checks, then the update."""
        m = self.plan.grad_accum
        scale = self.scaler.scale if self.scaler else 1.0
        loss_sum = self._forward_backward(micro, scale / (self.data_size * m))
        reduced = None
        for sync in self.syncs:
            got = sync.finish()
            reduced = got if got is not None else reduced
        if self.offload is not None:   # the last step's update in flight (streamed, or delayed beside this
            self.offload.wait()        # step's forward and backward): done before the gradients are read
        grads = self.masters.grads(reduced, scale)
        for sync in self.syncs:
            sync.complete(grads)          # (the pipe: tied embeddings' shares summed over the stages)
        loss, found_inf, sumsq, used = self._step_scalars(loss_sum, grads)
        loss = loss / (self.data_size * m)
        self.step_count += 1
        # the global norm of the (unscaled) gradients, where the step computes it (clipping); else None
        self.grad_norm = float(sumsq.double().sqrt()) if sumsq is not None else None
        skip = bool(found_inf > 0) if self.scaler else False
        self._check_finite(loss, sumsq, skip)
        if not skip:
            self._update(grads, used, sumsq, loss)
        if self.scaler:
            self.scaler.update(skip)
        if not (self.offload is not None and self.offload.in_flight):   # (an update in flight reads its gradients)
            self.masters.release()
        return float(loss)

    def _forward_backward(self, micro: list[Any], factor: float) -> torch.Tensor:
        """Every micro-batch's forward and backward (in turn, or by the pipeline's schedule); returns the sum
        of their losses on this rank."""
        plan = self.plan
        self.copies.reset()
        for off in (self.params_offload, self.act_offload):      # their timelines: this step's
            if off is not None:
                off.timeline = []
        for s in self.states:
            s.used = False
        for sync in self.syncs:
            sync.begin_step()
        if plan.broadcast_buffers and plan.dp_size > 1:     # rank 0's buffers before the forward, as DDP
            broadcast_buffers(self.model, self.mesh, plan.dp_axes)
        self.loss_sum.zero_()
        with self.context.active() if self.context is not None else contextlib.nullcontext():
            self.micro_batches.run(micro, factor, self.loss_sum)
        if self.act_offload is not None:
            self.act_offload.end_step()           # (a failed activation write stops the step here)
        return self.loss_sum

    def _step_scalars(self, loss_sum: torch.Tensor, grads: list[torch.Tensor]):
        """``(the loss summed over the mesh, the overflow count, the gradients' sum of squares or None, on how
        many ranks each trainable parameter got a gradient)``: the step's scalars, then the gradient flags,
        summed by one all-reduce or already summed in the last gradient bucket's collective."""
        scalars = [loss_sum]
        sharded = self.grads_sharded
        riding = isinstance(self.reduction, Riding)
        found_inf = torch.zeros((), device=self.mesh.device)
        if self.scaler:       # counted where the gradients are (the host, offloaded), reduced on the device
            found_inf = (sum((~torch.isfinite(g)).sum() for g in grads).float().to(self.mesh.device) if grads
                         else found_inf)
            if sharded:
                scalars.append(found_inf)
        sumsq = None
        if self.plan.clip_grad_norm is not None:
            sumsq = self.reduction.sum_of_squares(grads).to(self.mesh.device)
            if sharded and self.replica_coord != 0:
                sumsq = torch.zeros_like(sumsq)           # HSDP: the first replica counts the shards
            if sharded:
                scalars.append(sumsq)
        fp = self.fingerprint.placeholders() if riding else self.fingerprint.values()
        scalars += fp
        vec = self.reduction.reduce(scalars)
        try:            # (off: an empty slice; the next window starts either way)
            self.fingerprint.check(vec[len(scalars) - len(fp):len(scalars)], self.step_count + 1)
        except CollectiveError:
            self.masters.release()
            raise
        if sharded:
            k = 1
            if self.scaler:
                found_inf, k = vec[k], k + 1
            if sumsq is not None:
                sumsq = vec[k]
        return vec[0], found_inf, sumsq, vec[len(scalars):]

    def _check_finite(self, loss: torch.Tensor, sumsq: torch.Tensor | None, skip: bool) -> None:
        """Stop before the update on a non-finite loss (no loss scaler) or gradient norm."""
        plan = self.plan
        if not self.scaler and not torch.isfinite(loss):
            self.masters.release()
            raise NonFiniteLossError(
                f"step {self.step_count}: the loss is {loss.item()} ({plan.precision}) — the run stopped before "
                "updating the parameters. Lower the learning rate, check the data of this step, or clip "
                "gradients (plan(..., clip_grad_norm=1.0)).")
        if not skip and sumsq is not None and not torch.isfinite(sumsq):
            self.masters.release()
            raise NonFiniteLossError(
                f"step {self.step_count}: the loss is {loss.item():.6g} but the gradient norm is "
                f"{sumsq.double().sqrt().item()} ({plan.precision}) — the run stopped before updating the "
                "parameters. Lower the learning rate or check the model for an overflow in backward.")

    def _update(self, grads: list[torch.Tensor], used: torch.Tensor, sumsq: torch.Tensor | None,
                loss: torch.Tensor) -> None:
        """Clip, step the optimizer where the masters are, the learning-rate schedule, then the compute copies."""
        trainable = [s for s in self.states if s.trainable]
        for s, u in zip(trainable, used.tolist()):
            if u == 0:                                # no gradient on any rank: as one process, skip it
                s.master.grad = None
        if sumsq is not None:
            total = sumsq.double().sqrt()
            coef = torch.clamp(self.plan.clip_grad_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
        if self.plan.delayed:              # the update beside the next step's forward and backward
            self.offload.begin(self.optimizer, lambda: self._schedule(loss))
            return
        if self.offload is not None and self.offload.streams:   # unit by unit, beside the next forward
            self.optimizer._opt_called = True          # (a schedule stepped now follows an optimizer step)
            self.offload.streamed.start(self.optimizer, self.units.all)
            self._schedule(loss)
            return
        if self.offload is not None:       # the update where the masters are, then the device copies
            try:
                self.offload.step(self.optimizer)
            except OffloadError:            # nothing of the step was applied (runtime/offload/core.py)
                self.step_count -= 1
                self.masters.release()
                raise
        else:
            self.optimizer.step()
        self._schedule(loss)
        if self.offload is None:
            self.publish()

    def _schedule(self, loss: torch.Tensor) -> None:
        """The learning-rate schedule's step, after the optimizer's."""
        if self.lr_scheduler is not None:
            if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                self.lr_scheduler.step(float(loss))
            else:
                self.lr_scheduler.step()

    def scalar_vector(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """``[scalars..., used flag of each trainable parameter]`` in fp32."""
        used = torch.tensor([float(s.used) for s in self.states if s.trainable], device=self.mesh.device)
        return torch.cat([torch.stack([x.reshape(()).float() for x in scalars]), used])

    @property
    def timeline(self) -> list:
        """The last step's pipeline actions on this rank: ``Record(rank, action, start, end)`` with
        ``time.perf_counter`` seconds (``frontend/plots/timeline.py`` plots them); empty without a pipe axis."""
        return list(self.pipe.timeline) if self.pipe is not None else []

    @property
    def tokens_per_expert(self) -> dict[str, list[int]]:
        """The last step's tokens per expert of every experts module on the expert axis (the whole batch's,
        each token once per chosen expert); empty without an expert axis."""
        return dict(self.experts.last) if self.experts is not None else {}

    @property
    def dropped_tokens(self) -> dict[str, int]:
        """The last step's (token, expert) rows each MoE layer with a capacity dropped (the whole batch's; a token
        dropped by all its experts keeps its residual and shared experts); empty where no layer has a capacity."""
        return dict(self.dropped)

    @property
    def routed_rows(self) -> dict[str, tuple[int, int]]:
        """The last step's rows this rank's tokens routed to other ranks' experts, and the rows its experts
        received from other ranks, per experts module (micro-batches summed; ``planner/traffic.routing_bytes``
        gives their all-to-all bytes); empty without an expert axis."""
        return dict(self.experts.last_moved) if self.experts is not None else {}

    @property
    def expert_imbalance(self) -> float | None:
        """The last step's most loaded expert over the mean (the worst module's); None without an expert axis."""
        return self.experts.imbalance() if self.experts is not None else None

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without fp16)."""
        return self.scaler.scale if self.scaler else None

    def loss_of(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch: ``loss_fn(model, batch)``, or the model's own (a scalar, or a
        transformers output's ``.loss``)."""
        if self.context is not None:            # the micro-batch's documents and padding, for attention
            info = batch.get(CONTEXT_KEY) if isinstance(batch, dict) else None
            if info is not None:
                batch = {k: v for k, v in batch.items() if k != CONTEXT_KEY}
            self.context.use(info)
        with (router_loss.active(self.mesh, self.plan.dp_axes, self.router_chunks) if self.router_loss
              else contextlib.nullcontext()):
            if self.loss_fn is not None:
                out = self.loss_fn(self.model, batch)
            elif isinstance(batch, dict):
                out = self.model(**batch)
            elif isinstance(batch, (tuple, list)):
                out = self.model(*batch)
            else:
                out = self.model(batch)
        if self.loss_fn is None and not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
            if out.loss is None:
                raise ShardingTypeError(f"step: the model returned a {type(out).__name__} with no loss — expected "
                                        "labels in the batch (e.g. {'input_ids': ..., 'labels': ...}). Add labels, "
                                        "or pass loss_fn=.")
            out = out.loss      # a transformers ModelOutput: the model's own loss
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise ShardingTypeError(f"step: the loss must be a scalar tensor — got "
                                    f"{type(out).__name__}{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}. "
                                    "Return the mean loss from the model, or pass loss_fn=.")
        return out

    def publish(self) -> None:
        """After the update: bring the compute-dtype copies up to date with the masters (``Masters.publish``).
        A failed write of offloaded parameters leaves the engine without one step's state: a load is needed."""
        try:
            self.masters.publish(self.step_count)
        except LostStep as e:
            self.needs_load = e.why
            raise OffloadError(f"step: {e.why}") from None


def _offload(engine: Engine) -> OptimizerOffload | None:
    kind = dict(engine.plan.offload).get("optimizer")
    if kind == "host":
        return OptimizerOffload(engine)
    if kind == "disk":
        return DiskOptimizer(engine, engine.plan.offload_dir)
    return None
