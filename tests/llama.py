"""A tiny ``transformers`` Llama for the tensor-parallel parity tests, and the pattern table that
gives it Megatron TP without editing its code (issue 8, "Parity").

The model is the library's own ``LlamaForCausalLM``: grouped-query attention (``kv_heads <
heads``), an MLP width that neither 2 nor 4 divides (uneven shards on ``tensor``), untied
embeddings, no dropout, no KV cache, ``sdpa`` attention (deterministic on CPU).

Why the pattern table is enough (transformers 5.23, ``modeling_llama.py``): attention reads its
head count off the local tensors — ``view(*input_shape, -1, self.head_dim)`` — and the only
head-count attribute its forward uses is ``num_key_value_groups = heads // kv_heads``, which is
the same on a shard that holds ``heads/t`` query heads and ``kv_heads/t`` KV heads. Contiguous
row blocks of ``q_proj`` and ``k_proj``/``v_proj`` line up: query head ``i`` uses KV head
``i // groups``, so shard ``r`` holds query heads ``r·heads/t ...`` and exactly the KV heads they
use. The MLP reads no sizes in forward. The loss is ``ForCausalLMLoss``: ``logits.float()``,
labels padded by one ``-100`` and shifted left, ``logits.view(-1, config.vocab_size)``, then
``F.cross_entropy(..., ignore_index=-100, reduction="mean")`` — the ``view`` names the *full*
vocab, so vocab-parallel logits must look full-width to it.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardlib import P

# Megatron TP for a Llama by parameter patterns: q/k/v and gate/up are column-parallel (output
# features on ``tensor``), o_proj and down_proj row-parallel (input features on ``tensor``).
# RMSNorm weights, the embedding and the LM head stay replicated.
LLAMA_TP: dict[str, P] = {
    "*.q_proj.weight": P("tensor", None),
    "*.k_proj.weight": P("tensor", None),
    "*.v_proj.weight": P("tensor", None),
    "*.o_proj.weight": P(None, "tensor"),
    "*.gate_proj.weight": P("tensor", None),
    "*.up_proj.weight": P("tensor", None),
    "*.down_proj.weight": P(None, "tensor"),
}

# Vocab-parallel embedding and LM head, to add to ``LLAMA_TP``. The loss inside the model does
# ``logits.view(-1, config.vocab_size)`` on the head's output, so vocab-sharded logits must behave
# as full-width there (or the loss must be taken outside the model from ``.logits``).
LLAMA_VOCAB_TP: dict[str, P] = {
    "*.embed_tokens.weight": P("tensor", None),
    "lm_head.weight": P("tensor", None),
}


def tiny_config(*, vocab: int = 96, hidden: int = 32, intermediate: int = 90, heads: int = 4,
                kv_heads: int = 2, layers: int = 2, seq: int = 16) -> LlamaConfig:
    """A tiny ``LlamaConfig``: head_dim = hidden / heads, fp32, deterministic (no dropout, no cache)."""
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, num_hidden_layers=layers,
        max_position_embeddings=seq, attention_dropout=0.0, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, use_cache=False, pad_token_id=None, attn_implementation="sdpa",
        dtype=torch.float32)


def tiny_llama(seed: int = 0, *, vocab: int = 96, hidden: int = 32, intermediate: int = 90, heads: int = 4,
               kv_heads: int = 2, layers: int = 2, seq: int = 16) -> LlamaForCausalLM:
    """``LlamaForCausalLM`` from ``tiny_config``, its weights drawn after ``torch.manual_seed(seed)``
    (the same on every rank); ``model(input_ids=..., labels=...).loss`` is the mean next-token
    cross-entropy."""
    cfg = tiny_config(vocab=vocab, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                      layers=layers, seq=seq)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model.float().train()


def llama_batch(cfg: LlamaConfig, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """A deterministic batch of random tokens, ``dict(input_ids=..., labels=...)``, each
    ``(batch, max_position_embeddings)``; ``labels`` is ``input_ids`` (the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_position_embeddings), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
