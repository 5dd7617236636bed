"""The pipe axis in the planner (pure: no processes): stages from ``layers -> pipe``, the
stage-local plan, plan-time errors for bad input, and ``explain()``'s pipeline section.

Expected numbers are worked out here by hand: the best split by brute force over every contiguous
split, parameter counts from the model's own tensors, idle fractions from the closed forms, bytes
from the shapes (fp32: 4 bytes an element), what autograd saves from the ops' backward formulas.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardlib as sl
from shardlib import P
from shardlib.comm.core import format_bytes
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.pipeline_report import block_saved_bytes, saved_bytes

PIPE = {"layers": "pipe"}
TP = {"layers": "pipe", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
PRE, POST = ("wte.", "wpe."), ("ln_f.", "head.")


def mesh(**sizes: int) -> sl.AbstractMesh:
    return sl.AbstractMesh({"data": 1, **sizes})


def gpt(n_layers: int) -> GPT:
    return GPT(GPTConfig(n_layers=n_layers, vocab_size=64, d_model=32, n_heads=2, seq_len=8))


class MLP(nn.Module):
    """One block: ``relu(x W1ᵀ + b1) W2ᵀ + b2``. Backward needs x (for W1's gradient) and the relu
    output (relu's own backward, and W2's gradient): rows·(d + h) elements saved."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


@sl.shard({"blocks": ("layers",)})
class Stack(nn.Module):
    """A stack of MLP blocks of different widths, a wide input projection before it, a head after."""

    def __init__(self, widths, d: int = 8, d_in: int = 40, block: type[nn.Module] = MLP):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(block(d, h) for h in widths)
        self.out = nn.Linear(d, 1)

    def pipeline_pre(self, x, y):
        return self.inp(x)

    def pipeline_post(self, h, x, y):
        return F.mse_loss(self.out(h).squeeze(-1), y)

    def forward(self, x, y):
        h = self.pipeline_pre(x, y)
        for b in self.blocks:
            h = b(h)
        return self.pipeline_post(h, x, y)


@sl.shard({"fc.weight": ("mlp", None), "fc.bias": ("mlp",), "proj.weight": (None, "mlp")})
class SplitMLP(MLP):
    """The MLP split over ``tensor`` (rule ``mlp -> tensor``): fc by columns, proj by rows."""


WIDTHS = [3, 17, 5, 9, 30, 2, 11, 7, 4]


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def the_problem(err: sl.ShardingError, *words: str) -> str:
    """The one problem of ``err`` that contains every one of ``words``."""
    hits = [m for m in err.problems if all(w in m for w in words)]
    assert len(hits) == 1, f"{words} in {len(hits)} of the problems:\n{err}"
    return hits[0]


def plan_error(*args, **kwargs) -> sl.ShardingError:
    with pytest.raises(sl.ShardingError) as info:
        sl.plan(*args, **kwargs)
    return info.value


# ---- stages ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4])
def test_default_split_minimizes_the_largest_stage(p):
    model = Stack(WIDTHS)
    sizes = [numel(b) for b in model.blocks]
    pre, post = numel(model.inp), numel(model.out)
    n = len(sizes)

    def loads(counts):
        bounds = list(itertools.accumulate(counts, initial=0))
        out = [sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)]
        out[0] += pre
        out[-1] += post
        return out
    # brute force: every way to cut n blocks into p non-empty contiguous stages
    best = min(max(loads([b - a for a, b in itertools.pairwise((0, *cuts, n))]))
               for cuts in itertools.combinations(range(1, n), p - 1))
    plan = sl.plan(model, mesh(pipe=p), rules=PIPE)
    pp = plan.pipeline
    counts = [len(s.blocks) for s in pp.stages]
    assert len(counts) == p and all(c >= 1 for c in counts) and sum(counts) == n
    blocks = [f"blocks.{i}" for i in range(n)]
    assert [b for s in pp.stages for b in s.blocks] == blocks          # contiguous, in order
    assert max(loads(counts)) == best
    assert [s.numel for s in pp.stages] == loads(counts)
    assert pp.split == "balanced by parameter count (the default)"
    assert "split balanced by parameter count (the default)" in plan.explain()


def test_explicit_counts_give_those_stages():
    plan = sl.plan(gpt(8), mesh(pipe=4), rules=PIPE, stages=[1, 2, 2, 3])
    pp = plan.pipeline
    assert [s.blocks for s in pp.stages] == [("blocks.0",), ("blocks.1", "blocks.2"), ("blocks.3", "blocks.4"),
                                             ("blocks.5", "blocks.6", "blocks.7")]
    assert [(s.rank, s.pre, s.post) for s in pp.stages] == [(0, True, False), (1, False, False), (2, False, False),
                                                            (3, False, True)]
    assert pp.split == "explicit [1, 2, 2, 3]"


def test_layout_string_gives_those_stages():
    model = gpt(5)
    plan = sl.plan(model, mesh(pipe=4), rules=PIPE, stages="E|t t|t t|t L")
    pp = plan.pipeline
    assert [s.blocks for s in pp.stages] == [(), ("blocks.0", "blocks.1"), ("blocks.2", "blocks.3"), ("blocks.4",)]
    assert pp.stages[0].pre and pp.stages[3].post
    # stage 0 holds the embeddings only, stage 3 its block and the final norm and head
    assert pp.stages[0].numel == numel(model.wte) + numel(model.wpe)
    assert pp.stages[3].numel == numel(model.blocks[4]) + numel(model.ln_f) + numel(model.head)
    assert "layout 'E|t t|t t|t L'" in pp.split
    assert "stage 0 -> pipe rank 0: pre + no blocks" in plan.explain()


def test_interleaved_places_stage_s_on_rank_s_mod_p():
    model = gpt(8)
    plan = sl.plan(model, mesh(pipe=4), rules=PIPE, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4)
    pp = plan.pipeline
    assert (pp.size, pp.virtual, pp.num_stages) == (4, 2, 8)
    assert [(s.index, s.rank, s.blocks) for s in pp.stages] == [(s, s % 4, (f"blocks.{s}",)) for s in range(8)]
    for r in range(4):
        held = {p.name for p in plan.local(r).params}
        want = {f"blocks.{s}.{n}" for s in (r, r + 4) for n, _ in model.blocks[s].named_parameters()}
        want |= {n for n, _ in model.named_parameters() if (r == 0 and n.startswith(PRE)) or
                 (r == 3 and n.startswith(POST))}
        assert held == want


@pytest.mark.parametrize("sizes", [{"pipe": 4}, {"data": 2, "pipe": 2, "tensor": 2}])
def test_local_plan_holds_exactly_its_stages(sizes):
    model = gpt(4)
    m = sl.AbstractMesh({"data": 1, **sizes})
    plan = sl.plan(model, m, rules=TP if "tensor" in sizes else PIPE)
    pp = plan.pipeline
    p = sizes["pipe"]
    per = 4 // p
    names = dict(model.named_parameters())
    for rank in range(m.size):
        coord = m.coord(rank, "pipe")
        local = plan.local(rank)
        want = {n for n in names if any(n.startswith(f"blocks.{i}.") for i in range(coord * per, (coord + 1) * per))}
        want |= {n for n in names if (coord == 0 and n.startswith(PRE)) or (coord == p - 1 and n.startswith(POST))}
        assert {q.name for q in local.params} == want
        assert local.pipe_coord == coord and [s.index for s in pp.stages_of(coord)] == [coord]
        for q in local.params:      # full shapes unless split over tensor: a column Linear holds half its rows
            full = tuple(names[q.name].shape)
            if "tensor" in sizes and q.name.endswith("attn.qkv.weight"):
                assert q.shape == (full[0] // 2, full[1])
            elif "tensor" not in sizes:
                assert q.shape == full


def test_memory_per_rank_is_its_stages_states():
    model = gpt(4)
    whole = sl.plan(model, mesh(pipe=1), rules=PIPE)
    piped = sl.plan(model, mesh(pipe=4), rules=PIPE)
    total = numel(model)
    # fp32 data parallel with AdamW: 4 bytes of parameter, 4 of gradient, 8 of optimizer state each
    assert whole.memory_per_rank()["total"] == 16 * total
    for r in range(4):
        mine = numel(model.blocks[r]) + (numel(model.wte) + numel(model.wpe) if r == 0 else 0) \
            + (numel(model.ln_f) + numel(model.head) if r == 3 else 0)
        assert piped.memory_per_rank(r)["total"] == 16 * mine < whole.memory_per_rank()["total"]


# ---- bad input ------------------------------------------------------------------------------------

class _Body(nn.Module):
    def __init__(self, n: int, d: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(d, 12) for _ in range(n))
        self.norm = nn.LayerNorm(d)


class Nested(nn.Module):
    """The protocol with the stack one level down (``body.blocks``), declared nowhere."""

    def __init__(self, n: int = 4, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.body = _Body(n, d)
        self.out = nn.Linear(d, 1)

    def pipeline_pre(self, x, y):
        return self.inp(x)

    def pipeline_post(self, h, x, y):
        return F.mse_loss(self.out(self.body.norm(h)).squeeze(-1), y)


def test_a_nested_stack_is_found_and_split_at_every_level():
    """No table: the one list of identical blocks is the stack; modules registered before it at
    each level of its name run first, those after it last."""
    model = Nested()
    pp = sl.plan(model, mesh(pipe=2), rules=PIPE, batch=(torch.zeros(4, 3), torch.zeros(4))).pipeline
    assert pp.stack == "body.blocks" and "found" in pp.source and "pipeline_pre" in pp.source
    assert pp.pre_params == ("inp.weight", "inp.bias")
    assert pp.post_params == ("body.norm.weight", "body.norm.bias", "out.weight", "out.bias")
    assert [s.blocks for s in pp.stages] == [("body.blocks.0", "body.blocks.1"), ("body.blocks.2", "body.blocks.3")]
    assert pp.stream == (2, 8)
    sl.shard({"body.blocks": ("layers",)})(model)           # declared: the same stack
    assert sl.plan(model, mesh(pipe=2), rules=PIPE).pipeline.stack == "body.blocks"


def test_a_stack_entry_that_is_not_a_module_list_is_refused():
    model = Nested()
    sl.shard({"body.norm": ("layers",)})(model)
    the_problem(plan_error(model, mesh(pipe=2), rules=PIPE), "'body.norm'", "a LayerNorm", "nn.ModuleList of blocks",
                "['body.blocks']")


def test_fewer_blocks_than_stages_is_refused_naming_the_largest_pipe():
    err = plan_error(gpt(3), mesh(pipe=4), rules=PIPE)
    the_problem(err, "3 blocks", "4 stages", "pipe <= 3")
    err = plan_error(gpt(6), mesh(pipe=4), rules=PIPE, schedule="interleaved_1f1b", virtual_stages=2,
                     microbatches=4)
    the_problem(err, "6 blocks", "8 stages", "pipe=4 x 2 virtual", "pipe <= 3")


def test_an_explicit_split_that_does_not_add_up_is_refused():
    the_problem(plan_error(gpt(4), mesh(pipe=4), rules=PIPE, stages=[1, 1, 1, 2]),
                "adds up to 5 blocks", "the stack's 4", "add up to 4")
    the_problem(plan_error(gpt(4), mesh(pipe=4), rules=PIPE, stages="E|t t|t t|t L"),
                "adds up to 5 blocks", "the stack's 4")
    the_problem(plan_error(gpt(4), mesh(pipe=4), rules=PIPE, stages=[2, 1, 1]),
                "gives 3 stages", "expected 4", "one entry per stage")
    the_problem(plan_error(gpt(4), mesh(pipe=2), rules=PIPE, stages="E t|t|t t L"),
                "gives 3 stages", "expected 2")


def test_interleaved_needs_as_many_microbatches_as_ranks():
    err = plan_error(gpt(8), mesh(pipe=4), rules=PIPE, schedule="interleaved_1f1b", microbatches=2)
    the_problem(err, "m=2", "p=4", "microbatches >= 4")


def test_a_batch_data_times_microbatches_cannot_divide_is_refused():
    model = gpt(4)
    err = plan_error(model, sl.AbstractMesh({"data": 2, "pipe": 2}), rules=PIPE, microbatches=4,
                     batch=token_batch(model.cfg, 12, 0))
    the_problem(err, "12 rows", "data=2 x microbatches=4 = 8", "multiple of 8", "8 or 16")


def test_pipe_over_a_model_without_a_declared_stack_is_refused():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    err = plan_error(mlp, mesh(pipe=4), rules=PIPE)
    the_problem(err, "'pipe' over 4 ranks", "declares no layer stack", "('layers',)", "pipeline_pre",
                "pipe=1")


def test_pipe_on_a_dim_that_is_not_the_stack_is_refused():
    err = plan_error(gpt(4), mesh(pipe=2), rules={"layers": "pipe", "embed": "pipe"})
    msg = the_problem(err, "'wte.weight'", "(64, 32)")
    assert "'embed' -> 'pipe'" in msg and "drop 'pipe' from this spec or rule" in msg
    with pytest.raises(sl.ShardingError) as info:       # a spec naming 'pipe': refused by sl.shard itself
        sl.shard({"fc.weight": P("pipe", None)})
    the_problem(info.value, "P('pipe', None)", "shards only the layer stack", "drop 'pipe'")


def test_zb_h1_with_recompute_is_refused_suggesting_1f1b():
    err = plan_error(gpt(4), mesh(pipe=2), rules=PIPE, schedule="zb_h1", recompute=["blocks.1"])
    the_problem(err, "'zb_h1'", "['blocks.1']", "weight gradients cannot be split", "schedule='1f1b'")


def test_embeddings_tied_across_first_and_last_stage_are_held_by_both():
    """A weight tied across the first and last stage is one tensor held by both (issue 38), its gradient summed
    over pipe; under ZeRO-3, or between other stages, refused naming the fix."""
    model = gpt(4)
    model.head.weight = model.wte.weight
    plan = sl.plan(model, mesh(pipe=2), rules=PIPE)
    assert plan.pipeline.tied == ("wte.weight",)
    assert plan.pipeline.stages_of_param("wte.weight") == (0, 1)
    assert {p.name for p in plan.local(0).params} & {p.name for p in plan.local(1).params} == {"wte.weight"}
    four = sl.plan(model, mesh(pipe=4), rules=PIPE, microbatches=4)
    assert four.pipeline.stages_of_param("wte.weight") == (0, 3)
    # the stages between hold none of it and add zeros of the first stage's piece to the sum
    assert "wte.weight" not in {p.name for p in four.local(1).params}
    assert four.local(1).tied_pieces == four.local(0).tied_pieces == (("wte.weight", 64 * 32),)
    the_problem(plan_error(model, sl.AbstractMesh({"data": 2, "pipe": 2}), rules=PIPE, zero=3), "under ZeRO-3",
                "zero=2")
    odd = gpt(4)
    odd.blocks[2].mlp.fc.weight = odd.blocks[1].mlp.fc.weight        # shared by stages 1 and 2 of 4
    err = plan_error(odd, mesh(pipe=4), rules=PIPE)
    the_problem(err, "tied", "expected a weight shared only by the first and the last stage")


def test_a_stack_without_the_pipe_rule_is_refused_naming_the_rule():
    err = plan_error(gpt(4), mesh(pipe=2))
    the_problem(err, "'blocks'", "pipe=2", "{'layers': 'pipe'}")


def test_missing_pipeline_pre_and_post_are_each_named():
    @sl.shard({"blocks": ("layers",)})
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()
    err = plan_error(Bare(), mesh(pipe=2), rules=PIPE)
    the_problem(err, "no method pipeline_pre", "Add them")
    the_problem(err, "no method pipeline_post", "Add them")


# ---- activation memory ------------------------------------------------------------------------------

def test_saved_bytes_counts_each_saved_buffer_once_and_no_parameter():
    block = MLP(8, 24)
    values = {n: torch.empty(p.shape, device="meta", requires_grad=True) for n, p in block.named_parameters()}
    x = torch.empty(5, 8, device="meta", requires_grad=True)
    got = saved_bytes(torch.func.functional_call, block, values, (x,), exclude=list(values.values()))
    assert got == 5 * (8 + 24) * 4             # x and the relu output (saved twice: once)
    # x * x saves x for both operands: one buffer; a view of it is the same buffer
    assert saved_bytes(lambda t: t * t, x) == 5 * 8 * 4
    assert saved_bytes(lambda t: t.view(8, 5) * t.view(40, 1).view(8, 5), x) == 5 * 8 * 4
    # the parameters are saved too (for x's gradient), and counted unless excluded
    assert saved_bytes(torch.func.functional_call, block, values, (x,)) == got + 4 * 8 * 24 + 4 * 24 * 8


def test_block_saves_input_and_hidden_or_only_input_under_recompute():
    model = Stack(WIDTHS)
    batch = (torch.zeros(12, 40), torch.zeros(12))
    plan = sl.plan(model, mesh(pipe=3), rules=PIPE, microbatches=3, batch=batch)
    rows = 12 // 3
    assert plan.pipeline.stream == (rows, 8)
    assert block_saved_bytes(model, plan) == tuple(rows * (8 + h) * 4 for h in WIDTHS)
    rec = sl.plan(model, mesh(pipe=3), rules=PIPE, microbatches=3, batch=batch, recompute=True)
    assert block_saved_bytes(model, rec) == (rows * 8 * 4,) * len(WIDTHS)    # a checkpoint keeps its input


def test_a_tensor_split_block_saves_its_ceil_chunk_of_the_hidden():
    # split over tensor=2 (ceil chunks): a rank saves x whole (fc's input is replicated) and its own
    # columns of the relu output, ceil(h/2) on tensor coordinate 0 and the rest on coordinate 1
    widths = [4, 6, 5, 8]
    model = Stack(widths, block=SplitMLP)
    m = sl.AbstractMesh({"data": 1, "pipe": 2, "tensor": 2})
    plan = sl.plan(model, m, rules={"layers": "pipe", "mlp": "tensor"}, microbatches=2,
                   batch=(torch.zeros(8, 40), torch.zeros(8)))
    assert [s.kind for s in plan.tensor.sites] == ["column", "row"] * len(widths)
    rows = 8 // 2
    assert block_saved_bytes(model, plan, rank=m.rank_at((0, 0, 0))) == tuple(rows * (8 + -(-h // 2)) * 4 for h in widths)
    assert block_saved_bytes(model, plan, rank=m.rank_at((0, 0, 1))) == tuple(rows * (8 + h // 2) * 4 for h in widths)


# ---- explain ------------------------------------------------------------------------------------------

def measured(model: nn.Module, plan: sl.Plan) -> sl.Plan:
    """The plan with its blocks' saved bytes (``PipelinePlan.block_saved``), as the planner measures
    them from ``batch=``."""
    if getattr(plan.pipeline, "block_saved", None) is None:
        object.__setattr__(plan.pipeline, "block_saved", block_saved_bytes(model, plan))
    return plan


def test_explain_shows_stages_schedule_idle_p2p_and_activations():
    model = Stack(WIDTHS)
    p, m, rows, d = 3, 6, 2, 8
    plan = measured(model, sl.plan(model, mesh(pipe=p), rules=PIPE, microbatches=m,
                                   batch=(torch.zeros(rows * m, 40), torch.zeros(rows * m))))
    text = plan.explain()
    pp = plan.pipeline
    assert f"pipeline: 'pipe' (p={p}), {p} stages (1 per rank), layer stack 'blocks' of {len(WIDTHS)} blocks" in text
    for s in pp.stages:
        lo, hi = int(s.blocks[0].split(".")[1]), int(s.blocks[-1].split(".")[1])
        words = " + ".join((["pre"] if s.index == 0 else []) + [f"blocks.{lo}..{hi}"]
                           + (["post"] if s.index == p - 1 else []))
        assert f"stage {s.index} -> pipe rank {s.index}: {words}" in text
    # 1F1B: rank r runs p-1-r warm-up forwards, then one forward and one backward at a time
    assert "schedule '1f1b': p=3, m=6 micro-batches, v=1" in text
    assert "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 2F5 2B5" in text
    assert "rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0F4 0B2 0F5 0B3 0B4 0B5" in text
    bubble = (p - 1) / (m + p - 1)
    assert f"idle fraction (simulator, F=1 B=2 I=W=1): {bubble:.3f}" in text
    assert f"formula (p-1)/(m+p-1) = {bubble:.3f}" in text
    # the stream: rows x d fp32 per micro-batch, m of them forward (not from the last stage) and
    # m of their gradients backward (not from the first), each with the micro-batch's fp32 loss
    each, back = rows * d * 4, rows * d * 4 + 4
    assert f"stream between stages [{rows}, {d}] float32 per micro-batch" in text
    assert f"pipe rank 0: SEND_F x{m} {format_bytes(each)} = {format_bytes(m * each)}" in text
    assert (f"pipe rank 1: SEND_F x{m} {format_bytes(each)}, SEND_B x{m} {format_bytes(back)} = "
            f"{format_bytes(m * (each + back))}") in text
    assert f"pipe rank 2: SEND_B x{m} {format_bytes(back)} = {format_bytes(m * back)}" in text
    assert f"+ receive buffers: up to {pp.recv_window} posted ahead per rank x {format_bytes(back)}" in text
    # activations: rows·(d+h)·4 per block and micro-batch; 1F1B keeps p - r micro-batches on rank r
    assert "× live micro-batches (simulator's peak on its rank)" in text
    for s in pp.stages:
        each = [rows * (d + WIDTHS[int(b.split('.')[1])]) * 4 for b in s.blocks]
        per_mb, live = sum(each), p - s.index
        n = f"{len(each)} block{'s' if len(each) > 1 else ''}"
        words = f"{n} x {format_bytes(each[0])} = {format_bytes(per_mb)}" if len(set(each)) == 1 else \
            f"{n}, {format_bytes(per_mb)}"
        assert (f"stage {s.index} (pipe rank {s.index}): {words} per micro-batch x {live} live = "
                f"{format_bytes(per_mb * live)}") in text


def test_explain_without_batch_says_bytes_are_unknown():
    text = sl.plan(gpt(4), mesh(pipe=2), rules=PIPE, microbatches=4).explain()
    assert "pipe rank 0: SEND_F x4 sends; bytes unknown without batch=" in text
    assert "pipe rank 1: SEND_B x4 sends; bytes unknown without batch=" in text
    assert "(simulator's peak on its rank):\n      unknown without batch=" in text


def test_explain_of_an_interleaved_3d_plan_shows_placement_and_bubble():
    model = GPT(GPTConfig(n_layers=8, vocab_size=64, d_model=32, n_heads=2, seq_len=8))
    m3 = sl.AbstractMesh({"data": 2, "pipe": 2, "tensor": 2})
    plan = measured(model, sl.plan(model, m3, zero=3, rules=TP, schedule="interleaved_1f1b", virtual_stages=2,
                                   microbatches=4, batch=token_batch(model.cfg, 16, 0)))
    text = plan.explain()
    for s in range(4):
        assert f"stage {s} -> pipe rank {s % 2}: " in text
    bubble = (2 - 1) / (2 * 4 + 2 - 1)
    assert f"formula (p-1)/(v·m+p-1) = {bubble:.3f}" in text
    # 16 rows / (data 2 x 4 micro-batches) = 2 rows of 8 positions x 32 features, fp32
    assert "stream between stages [2, 8, 32] float32 per micro-batch" in text
    assert "pipe rank 0: peak live" in text and "pipe rank 1: peak live" in text
    assert "this plan holds pipe rank 1's stages" in plan.local(m3.rank_at((0, 1, 0))).explain()


def test_explain_truncates_long_action_lists_unless_full():
    plan = sl.plan(gpt(2), mesh(pipe=2), rules=PIPE, microbatches=16)
    short, full = plan.explain(), plan.explain(full=True)
    assert "rank 1 (32 actions, 8 not shown; explain(full=True) lists all): 1F0 1B0 1F1" in short
    listing = " ".join(f"1F{i} 1B{i}" for i in range(16))
    assert listing in " ".join(full.split())          # full=True lists all 32 (wrapped)
    assert listing not in " ".join(short.split())


def test_explain_of_plans_without_a_pipe_has_no_pipeline_section():
    for m in (mesh(pipe=1), sl.AbstractMesh({"data": 2})):
        assert "pipeline:" not in sl.plan(gpt(2), m, rules=PIPE).explain()


def test_step_scalars_take_a_collective_only_where_stages_must_agree():
    """The loss rides the backward messages, so a pipeline's step needs a collective for its scalars
    only over ``data`` (replicas' losses and used flags), riding DP's gradient all-reduce where it
    can, and over the whole mesh only when one stage's gradients decide for all (fp16, clipping)."""
    def scalars(plan, rank=0):
        return [(e.op, e.axes) for e in plan.comm_per_step(rank) if e.what == "scalars"]

    model = gpt(4)
    lone = sl.plan(model, mesh(pipe=2), rules=PIPE, microbatches=2)
    assert lone.pipe_scalar_axes() == () and scalars(lone) == [] and scalars(lone, 1) == []
    dp = sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, microbatches=2)
    assert dp.pipe_scalar_axes() == ("data",) and dp.local(0).scalars_ride_gradients and scalars(dp) == []
    local = dp.local(0)
    # the loss + this stage's flags + the fingerprint its data replicas compare
    assert local.scalars_per_step() == 1 + sum(p.trainable for p in local.params) + 4
    assert [e.where for e in dp.comm_per_step(0) if e.riders] == [f"bucket {len(local.buckets()) - 1}"]
    z1 = sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, microbatches=2, zero=1)
    assert scalars(z1) == [("all_reduce", ("data",))]
    everywhere = ("data", "pipe")
    for kw in ({"clip_grad_norm": 1.0}, {"precision": "fp16"}):
        plan = sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, microbatches=2, **kw)
        assert plan.pipe_scalar_axes() == everywhere and scalars(plan) == [("all_reduce", everywhere)], kw
        assert plan.local(0).scalars_per_step() == 2 + plan.pipeline.trainable


def test_zero3_gather_policy_is_checked_and_priced():
    """``pipe_gather``: unknown names, and the microbatch policy with zb_h1 (weight gradients come after
    the unit's backward) or with units kept gathered after forward, are refused at plan time; its
    traffic is each block unit's m x (2 gathers + 1 reduce-scatter), the root's once, where the step
    policy moves every unit once."""
    model, m = gpt(4), 4
    with pytest.raises(sl.ShardingError, match=r"pipe_gather='often' is unknown.*'step'.*'microbatch'"):
        sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, zero=3, pipe_gather="often")
    with pytest.raises(sl.ShardingError, match=r"pipe_gather='microbatch'.*'zb_h1'.*expected pipe_gather='step'"):
        sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, zero=3, schedule="zb_h1", pipe_gather="microbatch")
    with pytest.raises(sl.ShardingError, match=r"reshard_after_forward=False.*expected reshard_after_forward=True"):
        sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, zero=3, pipe_gather="microbatch", reshard_after_forward=False)
    sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, zero=1, schedule="zb_h1", pipe_gather="microbatch")  # no ZeRO-3

    def counts(plan, rank):
        out = {}
        for e in plan.comm_per_step(rank):
            if e.what in ("params", "grads"):
                out[(e.where, e.phase, e.op)] = e.count
        return out

    for rank in (0, 2):                       # pipe rank 0 (embeddings) and 1 (head)
        step = sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, zero=3, microbatches=m)
        micro = sl.plan(model, mesh(data=2, pipe=2), rules=PIPE, zero=3, microbatches=m, pipe_gather="microbatch")
        assert set(counts(step, rank).values()) == {1}
        blocks = [u.name for u in micro.local(rank).units if u.name]
        assert len(blocks) == 2
        assert counts(micro, rank) == {
            **{("<root>", "forward", "all_gather"): 1, ("<root>", "backward", "reduce_scatter"): 1},
            **{(b, ph, op): m for b in blocks for ph, op in (("forward", "all_gather"), ("backward", "all_gather"),
                                                             ("backward", "reduce_scatter"))}}
        assert micro.ring_minimum(rank) > step.ring_minimum(rank)
        assert micro.transient_per_rank(rank)["gathered"] < step.transient_per_rank(rank)["gathered"]
        assert "pipe_gather='microbatch'" in micro.explain() and "pipe_gather='step'" in step.explain()
