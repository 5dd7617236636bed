"""The layer stack of a pipelined model: finding it, and what runs before, between and after its blocks.

``stage_functions(model, stack)`` is what the executor calls for a stage — ``pre(batch, dtype) ->
(x, ctx)`` on the first, ``context(batch, dtype) -> ctx`` on the others, ``block_kwargs(ctx, i)``
for block ``i``, ``post(x, batch) -> loss`` on the last: the model's own ``pipeline_pre`` /
``pipeline_post`` (``ProtocolStages``: blocks take the stream alone), else, for a transformers
causal LM, its own forward's parts (``hf_stages.CausalLMStages``). ``stack_modules`` splits the
rest of the model by registration order (the protocol); ``auto_stack`` finds the one list of
identical blocks where no stack is declared; ``stack_entry_problems`` refuses a stack entry
that names something else.
"""

from __future__ import annotations

import torch
from torch import nn

from .hf_stages import CausalLMStages, is_causal_lm
from .specs import AxisRules, tables_by_prefix

PRE, POST = "pipeline_pre", "pipeline_post"


class ProtocolStages:
    """The pipeline protocol of a model that defines ``pipeline_pre`` / ``pipeline_post`` (the
    module doc): blocks take the stream alone; batches are tuples (or one tensor)."""

    kind = "protocol"

    def __init__(self, model: nn.Module):
        self.model = model

    @staticmethod
    def _args(batch) -> tuple:
        return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)

    def pre(self, batch, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        return self.model.pipeline_pre(*self._args(batch)), None

    def context(self, batch, dtype: torch.dtype) -> None:
        return None

    @staticmethod
    def block_kwargs(ctx, index: int) -> dict:
        return {}

    def post(self, x: torch.Tensor, batch) -> torch.Tensor:
        return self.model.pipeline_post(x, *self._args(batch))


def stage_functions(model: nn.Module, stack: str) -> ProtocolStages | CausalLMStages | None:
    """What runs before, between and after the stack's blocks: the model's own ``pipeline_pre`` /
    ``pipeline_post``, else the transformers adapter for a causal LM, else None."""
    if callable(getattr(model, PRE, None)) and callable(getattr(model, POST, None)):
        return ProtocolStages(model)
    if is_causal_lm(model):
        return CausalLMStages(model, stack)
    return None


def stack_modules(model: nn.Module, stack: str) -> tuple[list[str], list[str], list[str]]:
    """``(blocks, pre modules, post modules)``: the stack's children, and the modules holding
    parameters directly outside it — before / after the stack by registration order, at each
    level of its (possibly nested) name: in ``model.layers``, ``model``'s children registered
    before ``layers`` and the root's before ``model`` are before it."""
    lst = model.get_submodule(stack)
    blocks = [f"{stack}.{n}" for n, _ in lst.named_children()]
    parts = stack.split(".")
    pre, post = [], []
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        seen = False
        for name, child in parent.named_children():
            if name == parts[depth]:
                seen = True
                continue
            q = f"{prefix}.{name}" if prefix else name
            held = [f"{q}.{n}" if n else q for n, m in child.named_modules() if m._parameters]
            (post if seen else pre).extend(held)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    def at(name: str) -> int:
        return order.get(name, len(order))
    return blocks, sorted(pre, key=at), sorted(post, key=at)


def auto_stack(model: nn.Module) -> tuple[str | None, list[str]]:
    """The model's one ``nn.ModuleList`` of identical blocks (one class, the same parameter names
    and shapes, at least two), or None; and the candidates when there are several."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name and _identical_blocks(mod):
            found.append(name)
    return (found[0] if len(found) == 1 else None), found


def _identical_blocks(lst: nn.ModuleList) -> bool:
    kids = list(lst)
    if len(kids) < 2:
        return False
    sig = [(type(k), tuple((n, tuple(p.shape)) for n, p in k.named_parameters())) for k in kids]
    return bool(sig[0][1]) and all(s == sig[0] for s in sig)


def stack_entry_problems(model: nn.Module, rules, axis: str) -> list[str]:
    """Table entries of one logical dim ``layers`` (or one dim mapped to the pipe axis) that name a
    module which is not an ``nn.ModuleList`` of blocks."""
    rules = AxisRules.coerce(rules)
    modules = dict(model.named_modules())
    out = []
    for prefix, tables in tables_by_prefix(model).items():
        for table, owner in tables:
            for e in table.entries:
                dims = tuple(e.spec) if e.spec is not None else e.logical
                if len(dims) != 1:
                    continue
                mapped = dims[0] if e.spec is not None else (rules.get(dims[0]) if dims[0] else None)
                if not (e.logical == ("layers",) or mapped == axis or mapped == (axis,)):
                    continue
                name = f"{prefix}.{e.pattern}" if prefix else e.pattern
                mod = modules.get(name)
                if mod is None or (isinstance(mod, nn.ModuleList) and len(mod)):
                    continue       # a parameter pattern, or a stack
                what = "an empty nn.ModuleList" if isinstance(mod, nn.ModuleList) else f"a {type(mod).__name__}"
                lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m)]
                out.append(f"plan: the layer stack entry {e.pattern!r} ({owner}) names {name!r}, {what} — "
                           f"expected an nn.ModuleList of blocks, e.g. {lists[:3] or ['model.layers']}. Name the "
                           "model's list of blocks in the entry.")
    return out
