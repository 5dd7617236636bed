"""``sl.parallelize``: shard a model in place by a plan and return the engine that trains it
(``runtime/engine.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..algebra.mesh import Mesh
from ..planner.plan import Plan
from .engine import Engine
from .scaler import LossScaler


def parallelize(model: nn.Module, plan: Plan, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                loss_scale: LossScaler | float | None = None, mesh: Mesh | None = None, init: bool = True,
                check_replicas: bool = False) -> Engine:
    """Shard ``model`` in place by ``plan`` and return the engine that trains it.

    ``optimizer`` is a factory ``params -> torch.optim.Optimizer``: the engine decides which
    tensors the optimizer sees (fp32 shards under ZeRO). ``lr_scheduler`` is a factory
    ``optimizer -> scheduler``, stepped after every optimizer step (``ReduceLROnPlateau`` is
    given the step's loss). ``loss_fn(model, batch)`` returns the loss; without it the model is
    called with the batch (``model(*batch)`` for a tuple, ``model(**batch)`` for a dict) and must
    return the loss, or an output with a ``.loss`` (a transformers ``ModelOutput`` given labels).
    ``loss_scale`` (fp16 only): the initial dynamic loss scale, or a
    ``LossScaler`` with its growth rules (default: 2**16, halved on overflow, doubled after 2000
    good steps). A step whose gradients overflow on any rank is skipped on every rank.

    A trainable parameter that gets no gradient on any rank in a step (unused by the model's
    forward) is left out of that update, as one process would leave it (its ``grad`` is None):
    no weight decay, no momentum.

    A model built under ``with torch.device("meta"):`` (shapes, no values) is given the values a
    normal CPU build from the same generator state gives it — rank 0's on every rank — replayed
    from the model's ``reset_parameters()`` / ``init_weights(module)`` (the contract in
    ``runtime/materialize.py``); under ZeRO-3 unit by unit, each rank keeping only its piece, so
    building never holds more than one unit's full values; under a pipe axis each rank replays only
    its stages' parameters. Seed before building the model, and draw
    no random numbers between building it and ``parallelize``. A model that cannot be replayed is
    refused with a ``ShardingError`` naming its modules.

    ``init=False``: the values come from a load (``engine.load_pretrained(folder)``, or ``engine.load``);
    nothing is replayed or broadcast, each rank allocates only what it holds (ZeRO-3: its pieces; a
    pipe axis: its stages', a meta model allowed) — see ``runtime/pretrained/empty.py``. A model built
    normally is allowed too (its values are dropped). A step before the load is refused.

    ``check_replicas=True``: after every step, every trainable parameter's replicated copies (over the
    axes that do not split its master: data without ZeRO, tensor for a replicated norm, HSDP's replica)
    must be bit-equal, or ``ShardingError`` names the first that is not (``shardlib.verify.check_replicas``,
    callable on its own at any time; one small all-gather per set of axes).
    """
    return Engine(model, plan, optimizer, lr_scheduler=lr_scheduler, loss_fn=loss_fn,
                  loss_scale=loss_scale, mesh=mesh, init=init, check_replicas=check_replicas)
