"""Whether a model's own loss is transformers' ``ForCausalLMLoss`` reading ``num_items_in_batch``: the engine's
exact token mean (``runtime/batches.py``) and the context axis's refusal of a loss that shifts labels inside
(``planner/context.py``) both ask."""

from __future__ import annotations

import inspect
import sys
import weakref

from torch import nn

from .peft import peft_base


def causal_lm_loss(model: nn.Module) -> bool:
    """A transformers model that takes ``num_items_in_batch`` and gives it to ``ForCausalLMLoss`` (asked
    every step: kept per model)."""
    hit = _LOSS_KIND.get(model)
    if hit is None:
        hit = _LOSS_KIND[model] = _reads_token_count(model)
    return hit


_LOSS_KIND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reads_token_count(model: nn.Module) -> bool:
    model = peft_base(model)[0]            # a PEFT model computes its base model's loss
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, tf.PreTrainedModel):
        return False
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        try:
            params = inspect.signature(model.forward).parameters.values()
        except (TypeError, ValueError):
            return False
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    if not accepts:
        return False
    from transformers.loss.loss_utils import ForCausalLMLoss
    try:
        loss = model.loss_function
    except (AttributeError, KeyError):
        return False
    return loss is ForCausalLMLoss
