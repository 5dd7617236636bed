"""The logical dims of a ``transformers`` model, read off the model itself: ``sl.hf_dims(model)``.

A transformers model with no ``sl.shard`` table is planned with this table, so ``rules`` alone decide
the axes: ``sl.plan(model, mesh, rules={"heads": "tensor", "mlp": "tensor", "vocab": "tensor",
"layers": "pipe"})`` is the whole recipe. A user's own table wins (any table on the model or a submodule).

Where the entries come from, in order (``hf_dims(model, sources=True)`` says which, per entry):

1. **the project's table** for the families whose config plan is missing, or whose plan gathers what
   shardlib keeps split and so would not say the layout of what it splits (``BUILTIN``);
2. **the config's plans**: ``config.base_model_tp_plan`` (``colwise`` -> ``(X, "embed")`` on the weight
   and ``(X,)`` on the bias, ``rowwise`` -> ``("embed", X)``; X is ``heads`` under an attention module,
   ``mlp`` elsewhere; ``replicated_with_grad_allreduce`` stays replicated: its partial gradient is derived,
   ``planner/varying.py``) and ``base_model_pp_plan`` (its ``ModuleList`` -> ``("layers",)``);
3. **the embeddings**: untied input and output embeddings -> ``("vocab", "embed")`` (a biased head's bias
   ``("vocab",)``); a tied pair stays replicated.

MoE experts (transformers 5's fused 3-D weights, ``packed_colwise`` / ``rowwise`` / ``moe_tp_experts`` in the
plan) get ``("experts", Fused(2, "expert_mlp"), "embed")`` and ``("experts", "embed", "expert_mlp")``: the rule
``"expert_mlp": "tensor"`` splits each expert's width (the tensor plan's experts site, Megatron's tensor-parallel
experts); without it the experts run replicated over ``tensor``. A config plan entry of another kind shardlib does not lower
(``colwise_gather_output`` outside the project's table, ``sequence_parallel``, ...) is not in the table;
``unsupported(model)`` lists it with what supporting it would take, and ``sl.plan`` refuses it when the mesh's
tensor axis would split the model.
Patterns are written against the model's own parameter names (a PEFT model's: its base model's); only
patterns that match a parameter are returned. transformers is not imported here.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from ..algebra.spec import Fused
from .peft import ROOT, base_name, is_peft, peft_base

COL, ROW, REPLICATED = "colwise", "rowwise", "replicated"
COL3, COL2 = "colwise_fused3", "colwise_fused2"       # q|k|v (gate|up) end to end: each block split
COL12 = "colwise_fused12"     # CodeGen's qkv_proj: 4 chunks of q|v|k
ROW4 = "rowwise_fused4"       # CodeGen's out_proj: its input holds the 4 chunks' heads in turn
NORM = "norm_split"           # an RMSNorm over a column's whole output (OLMo-2's q_norm): its weight split with it
EXPERTS_COL2, EXPERTS_MODULE = "experts_packed_colwise", "experts_module"
_KINDS = {"colwise": COL, "rowwise": ROW, "replicated_with_grad_allreduce": REPLICATED,
          # MoE experts (transformers 5's fused 3-D weights): their dims are named (``experts``, ``expert_mlp``),
          # split over tensor by the rule ``"expert_mlp": "tensor"``, else replicated over it
          "packed_colwise": EXPERTS_COL2, "moe_tp_experts": EXPERTS_MODULE}
_WHY = {
    "packed_colwise": "MoE experts' fused gate|up weights (E, 2I, H) split on I per expert",
    "moe_tp_experts": "the experts' forward on split expert widths, its output summed over tensor",
    "local_colwise": "a column kept local (its output never gathered)",
    "local_rowwise": "a row kept local (its output never summed)",
    "local_packed_rowwise": "a local row over packed experts",
    "sequence_parallel": "a module run on sequence shards (sl.plan's sequence_parallel=True does this itself)",
    "gather": "a module output gathered over tensor",
    "colwise_gather_output": "a column whose output is gathered back to the full width",
    "rowwise_split_input": "a row that splits its own (replicated) input",
}

# family -> (the layer stack under the base model, {module pattern under the base model: kind}); the
# attention of multi-query GPT-BigCode (one K and one V head) stays replicated: its MLP splits. ALiBi (bloom,
# mpt): each rank's heads get their own biases
# (``TensorPlan.head_args``)
BUILTIN: dict[str, tuple[str, dict[str, str]]] = {
    "gpt2": ("h", {"h.*.attn.c_attn": COL3, "h.*.attn.c_proj": ROW, "h.*.mlp.c_fc": COL, "h.*.mlp.c_proj": ROW}),
    "gptj": ("h", {"h.*.attn.q_proj": COL, "h.*.attn.k_proj": COL, "h.*.attn.v_proj": COL,
                   "h.*.attn.out_proj": ROW, "h.*.mlp.fc_in": COL, "h.*.mlp.fc_out": ROW}),
    "gpt_neo": ("h", {"h.*.attn.attention.q_proj": COL, "h.*.attn.attention.k_proj": COL,
                      "h.*.attn.attention.v_proj": COL, "h.*.attn.attention.out_proj": ROW,
                      "h.*.mlp.c_fc": COL, "h.*.mlp.c_proj": ROW}),
    # CodeGen's forward cuts qkv_proj's output in a fixed 4 chunks (mp_num), each q|v|k of a quarter of the
    # heads: 12 equal blocks, each split (heads divisible by 4 x tensor)
    "codegen": ("h", {"h.*.attn.qkv_proj": COL12, "h.*.attn.out_proj": ROW4,
                      "h.*.mlp.fc_in": COL, "h.*.mlp.fc_out": ROW}),
    "opt": ("decoder.layers", {"decoder.layers.*.self_attn.q_proj": COL, "decoder.layers.*.self_attn.k_proj": COL,
                               "decoder.layers.*.self_attn.v_proj": COL, "decoder.layers.*.self_attn.out_proj": ROW,
                               "decoder.layers.*.fc1": COL, "decoder.layers.*.fc2": ROW}),
    # BLOOM's query_key_value is per-head interleaved ([q k v] of head 0, then head 1...): a plain column
    "bloom": ("h", {"h.*.self_attention.query_key_value": COL, "h.*.self_attention.dense": ROW,
                    "h.*.mlp.dense_h_to_4h": COL, "h.*.mlp.dense_4h_to_h": ROW}),
    # query_key_value is interleaved per KV group (new decoder architecture) or per head: a plain column
    "falcon": ("h", {"h.*.self_attention.query_key_value": COL, "h.*.self_attention.dense": ROW,
                     "h.*.mlp.dense_h_to_4h": COL, "h.*.mlp.dense_4h_to_h": ROW}),
    "mpt": ("blocks", {"blocks.*.attn.Wqkv": COL3, "blocks.*.attn.out_proj": ROW,
                       "blocks.*.ffn.up_proj": COL, "blocks.*.ffn.down_proj": ROW}),
    "gpt_bigcode": ("h", {"h.*.mlp.c_fc": COL, "h.*.mlp.c_proj": ROW}),
    "stablelm": ("layers", {"layers.*.self_attn.q_proj": COL, "layers.*.self_attn.k_proj": COL,
                            "layers.*.self_attn.v_proj": COL, "layers.*.self_attn.o_proj": ROW,
                            "layers.*.mlp.gate_proj": COL, "layers.*.mlp.up_proj": COL,
                            "layers.*.mlp.down_proj": ROW}),
    # plans that gather a fused column's output: shardlib keeps it split, so the blocks are declared
    "phi3": ("layers", {"layers.*.self_attn.qkv_proj": COL3, "layers.*.self_attn.o_proj": ROW,
                        "layers.*.mlp.gate_up_proj": COL2, "layers.*.mlp.down_proj": ROW}),
    "glm": ("layers", {"layers.*.self_attn.q_proj": COL, "layers.*.self_attn.k_proj": COL,
                       "layers.*.self_attn.v_proj": COL, "layers.*.self_attn.o_proj": ROW,
                       "layers.*.mlp.gate_up_proj": COL2, "layers.*.mlp.down_proj": ROW}),
    # q_norm / k_norm normalise the whole q and k width (the config's plan gathers the columns' output for
    # them): split with the columns, their statistics summed over tensor
    "olmo2": ("layers", {"layers.*.self_attn.q_proj": COL, "layers.*.self_attn.k_proj": COL,
                         "layers.*.self_attn.v_proj": COL, "layers.*.self_attn.o_proj": ROW,
                         "layers.*.self_attn.q_norm": NORM, "layers.*.self_attn.k_norm": NORM,
                         "layers.*.mlp.gate_proj": COL, "layers.*.mlp.up_proj": COL, "layers.*.mlp.down_proj": ROW}),
}
# configurations whose attention stays replicated (their MLPs split): grouped-query Phi-3 (its fused q|k|v blocks
# differ in width), StableLM's per-head q/k LayerNorms (a list the forward zips with the heads: a rank would
# take the first heads' norms) and Cohere's per-head q/k norms (a (heads, head_dim) weight): exact, not split
KEEP_ATTENTION = {
    "phi3": lambda cfg: getattr(cfg, "num_key_value_heads", None) not in (None, cfg.num_attention_heads),
    "stablelm": lambda cfg: bool(getattr(cfg, "qk_layernorm", False)),
    "cohere": lambda cfg: bool(getattr(cfg, "use_qk_norm", False)),
    # multi-query Falcon (Falcon-7B): one K and one V head, which a tensor split cannot divide
    "falcon": lambda cfg: bool(getattr(cfg, "multi_query", False)) and not getattr(cfg, "new_decoder_architecture",
                                                                                  False),
}
# config plan entries replaced by the project's (the rest of the config's plan kept): OLMoE's attention, whose
# plan gathers q and k for their norms over the whole width — split with them instead, as OLMo-2's
OVERRIDES: dict[str, tuple[str, dict[str, str]]] = {
    "olmoe": ("self_attn.", {"layers.*.self_attn.q_proj": COL, "layers.*.self_attn.k_proj": COL,
                             "layers.*.self_attn.v_proj": COL, "layers.*.self_attn.o_proj": ROW,
                             "layers.*.self_attn.q_norm": NORM, "layers.*.self_attn.k_norm": NORM}),
}



def _family(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _roles(model: nn.Module) -> tuple[nn.Module, str, dict[str, str], str | None, list[tuple[str, str, str]]]:
    """``(the transformers model, its base model's prefix, {module pattern: kind}, stack pattern,
    unsupported (pattern, kind, what it would take))``, patterns relative to the transformers model."""
    hf, _ = peft_base(model)
    cfg = getattr(hf, "config", None)
    prefix = getattr(hf, "base_model_prefix", "") or ""
    if prefix and not isinstance(getattr(hf, prefix, None), nn.Module):
        prefix = ""                 # the base model itself
    pre = f"{prefix}." if prefix else ""
    family = _family(hf)
    kinds: dict[str, str] = {}
    unsupported: list[tuple[str, str, str]] = []
    stack = None
    if family in BUILTIN:
        stack_rel, table = BUILTIN[family]
        stack = pre + stack_rel
        kinds = {pre + k: v for k, v in table.items()}
    else:
        drop, extra = OVERRIDES.get(family, (None, {}))
        kinds.update((pre + k, v) for k, v in extra.items())
        for key, kind in (getattr(cfg, "base_model_tp_plan", None) or {}).items():
            if drop is not None and drop in key:
                continue
            if kind in _KINDS:
                kinds[pre + key] = _KINDS[kind]
            else:
                unsupported.append((pre + key, kind, _WHY.get(kind, "a tensor-parallel style shardlib has "
                                                                   "no lowering for")))
    keep = KEEP_ATTENTION.get(family)
    if keep is not None and keep(cfg):
        kinds = {k: v for k, v in kinds.items() if not any(a in k for a in ("self_attn.", "attention."))}
    if family not in BUILTIN:
        for key in (getattr(cfg, "base_model_pp_plan", None) or {}):
            if isinstance(_get(hf, pre + key), nn.ModuleList):
                stack = pre + key
    return hf, pre, kinds, stack, unsupported


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _is_attention(module_name: str) -> bool:
    parent = module_name.rpartition(".")[0].lower()
    return "attn" in parent or "attention" in parent


def hf_dims(model: nn.Module, *, sources: bool = False) -> dict:
    """``{parameter pattern: logical dims}`` of a transformers model (or a PEFT model over one), for a
    user to read or edit and pass to ``sl.shard``; ``{}`` for a model with no ``config.model_type``.
    With ``sources=True``: ``{pattern: (dims, where it came from)}``."""
    if _family(peft_base(model)[0]) is None:
        return {}
    hf, pre, kinds, stack, _ = _roles(model)
    root = is_peft(model)
    names = [base_name(n, root) for n, _ in model.named_parameters()]
    modules = {base_name(n, root): m for n, m in model.named_modules()}
    src = "the project's table (hf_dims.BUILTIN)" if _family(hf) in BUILTIN else "config.base_model_tp_plan"
    params = {base_name(n, root): p for n, p in model.named_parameters()}
    out: dict[str, tuple] = {}
    for pattern, kind in kinds.items():
        if kind in (REPLICATED, EXPERTS_MODULE):
            continue
        experts = [p for n, p in params.items() if fnmatchcase(n, pattern)]
        if experts and all(p.dim() == 3 for p in experts):      # (experts, out, in): gate|up and down
            out[pattern] = ((("experts", "embed", "expert_mlp") if kind == ROW
                             else ("experts", Fused(2, "expert_mlp"), "embed")), src)
            continue
        hits = [m for n, m in modules.items() if fnmatchcase(n, pattern)]
        if not hits:
            continue
        x = "heads" if _is_attention(pattern) else "mlp"
        layer = getattr(hits[0], "base_layer", hits[0])        # through PEFT's wrapper
        conv = type(layer).__name__ == "Conv1D"
        fused = int(kind.removeprefix("colwise_fused")) if kind.startswith("colwise_fused") else 1
        out_dim = Fused(fused, x) if fused > 1 else x
        if kind == NORM:
            out[f"{pattern}.weight"] = ((x,), src)
            continue
        if kind in (ROW, ROW4):
            x = Fused(4, x) if kind == ROW4 else x
            weight = (x, "embed") if conv else ("embed", x)
        else:
            weight = ("embed", out_dim) if conv else (out_dim, "embed")
        out[f"{pattern}.weight"] = (weight, src)
        if kind not in (ROW, ROW4) and any(getattr(getattr(m, "base_layer", m), "bias", None) is not None for m in hits):
            out[f"{pattern}.bias"] = ((out_dim,), src)
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if emb is not None and head is not None and emb.weight is not head.weight:
        ids = {id(p): n for n, p in model.named_parameters()}
        out[base_name(ids[id(emb.weight)], root)] = (("vocab", "embed"), "the untied input embeddings")
        out[base_name(ids[id(head.weight)], root)] = (("vocab", "embed"), "the untied output embeddings")
        if getattr(head, "bias", None) is not None:
            out[base_name(ids[id(head.bias)], root)] = (("vocab",), "the untied output embeddings")
    if stack is not None:     # a module name, relative to the model (a PEFT model's: through its wrapper)
        stack = (ROOT if root else "") + stack
        out[stack] = (("layers",), "config.base_model_pp_plan" if _family(hf) not in BUILTIN
                      else "the project's table (hf_dims.BUILTIN)")
    out = {k: v for k, v in out.items()
           if k == stack or any(fnmatchcase(n, k) for n in names)}
    return out if sources else {k: v[0] for k, v in out.items()}


def unsupported(model: nn.Module) -> list[str]:
    """The config plan entries of ``model`` that ``hf_dims`` could not translate, one line each naming
    the module pattern, its kind and what lowering it would take."""
    if _family(peft_base(model)[0]) is None:
        return []
    hf, _, _, _, bad = _roles(model)
    found = {base_name(n, is_peft(model)) for n, _ in model.named_modules()}
    return [f"{pattern}: base_model_tp_plan kind {kind!r} ({why})" for pattern, kind, why in bad
            if any(fnmatchcase(n, pattern) or fnmatchcase(n, pattern.rpartition(".")[0]) for n in found)]
