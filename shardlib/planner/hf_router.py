"""Which transformers router load-balancing loss shardlib can make global (``runtime/router_loss.py``): the
modeling module's ``load_balancing_loss_func``, known by its body (an AST fingerprint), and whether the model's
config adds it to the loss. Planning reads this to refuse what it cannot run; the runtime installs the global
form."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import sys
import textwrap
from collections.abc import Iterator

import torch
from torch import nn

NAME = "load_balancing_loss_func"
# transformers 5's Switch formula (Mixtral's, copied verbatim by Qwen2-MoE, Qwen3-MoE, OLMoE, Jamba, GraniteMoE,
# PhiMoE, GPT-OSS, ...), checked equal to one
# process in tests/runtime/test_expert_parallel.py
FINGERPRINTS = frozenset({"ad7e74a6fd42"})


def fingerprint(fn) -> str:
    """A short hash of ``fn``'s arguments and body (its docstring left out)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return hashlib.sha1("".join(ast.dump(b) for b in body).encode() + ast.dump(tree.args).encode()).hexdigest()[:12]


def modeling_module(model: nn.Module):
    """The modeling module of the transformers model inside ``model`` (through PEFT's wrappers) that defines the
    load-balancing function, else None."""
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        fn = getattr(mod, NAME, None)
        if fn is not None:
            return mod
    return None


def adds_router_loss(model: nn.Module) -> bool:
    """Whether ``model``'s config asks for the router's loss in the training loss."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0))


def known(model: nn.Module) -> tuple[bool, str]:
    """Whether ``model``'s load-balancing function is the formula made global here, and its name."""
    mod = modeling_module(model)
    if mod is None:
        return False, "<none>"
    fn = getattr(mod, NAME)
    original = getattr(fn, "__wrapped__", fn)
    return fingerprint(original) in FINGERPRINTS, f"{mod.__name__}.{NAME}"


def recorded_routers(model: nn.Module) -> tuple[type, int] | None:
    """``(router class, index of its logits in its output)`` as the model's ``_can_record_outputs`` records
    ``router_logits`` (transformers 5), else None."""
    for m in model.modules():
        rec = (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
        if rec is None:
            continue
        cls = getattr(rec, "target_class", rec)
        return (cls, int(getattr(rec, "index", 0) or 0)) if isinstance(cls, type) else None
    return None


def router_counts(model: nn.Module) -> tuple[int, int, float]:
    """``(experts, top k, coefficient)`` of ``model``'s load-balancing loss, from its config."""
    config = model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return int(experts), int(config.num_experts_per_tok), float(config.router_aux_loss_coef)


@contextlib.contextmanager
def traced_router_loss(model: nn.Module, size: int, piped: bool = False) -> Iterator[None]:
    """While the planner traces ``model`` whole: under sequence parallelism over ``size`` ranks its router loss
    function (transformers') meets each layer's router logits for one chunk of the sequence, so its attention
    mask is cut to a chunk of positions too — the trace needs the shapes (the engine's global form sums every
    chunk's statistics: ``runtime/router_loss.py``; the plan counts those sums: ``planner/traffic.stats_entries``).
    Under a pipe axis (``piped``) the model's forward never computes it — the stages' messages carry its
    statistics (``runtime/pipe_router.py``) — so the trace meets a zero."""
    if not (size > 1 or piped) or not adds_router_loss(model):
        yield
        return
    mod = modeling_module(model)
    fn = getattr(mod, NAME)

    def cut(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if piped:
            return torch.zeros(())
        if attention_mask is not None:
            attention_mask = attention_mask.chunk(size, dim=1)[0]
        return fn(gate_logits, num_experts, top_k, attention_mask)

    setattr(mod, NAME, cut)
    try:
        yield
    finally:
        setattr(mod, NAME, fn)
