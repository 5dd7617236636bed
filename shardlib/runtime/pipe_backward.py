"""A pipeline stage's backward (``runtime/pipeline.py``'s ``B``, ``I`` and ``W`` actions): its roots — the
stage's output with the gradient received (the loss times the step's factor on the last stage), and a
transformers router loss's probability sums with their cotangent (``runtime/pipe_router.py``) — run whole, or
split into the input-gradient half now and the weight-gradient half later (zero-bubble schedules: the blocks'
``nn.Linear`` weight gradients deferred to ``W`` by ``runtime/weight_grads.py``, else torch's
``stage_backward_input`` / ``stage_backward_weight``)."""

from __future__ import annotations

import torch


class StageBackward:
    """Mixed into ``PipelineRuntime``: the backward of one stage and micro-batch."""

    def _target(self, s: int, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The roots of stage ``s``'s backward of micro-batch ``i`` and their cotangents: its output (the
        loss times the step's factor on the last stage, else with the gradient received) — and the stage's
        router probability sums of a transformers router loss (``runtime/pipe_router.py``)."""
        out = self.outputs.pop((s, i))
        roots, grads = ([out.float() * self.factor], [None]) if self.stages[s].post else \
            ([out], [self._received(("B", s, i))])
        extra = self.router.root(s, i) if self.router is not None else None
        if extra is not None:
            roots.append(extra[0])
            grads.append(extra[1])
        return roots, grads

    def _backward(self, s: int, i: int) -> None:
        torch.autograd.backward(*self._target(s, i))
        self._keep_input_grad(s, i)

    def _keep_input_grad(self, s: int, i: int) -> None:
        inp = self.inputs.pop((s, i))
        if self.engine.tensor is not None:
            self.engine.tensor.clear()
        if s > 0:
            g = inp.grad if inp is not None else None
            self.grad_in[(s, i)] = g if g is not None else torch.zeros(self.stream[0], dtype=self.stream[1])

    def _backward_input(self, s: int, i: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_input

        target, grad = self._target(s, i)
        inp = self.inputs.get((s, i))
        if inp is None:                 # the first stage: no input gradient; W runs the whole backward
            self.weight_work[(s, i)] = ("whole", target, grad)
            self.inputs.pop((s, i))
            return
        if self.deferred is not None:
            self.deferred.key = (s, i)
            try:
                torch.autograd.backward(target, grad)
            finally:
                self.deferred.key = None
            self.weight_work[(s, i)] = ("deferred",)
            self._keep_input_grad(s, i)
            return
        _, groups = stage_backward_input(target, None if all(g is None for g in grad) else grad, [inp],
                                         iter(self.stage_params[s]))
        self.weight_work[(s, i)] = ("split", groups)
        self._keep_input_grad(s, i)

    def _backward_weight(self, s: int, i: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        work = self.weight_work.pop((s, i))
        if work[0] == "whole":
            torch.autograd.backward(work[1], work[2])
        elif work[0] == "deferred":
            self.deferred.flush((s, i))
        else:
            # retain_graph: parameter groups can share nodes (SP's one fused f per block); the graph
            # goes with the last reference to the groups, here
            stage_backward_weight(iter(self.stage_params[s]), work[1], retain_graph=True)
        if self.engine.tensor is not None:
            self.engine.tensor.clear()
