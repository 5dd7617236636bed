"""Setting an engine up: validating the model, plan and optimizer; building each parameter's
runtime state (masters, shards, gradient shards) and ZeRO-3's units; recompute wrappers."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..algebra.mesh import Mesh
from ..errors import ShardingError, ShardingTypeError
from ..planner.build import param_owners
from ..planner.plan import Plan
from .flat import flat_runs
from .scaler import LossScaler
from .state import ParamState
from .units import Unit, UnitRunner

# optimizers whose update of an element depends on other elements of the tensor, or that need a
# closure: they cannot run on shards (or be skipped by the engine)
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam", "Muon")
_NEEDS_CLOSURE = ("LBFGS",)


class EngineSetup:
    """The construction half of ``Engine`` (mixed in)."""

    def _build_states(self) -> list[ParamState]:
        plan, mesh = self.plan, self.mesh
        owners = param_owners(self.model)
        modules = dict(self.model.named_modules())
        named = dict(self.model.named_parameters())
        flat, sharded = plan.flat, plan.states.optim is not None
        states = []
        for i, pp in enumerate(plan.params):
            p = named[pp.name]
            # this rank's piece: elements [lo, hi) of the flattened parameter (planner/flat.py)
            slot = flat.slot(pp.name) if sharded else None
            if slot is None:
                lo, hi = 0, pp.numel
            else:
                lo, hi = slot.piece(flat.groups[slot.group].segments[slot.segment].bounds(mesh.rank))
            st = ParamState(i, pp, p, slot, lo, hi, [(modules[m], a) for m, a in owners[id(p)]])
            value = p.detach().to(device=mesh.device, dtype=torch.float32)
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
                    for mod, attr in st.owners:
                        mod._parameters[attr] = full
                    st.param = full
            states.append(st)
        return states

    def _build_units(self) -> UnitRunner:
        modules = dict(self.model.named_modules())
        by_name = {s.name: s for s in self.states}
        flats = flat_runs(self.plan.flat.groups, by_name, self.mesh.rank)     # one per unit, in order
        root, units = None, []
        for u, fl in zip(self.plan.units, flats):
            unit = Unit(u.name, modules[u.name], [by_name[n] for n in u.params], u.reshard_after_forward, fl)
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
