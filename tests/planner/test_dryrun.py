"""Dry-run planning (``python -m shardlib.explain``): the numbers against the formulas, at scale without
processes, and at small scale against what the runtime holds and sends (exactly).

Step times are estimates; how close they come to measured ones is a benchmark's question
(``benchmarks/bench_estimate.py``), never a test's.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardlib as sl
from shardlib.cli.compose import check_overrides
from shardlib.frontend.config.run_config import run_config
from shardlib.frontend.dryrun import dry_run, report
from shardlib.models.gpt import GPT
from shardlib.planner.estimate import HOPS, estimate_step, transformer_flops
from shardlib.planner.simulate import bubble_formula
from shardlib.testing import get_mesh

ROOT = Path(__file__).resolve().parents[2]
LARGE = {
    "70b": ["model=70b", "mesh=h100_1024", "parallel=3d", "train.batch=1024", "train.precision=bf16",
            "train.recompute=true", "parallel.microbatches=32"],
    "1t": ["model=1t", "mesh=h100_16384", "parallel=3d", "train.batch=4096", "train.precision=bf16",
           "train.recompute=true", "parallel.microbatches=32"],
}


def run_of(*overrides: str):
    return run_config(check_overrides(list(overrides)))


def test_flops_are_three_forwards_by_hand_and_near_6nd_at_scale():
    """One layer, d = 4, s = 2, V = 10, 3 tokens: per token a layer's forward is 2·(4+8)·16 + 4·2·4 =
    416 FLOPs, the head 2·4·10 = 80; training is 3x forward (4x the layers' with recompute)."""
    assert transformer_flops(layers=1, d_model=4, seq=2, vocab=10, tokens=3) == 3 * (3 * 416 + 3 * 80)
    assert transformer_flops(layers=1, d_model=4, seq=2, vocab=10, tokens=3, recompute=True) == 3 * (4 * 416 + 3 * 80)
    # a large model: ~6 x parameters x tokens (Kaplan's rule), within the attention and head terms
    cfg = run_of("model=70b").model
    n = 12 * cfg.d_model ** 2 * cfg.n_layers
    f = transformer_flops(layers=cfg.n_layers, d_model=cfg.d_model, seq=cfg.seq_len, vocab=cfg.vocab_size, tokens=1)
    assert 6 * n < f < 1.3 * 6 * n


def test_estimate_is_the_stated_arithmetic():
    """compute = the busiest rank's flops / device rate (+ the calibrated cost per layer and micro-batch), stretched
    by the bubble formula; each collective costs bytes / bandwidth + hops x latency on the slowest of its
    axes (the reduce-scatter's and the all-gather's latency per hop measured apart). The CPU presets carry
    figures measured per rank count (``calibrated``): 8 ranks use theirs."""
    run = run_of("mesh=2x2x2")
    d = dry_run(run)
    e, plan = d.estimate, d.plan
    m = run.model
    flops = transformer_flops(layers=m.n_layers, d_model=m.d_model, seq=run.seq, vocab=m.vocab_size,
                              tokens=run.train.batch * run.seq)
    assert e.flops == flops
    # a pipeline runs at its busiest stage's pace: its blocks, and the LM head on the last stage;
    # each of the 4 ranks of a stage (data 2 x tensor 2) takes a quarter of the tokens' work
    pp = plan.pipeline
    per_layer = 3 * (2 * (4 + 2 * m.mlp_ratio) * m.d_model ** 2 + 4 * run.seq * m.d_model)
    head = 3 * 2 * m.d_model * m.vocab_size
    per_stage = [(sum(len(s.blocks) for s in pp.stages if s.rank == r), any(s.post for s in pp.stages if s.rank == r))
                 for r in range(pp.size)]
    worst = max((run.train.batch * run.seq / 4 * (b * per_layer + head * post), b) for b, post in per_stage)
    assert e.flops_per_rank == pytest.approx(worst[0]) and worst[0] > flops / 8
    # uncalibrated, 8 ranks on a host of 2 cores share them: each sustains a quarter of a core's rate
    assert run.mesh.shared_cores == 2 and run.mesh.rank_tflops == run.mesh.device_tflops / 4
    cal = dict(run.mesh.calibrated)[8]
    mc = run.mesh.at(8)
    assert (mc.device_tflops, mc.rank_tflops, mc.layer_us) == (cal.tflops, cal.tflops, cal.layer_us)
    passes = worst[1] * pp.microbatches
    assert e.compute_s == pytest.approx(worst[0] / (cal.tflops * 1e12) + cal.layer_us * 1e-6 * passes)
    assert e.idle == bubble_formula(pp.schedule, pp.size, pp.microbatches, pp.virtual) == pytest.approx(1 / 3)
    link = mc.link("data")
    assert (link.bandwidth, link.latency) == (cal.gbps * 1e9, pytest.approx(cal.latency_us * 1e-6))
    want: dict[str, float] = {}
    for entry in plan.comm_per_step(0):
        k = math.prod(plan.mesh.axis_size(a) for a in entry.axes)
        key = "+".join(entry.axes)
        hop = {"reduce_scatter": cal.rs_latency_us * 1e-6, "all_gather": cal.ag_latency_us * 1e-6}.get(entry.op,
                                                                                                  link.latency)
        want[key] = want.get(key, 0) + entry.count * (entry.bytes / link.bandwidth + HOPS[entry.op](k) * hop)
    assert e.comm_s == pytest.approx(want)
    assert e.total_s == pytest.approx(e.compute_s / (1 - e.idle) + sum(want.values()))
    # the slowest link of a collective's axes prices it
    slow = estimate_step(plan, flops=flops, tokens=1, device_flops=1e12, links={"default": (1e9, 0.0), "tensor": (1e6, 0.0)})
    assert slow.comm_s["tensor"] == pytest.approx(sum(x.total for x in plan.comm_per_step(0) if x.axes == ("tensor",)) / 1e6)


def test_materialized_attention_scores_add_their_elementwise_work_by_hand():
    """``mesh.score_ns``: each score element a rank's attention writes (``a·s²`` per sequence, heads split over
    tensor) costs that many ns per layer's forward and backward, 1.5 times under recompute (full or selective:
    attention's core runs again); the busiest pipe rank's blocks times its micro-batches. Without it, nothing."""
    base = ["mesh=a100_3072", "mesh.axes={data:2,pipe:2,tensor:2}", "model=1b", "model.n_layers=8",
            "model.d_model=1024", "model.n_heads=16", "model.seq_len=512", "parallel=3d", "train.batch=16",
            "parallel.microbatches=4", "parallel.rules={layers: pipe, heads: tensor, mlp: tensor, vocab: tensor}",
            "train.precision=bf16"]
    plain = dry_run(run_of(*base, "train.recompute=selective")).estimate
    for rc, again in (("false", 1.0), ("selective", 1.5), ("true", 1.5)):
        e = dry_run(run_of(*base, f"train.recompute={rc}", "+mesh.score_ns=0.25")).estimate
        # 4 blocks per pipe rank, 4 micro-batches of 16 / (2 data x 4) = 2 sequences, 16 heads / 2 tensor ranks
        want = 4 * 4 * (16 / 2) * 512 ** 2 * 2 * again * 0.25e-9
        assert e.scores_s == pytest.approx(want), rc
        if rc == "selective":
            assert e.compute_s == pytest.approx(plain.compute_s + want) and plain.scores_s == 0.0
    text = report(dry_run(run_of(*base, "+mesh.score_ns=0.25")))
    assert "of it attention scores" in text and "0.25 ns per element" in text, text


@pytest.mark.parametrize("name", list(LARGE))
def test_planning_70b_and_1t_at_scale_gives_zero1_states_that_fit(name):
    """70B on 1,024 devices and 1T on 16,384: model states per rank are the ZeRO-1 terms of the rank's
    shard (the model split over tensor x pipe), it fits the device, and the bubble is the formula's."""
    run = run_of(*LARGE[name])
    d = dry_run(run)
    plan = d.plan
    assert d.fits and d.estimate.total_s > d.estimate.overlapped_s > 0
    local = plan.local(d.worst_rank)
    psi = sum(p.numel for p in local.params)
    n = run.mesh.shape["data"]
    assert d.memory["params"] == 2 * psi and d.memory["grads"] == 2 * psi        # bf16, replicated over data
    assert abs(d.memory["optimizer"] - 12 * psi / n) <= 12 * len(local.buckets())  # fp32 master + Adam, sharded
    assert 0 < d.memory["activations"] < d.memory["total"] < run.mesh.memory_gib * 2**30
    pp = plan.pipeline
    assert d.estimate.idle == bubble_formula("1f1b", pp.size, 32, 1)
    assert set(d.bytes_per_axis) >= {"data", "tensor", "pipe"}


def test_the_command_prints_the_dry_run_and_refuses_bad_input(capsys):
    out = subprocess.run([sys.executable, "-m", "shardlib.explain", *LARGE["70b"]], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for want in ("model=70b (65 B parameters), mesh=h100_1024", "memory per rank", "fits", "bytes sent per step",
                 "pipeline: 1f1b, p=8, m=32", "estimated step: compute", "planned in"):
        assert want in text, text
    # refused: the same command's main in this process (the process path is the run above)
    from shardlib.cli.explain import main
    capsys.readouterr()
    assert main(["model=70b", "mesh=h100_1024", "parallel=3d"]) == 2
    assert "train.batch: 16 sequences do not split over 16 data-parallel ranks" in capsys.readouterr().err


# ---- small scale: the dry run's memory and bytes are what the runtime holds and sends ----------------

def _held_and_sent(overrides: list[str]) -> dict:
    from shardlib.frontend.run import Trainer

    run = run_of(*overrides)
    trainer = Trainer(run, get_mesh(run.mesh.shape))
    trainer.step(0, record=False)
    with sl.count_collectives() as c:
        trainer.engine.step(trainer.batch(1))
    by_axis: dict[str, int] = {}
    for r in c.records:
        if r.op != "recv":
            by_axis["+".join(r.axes)] = by_axis.get("+".join(r.axes), 0) + r.bytes
    return {"held": trainer.engine.memory_held(), "sent": by_axis}


def test_dry_run_equals_the_runtime_at_small_scale(world):
    overrides = ["mesh=2x2x2", "parallel=3d", "train=quick", "parallel.zero=3"]
    d = dry_run(run_of(*overrides))
    per_rank = world(8, _held_and_sent, overrides)
    assert per_rank[0]["sent"] == d.bytes_per_axis
    for r, got in enumerate(per_rank):
        planned = d.plan.memory_per_rank(r)
        assert {k: got["held"][k] for k in ("params", "grads", "optimizer")} == \
            {k: planned[k] for k in ("params", "grads", "optimizer")}, r


def test_activations_are_measured_in_the_compute_dtype():
    """Without a pipe axis the dry run measures the whole model's saved tensors: in bf16 a step saves
    them in bf16 (the loss's fp32 upcast aside), about half of what the fp32 model saves."""
    from shardlib.planner.peak import activation_bytes
    got = {p: dry_run(run_of("mesh=dp2", "parallel=dp", f"train.precision={p}")).memory["activations"]
           for p in ("fp32", "bf16")}
    run = run_of("mesh=dp2", "parallel=dp", "train.precision=bf16")
    with torch.device("meta"):
        model = GPT(run.model.gpt(), seed=None).to(torch.bfloat16)
    ids = torch.zeros(run.train.batch // 2, run.seq, dtype=torch.long, device="meta")
    assert got["bf16"] == activation_bytes(model, (ids, ids)) and 0.4 < got["bf16"] / got["fp32"] < 0.75


def test_the_dry_run_of_a_mixture_of_experts_prices_its_routing_and_says_what_it_cannot_estimate():
    """model=moe_tiny on data 2 x expert 2: each rank holds half the experts, the routing's all-to-alls are
    priced over expert (uniform routing), and the activations, whose shapes depend on the routing, are said
    not estimated rather than crashing the trace."""
    d = dry_run(run_of("model=moe_tiny", "mesh=dp2_ep2", "parallel=ep"))
    plan = d.plan
    experts = [p for p in plan.local(0).params if plan.is_expert(p.name)]
    assert experts and all(p.shape[0] == p.full_shape[0] // 2 for p in experts)
    assert d.bytes_per_axis["expert"] == sum(e.total for e in plan.comm_per_step() if e.op == "all_to_all") > 0
    assert any("data-dependent" in n for n in d.notes)


def test_a_mixture_of_experts_counts_the_flops_of_the_experts_a_token_takes_by_hand():
    """A token multiplies attention's 4d², the router's E·d, and its top_k routed plus the shared experts'
    SwiGLU weights (3·I·d each) — not every expert's, and not a dense MLP's."""
    from shardlib.models.gpt import GPTConfig
    from shardlib.planner.estimate import ModelDims
    c = GPTConfig(d_model=16, n_heads=4, n_layers=2, vocab_size=32, n_experts=8, top_k=2, expert_width=24,
                  shared_experts=1)
    dims = ModelDims.of(GPT(c))
    assert dims.block_matrix == 4 * 16 ** 2 + 8 * 16 + 3 * 3 * 24 * 16
    # a transformers Mixtral: its fused experts [E, 2I, H] and [E, H, I] counted for num_experts_per_tok of E
    from transformers import MixtralConfig, MixtralForCausalLM
    m = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2))
    attn = 32 * 32 * 2 + 32 * 16 * 2                      # q, o: 32x32; k, v: 2 heads of 8 -> 16x32
    assert ModelDims.of(m).block_matrix == attn + 4 * 32 + 2 * 3 * 48 * 32
