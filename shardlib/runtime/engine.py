"""``sl.parallelize(model, plan, optimizer=...)``: the training engine that executes a ``Plan``.

``engine.step(batch)`` runs one optimizer step on the *global* batch: each rank takes its rows
by the plan's batch layout (dim 0 over ``data``), splits them into ``grad_accum`` micro-batches,
runs forward and backward on each (gradients reduced on the last micro-step, overlapped with
its backward), then reduces the loss and checks, clips and updates. It returns the mean loss
of the whole batch, the same on every rank.

Feeding per-rank data (a real data loader): give each rank its own rows and call
``engine.step(local_batch, local=True)``; rank ``r`` must hold rows
``plan.batch.local_slices(global_shape, r)`` of the global batch (its ``data`` coordinate's
chunk). ``engine.data_index`` and ``engine.data_size`` say which chunk that is.

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
from ..comm import core as comm
from ..errors import ShardingError, ShardingTypeError
from ..planner.plan import Plan
from ..validate import flag
from .access import EngineAccess
from .batches import split_batch
from .buckets import GradBuckets
from . import inspection
from .machine import warn_slow_precision
from .materialize import is_meta, materialize_stage_
from .offload.core import Copies, DiskOptimizer, OffloadError, OptimizerOffload
from .offload.activations import activation_offload
from .offload.params import params_offload
from .pipeline import PipelineRuntime
from .pretrained.core import EnginePretrained
from .scaler import LossScaler
from .setup import EngineSetup, check_optimizer, loss_scaler, strip_to_stage, validate
from .sync import broadcast_buffers, broadcast_module, cast_buffers
from .tensor import TensorRuntime


class NonFiniteLossError(FloatingPointError):
    """The loss became inf or NaN in a run with no loss scaling to absorb it."""


class Engine(EngineSetup, EngineAccess, EnginePretrained):
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
        plan = plan.local(mesh.rank)
        self.model, self.plan, self.mesh = model, plan, mesh
        self.loss_fn = loss_fn
        # the batch's chunks: data ranks (times replicas under HSDP), and this rank's chunk
        self.data_size = plan.dp_size
        self.data_index = mesh.group_index(mesh.rank, plan.dp_axes)
        # HSDP: gradients are replicated over the replica axis; only its first replica counts them
        # in the clipping norm (the overflow count only needs to be > 0 somewhere)
        self.replica_coord = mesh.coord(mesh.rank, plan.replica_axis) if plan.replica_axis else 0
        self.cdt, self.rdt = plan.compute_dtype, plan.reduce_dtype
        # the reduced gradient can be the fp32 master's gradient itself (no copy for the update)
        self.grad_is_master = not plan.mixed and plan.reduce_dtype == torch.float32
        self.step_count = 0
        self.samples_seen = 0           # rows of the global batches stepped on (a data position)
        self.grad_norm: float | None = None
        self.scaler = loss_scaler(loss_scale, plan)
        self.copies = Copies()           # bytes moved between memory kinds in the last step
        warn_slow_precision(plan.precision, mesh.device)
        rng = None
        piped = self.global_plan.pipe_size > 1
        meta = is_meta(model)
        if piped:              # this rank keeps its stages' parameters; the rest stays shapes only
            strip_to_stage(model, {p.name for p in plan.params})
        # values from a load (init=False): none now, and a step is refused until one
        self._needs_load = not init
        if not init:
            self.states = self._build_states_empty()
        else:
            if meta and piped:     # rank 0's values replayed for this rank's stages only, then as built
                materialize_stage_(model, mesh, {p.name for p in plan.params})
            elif meta:      # built on the meta device: rank 0's values, replayed (see _materialize)
                rng = self._materialize()
            else:   # every replica starts from rank 0's model, as DDP (split over tensor: the whole mesh does)
                axes = (tuple(a for a in mesh.axis_names if not piped or a != self.global_plan.pipeline.axis)
                        if plan.tensor_size > 1 else plan.dp_axes)
                broadcast_module(model, mesh, axes)
            self.states = self._build_states(rng)
        if plan.mixed:
            cast_buffers(model, self.cdt)
        self._apply_recompute()
        self.act_offload = activation_offload(self)     # saved activations to the host or a file
        trainable = [s for s in self.states if s.trainable]
        if plan.states.params is None:
            by_name = {s.name: s for s in trainable}
            by_bucket = [[by_name[p.name] for p in bucket] for bucket in plan.buckets()]
            riders = plan.scalars_per_step() if plan.scalars_ride_gradients else 0
            self.buckets, self.units = GradBuckets(self, by_bucket, riders), None
        else:
            self.buckets, self.units = None, self._build_units()
        if piped and self.units is not None and plan.pipe_unshard:
            self.units.remove()       # the pipeline gathers and reduces a stage's units once per step
        # after the units: its unit hooks run after ZeRO-3's gathers
        self.tensor = TensorRuntime(self) if plan.tensor_size > 1 else None
        self.pipe = PipelineRuntime(self) if piped else None
        self.params_offload = params_offload(self)   # ZeRO-3's shards to the host or to files (runtime/offload/params.py)
        self.offload = _offload(self)           # masters and moments to the host or to files (runtime/offload/core.py)
        self.optimizer = optimizer([s.master for s in trainable])
        check_optimizer(self.optimizer, [s.master for s in trainable], plan, model)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self._setup_access()

    # ---- the step ------------------------------------------------------------------------------
    def step(self, batch: Any, *, local: bool = False) -> float:
        """One optimizer step on ``batch`` (the global batch, or this rank's rows with ``local=True``);
        returns the mean loss of the whole batch."""
        self._refuse_before_load("step")
        if self.pipe is not None and self.pipe.fns.kind == "transformers":    # every rank, before any collective
            problems = self.pipe.fns.batch_problems(batch, "step", "batch")
            if problems:
                raise ShardingTypeError("\n".join(problems))
        micro, rows = split_batch(self, batch, local)    # validates before any collective
        with self._stepping():
            loss = self._step(micro)
        self.samples_seen += rows
        if self.check_replicas:
            from .replicas import check_replicas
            check_replicas(self)
        return loss

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
        with self._offload_mapped():
            return save(self, path, extra=extra, frozen=frozen)

    def load(self, path) -> dict:
        """Restore the state ``save`` wrote — on any mesh, plan and world size; returns its ``extra``.
        A collective."""
        from .checkpoint.core import load
        with self._offload_mapped():
            extra = load(self, path)
        self._needs_load = False
        return extra

    def load_pretrained(self, path, *, strict: bool = True) -> None:
        """Read a transformers folder (``config.json`` with ``model.safetensors``, or shards with
        ``model.safetensors.index.json``; bf16/fp16/fp32, cast to fp32) or one ``.safetensors`` file into
        the shards: each rank reads only its pieces. Everything is checked before any value is written;
        ``strict=False`` ignores tensors the model lacks. Before the first step. A collective."""
        from .pretrained.core import load_pretrained
        with self._offload_mapped():
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
        self._refuse_before_load("save_pretrained")
        with self._offload_mapped():
            if merged or is_peft(self.model):
                return save_peft(self, path, merged=merged, max_shard_size=max_shard_size, dtype=dtype)
            refuse_quantized(self)
            return save_pretrained(self, path, max_shard_size=max_shard_size, dtype=dtype)

    def export(self, path):
        """The full model (``full_state_dict()``) as one safetensors file, for a plain model."""
        from .checkpoint.core import export
        with self._offload_mapped():
            return export(self, path)

    @contextlib.contextmanager
    def _offload_mapped(self):
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
        plan = self.plan
        m = plan.grad_accum
        scale = self.scaler.scale if self.scaler else 1.0
        loss_sum = self._forward_backward(micro, scale / (self.data_size * m))
        reduced = self.buckets.finish() if self.buckets is not None else None
        grads = self._master_grads(reduced, scale)
        if self.pipe is not None and self.pipe.tied_sums:
            self.pipe.sum_tied(grads)         # tied embeddings: the first and last stage's shares summed
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
        self._release_master_grads()
        return float(loss)

    def _forward_backward(self, micro: list[Any], factor: float) -> torch.Tensor:
        """Every micro-batch's forward and backward (through the pipeline's schedule when there is one);
        returns the sum of their losses on this rank."""
        plan = self.plan
        self.copies.reset()
        for off in (self.params_offload, self.act_offload):      # their timelines: this step's
            if off is not None:
                off.timeline = []
        self._begin_step()
        if plan.broadcast_buffers and plan.dp_size > 1:     # rank 0's buffers before the forward, as DDP
            broadcast_buffers(self.model, self.mesh, plan.dp_axes)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        if self.buckets is not None and self.buckets.riders:
            # read when the last bucket launches (end of the last backward): the loss of every
            # micro-step is in by then, and so is every parameter's "got a gradient" flag
            self.buckets.rider_values = lambda: self.scalar_vector([loss_sum])
        if self.pipe is not None:
            if self.buckets is not None:
                self.buckets.begin_micro(sync=False)     # reduced after the schedule (finish)
            loss_sum += self.pipe.run(micro, factor)
        else:
            self._accumulate(micro, factor, loss_sum)
        if self.act_offload is not None:
            self.act_offload.end_step()           # (a failed activation write stops the step here)
        return loss_sum

    def _step_scalars(self, loss_sum: torch.Tensor, grads: list[torch.Tensor]):
        """``(the loss summed over the mesh, the overflow count, the gradients' sum of squares or None, on how
        many ranks each trainable parameter got a gradient)``: the step's scalars, then the gradient flags,
        summed by one all-reduce or already summed in the last gradient bucket's collective."""
        plan = self.plan
        scalars = [loss_sum]
        split = self.tensor is not None
        sharded = plan.states.grads is not None or split or self.pipe is not None
        found_inf = torch.zeros((), device=self.mesh.device)
        if self.scaler:       # counted where the gradients are (the host, offloaded), reduced on the device
            found_inf = (sum((~torch.isfinite(g)).sum() for g in grads).float().to(self.mesh.device) if grads
                         else found_inf)
            if sharded:
                scalars.append(found_inf)
        sumsq = None
        if plan.clip_grad_norm is not None:
            norm = self.pipe.norm_grads(grads) if self.pipe is not None else grads
            sumsq = (self.tensor.sum_of_squares(norm) if split else
                     self.pipe.sum_of_squares(norm) if self.pipe is not None else
                     sum((g.double() ** 2).sum() for g in norm).float() if norm else torch.zeros(()))
            sumsq = sumsq.to(self.mesh.device)
            if sharded and self.replica_coord != 0:
                sumsq = torch.zeros_like(sumsq)           # HSDP: the first replica counts the shards
            if sharded:
                scalars.append(sumsq)
        if self.buckets is not None and self.buckets.riders:
            vec = self.buckets.rider_sums
        elif self.pipe is not None:   # over the whole mesh: each stage adds its own
            vec = self.pipe.reduce_scalars(scalars)
        elif split:      # over (data, tensor), each value counted once (TensorRuntime.scalars)
            vec = self.tensor.reduce_scalars(self.scalar_vector(scalars))
        else:
            vec = comm.all_reduce(self.scalar_vector(scalars), self.mesh, plan.dp_axes)
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
            self._release_master_grads()
            raise NonFiniteLossError(
                f"step {self.step_count}: the loss is {loss.item()} ({plan.precision}) — the run stopped before "
                "updating the parameters. Lower the learning rate, check the data of this step, or clip "
                "gradients (plan(..., clip_grad_norm=1.0)).")
        if not skip and sumsq is not None and not torch.isfinite(sumsq):
            self._release_master_grads()
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
        if self.offload is not None:       # the update where the masters are, then the device copies
            try:
                self.offload.step(self.optimizer)
            except OffloadError:            # nothing of the step was applied (runtime/offload/core.py)
                self.step_count -= 1
                self._release_master_grads()
                raise
        else:
            self.optimizer.step()
        if self.lr_scheduler is not None:
            if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                self.lr_scheduler.step(float(loss))
            else:
                self.lr_scheduler.step()
        if self.offload is None:
            self.publish()

    def _accumulate(self, micro: list[Any], factor: float, loss_sum: torch.Tensor) -> None:
        """Forward and backward of each micro-batch in turn, gradients reduced on the last (overlapped
        with its backward); the losses added into ``loss_sum``."""
        m = len(micro)
        for i, mb in enumerate(micro):
            if self.buckets is not None:
                self.buckets.begin_micro(sync=i == m - 1)
            else:
                self.units.begin_micro(first=i == 0)
            try:
                loss = self._loss(mb) if self.tensor is None else self.tensor.loss(mb)
                loss_sum += loss.detach().float()
                (loss.float() * factor).backward()
            except RuntimeError as e:              # a freed ZeRO-3 parameter read: name it
                if self.units is not None and (said := self.units.freed_use(e)):
                    raise ShardingError(said) from e
                raise
            if self.tensor is not None:
                self.tensor.clear()
            if self.units is not None:
                self.units.end_micro()

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
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without fp16)."""
        return self.scaler.scale if self.scaler else None

    def _loss(self, batch: Any) -> torch.Tensor:
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

    def _begin_step(self) -> None:
        for s in self.states:
            s.used = False
        if self.buckets is not None:
            self.buckets.begin_step()

    def _master_grads(self, reduced, scale: float) -> list[torch.Tensor]:
        """Put the reduced, unscaled fp32 gradient on each master; return them.

        In fp32 the master's gradient is the reduced gradient itself (no copy); in mixed
        precision it is an fp32 copy that lives until the update is done."""
        plan = self.plan
        by_name: dict[str, torch.Tensor] = {}
        if reduced is not None:
            for bucket, grads in zip(plan.buckets(), reduced):
                by_name.update((pp.name, g) for pp, g in zip(bucket, grads))
        out, host = [], []
        if self.offload is not None:          # gradient shards copied in during backward (ZeRO-2/3)
            self.offload.sync()
        for s in self.states:
            if not s.trainable:
                continue
            if s.grad_shard is not None:
                if plan.states.params is None and by_name[s.name] is not s.grad_shard:
                    s.grad_shard.copy_(by_name[s.name])       # ZeRO-2: keep only the reduced rows
                g = s.grad_shard
            else:
                g = by_name[s.name]                             # DP: full; ZeRO-1: this rank's rows
                if g.numel() != s.hi - s.lo:                     # replicated grads, sharded optimizer
                    g = s.local_piece(g)
                if self.offload is not None:                    # read by the update on the host
                    host.append((len(out), s))
                    out.append(self.offload.to_host(g).view(s.master_shape))
                    continue
            if plan.mixed or g.dtype != torch.float32:
                mg = g.float().view(s.master_shape)
                if scale != 1.0:
                    mg.div_(scale)
            else:
                mg = g.view(s.master_shape)
            s.master.grad = mg
            out.append(mg)
        if host:                              # the host reads them from here: the copies must have landed
            self.offload.sync()
            for i, s in host:
                mg = out[i].float() if out[i].dtype != torch.float32 else out[i]
                if scale != 1.0:
                    mg.div_(scale)
                out[i] = s.master.grad = mg
        return out

    def _release_master_grads(self) -> None:
        """Drop gradients that live only for the update (fp32 copies, ZeRO-1's reduced rows); keep
        those that are views of storage kept between steps (bucket buffers, gradient shards)."""
        kept = {t.untyped_storage().data_ptr() for t in self._kept_grad_storage()}
        for s in self.states:
            if s.master is None or s.master.grad is None:
                continue
            if s.master.grad.untyped_storage().data_ptr() not in kept:
                s.master.grad = None

    def _kept_grad_storage(self) -> list[torch.Tensor]:
        out = [s.grad_shard for s in self.states if s.grad_shard is not None]
        if self.buckets is not None and self.buckets.views:
            out += self.buckets.buffers
        if self.buckets is not None and self.buckets.direct:     # one data rank: autograd's own gradients
            out += [s.param.grad for s in self.states if s.trainable and s.param.grad is not None]
        return out

    @torch.no_grad()
    def publish(self) -> None:
        """After the update: bring the compute-dtype copies up to date with the masters."""
        plan = self.plan
        trainable = [s for s in self.states if s.trainable]
        if self.offload is not None:
            with self._offload_mapped():
                self.offload.publish_all()
            return
        if self.params_offload is not None:        # the masters (on the device) into the offloaded shards
            try:
                for s in trainable:
                    self.params_offload.publish(s, s.master.detach().view(-1), 0, "device")
                self.params_offload.commit()
            except OSError as e:
                self.params_offload.abort()
                self._needs_load = (
                    f"the new parameters of step {self.step_count} could not be written under {plan.offload_dir} "
                    f"({e}), after the optimizer on the device had updated its states: the engine holds no one "
                    "step's state. Load the last checkpoint (engine.load(path)) to go on — or offload the "
                    "optimizer too (offload={'optimizer': 'disk', 'params': 'disk'}), whose failed writes leave "
                    "the step undone.")
                raise OffloadError(f"step: {self._needs_load}") from None
            return
        if plan.states.params is not None:
            if plan.mixed:
                for s in trainable:
                    s.shard.copy_(s.master)
            return
        if plan.states.optim is None:
            if plan.mixed:
                for s in trainable:
                    s.param.data.copy_(s.master.view(s.param.shape))
            return
        self.buckets.publish(self.cdt)           # all-gather the updated pieces, bucket by bucket


def _offload(engine: Engine) -> OptimizerOffload | None:
    kind = dict(engine.plan.offload).get("optimizer")
    if kind == "host":
        return OptimizerOffload(engine)
    if kind == "disk":
        return DiskOptimizer(engine, engine.plan.offload_dir)
    return None
