"""Megatron tensor-parallel tables for the causal-LM families ``transformers`` ships.

``tp_table(model)`` returns ``{parameter pattern: PartitionSpec}`` for ``sl.shard(table)(model)``; for a
family beyond the six below it is ``sl.hf_dims(model)`` (the model's own plans, ``planner/hf_dims.py``)
resolved over the axis. For the six:
attention and MLP input projections column-split (output features), output projections row-split
(input features), column biases following their weights; norms, positions and (by default) the
embeddings replicated. Read off ``model.config.model_type``; transformers is not imported.

==========  ==============================================================================
family      how its projections are declared
==========  ==============================================================================
llama,      ``q/k/v/gate/up_proj`` ``P(t, None)`` (biases ``P(t)``: Qwen2's q/k/v), ``o/down_proj``
qwen2,      ``P(None, t)``
mistral
phi3        ``qkv_proj`` ``P(Fused(3, t), None)`` — q|k|v end to end, equal blocks only when the
            KV heads equal the query heads (otherwise ``qkv_proj``/``o_proj`` stay replicated);
            ``gate_up_proj`` ``P(Fused(2, t), None)`` (``.chunk(2)`` in the MLP); ``o/down_proj`` rows
gpt2        ``Conv1D`` (weight ``(in, out)``): ``c_attn`` ``P(None, Fused(3, t))``, bias
            ``P(Fused(3, t))``; ``mlp.c_fc`` ``P(None, t)``, bias ``P(t)``; ``c_proj``s ``P(t, None)``
gpt_neox    ``query_key_value`` is per-head interleaved (rows ``[head0: q k v][head1: q k v]...``):
            contiguous rows are whole heads, so it is a plain column ``P(t, None)``, bias ``P(t)``;
            ``dense_h_to_4h`` column, ``dense``/``dense_4h_to_h`` rows
==========  ==============================================================================

``vocab=True`` adds the vocab-parallel embedding and LM head (``P(t, None)`` each) where they are
not tied; a tied pair stays replicated (splitting one table two ways is not supported). Only
patterns that match a parameter of ``model`` are returned (a pattern matching nothing is an error
in ``sl.shard``). On a PEFT model the table is the base model's (PEFT's wrappers are transparent to
``sl.shard``; the adapters follow their base weights, ``planner/peft.py``).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from ..algebra.spec import Fused, PartitionSpec
from ..errors import ShardingError
from .peft import base_name, is_peft

P = PartitionSpec
FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gpt2", "gpt_neox")


def _llama(t: str, model: nn.Module) -> dict[str, PartitionSpec]:
    col, row = P(t, None), P(None, t)
    out = {f"*.{n}.weight": col for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    out.update({f"*.{n}.bias": P(t) for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")})
    out.update({"*.o_proj.weight": row, "*.down_proj.weight": row})
    return out


def _phi3(t: str, model: nn.Module) -> dict[str, PartitionSpec]:
    cfg = model.config
    out = {"*.gate_up_proj.weight": P(Fused(2, t), None), "*.down_proj.weight": P(None, t)}
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if kv == cfg.num_attention_heads:
        out.update({"*.qkv_proj.weight": P(Fused(3, t), None), "*.o_proj.weight": P(None, t)})
    return out


def _gpt2(t: str, model: nn.Module) -> dict[str, PartitionSpec]:
    return {"*.attn.c_attn.weight": P(None, Fused(3, t)), "*.attn.c_attn.bias": P(Fused(3, t)),
            "*.attn.c_proj.weight": P(t, None),
            "*.mlp.c_fc.weight": P(None, t), "*.mlp.c_fc.bias": P(t), "*.mlp.c_proj.weight": P(t, None)}


def _gpt_neox(t: str, model: nn.Module) -> dict[str, PartitionSpec]:
    return {"*.attention.query_key_value.weight": P(t, None), "*.attention.query_key_value.bias": P(t),
            "*.attention.dense.weight": P(None, t),
            "*.mlp.dense_h_to_4h.weight": P(t, None), "*.mlp.dense_h_to_4h.bias": P(t),
            "*.mlp.dense_4h_to_h.weight": P(None, t)}


_TABLES = {"llama": _llama, "qwen2": _llama, "mistral": _llama, "phi3": _phi3, "gpt2": _gpt2, "gpt_neox": _gpt_neox}


def tp_table(model: nn.Module, *, vocab: bool = False, axis: str = "tensor") -> dict[str, PartitionSpec]:
    """The Megatron table of ``model`` (a ``transformers`` causal LM of a family in ``FAMILIES``):
    ``{pattern: spec}``, only patterns that match its parameters; ``vocab=True`` adds the untied
    embedding and LM head split on the vocabulary."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in _TABLES and family is not None:     # every other family: its own plans, resolved
        return _from_dims(model, vocab=vocab, axis=axis)
    if family not in _TABLES:
        raise ShardingError(f"tp_table: {type(model).__name__} is of family {family!r} — expected a transformers "
                            f"causal LM of one of {FAMILIES}. Write its table by hand: column projections "
                            "P('tensor', None), rows P(None, 'tensor'), fused ones P(Fused(parts, 'tensor'), None).")
    table = _TABLES[family](axis, model)
    root = is_peft(model)           # a PEFT model: patterns are written against the base model's names
    if vocab:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if emb is not None and head is not None and emb.weight is not head.weight:
            names = {id(p): base_name(n, root) for n, p in model.named_parameters()}
            table[names[id(emb.weight)]] = P(axis, None)
            table[names[id(head.weight)]] = P(axis, None)
    names = [base_name(n, root) for n, _ in model.named_parameters()]
    return {k: v for k, v in table.items() if any(fnmatchcase(n, k) for n in names)}


def _from_dims(model: nn.Module, *, vocab: bool, axis: str) -> dict[str, PartitionSpec]:
    """``sl.hf_dims(model)`` resolved over ``axis`` (heads and mlp; vocab with ``vocab=True``): the split
    entries only, the layer stack left out."""
    from .hf_dims import hf_dims
    from .rules import AxisRules
    rules = AxisRules({"heads": axis, "mlp": axis, **({"vocab": axis} if vocab else {})})
    out = {}
    for pattern, dims in hf_dims(model).items():
        spec, _ = rules.map(dims, pattern)
        if dims != ("layers",) and spec.axes:
            out[pattern] = spec
    return out
