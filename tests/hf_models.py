"""Tiny ``transformers`` causal LMs of several families, built from configs (no downloads), for the
tests of issue 18: every family trains, pipelines and loads like one process.

Each builder returns a fp32 model in train mode, its weights drawn after ``torch.manual_seed(seed)``
(the same on every rank), with dropout off and no KV cache, ``sdpa`` attention (deterministic on
CPU). Sizes are chosen so that 2 and 4 tensor ranks split heads whole while some MLP widths are
uneven where the family allows it.

- ``llama``: grouped-query attention 4/2, MLP 90 (uneven), untied.
- ``qwen2``: q/k/v biases, grouped-query attention 4/2, untied.
- ``mistral``: grouped-query attention 4/2, sliding window off, untied.
- ``gpt2``: ``Conv1D`` projections, fused ``c_attn`` (q|k|v), learned positions, tied embeddings.
- ``gpt_neox``: fused per-head interleaved ``query_key_value``, partial rotary, parallel residual.
- ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN, HEADS, KV_HEADS, SEQ = 96, 32, 4, 2, 16
FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi3")


def config(family: str, *, layers: int = 4, tie: bool | None = None):
    """The tiny config of ``family`` (``FAMILIES``); ``tie`` overrides the family's default tying."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, use_cache=False, pad_token_id=None, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
                  dtype=torch.float32)
    if family in ("llama", "qwen2", "mistral", "phi3"):
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig,
               "phi3": tf.Phi3Config}[family]
        kw = dict(hidden_size=HIDDEN, intermediate_size=90 if family != "phi3" else 64,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=layers,
                  max_position_embeddings=SEQ, attention_dropout=0.0, tie_word_embeddings=bool(tie))
        if family == "mistral":
            kw["sliding_window"] = None
        if family == "phi3":
            kw.update(resid_pdrop=0.0, embd_pdrop=0.0, num_key_value_heads=HEADS)
        return cls(**kw, **common)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=HIDDEN, n_layer=layers, n_head=HEADS, n_positions=SEQ, n_inner=None,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             tie_word_embeddings=True if tie is None else tie, **common)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
                                num_hidden_layers=layers, max_position_embeddings=SEQ, rotary_pct=0.5,
                                attention_dropout=0.0, hidden_dropout=0.0, use_parallel_residual=True,
                                tie_word_embeddings=bool(tie), **common)
    raise ValueError(f"hf_models.config: unknown family {family!r} — expected one of {FAMILIES}.")


def build(family: str, seed: int = 0, *, layers: int = 4, tie: bool | None = None, meta: bool = False):
    """``AutoModelForCausalLM`` of ``config(family)``: weights after ``torch.manual_seed(seed)``, or on the
    meta device (``meta=True``: shapes only)."""
    from transformers import AutoModelForCausalLM

    cfg = config(family, layers=layers, tie=tie)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    return model.float().train()


def batch(family: str, rows: int, seed: int, *, mask: bool = False) -> dict[str, torch.Tensor]:
    """Random tokens ``{"input_ids", "labels"}`` of ``(rows, SEQ)`` (labels = ids: the model shifts them);
    with ``mask`` an ``attention_mask`` whose last tokens of odd rows are padding (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if mask:
        m = torch.ones(rows, SEQ, dtype=torch.long)
        m[1::2, -3:] = 0
        out["attention_mask"] = m
        out["labels"] = ids.masked_fill(m == 0, -100)
    return out


def adamw(params, lr: float = 1e-2):
    """The tests' optimizer: AdamW with weight decay (so a parameter left out of an update shows).

    ``eps=1e-3``: Adam divides each gradient by its own running size, so where a gradient is near zero a
    round-off difference (another summation order: a tensor-parallel matmul, another CPU's SIMD width)
    becomes a difference of a good fraction of ``lr`` in the weight, and the next steps carry it on. At
    eps 1e-6 the Llama trained 4 steps at tensor 2 ended 1.3e-3 from one process's logits on an AVX-512
    EPYC (the tests allowed 1e-3 and passed on the machines before); at 1e-3 it ends 1.5e-6 from it (1.8e-6
    at data 2 x tensor 2)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, eps=1e-3)


def train_alone(model, batches, *, lr: float = 1e-2, loss=None, optimizer=None) -> list[float]:
    """The one-process reference: ``model`` trained in place by ``adamw`` (or ``optimizer(params)``) on
    each batch in turn, the loss ``model(**batch).loss`` (or ``loss(model, batch)``); the losses, as floats."""
    params = list(model.parameters())
    opt = adamw(params, lr) if optimizer is None else optimizer(params)
    out = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        value = model(**b).loss if loss is None else loss(model, b)
        value.backward()
        opt.step()
        out.append(float(value.detach()))
    return out
