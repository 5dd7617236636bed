"""A small GPT: readable, deterministic, and written so the same ``forward`` runs on shards.

Attention is written with ``einops``, and the number of heads is read off the local weight
(``heads = out_features // (3 * head_dim)``), so a tensor-parallel shard that holds a subset of
heads runs the same code. The fused QKV projection orders its output features as
``(head, q|k|v, head_dim)``: splitting the features into contiguous blocks hands each shard
whole heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..planner.specs import shard
from .moe import MoE


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    mlp_width: int | None = None       # the MLP's hidden width (default mlp_ratio * d_model)
    # a mixture of experts in place of each block's MLP (models/moe.py) when n_experts > 0
    n_experts: int = 0
    top_k: int = 2                     # experts per token
    expert_width: int | None = None    # each expert's hidden width (default: the MLP's)
    expert_modules: bool = False       # the experts one module each (an nn.ModuleList), not fused 3-D weights
    shared_experts: int = 0            # always-on experts beside the routed ones (Qwen2-MoE, DeepSeek)
    norm_topk: bool = True             # the chosen experts' weights renormalized to sum to 1 (Mixtral)
    aux_loss: float = 0.01             # the load-balancing loss's coefficient in the training loss
    # each expert takes at most ceil(capacity_factor x tokens x top_k / n_experts) of a forward's (token, expert)
    # rows, the earliest tokens first; the rest are dropped (their weight 0; the token keeps its residual and
    # shared experts). 0: dropless
    capacity_factor: float = 0.0
    # DeepSeek-V3's routing: sigmoid scores, experts chosen within the best topk_group of n_group groups, the
    # chosen weights scaled by routed_scale, and aux-loss-free balancing (a per-expert bias for choosing,
    # nudged by bias_rate after each step: GPT.update_routing_bias)
    scoring: str = "softmax"           # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    bias_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.expert_width is None:
            object.__setattr__(self, "expert_width", self.hidden)
        if self.n_experts < 0 or self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} of n_experts={self.n_experts} — expected n_experts >= 0 "
                             "and 1 <= top_k <= n_experts.")
        if self.capacity_factor < 0:
            raise ValueError(f"GPTConfig: capacity_factor={self.capacity_factor} — expected 0 (dropless) or more.")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"GPTConfig: scoring={self.scoring!r} — expected 'softmax' or 'sigmoid'.")
        if self.n_experts and (self.n_group < 1 or self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group
                               or self.top_k > self.topk_group * (self.n_experts // self.n_group)):
            raise ValueError(f"GPTConfig: {self.n_experts} experts in n_group={self.n_group} groups, topk_group="
                             f"{self.topk_group}, top_k={self.top_k} — expected groups dividing the experts, "
                             "1 <= topk_group <= n_group, and top_k within the chosen groups' experts.")

    @property
    def hidden(self) -> int:
        return self.mlp_width if self.mlp_width is not None else self.mlp_ratio * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# The model names its dims (logical axes); ``AxisRules`` map them to mesh axes at plan time, so
# ``rules={"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}`` is Megatron TP and no rules
# (every name unmapped) is plain replication.
@shard({"qkv.weight": ("heads", "embed"), "qkv.bias": ("heads",),
        "proj.weight": ("embed", "heads"), "proj.bias": ("embed",)})
class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"GPTConfig: d_model {cfg.d_model} does not divide into {cfg.n_heads} heads.")
        self.head_dim, self.n_heads = cfg.head_dim, cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        q, k, v = rearrange(qkv, "b s (h three d) -> three b h s d", three=3, d=self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h s d -> b s (h d)"))


@shard({"fc.weight": ("mlp", "embed"), "fc.bias": ("mlp",),
        "out.weight": ("embed", "mlp"), "out.bias": ("embed",)})
class MLPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


@shard({"ln?.*": ("embed",)})
class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLPBlock(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# wpe's dim 0 is left unnamed: a "seq" rule for activations must not split the position table
# ``blocks`` is the layer stack: ``rules={"layers": "pipe"}`` cuts it into pipeline stages
@shard({"wte.weight": ("vocab", "embed"), "wpe.weight": (None, "embed"),
        "head.weight": ("vocab", "embed"), "ln_f.*": ("embed",), "blocks": ("layers",)})
class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` pre-norm blocks, a final norm and an LM head.

    ``model(idx, targets)`` returns the mean cross-entropy; ``model(idx)`` returns logits.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        if seed is not None:
            torch.manual_seed(seed)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for module in self.modules():
            self.init_weights(module)

    @torch.no_grad()
    def init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialization of ``module``'s own parameters: matrices and embeddings
        ``N(0, 0.02)``, biases 0 (LayerNorm weights keep their 1). The constructor applies it to
        every module in ``modules()`` order, after building them all; a model built on the meta
        device is given the same values by replaying it (``shardlib.runtime.materialize``)."""
        for name, p in module.named_parameters(recurse=False):
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name == "bias":
                nn.init.zeros_(p)

    # the pipeline protocol (planner/pipeline.py): what runs before the stack, and after it
    def pipeline_pre(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)

    def pipeline_post(self, x: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(rearrange(logits, "b s v -> (b s) v"), rearrange(targets, "b s -> (b s)"))
        if self.cfg.n_experts and self.cfg.aux_loss and not self.blocks[0].mlp.inject_aux:
            # every MoE layer's load-balancing loss, as transformers adds it (under a pipe axis the runtime attaches
            # each layer's gradient where it runs and adds the value: models/moe.py's AttachAux)
            loss = loss + self.cfg.aux_loss * sum(b.mlp.aux_loss for b in self.blocks)
        return loss

    @torch.no_grad()
    def update_routing_bias(self) -> None:
        """DeepSeek-V3's aux-loss-free balancing, after a step: each MoE layer's routing bias nudged toward the
        experts the step's batch under-used (``MoE.update_bias``)."""
        for block in self.blocks:
            if isinstance(block.mlp, MoE):
                block.mlp.update_bias()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.pipeline_pre(idx, targets)
        for block in self.blocks:
            x = block(x)
        return self.pipeline_post(x, idx, targets)


def token_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic ``(idx, targets)`` batch of random tokens (targets = next token)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
