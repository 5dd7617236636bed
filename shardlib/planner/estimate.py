"""A step's time from the plan and the machine's figures: what ``python -m shardlib.explain`` prints.

Compute. A transformer's training FLOPs (Narayanan et al. 2021, eq. 3, for any MLP width): per token
and layer the forward multiplies ``(4 + 2r)·d²`` weights (attention's q, k, v, output; an MLP of width
``r·d``) at 2 FLOPs each, and the attention scores and their weighting cost ``2·2·s·d``; the LM head
``2·d·V``. Backward is twice the forward; full recompute adds one more forward of the blocks,
selective recompute one more forward of attention's core (its ``4sd``)::

    F = tokens · L · ((3 + rc) · 2(4+2r)d² + (3 + rc + sel) · 4sd) + 3 · tokens · 2dV
        (rc = 1 with recompute="full", sel = 1 with recompute="selective")

Every rank computes ``F / ranks`` (the data axis splits the tokens, tensor and pipe the layers'
work) — with a pipeline, its busiest stage's share (its blocks, and the head on the last stage:
``pipeline_rank_flops``) — at the mesh's sustained ``device_tflops``, plus a fixed cost per layer and micro-batch where the
mesh is calibrated (``layer_us``: what many small micro-batches pay beyond their FLOPs); a pipeline stretches it by its bubble,
``compute / (1 - idle)`` with the schedule's formula ``(p-1)/(m+p-1)`` (``planner/simulate.py``).

Attention scores. Where the attention kernel writes its ``a·s²`` scores per sequence to memory (Megatron's
scaled-masked softmax and dropout of 2021-22; not flash attention, which never holds them), their
elementwise work — scale, mask, softmax, dropout, and their backward — is bound by memory traffic, not
FLOPs: the mesh's ``score_ns`` (seconds per score element per layer's forward and backward, calibrated)
times each rank's ``a·s²·b/t`` elements per layer and micro-batch (``b`` sequences per micro-batch, the
heads split ``t`` ways), ``1.5`` times where recompute re-runs attention's core (full or selective).

Communication. Each collective of ``plan.comm_per_step(rank)`` takes ``bytes / bandwidth + hops ·
latency`` on the slowest link of its axes (ring hops: all-reduce ``2(k-1)``, all-gather and
reduce-scatter ``k-1``, broadcast ``k-1``, a point-to-point send 1); a calibrated mesh may give the
reduce-scatter's and the all-gather's latency per hop apart from the all-reduce's (measured: with gloo
on oversubscribed cores each costs about twice an all-reduce's per call).

Copies between memory kinds (offload). The plan's ``d2h``/``h2d`` entries take ``bytes / host``
(the device-host link, PCIe), its ``disk_read``/``disk_write`` ``bytes / disk`` (a rank's share of the
disk's bandwidth); an offloaded optimizer's update runs on the host at ``host_update`` bytes/s, 28 bytes
moved per element (AdamW: reads parameter, gradient and two moments, writes three).

The estimate adds them all (no overlap: an upper bound) and beside it gives the lower bound of perfect
overlap: the largest of compute, communication, host copies and disk traffic, plus the host update,
which the step waits for (the next forward needs its parameters).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .plan import Plan

HOPS = {"all_reduce": lambda k: 2 * (k - 1), "all_gather": lambda k: k - 1, "reduce_scatter": lambda k: k - 1,
        "broadcast": lambda k: k - 1, "all_to_all": lambda k: k - 1, "send": lambda k: 1, "recv": lambda k: 0,
        "send_recv": lambda k: 1}


@dataclass(frozen=True)
class StepEstimate:
    flops: float                  # one step, the whole model (fwd + bwd (+ recompute))
    flops_per_rank: float
    compute_s: float              # flops_per_rank at the device's sustained rate
    idle: float                   # the pipeline's bubble (0 without one)
    comm_s: dict[str, float]      # seconds of the step's collectives by axes ("data", "tensor", "data+tensor", ...)
    tokens: int
    copy_s: tuple[tuple[str, float], ...] = ()    # ("host" | "disk", seconds of the step's copies)
    update_s: float = 0.0         # the offloaded optimizer's update on the host
    overlap: float = 0.0          # the machine's fraction of communication hidden behind compute
    scores_s: float = 0.0         # of compute_s: the attention scores' elementwise work (memory-bound)

    @property
    def compute_with_bubble_s(self) -> float:
        return self.compute_s / (1.0 - self.idle)

    @property
    def total_s(self) -> float:
        """No overlap of communication with compute: an upper bound."""
        return self.compute_with_bubble_s + sum(self.comm_s.values()) + sum(s for _, s in self.copy_s) + self.update_s

    @property
    def overlapped_s(self) -> float:
        """Perfect overlap: a lower bound."""
        return max(self.compute_with_bubble_s, sum(self.comm_s.values()), *(s for _, s in self.copy_s)) + self.update_s

    @property
    def step_s(self) -> float:
        """The predicted step: between the bounds by the machine's ``overlap`` (0: no overlap)."""
        return self.total_s - self.overlap * (self.total_s - self.overlapped_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


@dataclass(frozen=True)
class ModelDims:
    """What the FLOP count needs of a transformer: its layers, width, heads and vocabulary, and where
    its blocks are not GPT's ``(4 + 2r)·d²`` weights (grouped key/value heads, a gated MLP), the
    elements of one block's matrices (``block_matrix``: each multiplies 2 FLOPs per token)."""

    layers: int
    d_model: int
    heads: int
    vocab: int
    mlp_ratio: int = 4
    block_matrix: int | None = None

    @staticmethod
    def of(model) -> ModelDims:
        """The reference GPT's dims from its config; a transformers model's from its ``config`` and its
        first block's matrices (the layer stack ``planner/stack.auto_stack`` finds)."""
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "num_hidden_layers"):
            c = model.cfg
            if c.n_experts:        # a token multiplies the router, its top_k experts and the shared ones (SwiGLU)
                matrix = (4 * c.d_model ** 2 + c.n_experts * c.d_model
                          + (c.top_k + c.shared_experts) * 3 * c.expert_width * c.d_model)
                return ModelDims(c.n_layers, c.d_model, c.n_heads, c.vocab_size, c.mlp_ratio, matrix)
            return ModelDims(c.n_layers, c.d_model, c.n_heads, c.vocab_size, c.mlp_ratio,
                             None if c.mlp_width is None else 4 * c.d_model ** 2 + 2 * c.d_model * c.mlp_width)
        from .stack import auto_stack
        stack, _ = auto_stack(model)
        first = next(iter(dict(model.named_modules())[stack].children()), None) if stack else None
        matrix = None
        if first is not None:
            # fused experts [E, ., .]: a token multiplies its top_k of the E (the config's num_experts_per_tok)
            k = getattr(cfg, "num_experts_per_tok", None)
            matrix = sum(p.numel() if p.dim() == 2 else p.numel() * k // p.shape[0] if p.dim() == 3 and k else 0
                         for p in first.parameters())
        return ModelDims(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size, 4, matrix)

    def flops(self, *, seq: int, tokens: int, recompute: bool | str = False) -> float:
        return transformer_flops(layers=self.layers, d_model=self.d_model, seq=seq, vocab=self.vocab, tokens=tokens,
                                 mlp_ratio=self.mlp_ratio, recompute=recompute, block_matrix=self.block_matrix)


def transformer_flops(*, layers: int, d_model: int, seq: int, vocab: int, tokens: int, mlp_ratio: int = 4,
                      recompute: bool | str = False, block_matrix: int | None = None) -> float:
    """Training FLOPs of one step over ``tokens`` tokens (the module doc's formula); ``recompute``:
    ``"none"``/``False``, ``"selective"``, ``"full"``/``True``; ``block_matrix``: one block's matrix
    elements where they are not ``(4 + 2r)·d²`` (its dense FLOPs per token are then ``2·block_matrix``)."""
    rc = int(recompute is True or recompute == "full")
    sel = int(recompute == "selective")
    dense = 2 * (4 + 2 * mlp_ratio) * d_model ** 2 if block_matrix is None else 2 * block_matrix
    core = 4 * seq * d_model
    return tokens * (layers * ((3 + rc) * dense + (3 + rc + sel) * core) + 3 * 2 * d_model * vocab)


def pipeline_rank_flops(plan: Plan, *, layers: int, d_model: int, seq: int, vocab: int, tokens: int,
                        mlp_ratio: int = 4, recompute: bool | str = False,
                        block_matrix: int | None = None) -> tuple[float, int]:
    """(FLOPs, blocks) of the busiest pipe rank: its stages' blocks, and the LM head where its last
    stage holds it — a pipeline runs at its slowest stage's pace, and the head sits on one stage only.
    Each data rank takes ``tokens / dp`` and the tensor axis splits a rank's work ``t`` ways."""
    pp = plan.pipeline
    per_layer = transformer_flops(layers=1, d_model=d_model, seq=seq, vocab=0, tokens=1, mlp_ratio=mlp_ratio,
                                  recompute=recompute, block_matrix=block_matrix)
    head = 3 * 2 * d_model * vocab
    share = tokens / (plan.dp_size * plan.tensor_size)
    worst = (0.0, 0)
    for r in range(pp.size):
        blocks = sum(len(s.blocks) for s in pp.stages if s.rank == r)
        post = any(s.post for s in pp.stages if s.rank == r)
        worst = max(worst, (share * (blocks * per_layer + (head if post else 0)), blocks))
    return worst


def recompute_passes(recompute: bool | str) -> float:
    """A block's passes per micro-batch relative to forward + backward (what ``layer_us``, the fixed
    cost per layer pass, multiplies): full recompute adds a third pass (1.5); selective re-runs one
    kernel of a block's forward of about a dozen (``1 + 1/24``, an approximation)."""
    if recompute is True or recompute == "full":
        return 1.5
    return 1.0 + 1 / 24 if recompute == "selective" else 1.0


def score_elements(*, blocks: int, microbatches: int, heads: int, seq: int, sequences: int, tensor: int,
                   recompute: bool | str) -> float:
    """Attention score elements one rank's forward and backward touch in a step (the module doc):
    ``blocks x microbatches x heads·seq²·sequences / tensor``, 1.5 times where recompute re-runs the core."""
    again = 1.5 if recompute is True or recompute in ("full", "selective") else 1.0
    return blocks * microbatches * heads * seq ** 2 * sequences / tensor * again


def estimate_step(plan: Plan, *, flops: float, tokens: int, device_flops: float,
                  links: Mapping[str, tuple[float, float]], rank: int = 0, host: float | None = None,
                  disk: float | None = None, host_update: float | None = None,
                  layer_s: float = 0.0, layer_passes: float = 0.0,
                  flops_per_rank: float | None = None,
                  hop_s: Mapping[str, float] | None = None, overlap: float = 0.0,
                  score_s: float = 0.0, scores: float = 0.0) -> StepEstimate:
    """``flops`` of a step over ``tokens`` tokens; ``device_flops`` per second; ``links[axis] =
    (bytes/s, seconds per hop)`` (an axis missing from ``links`` takes ``links["default"]``); with
    offload, ``host``, ``disk`` and ``host_update`` in bytes/s (the module doc; a figure not given
    leaves its part out of the estimate); ``layer_s`` a fixed cost per layer and micro-batch (forward and
    backward: Python and kernel launches, measured by ``python -m shardlib.calibrate``) times this rank's
    ``layer_passes``; ``flops_per_rank`` the busiest rank's share where it is not ``flops / ranks``
    (a pipeline: ``pipeline_rank_flops``); ``hop_s[op]`` a collective's seconds per ring hop where it
    was measured apart from the links' (calibrated CPU meshes: gloo's reduce-scatter and all-gather);
    ``score_s`` seconds per attention score element (``score_elements``: ``scores`` of them) where the
    attention kernel materializes its scores."""
    from .simulate import bubble_formula

    ranks = plan.mesh.size
    per_rank = flops / ranks if flops_per_rank is None else flops_per_rank
    pp = plan.pipeline
    idle = bubble_formula(pp.schedule, pp.size, pp.microbatches, pp.virtual) if pp is not None else 0.0
    comm: dict[str, float] = {}
    copies = {"host": 0.0, "disk": 0.0}
    for e in plan.comm_per_step(rank):
        if not e.axes:          # a copy between memory kinds (planner/offload.py)
            link, rate = ("host", host) if e.op in ("d2h", "h2d") else ("disk", disk)
            if rate:
                copies[link] += e.total / rate
            continue
        k = math.prod(plan.mesh.axis_size(a) for a in e.axes)
        figs = [links.get(a, links.get("default")) for a in e.axes]
        if any(f is None for f in figs):
            raise KeyError(f"estimate_step: no link figures for axes {e.axes} — got {sorted(links)}; "
                           "expected each axis or 'default'.")
        bandwidth, latency = min(f[0] for f in figs), max(f[1] for f in figs)
        key = "+".join(e.axes)
        hop = (hop_s or {}).get(e.op, latency)
        comm[key] = comm.get(key, 0.0) + e.count * (e.bytes / bandwidth + HOPS[e.op](k) * hop)
    update = 0.0
    if dict(plan.offload).get("optimizer") and host_update:
        n_opt = plan.memory_per_rank(rank, kind="all")["optimizer"] / (4 + plan.optimizer_state_bytes)
        update = 28 * n_opt / host_update
    on_scores = score_s * scores
    # + a fixed cost per layer and micro-batch, + the materialized scores' memory-bound work
    compute = per_rank / device_flops + layer_s * layer_passes + on_scores
    return StepEstimate(flops, per_rank, compute, idle, comm, tokens,
                        tuple((k, v) for k, v in copies.items() if v), update, overlap, on_scores)
