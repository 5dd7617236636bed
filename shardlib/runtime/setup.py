"""Setting an engine up: validating the model, plan and optimizer; building each parameter's
runtime state (masters, shards, gradient shards) and ZeRO-3's units; recompute wrappers; a pipeline
stage's model stripped to its own parameters."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..algebra.layout import Layout
from ..algebra.mesh import Mesh
from ..errors import ShardingError, ShardingTypeError
from ..planner.units import param_owners
from ..planner.plan import Plan
from ..quant.api import format_of
from ..quant.layout import local_weight, pack, views
from ..validate import is_number
from .flat import flat_runs
from .materialize import (agreed_rng_state, init_program, materialize, materialize_, partly_meta, put_buffers,
                          unit_groups)
from .scaler import LossScaler
from .state import ParamState
from .units import Unit, UnitRunner

# optimizers whose update of an element depends on other elements of the tensor, or that need a
# closure: they cannot run on shards (or be skipped by the engine)
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam", "Muon")
_NEEDS_CLOSURE = ("LBFGS",)


def strip_to_stage(model: nn.Module, keep: set[str]) -> None:
    """Leave every parameter not named in ``keep`` (another stage's) on the meta device: shapes
    only, no storage. Tied parameters stay tied."""
    named = dict(model.named_parameters())
    kept = {id(named[n]) for n in keep if n in named}
    done: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is None or id(p) in kept or p.is_meta:
                continue
            if id(p) not in done:
                # shapes only (a quantized weight too: another stage's weight is never used here)
                done[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                           requires_grad=p.requires_grad)
            mod._parameters[attr] = done[id(p)]


class StateBuilder:
    """Each parameter's runtime state on this rank (``ParamState``: masters, shards, gradient shards), from
    the model's values (``build``), replayed from a model on the meta device (``materialize``, then
    ``build``), or zeros for a load to fill (``pretrained/empty.py``). Holds nothing but what it is built
    with: the model, this rank's plan and the mesh."""

    def __init__(self, model: nn.Module, plan: Plan, mesh: Mesh):
        self.model, self.plan, self.mesh = model, plan, mesh
        self.cdt, self.rdt = plan.compute_dtype, plan.reduce_dtype
        # the reduced gradient can be the fp32 master's gradient itself (no copy for the update)
        self.grad_is_master = not plan.mixed and plan.reduce_dtype == torch.float32

    def materialize(self) -> torch.Tensor | None:
        """A model built on the meta device gets the values a normal build gives it (``materialize.py``). Building on meta draws no random numbers, so the generator's state
        now is the state the build began from (the seed set before it, or inside the model's
        constructor); every rank takes rank 0's (one ~5 KB broadcast over the whole mesh, a set-up
        collective) and replays from it, so every rank gets rank 0's values bit for bit — the
        set-up broadcast of the model is not needed, and not run. Without ZeRO-3 each rank keeps
        the full model anyway: it is materialized whole, in place. Under ZeRO-3 returns the agreed
        state, for ``build`` to materialize unit by unit. Afterwards the generator is where
        rank 0's normal build would leave it, on every rank."""
        real = partly_meta(self.model)
        if real:
            raise ShardingError(
                f"parallelize: the model is partly on the meta device — got {len(real)} tensor(s) with values "
                f"({', '.join(real[:4])}{' ...' if len(real) > 4 else ''}); expected every parameter and buffer "
                "on the meta device (materialized here) or none. Build the whole model under "
                "torch.device('meta'), or none of it.")
        init_program(self.model)              # refuse a model that cannot be replayed before any collective
        rng = agreed_rng_state(self.mesh)
        if self.plan.states.params is not None:
            return rng
        materialize_(self.model, rng_state=rng)
        return None

    def build(self, rng_state: torch.Tensor | None = None) -> list[ParamState]:
        """Each parameter's runtime state, from the model's values. ``rng_state`` (ZeRO-3, a model on
        the meta device): the values are replayed unit by unit from that generator state instead
        (``build_meta``)."""
        if rng_state is not None:
            return self.build_meta(rng_state)
        named, owners = dict(self.model.named_parameters()), self.owners()
        states = []
        for i, pp in enumerate(self.plan.params):
            p = named[pp.name]
            st = self.param_state(i, pp, p, p.detach(), owners[id(p)])
            self.put(st)
            states.append(st)
        return states

    def build_meta(self, rng_state: torch.Tensor) -> list[ParamState]:
        """ZeRO-3 on a meta-device model: the plan's units materialized one at a time
        (``materialize.py``), each rank keeping its piece of each parameter and every buffer; a
        unit's full values are dropped before the next is built, so building holds one unit's
        values (plus one module's scratch tensors), not the model's. The modules get their
        tensors once every unit is built (the replay must see the meta tensors)."""
        model, plan = self.model, self.plan
        named, owners = dict(model.named_parameters()), self.owners()
        index = {pp.name: i for i, pp in enumerate(plan.params)}
        groups = unit_groups(model, [u.name for u in plan.units if u.name])
        states: list[ParamState | None] = [None] * len(plan.params)
        buffers: dict[str, torch.Tensor] = {}
        for _, values in materialize(model, list(groups.values()), rng_state=rng_state):
            for name in list(values):
                value = values.pop(name)
                if name in index:
                    i = index[name]
                    states[i] = self.param_state(i, plan.params[i], named[name], value, owners[id(named[name])])
                else:
                    buffers[name] = value.to(self.mesh.device)
                del value
        for st in states:
            self.put(st)
        put_buffers(model, buffers)
        return states

    def param_state(self, i: int, pp, p: nn.Parameter, full: torch.Tensor,
                     owners: list[tuple[nn.Module, str]]) -> ParamState:
        """Parameter ``i``'s state from its full value ``full`` (``p`` itself, or a materialized
        value for the meta parameter ``p``): this rank keeps its piece under ZeRO-3, the whole
        parameter otherwise."""
        plan, mesh = self.plan, self.mesh
        flat, sharded = plan.flat, plan.states.optim is not None
        # this rank's piece: elements [lo, hi) of the flattened parameter (planner/flat.py)
        slot = flat.slot(pp.name) if sharded else None
        lo, hi = (0, pp.numel) if slot is None else flat.piece(pp.name, mesh.rank)
        st = ParamState(i, pp, p, slot, lo, hi, owners)
        if pp.quant is not None:
            return self.quantized_state(st, full)
        if pp.full_shape is not None and tuple(full.shape) != pp.shape:   # split over tensor: keep this rank's shard
            full = Layout(mesh, pp.spec).local_part(full, mesh.rank).clone(   # a fused dim: its chunk of every block
                memory_format=torch.contiguous_format)          # not a view: the full value is freed
        value = full.to(device=mesh.device, dtype=torch.float32)
        mine = st.local_piece(value)
        with torch.no_grad():
            if plan.states.params is None:
                p.data = value.to(self.cdt) if plan.mixed else value
                if pp.trainable:
                    if plan.states.optim is None:
                        st.master = nn.Parameter(value.clone()) if plan.mixed else p
                    elif plan.mixed:
                        st.master = nn.Parameter(mine.clone())
                    else:   # fp32: the optimizer updates this rank's piece of the parameter in place
                        st.master = nn.Parameter(st.local_piece(p.data))
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
                st.param = full
        return st

    def quantized_state(self, st: ParamState, full: torch.Tensor) -> ParamState:
        """A quantized frozen weight: this rank's tensor shard of it (every component cut to match,
        ``quant/layout.py``), held packed; under ZeRO-3 this rank keeps its piece of the shard's packed
        bytes and the modules hold the shard rebuilt as views of a buffer filled while gathered."""
        plan, mesh, pp = self.plan, self.mesh, st.plan
        st.quant_format = format_of(st.param)
        mine = full
        if pp.full_shape is not None and tuple(full.shape) != pp.shape:
            mine = local_weight(full, Layout(mesh, pp.spec), mesh.rank)
        mine = mine.to(mesh.device)
        if plan.states.params is None:
            st.param = nn.Parameter(mine, requires_grad=False)
            for mod, attr in st.owners:
                mod._parameters[attr] = st.param
            return st
        c = self.cdt.itemsize
        packed = pack(mine)
        store = torch.zeros(pp.stored(c) * c, dtype=torch.uint8, device=mesh.device)
        store[:packed.numel()] = packed
        store = store.view(self.cdt)
        st.shard = st.local_piece(store).clone()
        st.store = store
        st.param = nn.Parameter(views(mine, store, tuple(mine.shape)), requires_grad=False)
        store.untyped_storage().resize_(0)
        return st

    def owners(self) -> dict[int, list[tuple[nn.Module, str]]]:
        """Every (module, attribute) holding each parameter, by the parameter's id."""
        modules = dict(self.model.named_modules())
        return {k: [(modules[m], a) for m, a in v] for k, v in param_owners(self.model).items()}

    def put(self, st: ParamState) -> None:
        """ZeRO-3: the modules hold the parameter's full-shaped tensor (storage only while gathered)."""
        if self.plan.states.params is not None:
            for mod, attr in st.owners:
                mod._parameters[attr] = st.param



def build_units(engine) -> UnitRunner:
    """ZeRO-3's units of this rank's plan over the engine's states (``units.py``)."""
    plan, states = engine.plan, engine.states
    modules = dict(engine.model.named_modules())
    by_name = {s.name: s for s in states}
    flats = flat_runs(plan.flat.groups, by_name, engine.mesh.rank)     # one per unit, in order
    root, units = None, []
    for u, fl in zip(plan.units, flats):
        unit = Unit(u.name, modules[u.name], [by_name[n] for n in u.params], u.reshard_after_forward, fl,
                    u.backward)
        if u.name == "":
            root = unit
        else:
            units.append(unit)
    return UnitRunner(engine, units, root)


def apply_recompute(model: nn.Module, plan: Plan) -> None:
    """Wrap the forward of each unit the plan recomputes (whole, or selective: attention's core)."""
    from ..comm.recompute import recomputed

    # split over tensor, a recomputed unit runs collectives: recompute it whole (no early stop,
    # which would skip the collectives after the last tensor backward needs), so what runs is
    # what the plan traced
    early = plan.tensor_size == 1
    modules = dict(model.named_modules())
    for u in plan.units:
        if u.recompute or u.selective:
            mod = modules[u.name]
            mod.forward = recomputed(mod.forward, "full" if u.recompute else "selective", early_stop=early,
                                     name=u.name)


def validate(model, plan, optimizer, mesh, loss_fn) -> None:
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
    if loss_fn is not None and plan.pipe_size > 1:
        raise ShardingError(
            "parallelize: loss_fn is given, but the plan cuts the model into pipeline stages, whose last stage "
            "computes the loss itself — the model's pipeline_post, or a transformers model's own loss "
            "(model(**batch).loss) — expected no loss_fn under a pipe axis. Drop loss_fn (put the loss in "
            "pipeline_post, or pass labels in the batch).")


def check_optimizer(opt, masters: list[torch.Tensor], plan: Plan, model: nn.Module) -> None:
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


def loss_scaler(loss_scale, plan: Plan) -> LossScaler | None:
    if loss_scale is not None and plan.precision != "fp16":
        raise ShardingError(f"parallelize: loss_scale={loss_scale!r} given, but the plan computes in "
                            f"{plan.precision} — expected loss scaling only with precision='fp16'. Drop loss_scale.")
    if plan.precision != "fp16":
        return None
    if loss_scale is None:
        return LossScaler()
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if not is_number(loss_scale):
        raise ShardingTypeError(f"parallelize: loss_scale must be a number or a LossScaler — got "
                                f"{type(loss_scale).__name__}.")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ShardingError(f"parallelize: loss_scale must be a positive finite number — got {loss_scale!r}.")
    return LossScaler(scale=float(loss_scale))
