"""The pipe axis in the planner: stages from the layer stack's ``layers -> pipe`` layout.

A pipeline is not a separate API. The model declares its layer stack — an ``nn.ModuleList``
named in its ``sl.shard`` table with the logical dim ``layers`` (``@sl.shard({"blocks":
("layers",)})``) — and ``rules={"layers": "pipe"}`` shards that dim over the mesh axis ``pipe``:
the stack is cut into ``p·v`` contiguous virtual stages, virtual stage ``s`` on pipe rank
``s % p`` (``v`` interleaved chunks per rank, Megatron's looped placement). What comes before the
stack lives with the first stage, what comes after with the last.

**The protocol a model follows** (the reference GPT does):

* the stack: an ``nn.ModuleList`` attribute named by the ``("layers",)`` entry of its table;
* ``model.pipeline_pre(*batch) -> x``: what comes before the stack (embeddings), from the batch
  that ``engine.step`` is given (e.g. ``(idx, targets)``) to the residual stream;
* each block: ``x = block(x)``, one tensor in, one tensor of the same shape out;
* ``model.pipeline_post(x, *batch) -> loss``: what comes after (final norm, head, loss), the mean
  loss of the micro-batch's rows, a scalar.

The model's own ``forward`` must compute the same thing (``pipeline_post(blocks(pipeline_pre(b)), b)``)
so that one process and every pipeline train alike. Modules registered before the stack
attribute run in ``pipeline_pre`` (first stage); those registered after it in ``pipeline_post``
(last stage) — at every level of a nested stack's name. A parameter used on both sides (tied
embeddings) is held by the first and the last stage (``PipelinePlan.tied``, Megatron's embedding group):
one tensor, its two gradients summed over the pipe axis once a step (the stages between add zeros), the same
update on both (ZeRO 0-2; under ZeRO-3 refused at plan time, naming the fix).

**A transformers causal LM needs no code** (``planner/hf_stages.py``; ``planner/stack.py`` picks
what runs around the blocks and finds the stack): a model without these
methods whose ``forward`` takes ``input_ids``, ``inputs_embeds`` and ``labels`` (Llama, Qwen2,
Mistral, GPT-2, GPT-NeoX, ...) is fed the dicts ``model(**batch)`` takes; what runs before and
after the stack, the blocks' keyword arguments (rotary tables, masks, positions: each stage
computes its own from the micro-batch, so only the hidden state crosses stages) and the loss
are the model's own ``forward``'s, checked at plan time. The modules that run before the stack
(by execution) are the first stage's, the others the last stage's. Its stack is named by a
table entry (``sl.shard({"model.layers": ("layers",)})(model)``) or, where none is declared,
found: the model's one ``nn.ModuleList`` of identical blocks (one class, the same parameter
shapes).

**The split.** By default the stack is cut so that the largest stage (counting the parameters of
``pipeline_pre`` on the first stage and of ``pipeline_post`` on the last) is as small as it can
be — balanced by parameter count (``explain()`` says so). ``stages=[3, 3, 2]`` gives the blocks of
each virtual stage; ``stages="E|t t t|t t|t L"`` is a layout in the spirit of Megatron's
``--pipeline-model-parallel-layout`` (``E`` the embeddings, ``t`` a block, ``L`` the head and
loss, ``|`` between stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass, replace
from functools import cached_property

import math

import torch
from torch import nn

from ..errors import ShardingError
from ..validate import is_int
from .functional import functional_call
from .hf_stages import CausalLMStages, meta_or_zeros
from .stage_checks import combination_problems, tied_across_stages
from .schedules import Action, lower, schedule_actions, schedule_problems, split_last_backwards
from .specs import AxisRules, find_stack
from .stack import POST, PRE, auto_stack, stack_entry_problems, stack_modules, stage_functions

# Receives posted ahead of the action that waits for them, per stage a rank holds. gloo (and NCCL)
# move a message only once both sides have posted it, so a receive posted just before its wait leaves
# the sender's data sitting until then; posted ahead, it arrives while the rank computes. A bounded
# window keeps the buffers (one message each) few. Measured on the 2-core reference machine (GPT
# 1.7M, m = 8, step medians, window 0 -> 4 per stage): GPipe p=2 156 -> 137 ms, 1F1B p=4 166 -> 154,
# interleaved p=2 (v=2, window 8) 168 -> 144; a window of every receive of the step gained <= 3% more.
RECV_WINDOW = 4


@dataclass(frozen=True)
class StagePlan:
    """One virtual stage: its blocks (qualified module names) and whether it runs the model's
    ``pipeline_pre`` / ``pipeline_post``."""

    index: int
    rank: int                    # pipe coordinate that runs it
    blocks: tuple[str, ...]
    pre: bool
    post: bool
    numel: int                   # parameter elements (its blocks, plus pre/post)


@dataclass(frozen=True)
class PipelinePlan:
    axis: str
    size: int                    # p
    virtual: int                 # v: stages per rank
    microbatches: int            # m
    schedule: str
    stack: str                   # qualified name of the layer stack
    stages: tuple[StagePlan, ...]
    split: str                   # how the stack was cut (said in explain())
    pre_params: tuple[str, ...]
    post_params: tuple[str, ...]
    trainable: int = 0           # trainable parameters of the whole model (the step's scalar flags)
    # the stream sent between stages, per micro-batch, on each rank (with SP: its sequence chunk)
    # and its dtype; known when the plan is given an example ``batch=``
    stream: tuple[int, ...] | None = None
    stream_dtype: str | None = None
    # bytes autograd saves for backward per micro-batch, for each block in stack order (measured on
    # the meta device when the plan is given ``batch=``; planner/pipeline_report.py)
    block_saved: tuple[int, ...] | None = None
    # ZeRO-3's gather policy (GATHER_POLICIES); the plan's ``pipe_unshard`` says whether it applies
    gather: str = "step"
    # what runs before, between and after the blocks (``stage_functions``), and how the stack was found
    source: str = ""
    # a transformers block returning a tuple around the hidden state (GPT-J, BLOOM, MPT): its length; 0: a tensor
    block_tuple: int = 0
    # parameters held by both the first and the last stage (tied embeddings): their gradients are summed
    # over the pipe axis once a step
    tied: tuple[str, ...] = ()
    # routers whose load-balancing loss is in the training loss (``models/moe.py``'s ``aux_weight``): their gradient
    # is attached in each stage's backward, and each micro-batch's forward message carries the stages' aux terms
    # so far (``loss_words``) for the last stage's loss value
    aux_riding: bool = False
    # a transformers model's router load-balancing loss (``config.output_router_logits``) over ``router_experts``
    # experts: its statistics ride each forward message (``2E + 1`` fp32: counts, rows, probability sums) to
    # the last stage, which sums them over the batch's ranks; their cotangent rides back (``E``)
    # (``runtime/pipe_router.py``); 0: none
    router_experts: int = 0

    def stages_of_param(self, param: str) -> tuple[int, ...]:
        """Every virtual stage holding ``param``: one, or the first and the last for a tied one."""
        return (0, len(self.stages) - 1) if param in self.tied else (self.stage_of(param),)

    @property
    def stream_bytes(self) -> int | None:
        if self.stream is None:
            return None
        return math.prod(self.stream) * getattr(torch, self.stream_dtype).itemsize

    @property
    def stream_message_bytes(self) -> int | None:
        """A forward message: the stream, and with ``aux_riding`` the micro-batch's aux terms so far (fp32),
        with ``router_experts`` its router statistics so far."""
        if self.stream is None:
            return None
        dtype = getattr(torch, self.stream_dtype)
        return self.stream_bytes + loss_words(dtype) * dtype.itemsize * self.forward_floats

    @property
    def grad_message_bytes(self) -> int | None:
        """A backward message: the stream's gradient and the micro-batch's fp32 loss behind it
        (``loss_words``), so every stage learns the losses without a collective — with ``router_experts``
        the router probability sums' cotangent too."""
        if self.stream is None:
            return None
        dtype = getattr(torch, self.stream_dtype)
        return self.stream_bytes + loss_words(dtype) * dtype.itemsize * self.backward_floats

    @property
    def forward_floats(self) -> int:
        """fp32 values behind each forward message: the aux terms so far (``aux_riding``), the router
        statistics so far (``router_experts``: counts, rows, probability sums)."""
        return (1 if self.aux_riding else 0) + (2 * self.router_experts + 1 if self.router_experts else 0)

    @property
    def backward_floats(self) -> int:
        """fp32 values behind each backward message: the micro-batch's loss, and the router probability
        sums' cotangent (``router_experts``)."""
        return 1 + self.router_experts

    @property
    def recv_window(self) -> int:
        """Receives a rank keeps posted ahead of the actions that wait for them (``RECV_WINDOW``
        per stage it holds): each holds a buffer of one message."""
        return RECV_WINDOW * self.virtual

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stages_of(self, coord: int) -> list[StagePlan]:
        return [s for s in self.stages if s.rank == coord]

    @cached_property
    def _stage_of_param(self) -> dict[str, int]:
        out = {n: 0 for n in self.pre_params}
        out.update((n, len(self.stages) - 1) for n in self.post_params)
        return out

    def stage_of_block(self, block: str) -> int | None:
        """The virtual stage holding ``block`` (a qualified module name), or None for another module."""
        return self._stage_of_block.get(block)

    @cached_property
    def _stage_of_block(self) -> dict[str, int]:
        return {b: s.index for s in self.stages for b in s.blocks}

    def stage_of(self, param: str) -> int:
        """The virtual stage that holds ``param`` (qualified name)."""
        hit = self._stage_of_param.get(param)
        if hit is not None:
            return hit
        rest = param[len(self.stack) + 1:]
        block = f"{self.stack}.{rest.split('.', 1)[0]}"
        return self._stage_of_block[block]

    def actions(self, coord: int) -> list[Action]:
        """The compute actions of pipe rank ``coord``, in order."""
        return self._actions[coord]

    @cached_property
    def _actions(self) -> dict[int, list[Action]]:
        return schedule_actions(self.schedule, self.size, self.microbatches, self.virtual)

    def lowered(self, coord: int, *, unshard: bool = False, split_tail: bool = False) -> list[Action]:
        """Rank ``coord``'s actions with the point-to-point sends and receives (and, with
        ``unshard``, ZeRO-3's per-stage gather and free) added. ``split_tail``: under ``1f1b``, the
        last stage's last backward split into ``I`` and ``W`` (``split_last_backwards``: the first
        stage's last backward, the end of the step, starts a ``W`` earlier; the simulator finds no
        gain in splitting other stages' or other schedules' last backwards)."""
        key = (bool(unshard), bool(split_tail) and self.schedule == "1f1b")
        if key not in self._lowered:
            acts = split_last_backwards(self._actions, [self.num_stages - 1]) if key[1] else self._actions
            self._lowered[key] = lower(acts, self.size, self.virtual, unshard=unshard)
        return self._lowered[key][coord]

    @cached_property
    def _lowered(self) -> dict[bool, dict[int, list[Action]]]:
        return {}


# ZeRO-3 under a pipeline: when a stage's parameters are gathered (``sl.plan(..., pipe_gather=)``)
GATHER_POLICIES = {
    "step": "a stage gathered once per step, kept through all its micro-batches, its gradients accumulated "
            "whole and reduce-scattered once after its last backward (torch's UNSHARD/RESHARD lowering)",
    "microbatch": "each unit gathered for every micro-batch's forward and again for its backward, freed after "
                  "each, its gradients reduce-scattered after each backward (ZeRO-3 as without a pipeline); the "
                  "root (embeddings, head) gathered once per step",
}


def loss_words(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that carry an fp32 loss bit for bit behind a backward message: its 4
    bytes reinterpreted (2 for bf16/fp16), or one element where ``dtype`` holds fp32 exactly."""
    return max(1, 4 // dtype.itemsize)


def values_to_words(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values (a loss, router statistics) as ``loss_words(dtype)`` elements of ``dtype`` each, bit for bit,
    to ride behind a message of ``dtype``."""
    x = values.detach().float().reshape(-1)
    return x.view(dtype) if dtype.itemsize <= 4 else x.to(dtype)


def values_from_words(words: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``values_to_words`` wrote, a vector."""
    return words.float() if words.dtype.itemsize > 4 else words.clone().view(torch.float32)   # clone: aligned


# ---------------------------------------------------------------------------------------------

def balance(block_sizes: Sequence[int], stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Blocks per stage, contiguous, minimizing the largest stage's parameter count (the first
    stage also holds ``first`` elements, the last ``last``); every stage gets at least one block.
    Among the splits with that maximum, the one that fills earlier stages first is taken, so the
    result is deterministic. O(stages · blocks²)."""
    n = len(block_sizes)
    prefix = [0]
    for c in block_sizes:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest possible maximum when the first i blocks form stages 0..s-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                load = prefix[i] - prefix[j] + (first if s == 1 else 0) + (last if s == stages else 0)
                cand = max(best[s - 1][j], load)
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def parse_layout(layout: str) -> tuple[list[int], list[str]]:
    """``"E|t t|t t|t L"`` -> (blocks per stage, problems). ``E`` must open the first stage, ``L``
    close the last; ``t`` is one block; spaces are ignored."""
    problems: list[str] = []
    parts = layout.split("|")
    counts = []
    for i, part in enumerate(parts):
        toks = part.replace(" ", "")
        bad = sorted(set(toks) - set("EtL"))
        if bad:
            problems.append(f"plan: stages layout {layout!r} has {bad} in stage {i} — expected only 'E' (what "
                            "comes before the stack), 't' (one block), 'L' (what comes after) and '|' between "
                            "stages, e.g. 'E|t t|t t|t L'.")
        if "E" in toks and (i != 0 or not toks.startswith("E") or toks.count("E") > 1):
            problems.append(f"plan: stages layout {layout!r} puts 'E' in stage {i} — expected it once, first in "
                            "stage 0: what comes before the stack runs on the first stage.")
        if "L" in toks and (i != len(parts) - 1 or not toks.endswith("L") or toks.count("L") > 1):
            problems.append(f"plan: stages layout {layout!r} puts 'L' in stage {i} — expected it once, last in "
                            f"stage {len(parts) - 1}: what comes after the stack runs on the last stage.")
        counts.append(toks.count("t"))
    return counts, problems


# ---------------------------------------------------------------------------------------------

def derive(model: nn.Module, mesh, *, rules, axis: str, microbatches: int | None, schedule: str | None,
           virtual: int | None, stages, recompute: Sequence[str] = (), gather: str = "step", zero3: bool = False,
           reshard: bool = True, batch=None) -> tuple[PipelinePlan | None, list[str]]:
    """The pipeline of ``model`` on ``mesh``'s ``axis`` (None when the axis is 1 or absent), and
    every problem found. ``gather``: ZeRO-3's policy (``GATHER_POLICIES``), checked against the
    schedule when ``zero3``; ``reshard``: the plan's ``reshard_after_forward``; ``batch``: the
    plan's example batch (a transformers model's stages are checked on it)."""
    p = mesh.axis_sizes.get(axis, 1)
    stack, axes, problems = find_stack(model, rules)
    if not (isinstance(gather, str) and gather in GATHER_POLICIES):
        problems.append(f"plan: pipe_gather={gather!r} is unknown — expected one of {tuple(GATHER_POLICIES)}: "
                        + "; ".join(f"{k!r}: {v}" for k, v in GATHER_POLICIES.items()) + ".")
    if p <= 1:
        return None, problems
    problems += stack_entry_problems(model, rules, axis)
    how_found = ""
    if stack is None and not problems:
        stack, candidates = auto_stack(model)
        rule = AxisRules.coerce(rules).get("layers")
        axes = () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
        how_found = " (found: the model's one nn.ModuleList of identical blocks)"
        if len(candidates) > 1:
            problems.append(f"plan: the model {type(model).__name__} declares no layer stack and has several lists of "
                            f"identical blocks {candidates} — expected one to cut into stages. Declare it: "
                            f"sl.shard({{{candidates[0]!r}: ('layers',)}})(model).")
            return None, problems
    if stack is None:
        problems.append(
            f"plan: the mesh splits {axis!r} over {p} ranks, but the model {type(model).__name__} declares no layer "
            "stack and has no nn.ModuleList of identical blocks — expected an nn.ModuleList named with the logical "
            f"dim 'layers' in its sl.shard table, and (unless it is a transformers causal LM) the methods "
            f"{PRE}(*batch) -> x and {POST}(x, *batch) -> loss. Declare it, e.g. "
            "@sl.shard({'blocks': ('layers',)}) on the model's class (see shardlib/planner/pipeline.py), or "
            f"plan with {axis}=1.")
        return None, problems
    if axes != (axis,):
        problems.append(f"plan: the layer stack {stack!r}{how_found} is split over {axes or 'nothing'} — expected "
                        f"exactly ({axis!r},) on a mesh with {axis}={p}. Add the rule {{'layers': {axis!r}}} "
                        f"(rules={{'layers': {axis!r}, ...}}).")
    fns = stage_functions(model, stack)
    for attr in (PRE, POST) if fns is None else ():
        if not callable(getattr(model, attr, None)):
            problems.append(f"plan: the model {type(model).__name__} has no method {attr} and is not a transformers "
                            f"causal LM (a forward taking input_ids, inputs_embeds and labels) — expected "
                            f"{PRE}(*batch) -> x (what runs before the stack) and {POST}(x, *batch) -> loss "
                            "(what runs after it) for a pipeline. Add them (shardlib/planner/pipeline.py "
                            "documents the protocol; shardlib.models.GPT is an example).")
    v = virtual if virtual is not None else (2 if schedule == "interleaved_1f1b" else 1)
    name = schedule if schedule is not None else ("interleaved_1f1b" if v > 1 else "1f1b")
    m = microbatches if microbatches is not None else p
    problems += schedule_problems(name, p, m, v)
    if problems:
        return None, problems

    blocks, pre_mods, post_mods = stack_modules(model, stack)
    if isinstance(fns, CausalLMStages):          # what runs before the stack, by execution
        pre_mods, post_mods, found = fns.check(batch)
        problems += found
    modules = dict(model.named_modules())
    n_stages = p * v

    def params_of(names: Sequence[str], recurse: bool) -> list[tuple[str, object]]:
        out = []
        for mname in names:
            out += [(f"{mname}.{n}" if mname else n, t) for n, t in modules[mname].named_parameters(recurse=recurse)]
        return out

    block_params = [params_of([b], True) for b in blocks]
    pre_params, post_params = params_of(pre_mods, False), params_of(post_mods, False)
    parts = stack.split(".")
    for depth in range(len(parts)):
        holder = ".".join(parts[:depth])
        own = modules[holder]._parameters
        if own:
            problems.append(f"plan: the module {holder or type(model).__name__!r} above the layer stack holds "
                            f"parameters of its own ({sorted(own)}) — expected every parameter in a submodule, so "
                            f"the pipeline knows its stage. Move them into a module registered before the stack "
                            f"(run before it) or after it (run after it).")
    if len(blocks) < n_stages:
        problems.append(f"plan: the layer stack {stack!r} has {len(blocks)} blocks, fewer than the {n_stages} stages "
                        f"({axis}={p} x {v} virtual) — expected at least one block per stage. Use {axis} <= "
                        f"{len(blocks) // v if v else len(blocks)} or fewer virtual stages, or a deeper model.")
        return None, problems

    def numel(ps) -> int:
        seen, total = set(), 0
        for _, t in ps:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel()
        return total

    sizes = [numel(ps) for ps in block_params]
    if stages is None:
        counts = balance(sizes, n_stages, numel(pre_params), numel(post_params))
        how = "balanced by parameter count (the default)"
    else:
        counts, how = _explicit(stages, n_stages, len(blocks), axis, p, v, problems)
        if counts is None:
            return None, problems
    # what each stage holds, and tied parameters across stages
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    tied, found = tied_across_stages(ranges, block_params, pre_params, post_params,
                                     {id(t): n for n, t in model.named_parameters()}, zero3=zero3)
    problems += found + combination_problems(name, zero3=zero3, gather=gather, reshard=reshard, recompute=recompute,
                                             stage_modules=set(blocks) | set(pre_mods) | set(post_mods))
    if problems:
        return None, problems
    stage_plans = tuple(
        StagePlan(s, s % p, tuple(blocks[i] for i in r), s == 0, s == n_stages - 1,
                  sum(sizes[i] for i in r) + (numel(pre_params) if s == 0 else 0)
                  + (numel(post_params) if s == n_stages - 1 else 0))
        for s, r in enumerate(ranges))
    source = (f"{type(model).__name__}'s own forward (transformers adapter, planner/hf_stages.py)"
              if isinstance(fns, CausalLMStages) else f"the model's {PRE} / {POST}")
    return PipelinePlan(axis, p, v, m, name, stack, stage_plans, how,
                        tuple(n for n, _ in pre_params), tuple(n for n, _ in post_params), gather=gather,
                        source=source + how_found,
                        block_tuple=fns.tuple_out or 0 if isinstance(fns, CausalLMStages) else 0,
                        tied=tuple(tied)), problems


def _explicit(stages, n_stages: int, n_blocks: int, axis: str, p: int, v: int, problems: list[str]
              ) -> tuple[list[int] | None, str]:
    if isinstance(stages, str):
        counts, found = parse_layout(stages)
        problems += found
        how = f"layout {stages!r}"
    elif isinstance(stages, Sequence) and all(is_int(c) for c in stages):
        counts, how = list(stages), f"explicit {list(stages)}"
    else:
        problems.append(f"plan: stages must be a list of blocks per stage or a layout string — got "
                        f"{type(stages).__name__} {stages!r}; expected e.g. [3, 3, 2] or 'E|t t t|t t|t L'.")
        return None, ""
    if len(counts) != n_stages:
        problems.append(f"plan: stages {stages!r} gives {len(counts)} stages — expected {n_stages} ({axis}={p} x "
                        f"{v} virtual stages per rank). Give one entry per stage.")
    if sum(counts) != n_blocks:
        problems.append(f"plan: stages {stages!r} adds up to {sum(counts)} blocks — expected the stack's "
                        f"{n_blocks}. Make the counts add up to {n_blocks}.")
    if any(c < 0 for c in counts) or any(c == 0 for c in counts[1:-1]):
        problems.append(f"plan: stages {stages!r} leaves a stage with no blocks (or a negative count) — expected "
                        "at least one block on every stage (the first and the last may have none: they run "
                        "what comes before and after the stack).")
    if problems:
        return None, how
    return counts, how


def stream_shape(model: nn.Module, stack: str, batch, rows: int, dtype) -> tuple[int, ...]:
    """The shape of the stream between stages for a micro-batch of ``rows`` rows of ``batch``:
    ``pipeline_pre`` and the first block on the meta device (nothing is computed); every parameter
    as a meta tensor of ``dtype`` (the compute dtype), whatever the model holds now. A transformers
    model's first block is called with the keyword arguments its forward gives it
    (``CausalLMStages.probe``: computed on the CPU from zeros, then on the meta device)."""
    first = model.get_submodule(stack)[0]
    fns = stage_functions(model, stack)
    if isinstance(fns, CausalLMStages):
        shape, ctx = fns.probe(batch, rows, dtype)
        # block 0 (under SP the stack's first block slices the sequence, wherever it runs), with the
        # shapes of a block this rank holds: another stage's parameters are on the meta device at
        # their full shapes, while the tensor axis's local attributes (GPT-2's split_size) are set
        held = next((b for b in model.get_submodule(stack) if not any(t.is_meta for t in b.parameters())), first)
        local = dict([*held.named_parameters(), *held.named_buffers()])
        values = {n: torch.empty(local.get(n, t).shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                 device="meta")
                  for n, t in [*first.named_parameters(), *first.named_buffers()]}
        x = torch.empty(shape, dtype=dtype, device="meta")

        def run(values, x, kwargs):
            with torch.no_grad():
                return CausalLMStages.hidden_out(functional_call(first, values, (x,), kwargs, strict=False))
        return tuple(meta_or_zeros(run, values, x, ctx[0]).shape)

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *b):
            return first(self.model.pipeline_pre(*b))

    b = batch if isinstance(batch, (tuple, list)) else (batch,)
    meta = tuple(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor)
                 else t for t in b)
    params = {f"model.{n}": torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device="meta")
              for n, p in model.named_parameters(remove_duplicate=False)}
    # the buffers too: a forward that updates its own (a router's load) updates these, not the model's
    params.update({f"model.{n}": torch.empty(b.shape, dtype=b.dtype, device="meta")
                   for n, b in model.named_buffers(remove_duplicate=False)})

    def run(params, meta):      # a MoE block has no meta kernel for its routing (nonzero): then on zeros
        with torch.no_grad():
            return functional_call(Probe(), params, meta, strict=False, tie_weights=True)
    return tuple(meta_or_zeros(run, params, meta).shape)


def with_stream(model: nn.Module, pplan: PipelinePlan, plan: Any, batch: Any) -> PipelinePlan:
    """The pipeline plan with the stream's per-micro-batch shape on each rank (``batch``: the
    example global batch), after checking that ``data x microbatches`` divides it."""
    from torch.utils._pytree import tree_leaves

    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    b = leaves[0].shape[0] if leaves and leaves[0].dim() else None
    need = plan.dp_size * pplan.microbatches
    if b is None or b % need:
        raise ShardingError(f"plan: the batch of {b} rows does not split into data={plan.dp_size} x "
                            f"microbatches={pplan.microbatches} = {need} micro-batches — expected a multiple of {need}. "
                            f"Use a batch of {max(need, (b or 0) // need * need)} or {((b or 0) // need + 1) * need}, "
                            "or change microbatches.")
    shape = list(stream_shape(model, pplan.stack, batch, b // need, plan.compute_dtype))
    tp = plan.tensor
    if tp is not None and tp.sequence_parallel and tp.size > 1:
        shape[tp.seq_dim] //= tp.size           # the stream is sequence-split between the stack's blocks
    return replace(pplan, stream=tuple(shape), stream_dtype=str(plan.compute_dtype).replace("torch.", ""))
