"""``sl.plan``'s settings: one field of one policy each, every policy checking its own fields.

Six groups, as torchtitan's job config and FSDP2's policy dataclasses split theirs::

    sl.plan(model, mesh, rules={"layers": "pipe"},
            roles=sl.MeshRoles(data="dp"),                       # which mesh axis plays which role
            pipeline=sl.PipelinePolicy(schedule="1f1b"),
            memory=sl.MemoryPolicy(zero=3, recompute="selective"),
            training=sl.TrainingPolicy(precision="bf16", microbatches=8, clip_grad_norm=1.0))

Every flat keyword of ``sl.plan`` (the contract's ``zero=``, ``microbatches=``, ``precision=``, ...) is a
short form of exactly one field (``SHORT_FORMS``): ``zero=3`` is ``memory=MemoryPolicy(zero=3)``.
Synonyms are one field: ``grad_accum=`` and ``microbatches=`` set ``TrainingPolicy.microbatches``
(micro-batches per step and data rank, which a pipeline's schedule runs), ``states=`` and ``zero=`` set
``MemoryPolicy.zero`` (a stage, or the per-state layouts), and the four ``*_axis=`` keywords set the fields
of ``MeshRoles``. ``collect`` builds the groups from a call: a field given twice (flat and in a group, or
by two synonyms) with different values is refused, naming both. A field left ``None`` takes ``sl.plan``'s
default (``DEFAULTS``). Each policy's ``problems(mesh)`` checks its own fields; what needs the model
(units, specs, stages) is checked by the planner.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch

from ..errors import ShardingError, ShardingTypeError
from ..validate import flag, is_int, non_negative_int, positive_int, positive_number
from .context import METHODS as CONTEXT_METHODS
from .plan import OPTIMIZER_STATE_BYTES, PRECISIONS
from .states import StateLayouts, zero_problem

F = TypeVar("F", bound=Callable[..., Any])
Problem = tuple[bool, str]        # (of the wrong kind: a ShardingTypeError, message)



def _flag(name: str, value: object) -> list[Problem]:
    bad = None if value is None else flag(value, f"plan: {name}")
    return [(True, bad + ".")] if bad else []


class _Policy:
    """Shared behaviour: a repr with the fields given only; the fields given; no checks by default."""

    def given(self) -> dict[str, Any]:
        """``{field: value}`` for every field that is not ``None``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.given().items())})"

    def problems(self, mesh: Any) -> list[Problem]:
        return []


@dataclass(frozen=True, kw_only=True, repr=False)
class MeshRoles(_Policy):
    """Which mesh axis plays which role: ``data`` (the batch, ZeRO's shards), ``tensor``, ``pipe``, HSDP's
    ``replica`` (by default an axis named ``"replica"`` when the mesh has one), ``expert`` (by default an
    axis named ``"expert"``: experts split over it, the batch too) and ``context`` (by default an axis named
    ``"context"``: the sequence split over it, ``rules={"seq": "context"}``). An axis of size > 1 that plays
    no role is refused."""

    data: str | None = None
    tensor: str | None = None
    pipe: str | None = None
    replica: str | None = None
    expert: str | None = None
    context: str | None = None

    def context_of(self, mesh: Any) -> str | None:
        """The context axis: the one given, else an axis named ``"context"``; None where it is absent."""
        name = self.context if isinstance(self.context, str) else "context"
        return name if name in mesh.axis_names else None

    def expert_of(self, mesh: Any) -> str | None:
        """The expert axis: the one given, else an axis named ``"expert"``; None where it is absent."""
        name = self.expert if isinstance(self.expert, str) else "expert"
        return name if name in mesh.axis_names else None

    def replica_of(self, mesh: Any) -> str | None:
        """HSDP's replica axis: the one given, else an axis named ``"replica"``; None where it is absent."""
        name = self.replica if isinstance(self.replica, str) else "replica"
        return name if name in mesh.axis_names else None

    def problems(self, mesh: Any) -> list[Problem]:
        out: list[Problem] = []
        data, tensor, pipe = self.data or "data", self.tensor or "tensor", self.pipe or "pipe"
        if not isinstance(data, str):
            out.append((True, f"plan: data_axis must be a mesh axis name — got {type(data).__name__} {data!r}."))
        elif data not in mesh.axis_names:
            out.append((False, f"plan: the mesh {mesh.axis_sizes} has no {data!r} axis — expected data_axis to name "
                               f"one of its axes {mesh.axis_names} (a mesh with no axis named 'data' plans with "
                               "data = 1 by default). Fix data_axis=, or drop it."))
        rep, exp, ctx = self.replica, self.expert, self.context
        out += _role_axis("replica_axis", rep, mesh, (data, tensor, pipe), "the data, tensor or pipe axis",
                          "the axis over which HSDP replicates the sharded training states")
        out += _role_axis("expert_axis", exp, mesh, (data, tensor, pipe, rep), "the data, tensor, pipe or replica axis",
                          "the axis the experts split over")
        out += _role_axis("context_axis", ctx, mesh, (data, tensor, pipe, rep, exp),
                          "the data, tensor, pipe, replica or expert axis", "the axis the sequence splits over")
        used = (data, tensor, pipe, self.replica_of(mesh), self.expert_of(mesh), self.context_of(mesh))
        others = {a: s for a, s in mesh.axis_sizes.items() if a not in used and s > 1}
        if others and isinstance(data, str) and data in mesh.axis_names:
            out.append((False, f"plan: axes {others} are larger than 1, but this plan uses only {data!r}, {pipe!r} "
                               f"and {tensor!r} — expected the other axes of size 1. Use them as one of those "
                               "(data_axis=, pipe_axis=, tensor_axis=, expert_axis= for experts, context_axis= for the sequence, or replica_axis= "
                               "for HSDP: states sharded over data, replicated over it) or give them size 1."))
        return out


def _role_axis(key: str, axis: Any, mesh: Any, taken: tuple, taken_words: str, role: str) -> list[Problem]:
    """The problems of an optional role's axis ``key=axis``: not a name, not on the mesh, or another role's."""
    if axis is None:
        return []
    if not isinstance(axis, str):
        return [(True, f"plan: {key} must be a mesh axis name or None — got {type(axis).__name__} {axis!r}.")]
    if axis not in mesh.axis_names:
        return [(False, f"plan: {key}={axis!r} is not an axis of the mesh {mesh.axis_sizes} — expected {role}. Add "
                        f"it to the mesh, or drop {key}.")]
    if axis in taken:
        return [(False, f"plan: {key}={axis!r} is also {taken_words} — expected an axis of its own.")]
    return []


@dataclass(frozen=True, kw_only=True, repr=False)
class DataPolicy(_Policy):
    """The data axis's gradient buckets (MB) and DDP's ``broadcast_buffers``."""

    bucket_mb: float | None = None
    broadcast_buffers: bool | None = None

    def problems(self, mesh: Any) -> list[Problem]:
        out = _flag("broadcast_buffers", self.broadcast_buffers)
        if self.bucket_mb is not None and (bad := positive_number(self.bucket_mb, "plan: bucket_mb")):
            out.append((False, bad + "."))
        return out


@dataclass(frozen=True, kw_only=True, repr=False)
class TensorPolicy(_Policy):
    """How the sequence splits: whether sequence parallelism splits the residual stream inside the layer
    stack over the tensor axis, and by which method attention runs over a context axis
    (``context_attention``: ``"allgather"``, ``"ring"``, ``"ulysses"``; None: the planner picks)."""

    sequence_parallel: bool | None = None
    context_attention: str | None = None

    def problems(self, mesh: Any) -> list[Problem]:
        out = _flag("sequence_parallel", self.sequence_parallel)
        m = self.context_attention
        if m is not None and m not in CONTEXT_METHODS:
            out.append((not isinstance(m, str), f"plan: context_attention must be 'allgather', 'ring', 'ulysses' or "
                                                f"None (the planner picks) — got {m!r}."))
        return out


@dataclass(frozen=True, kw_only=True, repr=False)
class PipelinePolicy(_Policy):
    """The pipe axis: the schedule, virtual stages per pipe rank, the split (``stages``) and ZeRO-3's
    gather policy (``pipe_gather``); checked with the model by ``planner/pipeline.py``."""

    schedule: str | None = None
    virtual_stages: int | None = None
    stages: Any = None
    pipe_gather: str | None = None


@dataclass(frozen=True, kw_only=True, repr=False)
class MemoryPolicy(_Policy):
    """What each rank holds: the ZeRO stage (0-3) or the per-state layouts (``sl.StateLayouts``), ZeRO-3's
    units and resharding after forward, recompute, and the memory kinds of offload."""

    zero: int | StateLayouts | None = None
    units: Sequence[str] | None = None
    reshard_after_forward: bool | None = None
    recompute: bool | str | Iterable[str] | None = None
    offload: Mapping[str, str] | None = None
    offload_dir: Any = None
    delayed: bool | None = None        # the optimizer on the host updates one step behind (DeepSpeed's DPU)

    def states(self, data_axis: str) -> StateLayouts:
        """The state layouts: the given ones, or the stage's (ZeRO-0 when none is given)."""
        if isinstance(self.zero, StateLayouts):
            return self.zero
        return StateLayouts.zero(0 if self.zero is None else self.zero, data_axis)

    @property
    def zero3(self) -> bool:
        return self.zero.params is not None if isinstance(self.zero, StateLayouts) else self.zero == 3

    def problems(self, mesh: Any) -> list[Problem]:
        out = _flag("reshard_after_forward", self.reshard_after_forward) + _flag("delayed", self.delayed)
        if isinstance(self.zero, StateLayouts):
            out += [(False, m) for m in self.zero.problems(mesh)]
        elif self.zero is not None and (problem := zero_problem(self.zero)) is not None:
            out.append((problem[0] is ShardingTypeError, problem[1]))
        return out


@dataclass(frozen=True, kw_only=True, repr=False)
class TrainingPolicy(_Policy):
    """The step's arithmetic: the compute precision and the gradients' reduction dtype, micro-batches per
    step and data rank (accumulation; a pipeline's schedule runs them), clipping, and the optimizer family
    (its state bytes per parameter)."""

    precision: str | None = None
    reduce_dtype: str | torch.dtype | None = None
    microbatches: int | None = None
    clip_grad_norm: float | None = None
    optimizer: str | int | None = None

    def reduction_dtype(self) -> torch.dtype:
        p = self.precision if self.precision is not None else "fp32"
        rdt = PRECISIONS.get(p, torch.float32) if isinstance(p, str) else torch.float32
        if self.reduce_dtype is not None:
            rdt = PRECISIONS.get(self.reduce_dtype) if isinstance(self.reduce_dtype, str) else self.reduce_dtype
        return rdt

    def state_bytes(self) -> int:
        """The optimizer's state bytes per parameter (0 when the optimizer is not known)."""
        opt = self.optimizer if self.optimizer is not None else "adamw"
        if isinstance(opt, str):
            return OPTIMIZER_STATE_BYTES.get(opt.lower(), 0)
        return opt if non_negative_int(opt, "optimizer") is None else 0

    def problems(self, mesh: Any) -> list[Problem]:
        out: list[Problem] = []
        p, mb, clip, opt = self.precision, self.microbatches, self.clip_grad_norm, self.optimizer
        if p is not None and not (isinstance(p, str) and p in PRECISIONS):
            out.append((False, f"plan: precision {p!r} is unknown — expected one of {tuple(PRECISIONS)}."))
        if self.reduce_dtype is not None and self.reduction_dtype() not in PRECISIONS.values():
            out.append((False, f"plan: reduce_dtype {self.reduce_dtype!r} is unknown — expected fp32, bf16 or fp16 "
                               "(or the torch dtype)."))
        if mb is not None and (bad := positive_int(mb, "plan: microbatches (grad_accum: micro-batches per step "
                                                         "and data rank)")):
            out.append((False, bad + "."))
        if clip is not None and (bad := positive_number(clip, "plan: clip_grad_norm")):
            out.append((False, bad + " (or None: no clipping)."))
        if isinstance(opt, str) and opt.lower() not in OPTIMIZER_STATE_BYTES:
            out.append((False, f"plan: optimizer {opt!r} is unknown — expected one of {tuple(OPTIMIZER_STATE_BYTES)} "
                               "or its state bytes per parameter as an int."))
        elif opt is not None and not isinstance(opt, str) and non_negative_int(opt, "optimizer"):
            out.append((not is_int(opt),
                        f"plan: optimizer must be a name such as 'adamw' or its state bytes per parameter (an int "
                        f">= 0) — got {type(opt).__name__} {opt!r}."))
        return out


# plan's keyword for each group, and the group's class
GROUPS: dict[str, type[_Policy]] = {"roles": MeshRoles, "data": DataPolicy, "tensor": TensorPolicy,
                                    "pipeline": PipelinePolicy, "memory": MemoryPolicy, "training": TrainingPolicy}
# every flat keyword of sl.plan: the one (group, field) it sets
SHORT_FORMS: dict[str, tuple[str, str]] = {
    "data_axis": ("roles", "data"), "tensor_axis": ("roles", "tensor"), "pipe_axis": ("roles", "pipe"),
    "replica_axis": ("roles", "replica"), "expert_axis": ("roles", "expert"), "context_axis": ("roles", "context"),
    "bucket_mb": ("data", "bucket_mb"), "broadcast_buffers": ("data", "broadcast_buffers"),
    "sequence_parallel": ("tensor", "sequence_parallel"), "context_attention": ("tensor", "context_attention"),
    "schedule": ("pipeline", "schedule"), "virtual_stages": ("pipeline", "virtual_stages"),
    "stages": ("pipeline", "stages"), "pipe_gather": ("pipeline", "pipe_gather"),
    "zero": ("memory", "zero"), "states": ("memory", "zero"), "units": ("memory", "units"),
    "reshard_after_forward": ("memory", "reshard_after_forward"), "recompute": ("memory", "recompute"),
    "offload": ("memory", "offload"), "offload_dir": ("memory", "offload_dir"), "delayed": ("memory", "delayed"),
    "precision": ("training", "precision"), "reduce_dtype": ("training", "reduce_dtype"),
    "microbatches": ("training", "microbatches"), "grad_accum": ("training", "microbatches"),
    "clip_grad_norm": ("training", "clip_grad_norm"), "optimizer": ("training", "optimizer"),
}
# sl.plan's defaults, per field
DEFAULTS: dict[tuple[str, str], Any] = {
    ("roles", "data"): "data", ("roles", "tensor"): "tensor", ("roles", "pipe"): "pipe",
    ("data", "bucket_mb"): 25.0, ("data", "broadcast_buffers"): True, ("tensor", "sequence_parallel"): False,
    ("pipeline", "pipe_gather"): "step", ("memory", "reshard_after_forward"): True, ("memory", "recompute"): False,
    ("memory", "delayed"): False,
    ("training", "precision"): "fp32", ("training", "optimizer"): "adamw",
}


@dataclass(frozen=True)
class Policies:
    """The six groups of one ``sl.plan`` call, each field given once; ``resolved()`` fills the defaults."""

    roles: MeshRoles
    data: DataPolicy
    tensor: TensorPolicy
    pipeline: PipelinePolicy
    memory: MemoryPolicy
    training: TrainingPolicy
    clashes: tuple[str, ...] = ()      # fields given twice with two values (the first value kept)
    others: tuple[tuple[str, str, Any], ...] = ()     # the other values of those: (group, field, value)

    def resolved(self) -> Policies:
        out = {}
        for key in GROUPS:
            group = getattr(self, key)
            fill = {f: v for (g, f), v in DEFAULTS.items() if g == key and getattr(group, f) is None}
            out[key] = replace(group, **fill) if fill else group
        return Policies(**out, clashes=self.clashes, others=self.others)

    def problems(self, mesh: Any) -> list[Problem]:
        """The clashes, then every policy's problems with its own fields (the clashing values' too)."""
        out = [(False, c) for c in self.clashes] + [p for key in GROUPS for p in getattr(self, key).problems(mesh)]
        for key, name, value in self.others:
            out += [p for p in replace(getattr(self, key), **{name: value}).problems(mesh) if p not in out]
        return out


def collect(given: dict[str, Any], api: str = "plan") -> tuple[Policies, dict[str, Any]]:
    """The policies of a call whose named arguments are ``given`` (flat short forms and groups), and the
    arguments that are neither. A field set twice with different values is a clash (``Policies.clashes``,
    reported with every other problem); a group of the wrong type is refused here."""
    rest = {k: v for k, v in given.items() if k not in GROUPS and k not in SHORT_FORMS}
    values: dict[str, dict[str, Any]] = {k: {} for k in GROUPS}
    said: dict[tuple[str, str], str] = {}           # (group, field) -> how it was given
    wrong, clashes, others = [], [], []

    def put(key: str, name: str, value: Any, how: str) -> None:
        if name in values[key] and not _same(values[key][name], value):
            others.append((key, name, value))
            clashes.append(f"{api}: {name if key != 'roles' else key + '.' + name} is given twice and the two "
                           f"disagree — got {said[key, name]} and {how}; expected one value. Drop one of them.")
        else:
            values[key][name] = value
            said.setdefault((key, name), how)

    if given.get("grad_accum") == 1 and given.get("microbatches") is not None:
        given = {k: v for k, v in given.items() if k != "grad_accum"}    # 1, the default: the other one says
    for flat, (key, name) in SHORT_FORMS.items():
        if flat in given and given[flat] is not None:
            put(key, name, given[flat], f"{flat}={given[flat]!r}")
    for key, cls in GROUPS.items():
        group = given.get(key)
        if group is None:
            continue
        if not isinstance(group, cls):
            wrong.append(f"{api}: {key}= must be a sl.{cls.__name__} — got {type(group).__name__} {group!r}; expected "
                         f"e.g. {key}=sl.{cls.__name__}({fields(cls)[0].name}=...). Give the policy, or its "
                         f"fields as keywords of {api}.")
            continue
        for name, value in group.given().items():
            put(key, name, value, f"{key}={group!r}")
    if wrong:
        raise ShardingTypeError(wrong[0] if len(wrong) == 1 else str(ShardingError(wrong, api=api)))
    return Policies(**{k: cls(**values[k]) for k, cls in GROUPS.items()}, clashes=tuple(clashes),
                    others=tuple(others)), rest


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:          # noqa: BLE001 — values whose == does not give a bool (tensors) are not equal
        return a is b


def grouped(fn: F) -> F:
    """``fn(model, mesh, policies, **rest)`` called as ``sl.plan``: its flat short forms and groups (the
    signature of the function this decorates) collected into ``Policies`` (``collect``). Which keywords a
    call gave is read from the call itself, so an explicit default still clashes with a group that sets
    another value."""

    def wrap(shape: Callable[..., Any]) -> F:
        sig = inspect.signature(shape)
        missing = [k for k in (*GROUPS, *SHORT_FORMS) if k not in sig.parameters]
        assert not missing, f"{shape.__name__} lacks the keywords {missing}"

        @functools.wraps(shape)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            policies, rest = collect(dict(bound.arguments), shape.__name__)
            return fn(policies=policies, **rest)

        return call  # type: ignore[return-value]

    return wrap  # type: ignore[return-value]
