"""The masters' side of the update: each trainable parameter's fp32 master gets its reduced, unscaled
gradient from what the gradient syncs hand over (or kept in its gradient shard), on the host when the
optimizer is offloaded; those that live only for the update are released after it; and the compute copies
are published from the updated masters (in place, from offloaded files, or all-gathered bucket by bucket
under ZeRO-1/2)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from .offload.files import OffloadError

if TYPE_CHECKING:
    from ..planner.plan import Plan
    from .buckets import GradBuckets
    from .state import ParamState


class LostStep(OffloadError):
    """The new parameters could not be written after the optimizer had updated its states: the engine holds
    no one step's state (``why`` says what to do)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class Masters:
    """Built with what it reads: this rank's plan, the parameters' states, the gradient buckets (data parallel
    and ZeRO-1/2, else None), the optimizer's and the parameters' offload (or None), and ``offload_mapped``."""

    def __init__(self, plan: Plan, states: list[ParamState], buckets: GradBuckets | None, offload: Any,
                 params_offload: Any, offload_mapped: Callable[[], AbstractContextManager[None]]):
        self.plan, self.states, self.buckets = plan, states, buckets
        self.offload, self.params_offload, self.offload_mapped = offload, params_offload, offload_mapped

    def grads(self, reduced, scale: float) -> list[torch.Tensor]:
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

    def release(self) -> None:
        """Drop gradients that live only for the update (fp32 copies, ZeRO-1's reduced rows); keep
        those that are views of storage kept between steps (bucket buffers, gradient shards)."""
        kept = {t.untyped_storage().data_ptr() for t in self._kept()}
        for s in self.states:
            if s.master is None or s.master.grad is None:
                continue
            if s.master.grad.untyped_storage().data_ptr() not in kept:
                s.master.grad = None

    def _kept(self) -> list[torch.Tensor]:
        out = [s.grad_shard for s in self.states if s.grad_shard is not None]
        if self.buckets is not None and self.buckets.views:
            out += self.buckets.buffers
        if self.buckets is not None and self.buckets.direct:     # one data rank: autograd's own gradients
            out += [s.param.grad for s in self.states if s.trainable and s.param.grad is not None]
        return out

    @torch.no_grad()
    def publish(self, step: int) -> None:
        """After the update (of step ``step``): bring the compute-dtype copies up to date with the masters."""
        plan = self.plan
        trainable = [s for s in self.states if s.trainable]
        if self.offload is not None:
            with self.offload_mapped():
                self.offload.publish_all()
            return
        if self.params_offload is not None:        # the masters (on the device) into the offloaded shards
            try:
                for s in trainable:
                    self.params_offload.publish(s, s.master.detach().view(-1), 0, "device")
                self.params_offload.commit()
            except OSError as e:
                self.params_offload.abort()
                raise LostStep(
                    f"the new parameters of step {step} could not be written under {plan.offload_dir} "
                    f"({e}), after the optimizer on the device had updated its states: the engine holds no one "
                    "step's state. Load the last checkpoint (engine.load(path)) to go on — or offload the "
                    "optimizer too (offload={'optimizer': 'disk', 'params': 'disk'}), whose failed writes leave "
                    "the step undone.") from None
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
        self.buckets.publish(self.plan.compute_dtype)           # all-gather the updated pieces, bucket by bucket
