"""Tiny ``transformers`` causal LMs of many families, built from configs (no downloads), for the family
matrix of tensor and pipeline parallelism: every family that ``transformers`` (5.23) builds as an
``AutoModelForCausalLM`` and that trains on CPU here.

The conventions of ``tests/hf_models.py``: each model is fp32 in train mode, its weights drawn after
``torch.manual_seed(seed)`` (the same on every rank), every dropout 0, no KV cache, ``sdpa`` attention
where the family has it (``eager`` where it has not: ``EAGER``); ``meta=True`` builds on the meta device
(shapes only). ``batch``, ``adamw`` and ``train_alone`` are ``hf_models``'s.

Sizes: vocabulary 96, hidden 32, 4 attention heads of 8, 2 key/value heads where the family has
grouped-query attention (else 4), MLP 64, sequences of 16 and at most 16 positions, 2 blocks. MoE
families (``MOE``): 4 experts, top 2, expert width 32, no router noise, ``output_router_logits=False``
(so ``.loss`` is the language-model loss alone: the load-balancing loss is not additive over micro-batches
or ranks, so one process and a pipeline would disagree by design), and ``experts_implementation="eager"``
(a loop over the experts hit, each a plain ``F.linear`` of one expert's slice of the 3-D weights; the
default ``grouped_mm`` falls back to a custom autograd op on CPU).

Per family: its distinctive structure (kept on); ``tp``: whether ``config.base_model_tp_plan`` is set
(non-empty) for the family in transformers 5.23; ``tied``: whether the family's config ties the input
and output embeddings by default (``TIED``; ``tie=`` overrides it):

- ``llama``: grouped-query attention 4/2, SwiGLU. tp yes, tied no.
- ``qwen2``: q/k/v biases, GQA. tp yes, tied no.
- ``qwen3``: per-head RMSNorm of q and k (``q_norm``/``k_norm``, width head_dim), GQA. tp yes, tied no.
- ``qwen3_moe``: Qwen3 attention, every block MoE (fused 3-D expert weights ``gate_up_proj``/``down_proj``),
  top-k weights renormalised. tp yes, tied no.
- ``mistral``: GQA, sliding window 8 (< the sequence, so it masks). tp yes, tied no.
- ``mixtral``: Mistral attention (no window), every block MoE, no jitter. tp yes, tied no.
- ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``, GQA. tp yes, tied no.
- ``phi``: parallel attention and MLP off one LayerNorm, biases everywhere, partial rotary (half of each head),
  ``dense`` output projection, biased ``lm_head``. tp yes, tied no.
- ``gemma``: embeddings scaled by sqrt(hidden), RMSNorm of ``(1 + w)``, GeGLU, GQA. tp yes, tied yes.
- ``gemma2``: Gemma plus attention and final logit soft-capping (50, 30), sliding window 8 on alternate
  blocks, pre- and post-norms around attention and MLP; ``eager`` (no ``sdpa`` in 5.23). tp yes, tied yes.
- ``gemma3_text``: Gemma-2 norms plus per-head ``q_norm``/``k_norm``, block 0 sliding (window 8, local rope
  base) and block 1 full attention, no soft-capping. tp yes, tied yes.
- ``gpt2``: ``Conv1D`` projections (weights transposed), fused ``c_attn`` (q|k|v), learned positions.
  tp no, tied yes.
- ``gpt_neox``: fused per-head interleaved ``query_key_value``, partial rotary (half), parallel residual.
  tp yes, tied no.
- ``gptj``: separate bias-free q/k/v, rotary on the first 4 of each head's 8 dims (``rotary_dim``,
  interleaved pairs), parallel attention and MLP off one LayerNorm, biased ``lm_head``; ``eager``.
  tp no, tied no.
- ``opt``: learned positions offset by 2 and counted from ``attention_mask``, ``project_in``/``project_out``
  between a 16-wide embedding (``word_embed_proj_dim``) and the 32-wide blocks, ReLU MLP ``fc1``/``fc2``.
  tp no, tied yes.
- ``bloom``: ALiBi (no positions), fused per-head interleaved ``query_key_value``, LayerNorm right after
  the embedding, MLP fixed at 4 x hidden; ``eager``. tp no, tied yes.
- ``falcon``: the new decoder architecture (Falcon-40B/180B): fused ``query_key_value`` grouped per KV head
  (2 KV heads: q, q, k, v of each group), two LayerNorms (``ln_attn``/``ln_mlp``) in parallel, bias-free
  linears, rotary. (Multi-query attention, Falcon-7B's default, is covered by ``gpt_bigcode``.) tp no, tied yes.
- ``stablelm``: partial rotary (a quarter: 2 of 8 dims), LayerNorm, GQA, defaults otherwise (no qk-norm,
  sequential residual). tp no, tied no.
- ``mpt``: ALiBi (no positions), fused ``Wqkv``, no biases, bias-free ``low_precision_layernorm``, GELU MLP
  ``up_proj``/``down_proj``; ``eager``. tp no, tied yes.
- ``olmo``: LayerNorm without parameters, SwiGLU. tp yes, tied no.
- ``olmo2``: RMSNorm of q and k over the whole projection (width heads x head_dim, not per head), norms
  after attention and MLP (post-norm). tp yes, tied no.
- ``gpt_bigcode``: multi-query attention (one K and one V head) in a fused ``c_attn`` (q | k | v =
  32 + 8 + 8), ``nn.Linear`` projections, learned positions. tp no, tied yes.
- ``deepseek_v3``: multi-head latent attention (q through a rank-16 LoRA with its norm, k/v through a
  rank-16 latent + a shared 4-dim rope key, qk head 4 nope + 4 rope, v head 8, interleaved rope), block 0
  dense (``first_k_dense_replace=1``), block 1 MoE: sigmoid router with ``e_score_correction_bias`` (a
  buffer), 1 group, 4 routed experts top 2, scaled by 2.5, one shared expert. tp yes, tied no.
- ``granite``: Llama with multipliers: embeddings x 12, residual branches x 0.22, attention scale 1/8
  instead of 1/sqrt(8), logits / 4. tp yes, tied no.
- ``cohere``: LayerNorm without bias (``CohereLayerNorm``), parallel attention and MLP off one norm, logits
  x 0.0625, interleaved rotary. tp yes, tied yes.
- ``starcoder2``: biases everywhere, LayerNorm, GELU MLP ``c_fc``/``c_proj``, GQA. tp yes, tied yes.
- ``smollm3``: Llama with NoPE every other block (``no_rope_layer_interval=2``: block 1 has no rotary).
  tp yes, tied yes.
- ``glm``: fused ``gate_up_proj``, q/k/v biases, partial interleaved rotary (half), GQA. tp yes, tied no.
- ``gpt_neo``: block 0 global, block 1 local attention (window 8), unscaled attention scores, separate
  bias-free q/k/v, learned positions; ``eager``. tp no, tied yes.
- ``codegen``: fused ``qkv_proj`` split in 4 ``mp_num`` chunks (each q|v|k of two of its 8 heads of 4 dims:
  tensor 2 splits each chunk), rotary on 2 of 4 dims (``rotary_dim``), parallel attention and MLP, biased
  ``lm_head``; ``eager``. tp no, tied no.
- ``olmoe``: OLMo-2-style whole-projection q/k RMSNorm (pre-norm), every block MoE, top-k weights not
  renormalised. tp yes, tied no.
- ``qwen2_moe``: q/k/v biases, every block MoE plus a shared expert (width 64) behind a sigmoid gate.
  tp yes, tied no.
- ``exaone4``: post-norm blocks, per-head q/k RMSNorm, block 0 sliding (window 8, rotary), block 1 full
  attention without rotary (NoPE). tp yes, tied no.

Dropped: none — every family asked for builds, runs ``model(**batch).loss`` (with and without
``attention_mask``) and trains on CPU here.
"""

from __future__ import annotations

import torch

from hf_models import SEQ, VOCAB, adamw, train_alone  # noqa: F401  (the suite's optimizer and reference)
from hf_models import batch as _batch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, EXPERT_MLP, EXPERTS, TOP_K, WINDOW = 32, 4, 2, 8, 64, 32, 4, 2, 8

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "phi3", "phi", "gemma", "gemma2",
            "gemma3_text", "gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "stablelm", "mpt", "olmo",
            "olmo2", "gpt_bigcode", "deepseek_v3", "granite", "cohere", "starcoder2", "smollm3", "glm",
            "gpt_neo", "codegen", "olmoe", "qwen2_moe", "exaone4")
# the families whose config ties lm_head to the input embedding by default (transformers 5.23)
TIED = frozenset({"gemma", "gemma2", "gemma3_text", "gpt2", "opt", "bloom", "falcon", "mpt", "gpt_bigcode",
                  "cohere", "starcoder2", "smollm3", "gpt_neo"})
MOE = frozenset({"qwen3_moe", "mixtral", "deepseek_v3", "olmoe", "qwen2_moe"})
# the families without sdpa attention in transformers 5.23 (built with attn_implementation="eager")
EAGER = frozenset({"gemma2", "gptj", "bloom", "mpt", "gpt_neo", "codegen"})


def _alternate(layers: int, first: str, second: str) -> list[str]:
    return [first if i % 2 == 0 else second for i in range(layers)]


def _family_kwargs(family: str, layers: int) -> dict:
    """The family's own config arguments (sizes, distinctive features, dropouts 0)."""
    L, H = layers, HIDDEN
    llama_like = dict(hidden_size=H, intermediate_size=MLP, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      num_hidden_layers=L, max_position_embeddings=SEQ, attention_dropout=0.0)
    moe = dict(output_router_logits=False, experts_implementation="eager")
    if family in ("llama", "qwen2", "olmo", "olmo2", "smollm3", "starcoder2"):
        kw = dict(llama_like)
        if family == "smollm3":
            kw["no_rope_layer_interval"] = 2
        if family == "starcoder2":
            kw.update(residual_dropout=0.0, embedding_dropout=0.0, sliding_window=None)
        return kw
    if family == "qwen3":
        return dict(llama_like, head_dim=HEAD_DIM)
    if family == "mistral":
        return dict(llama_like, head_dim=HEAD_DIM, sliding_window=WINDOW)
    if family == "phi3":
        return dict(llama_like, resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "phi":
        return dict(llama_like, num_key_value_heads=HEADS, resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "gemma":
        return dict(llama_like, head_dim=HEAD_DIM)
    if family == "gemma2":
        return dict(llama_like, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                    layer_types=_alternate(L, "sliding_attention", "full_attention"))
    if family == "gemma3_text":
        return dict(llama_like, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
                    layer_types=_alternate(L, "sliding_attention", "full_attention"))
    if family == "exaone4":
        return dict(llama_like, sliding_window=WINDOW, layer_types=_alternate(L, "sliding_attention", "full_attention"))
    if family == "granite":
        return dict(llama_like, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.0 / HEAD_DIM,
                    logits_scaling=4.0)
    if family == "cohere":
        return dict(llama_like)
    if family == "glm":
        return dict(llama_like, head_dim=HEAD_DIM)
    if family == "stablelm":
        return dict(llama_like, hidden_dropout=0.0)
    if family == "gpt_neox":
        return dict(hidden_size=H, intermediate_size=MLP, num_attention_heads=HEADS, num_hidden_layers=L,
                    max_position_embeddings=SEQ, rotary_pct=0.5, attention_dropout=0.0, hidden_dropout=0.0,
                    use_parallel_residual=True, classifier_dropout=0.0)
    if family == "mixtral":
        return dict(llama_like, intermediate_size=EXPERT_MLP, head_dim=HEAD_DIM, sliding_window=None,
                    num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, router_jitter_noise=0.0, **moe)
    if family == "qwen3_moe":
        return dict(llama_like, head_dim=HEAD_DIM, moe_intermediate_size=EXPERT_MLP, num_experts=EXPERTS,
                    num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **moe)
    if family == "qwen2_moe":
        return dict(llama_like, moe_intermediate_size=EXPERT_MLP, shared_expert_intermediate_size=MLP,
                    num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[], **moe)
    if family == "olmoe":
        return dict(llama_like, intermediate_size=EXPERT_MLP, num_experts=EXPERTS, num_experts_per_tok=TOP_K, **moe)
    if family == "deepseek_v3":
        return dict(llama_like, num_key_value_heads=HEADS, moe_intermediate_size=EXPERT_MLP, first_k_dense_replace=1,
                    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=HEAD_DIM,
                    n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1, topk_group=1, n_shared_experts=1,
                    **moe)
    if family == "gpt2":
        return dict(n_embd=H, n_layer=L, n_head=HEADS, n_positions=SEQ, n_inner=MLP, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, summary_first_dropout=0.0)
    if family == "gpt_bigcode":
        return dict(n_embd=H, n_layer=L, n_head=HEADS, n_positions=SEQ, n_inner=MLP, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, multi_query=True)
    if family == "gptj":
        return dict(n_embd=H, n_layer=L, n_head=HEADS, n_positions=SEQ, n_inner=MLP, rotary_dim=4, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "codegen":
        return dict(n_embd=H, n_layer=L, n_head=2 * HEADS, n_positions=SEQ, n_ctx=SEQ, n_inner=MLP, rotary_dim=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "gpt_neo":
        types = [[["global", "local"], L // 2]] + ([[["global"], 1]] if L % 2 else [])
        return dict(hidden_size=H, num_layers=L, num_heads=HEADS, intermediate_size=MLP, max_position_embeddings=SEQ,
                    attention_types=types, window_size=WINDOW, resid_dropout=0.0, embed_dropout=0.0,
                    attention_dropout=0.0, classifier_dropout=0.0)
    if family == "opt":
        return dict(hidden_size=H, num_hidden_layers=L, ffn_dim=MLP, num_attention_heads=HEADS,
                    max_position_embeddings=SEQ, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                    layerdrop=0.0)
    if family == "bloom":
        return dict(hidden_size=H, n_layer=L, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    if family == "falcon":
        return dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, num_kv_heads=KV_HEADS,
                    new_decoder_architecture=True, multi_query=False, parallel_attn=True, alibi=False, bias=False,
                    ffn_hidden_size=MLP, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    if family == "mpt":
        return dict(d_model=H, n_heads=HEADS, n_layers=L, expansion_ratio=MLP // H, max_seq_len=SEQ,
                    resid_pdrop=0.0, emb_pdrop=0.0, attn_config={"alibi": True, "attn_pdrop": 0})
    raise ValueError(f"hf_families.config: unknown family {family!r} — expected one of {FAMILIES}.")


def config(family: str, *, layers: int = 2, tie: bool | None = None):
    """The tiny config of ``family`` (``FAMILIES``); ``tie`` overrides the family's default tying (``TIED``)."""
    from transformers import CONFIG_MAPPING

    if family not in FAMILIES:
        raise ValueError(f"hf_families.config: unknown family {family!r} — expected one of {FAMILIES}.")
    kw = _family_kwargs(family, layers)
    kw.update(vocab_size=VOCAB, use_cache=False, pad_token_id=None, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=(family in TIED) if tie is None else bool(tie),
              attn_implementation="eager" if family in EAGER else "sdpa", dtype=torch.float32)
    return CONFIG_MAPPING[family](**kw)


def build(family: str, seed: int = 0, *, layers: int = 2, tie: bool | None = None, meta: bool = False):
    """``AutoModelForCausalLM`` of ``config(family)``: weights after ``torch.manual_seed(seed)``, or on the
    meta device (``meta=True``: shapes only); fp32, train mode."""
    from transformers import AutoModelForCausalLM

    cfg = config(family, layers=layers, tie=tie)
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg)
    return model.float().train()


def batch(family: str, rows: int, seed: int, *, mask: bool = False) -> dict[str, torch.Tensor]:
    """``hf_models.batch``: random tokens ``{"input_ids", "labels"}`` of ``(rows, SEQ)`` (labels = ids: the
    model shifts them); with ``mask`` an ``attention_mask`` whose last 3 tokens of odd rows are padding
    (labels -100 there). The same for every family (one vocabulary, one length). The padding is on the right
    and every family is causal, so the mask changes no loss here (not even OPT's mask-counted positions or
    BLOOM's/MPT's ALiBi): it exercises the mask's path, not its effect."""
    if family not in FAMILIES:
        raise ValueError(f"hf_families.batch: unknown family {family!r} — expected one of {FAMILIES}.")
    return _batch(family, rows, seed, mask=mask)
