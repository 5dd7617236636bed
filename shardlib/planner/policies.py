"""``sl.plan``'s keywords grouped by concern: ``sl.DataPolicy``, ``sl.TensorPolicy``, ``sl.PipelinePolicy``,
``sl.MemoryPolicy`` and ``sl.TrainingPolicy``.

``sl.plan`` takes some 26 keywords; a group gathers those of one concern, as torchtitan's job config
does (``parallelism``, ``activation_checkpoint``, ``training``)::

    sl.plan(model, mesh, rules={"layers": "pipe"},
            pipeline=sl.PipelinePolicy(schedule="1f1b", microbatches=8),
            memory=sl.MemoryPolicy(zero=3, recompute="selective"),
            training=sl.TrainingPolicy(precision="bf16", clip_grad_norm=1.0))

is ``sl.plan(model, mesh, rules=..., schedule="1f1b", microbatches=8, zero=3, recompute="selective",
precision="bf16", clip_grad_norm=1.0)``. A group's fields are the flat keywords of the same names
(and the Hydra config's keys: ``parallel.schedule``, ``train.precision``), and the flat keywords keep
working. A field left ``None`` is not given: ``plan``'s own default applies. A keyword given both
flat and in a group must agree; where the two differ ``plan`` refuses with both named. Values are
checked by ``plan`` itself, as if given flat. ``rules`` and ``batch`` stay flat: they are the layout
and the example input, not a policy.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from ..errors import ShardingError, ShardingTypeError
from .states import StateLayouts

F = TypeVar("F", bound=Callable[..., Any])


class _Policy:
    """Shared behaviour: a repr with the fields given only, and the flat keywords a policy sets."""

    def given(self) -> dict[str, Any]:
        """``{flat keyword: value}`` for every field that is not ``None``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.given().items())})"


@dataclass(frozen=True, kw_only=True, repr=False)
class DataPolicy(_Policy):
    """The data axis: which mesh axis it is, HSDP's replica axis, the gradient buckets' size (MB) and
    DDP's ``broadcast_buffers``."""

    data_axis: str | None = None
    replica_axis: str | None = None
    bucket_mb: float | None = None
    broadcast_buffers: bool | None = None


@dataclass(frozen=True, kw_only=True, repr=False)
class TensorPolicy(_Policy):
    """The tensor axis: which mesh axis it is, and whether sequence parallelism splits the residual
    stream inside the layer stack."""

    tensor_axis: str | None = None
    sequence_parallel: bool | None = None


@dataclass(frozen=True, kw_only=True, repr=False)
class PipelinePolicy(_Policy):
    """The pipe axis: which mesh axis it is, the schedule, micro-batches per step and data rank, virtual
    stages per pipe rank, the split (``stages``) and ZeRO-3's gather policy (``pipe_gather``)."""

    pipe_axis: str | None = None
    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    stages: Any = None
    pipe_gather: str | None = None


@dataclass(frozen=True, kw_only=True, repr=False)
class MemoryPolicy(_Policy):
    """What each rank holds: the ZeRO stage (or the state layouts), ZeRO-3's units and resharding after
    forward, recompute, and the memory kinds of offload."""

    zero: int | None = None
    states: StateLayouts | None = None
    units: Sequence[str] | None = None
    reshard_after_forward: bool | None = None
    recompute: bool | str | Iterable[str] | None = None
    offload: Mapping[str, str] | None = None
    offload_dir: Any = None


@dataclass(frozen=True, kw_only=True, repr=False)
class TrainingPolicy(_Policy):
    """The step's arithmetic: the compute precision and the gradients' reduction dtype, accumulation,
    clipping, and the optimizer family (its state bytes per parameter)."""

    precision: str | None = None
    reduce_dtype: str | torch.dtype | None = None
    grad_accum: int | None = None
    clip_grad_norm: float | None = None
    optimizer: str | int | None = None


# plan's keyword for each group, and the group's class
GROUPS: dict[str, type[_Policy]] = {"data": DataPolicy, "tensor": TensorPolicy, "pipeline": PipelinePolicy,
                                    "memory": MemoryPolicy, "training": TrainingPolicy}


def merge(given: dict[str, Any], api: str = "plan") -> dict[str, Any]:
    """``given`` (the arguments a call named) with each group's fields as flat keywords and the group
    keywords dropped. A keyword given both ways with different values is refused, every one at once."""
    out = {k: v for k, v in given.items() if k not in GROUPS}
    wrong, clashes = [], []
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
            if name in out and not _same(out[name], value):
                clashes.append(f"{api}: {name} is given twice and the two disagree — got {name}={out[name]!r} and "
                               f"{key}={group!r}; expected one value. Drop one of them.")
            else:
                out[name] = value
    if wrong:
        raise ShardingTypeError(wrong[0] if len(wrong) == 1 else str(ShardingError(wrong, api=api)))
    if clashes:
        raise ShardingError(clashes, api=api)
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:          # noqa: BLE001 — values whose == does not give a bool (tensors) are not equal
        return a is b


def grouped(fn: F) -> F:
    """``fn`` taking the policy groups of ``GROUPS`` beside its flat keywords: the groups are merged
    into the keywords (``merge``) before ``fn`` runs. Which keywords a call gave is read from the call
    itself, so an explicit default still clashes with a group that sets another value."""
    sig = inspect.signature(fn)
    missing = [k for k in GROUPS if k not in sig.parameters]
    assert not missing, f"{fn.__name__} lacks the group keywords {missing}"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        return fn(**merge(dict(bound.arguments), fn.__name__))

    return call  # type: ignore[return-value]
