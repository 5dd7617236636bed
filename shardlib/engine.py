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
whole batch, which is what makes every layout train like one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from . import comm
from .errors import ShardingError, ShardingTypeError
from .mesh import Mesh
from .planner import Plan, param_owners
from .runtime.buckets import GradBuckets
from .runtime.flat import RowSharding, flat_shape, pack_shards, unpack_gathered
from .runtime.scaler import LossScaler
from .runtime.state import ParamState
from .runtime.units import Unit, UnitRunner

# optimizers whose update of an element depends on other elements of the tensor, or that need a
# closure: they cannot run on shards (or be skipped by the engine)
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam", "Muon")
_NEEDS_CLOSURE = ("LBFGS",)


class NonFiniteLossError(FloatingPointError):
    """The loss became inf or NaN in a run with no loss scaling to absorb it."""


def parallelize(model: nn.Module, plan: Plan, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                loss_scale: LossScaler | float | None = None, mesh: Mesh | None = None) -> Engine:
    """Shard ``model`` in place by ``plan`` and return the engine that trains it.

    ``optimizer`` is a factory ``params -> torch.optim.Optimizer``: the engine decides which
    tensors the optimizer sees (fp32 shards under ZeRO). ``lr_scheduler`` is a factory
    ``optimizer -> scheduler``, stepped after every optimizer step (``ReduceLROnPlateau`` is
    given the step's loss). ``loss_fn(model, batch)`` returns the loss; without it the model is
    called with the batch (``model(*batch)`` for a tuple, ``model(**batch)`` for a dict) and must
    return the loss. ``loss_scale`` (fp16 only): the initial dynamic loss scale, or a
    ``LossScaler`` with its growth rules (default: 2**16, halved on overflow, doubled after 2000
    good steps). A step whose gradients overflow on any rank is skipped on every rank.

    A trainable parameter that gets no gradient on any rank in a step (unused by the model's
    forward) is left out of that update, as one process would leave it (its ``grad`` is None):
    no weight decay, no momentum.
    """
    return Engine(model, plan, optimizer, lr_scheduler=lr_scheduler, loss_fn=loss_fn,
                  loss_scale=loss_scale, mesh=mesh)


class Engine:
    def __init__(self, model: nn.Module, plan: Plan, optimizer, *, lr_scheduler=None, loss_fn=None,
                 loss_scale: LossScaler | None = None, mesh: Mesh | None = None):
        mesh = mesh if mesh is not None else plan.mesh
        _validate(model, plan, optimizer, mesh, loss_fn)
        self.model, self.plan, self.mesh = model, plan, mesh
        self.loss_fn = loss_fn
        self.data_size = plan.data_size
        self.data_index = mesh.group_index(mesh.rank, (plan.data_axis,))
        self.cdt, self.rdt = plan.compute_dtype, plan.reduce_dtype
        # the reduced gradient can be the fp32 master's gradient itself (no copy for the update)
        self.grad_is_master = not plan.mixed and plan.reduce_dtype == torch.float32
        self.step_count = 0
        self.scaler = _scaler(loss_scale, plan)
        self.states = self._build_states()
        self._apply_recompute()
        trainable = [s for s in self.states if s.trainable]
        if plan.states.params is None:
            by_name = {s.name: s for s in trainable}
            by_bucket = [[by_name[p.name] for p in bucket] for bucket in plan.buckets()]
            riders = plan.scalars_per_step() if plan.scalars_ride_gradients else 0
            self.buckets, self.units = GradBuckets(self, by_bucket, riders), None
        else:
            self.buckets, self.units = None, self._build_units()
        self.optimizer = optimizer([s.master for s in trainable])
        _check_optimizer(self.optimizer, [s.master for s in trainable], plan, model)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None

    # ---- construction --------------------------------------------------------------------------
    def _build_states(self) -> list[ParamState]:
        plan, mesh = self.plan, self.mesh
        owners = param_owners(self.model)
        modules = dict(self.model.named_modules())
        named = dict(self.model.named_parameters())
        states = []
        for i, pp in enumerate(plan.params):
            p = named[pp.name]
            rows = RowSharding(flat_shape(pp.shape), self.data_size)
            lo, hi = rows.bounds(self.data_index)
            st = ParamState(i, pp, p, rows, lo, hi, [(modules[m], a) for m, a in owners[id(p)]])
            value = p.detach().to(device=mesh.device, dtype=torch.float32)
            mine = value.view(rows.shape)[lo:hi]
            with torch.no_grad():
                if plan.states.params is None:
                    p.data = value.to(self.cdt) if plan.mixed else value
                    if pp.trainable:
                        if plan.states.optim is None:
                            st.master = nn.Parameter(value.clone()) if plan.mixed else p
                        elif plan.mixed:
                            st.master = nn.Parameter(mine.clone())
                        else:   # fp32: the optimizer updates this rank's rows of the parameter in place
                            st.master = nn.Parameter(p.data.view(rows.shape)[lo:hi])
                        if plan.states.grads is not None and not plan.states.keep_local_grads:
                            st.grad_shard = torch.zeros_like(mine, dtype=self.rdt)
                            if self.grad_is_master:
                                st.master.grad = st.grad_shard
                else:
                    master = nn.Parameter(mine.clone(), requires_grad=pp.trainable)
                    st.shard = master.detach().to(self.cdt) if plan.mixed else master.detach()
                    if pp.trainable:
                        st.master = master
                        st.grad_shard = torch.zeros_like(mine, dtype=self.rdt)
                        if self.grad_is_master:
                            master.grad = st.grad_shard
                    full = nn.Parameter(torch.empty(pp.shape, dtype=self.cdt, device=mesh.device),
                                        requires_grad=pp.trainable)
                    full.untyped_storage().resize_(0)
                    for mod, attr in st.owners:
                        mod._parameters[attr] = full
                    st.param = full
            states.append(st)
        return states

    def _build_units(self) -> UnitRunner:
        modules = dict(self.model.named_modules())
        by_name = {s.name: s for s in self.states}
        root, units = None, []
        for u in self.plan.units:
            unit = Unit(u.name, modules[u.name], [by_name[n] for n in u.params], u.reshard_after_forward)
            if u.name == "":
                root = unit
            else:
                units.append(unit)
        return UnitRunner(self, units, root)

    def _apply_recompute(self) -> None:
        from torch.utils.checkpoint import checkpoint

        modules = dict(self.model.named_modules())
        for u in self.plan.units:
            if u.recompute:
                mod = modules[u.name]
                inner = mod.forward

                def forward(*args, _inner=inner, **kwargs):
                    return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

                mod.forward = forward

    # ---- the step ------------------------------------------------------------------------------
    def step(self, batch: Any, *, local: bool = False) -> float:
        """One optimizer step on ``batch`` (the global batch, or this rank's rows with ``local=True``);
        returns the mean loss of the whole batch."""
        plan = self.plan
        m = plan.grad_accum
        micro = self._split(batch, local)            # validates before any collective
        self._begin_step()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        scale = self.scaler.scale if self.scaler else 1.0
        factor = scale / (self.data_size * m)
        if self.buckets is not None and self.buckets.riders:
            # read when the last bucket launches (end of the last backward): the loss of every
            # micro-step is in by then, and so is every parameter's "got a gradient" flag
            self.buckets.rider_values = lambda: self._scalar_vector([loss_sum])
        for i, mb in enumerate(micro):
            last = i == m - 1
            if self.buckets is not None:
                self.buckets.begin_micro(sync=last)
            else:
                self.units.begin_micro(first=i == 0)
            loss = self._loss(mb)
            loss_sum += loss.detach().float()
            (loss.float() * factor).backward()
            if self.units is not None:
                self.units.end_micro()
        reduced = self.buckets.finish() if self.buckets is not None else None
        trainable = [s for s in self.states if s.trainable]
        grads = self._master_grads(reduced, scale)
        scalars = [loss_sum]
        sharded = plan.states.grads is not None
        found_inf = torch.zeros((), device=self.mesh.device)
        if self.scaler:
            found_inf = sum((~torch.isfinite(g)).sum() for g in grads).float() if grads else found_inf
            if sharded:
                scalars.append(found_inf)
        sumsq = None
        if plan.clip_grad_norm is not None:
            sumsq = sum((g.double() ** 2).sum() for g in grads).float() if grads else torch.zeros(())
            if sharded:
                scalars.append(sumsq)
        # the step's scalars, then on how many ranks each parameter got a gradient: summed by one
        # all-reduce, or already summed in the last gradient bucket's collective
        if self.buckets is not None and self.buckets.riders:
            vec = self.buckets.rider_sums
        else:
            vec = comm.all_reduce(self._scalar_vector(scalars), self.mesh, plan.data_axis)
        loss = vec[0] / (self.data_size * m)
        if sharded:
            k = 1
            if self.scaler:
                found_inf, k = vec[k], k + 1
            if sumsq is not None:
                sumsq = vec[k]
        used = vec[len(scalars):]
        self.step_count += 1
        skip = bool(found_inf > 0) if self.scaler else False
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
        if not skip:
            for s, u in zip(trainable, used.tolist()):
                if u == 0:                                # no gradient on any rank: as one process, skip it
                    s.master.grad = None
            if sumsq is not None:
                total = sumsq.double().sqrt()
                coef = torch.clamp(plan.clip_grad_norm / (total + 1e-6), max=1.0)
                for g in grads:
                    g.mul_(coef.to(g.dtype))
            self.optimizer.step()
            if self.lr_scheduler is not None:
                if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    self.lr_scheduler.step(float(loss))
                else:
                    self.lr_scheduler.step()
            self._publish()
        if self.scaler:
            self.scaler.update(skip)
        self._release_master_grads()
        return float(loss)

    def _scalar_vector(self, scalars: list[torch.Tensor]) -> torch.Tensor:
        """``[scalars..., used flag of each trainable parameter]`` in fp32."""
        used = torch.tensor([float(s.used) for s in self.states if s.trainable], device=self.mesh.device)
        return torch.cat([torch.stack([x.reshape(()).float() for x in scalars]), used])

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without fp16)."""
        return self.scaler.scale if self.scaler else None

    def _split(self, batch: Any, local: bool) -> list[Any]:
        n, m = self.data_size, self.plan.grad_accum
        leaves = _leaves(batch)
        if not leaves:
            raise ShardingTypeError("step: the batch holds no tensors — expected a tensor, or a tuple/list/dict of "
                                    "tensors with the batch in dim 0.")
        sizes = {t.shape[0] if t.dim() else None for t in leaves}
        if None in sizes or len(sizes) != 1:
            raise ShardingError(f"step: batch tensors disagree on dim 0 (the batch dim) — got sizes "
                                f"{[tuple(t.shape) for t in leaves]}; expected the same batch size in every tensor.")
        b = sizes.pop()
        need = m if local else n * m
        if b % need:
            what = (f"{m} micro-batches (grad_accum)" if local else
                    f"data={n} ranks x {m} micro-batches (grad_accum) = {need}")
            lo, hi = (b // need) * need, (b // need + 1) * need
            use = f"{lo} or {hi}" if lo else f"{hi}"
            fix = "grad_accum" if local else "grad_accum or the data degree"
            raise ShardingError(f"step: a {'local ' if local else ''}batch of {b} does not split evenly over {what} "
                                f"— expected a multiple of {need}. Use a batch of {use}, or change {fix}.")
        rows = b if local else b // n
        start = 0 if local else self.data_index * rows
        per = rows // m
        return [_map(batch, lambda t, i=i: self._prepare(t[start + i * per:start + (i + 1) * per])) for i in range(m)]

    def _prepare(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.mesh.device)
        return t.to(self.cdt) if t.is_floating_point() and self.plan.mixed else t

    def _loss(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            out = self.loss_fn(self.model, batch)
        elif isinstance(batch, dict):
            out = self.model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = self.model(*batch)
        else:
            out = self.model(batch)
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
        out = []
        for s in self.states:
            if not s.trainable:
                continue
            if s.grad_shard is not None:
                if plan.states.params is None:
                    s.grad_shard.copy_(by_name[s.name])       # ZeRO-2: keep only the reduced rows
                g = s.grad_shard
            else:
                g = by_name[s.name]                             # DP: full; ZeRO-1: this rank's rows
                if g.numel() != s.master.numel():               # replicated grads, sharded optimizer
                    g = s.flat(g)[s.lo:s.hi]
            if plan.mixed or g.dtype != torch.float32:
                mg = g.float().view(s.master.shape)
                if scale != 1.0:
                    mg.div_(scale)
            else:
                mg = g.view(s.master.shape)
            s.master.grad = mg
            out.append(mg)
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
        return out

    @torch.no_grad()
    def _publish(self) -> None:
        """After the update: bring the compute-dtype copies up to date with the masters."""
        plan = self.plan
        trainable = [s for s in self.states if s.trainable]
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
        by_name = {s.name: s for s in trainable}
        for bucket in plan.buckets():
            states = [by_name[p.name] for p in bucket]
            flat = pack_shards([s.master for s in states], [s.rows for s in states], self.cdt)
            out = comm.all_gather(flat, self.mesh, plan.data_axis)
            unpack_gathered(out, [s.rows for s in states], [s.param.data for s in states])

    # ---- inspection ----------------------------------------------------------------------------
    def memory_held(self) -> dict[str, int]:
        """Bytes of storage this rank holds for model states, by kind (as ``Plan.memory_per_rank``):
        ``params`` (compute-dtype copies, gathered or not), ``grads`` (kept gradients, and the
        gradients the optimizer reads while it steps), ``optimizer`` (fp32 masters that are not
        the parameters themselves, and per-element optimizer state; step counters excluded).
        Shared storage is counted once. Between steps it equals ``plan.memory_per_rank()``;
        inside ``optimizer.step`` (e.g. from a step pre-hook), ``plan.memory_per_rank(at="update")``."""
        seen: set[int] = set()
        out = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is None:
                return
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                return
            seen.add(st.data_ptr())
            out[kind] += st.nbytes()

        for s in self.states:
            add("params", s.param)
            add("params", s.shard)
        if self.buckets is not None and self.buckets.views:
            for buf in self.buckets.buffers:
                add("grads", buf)
            # the last bucket's tail holds the step's scalars, not gradients
            out["grads"] -= 4 * self.buckets.riders
            out["buffers"] += 4 * self.buckets.riders
        for s in self.states:
            add("grads", s.param.grad)
            add("grads", s.grad_shard)
        for s in self.states:                      # what the optimizer reads, where it is another tensor
            add("grads", s.master.grad if s.master is not None else None)
        for s in self.states:
            add("optimizer", s.master)
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    add("optimizer", v)
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    @property
    def peak_gathered_bytes(self) -> int:
        """ZeRO-3: the most bytes of gathered parameters (and gather buffers) held at once."""
        return self.units.peak if self.units is not None else 0

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value (fp32 masters, gathered where sharded), the same on every rank."""
        out = {}
        for s in self.states:
            if s.master is not None and s.master.shape == s.param.shape:
                out[s.name] = s.master.detach().float().clone()          # replicated master
            elif self.plan.states.params is None and not (s.master is not None and self.plan.mixed):
                out[s.name] = s.param.detach().float().clone()           # the full copy is exact
            else:
                rows = s.master if s.master is not None else s.shard
                flat = pack_shards([rows.detach().float()], [s.rows], torch.float32)
                full = torch.empty(s.rows.shape, dtype=torch.float32, device=self.mesh.device)
                unpack_gathered(comm.all_gather(flat, self.mesh, self.plan.data_axis), [s.rows], [full])
                out[s.name] = full.reshape(s.plan.shape)
        return out


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _validate(model, plan, optimizer, mesh, loss_fn) -> None:
    if not isinstance(plan, Plan):
        raise ShardingTypeError(f"parallelize: expected a Plan from sl.plan(...) — got {type(plan).__name__}.")
    if not isinstance(mesh, Mesh):
        raise ShardingTypeError("parallelize: the plan's mesh is an AbstractMesh — training needs a Mesh over "
                                "running processes: plan with sl.Mesh(...) or pass mesh=.")
    if mesh.abstract() != plan.mesh.abstract():
        raise ShardingError(f"parallelize: mesh {mesh.axis_sizes} differs from the plan's {plan.mesh.axis_sizes}.")
    names = [n for n, _ in model.named_parameters()]
    if names != [p.name for p in plan.params]:
        raise ShardingError("parallelize: the model's parameters differ from the plan's — expected the model the "
                            "plan was made for (same parameter names, in the same order).")
    if not any(p.trainable for p in plan.params):
        raise ShardingError(f"parallelize: the model {type(model).__name__} has no trainable parameters — all "
                            f"{len(names)} have requires_grad=False; expected at least one to train. Unfreeze some "
                            "(p.requires_grad_(True)) before planning.")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ShardingTypeError(
            f"parallelize: optimizer is a {type(optimizer).__name__} already built on the model's parameters — "
            "expected a factory. The engine decides which tensors the optimizer sees (fp32 shards under ZeRO, "
            "fp32 masters in mixed precision); pass e.g. optimizer=lambda params: "
            f"torch.optim.{type(optimizer).__name__}(params, lr=...).")
    if not callable(optimizer):
        raise ShardingTypeError(f"parallelize: optimizer must be a factory params -> Optimizer — got "
                                f"{type(optimizer).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise ShardingTypeError(f"parallelize: loss_fn must be callable (model, batch) -> loss — got "
                                f"{type(loss_fn).__name__}.")


def _check_optimizer(opt, masters: list[torch.Tensor], plan: Plan, model: nn.Module) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise ShardingTypeError(f"parallelize: the optimizer factory returned {type(opt).__name__} — expected a "
                                "torch.optim.Optimizer.")
    name = type(opt).__name__
    if plan.precision == "fp16" and name in _NEEDS_CLOSURE:
        raise ShardingError(f"parallelize: fp16 loss scaling skips steps that overflow, but {name} runs the model "
                            "inside step() (it needs a closure) and cannot be skipped — use an optimizer such as "
                            "AdamW or SGD, or bf16/fp32.")
    if name in _NEEDS_CLOSURE:
        raise ShardingError(f"parallelize: {name} needs a closure that re-runs the model; the engine runs forward "
                            "and backward itself — use AdamW, SGD or another step-by-step optimizer.")
    if plan.states.optim is not None and name in _NOT_ELEMENTWISE:
        raise ShardingError(f"parallelize: {name} updates an element from others of its tensor, so it cannot run on "
                            "the shards ZeRO gives it — use zero=0, or an elementwise optimizer (AdamW, SGD, ...).")
    seen = {id(p) for g in opt.param_groups for p in g["params"]}
    if seen != {id(m) for m in masters}:
        stranger = len(seen - {id(m) for m in masters})
        of_model = len(seen & {id(p) for p in model.parameters()} - {id(m) for m in masters})
        stage = f"ZeRO-{plan.zero}" if plan.zero else ("mixed precision" if plan.mixed else "this plan")
        raise ShardingError(
            f"parallelize: the optimizer holds {stranger} tensor(s) the engine did not give it"
            + (f" ({of_model} of them the model's own, unsharded parameters)" if of_model else "")
            + f" — expected exactly the {len(masters)} tensors passed to the factory. Under {stage} the optimizer "
            "updates what the engine gives it (fp32 masters, this rank's rows where the plan shards them); build "
            "it from the factory's argument: optimizer=lambda params: torch.optim.AdamW(params, ...).")


def _scaler(loss_scale, plan: Plan) -> LossScaler | None:
    if loss_scale is not None and plan.precision != "fp16":
        raise ShardingError(f"parallelize: loss_scale={loss_scale!r} given, but the plan computes in "
                            f"{plan.precision} — expected loss scaling only with precision='fp16'. Drop loss_scale.")
    if plan.precision != "fp16":
        return None
    if loss_scale is None:
        return LossScaler()
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise ShardingTypeError(f"parallelize: loss_scale must be a number or a LossScaler — got "
                                f"{type(loss_scale).__name__}.")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ShardingError(f"parallelize: loss_scale must be a positive finite number — got {loss_scale!r}.")
    return LossScaler(scale=float(loss_scale))


def _leaves(batch: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


def _map(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return tree_map_only(torch.Tensor, fn, batch)
