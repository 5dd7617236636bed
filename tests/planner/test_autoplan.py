"""The auto-planner (issue 21): the pruned search finds what brute force over the same space finds, every
plan it returns is one ``sl.plan`` accepts and, at 4 and 8 CPU processes, one that trains; bad input is
named with its fix. ``mesh.axes={...}`` on the command line replaces a preset's axes whole, and
``python -m shardlib.explain --json`` prints one JSON object."""

from __future__ import annotations

import json

import pytest
import torch

import shardlib as sl
from shardlib.cli.autoplan import block_probe, model_shape
from shardlib.cli.compose import check_overrides
from shardlib.frontend.config.checking import ConfigError
from shardlib.frontend.config.run_config import run_config
from shardlib.planner import autoplan as ap


def _costs(model: str, mesh: str, devices: int, batch: int, precision: str = "fp32"):
    cfg = check_overrides([f"model={model}", f"mesh={mesh}", "parallel=zero3", f"train.batch={batch}"])
    cfg["mesh"]["axes"] = {"data": 1}
    cfg["mesh"]["links"] = {"default": cfg["mesh"]["links"]["default"]}
    run = run_config(cfg)
    dtype = {"bf16": torch.bfloat16}.get(precision)
    shape = model_shape(run.model.gpt(), run.seq, dtype)
    return ap.Costs(shape, ap.Machine.of_mesh(run.mesh), batch=batch, precision=precision,
                    block_fn=block_probe(run.model.gpt(), run.seq, precision))


@pytest.mark.parametrize("model, mesh, devices, batch, precision", [
    ("tiny", "dp4", 4, 16, "fp32"), ("tiny", "2x2x2", 8, 16, "fp32"), ("small", "dp4", 8, 32, "fp32"),
    ("1b", "h100_64", 64, 256, "bf16")])
def test_pruned_search_finds_what_brute_force_finds(model, mesh, devices, batch, precision):
    costs = _costs(model, mesh, devices, batch, precision)
    pruned, n_pruned = ap.search(costs, devices, keep=6)
    brute, n_brute = ap.search(costs, devices, keep=6, prune=False)
    assert pruned and [(p.cand, p.step_s) for p in pruned] == [(b.cand, b.step_s) for b in brute]
    assert n_pruned <= n_brute


def test_search_bounds_are_admissible():
    """The lower bound of a shape is at most the step of every configuration of it; the frugal
    configurations hold the least memory of their shape."""
    costs = _costs("small", "dp4", 8, 32)
    for d, p, t, e, c in ap.shapes(8, costs.m):
        assert e == 1                                       # a dense model: no expert axis
        bound = costs.lower_bound(d, p, t, e, c)
        priced = [costs.price(k) for k in ap.configs(d, p, t, costs.m, 32, context=c)]
        assert priced and all(bound <= x.step_s * (1 + 1e-12) for x in priced), (d, p, t, c)
        least = min(costs.memory(k)["total"] for k in ap.frugal(d, p, t, 32, context=c))
        assert least <= min(x.memory["total"] for x in priced) * (1 + 1e-12), (d, p, t, c)


def test_every_candidate_autoplan_returns_passes_the_run_check():
    from shardlib.frontend.run import check
    for devices, mesh in ((4, "dp4"), (8, "2x2x2")):
        got = sl.autoplan(model="tiny", mesh=mesh, devices=devices, top=4)
        assert got["candidates"] and got["searched"] > 0
        for c in got["candidates"]:
            run = run_config(check_overrides(c["overrides"]))
            assert run.mesh.size == devices and check(run) == [], c["overrides"]
            assert c["exact"] and c["fits"] and c["step_ms"] > 0


def _composed(overrides: list[str]) -> dict:
    """The config a plan's overrides give, composed once here (as the main job's parent does), not in
    every rank."""
    return check_overrides(overrides + ["data.megabytes=0.2"])


def _train(cfg: dict) -> list[float]:
    from shardlib.frontend.run import Trainer
    from shardlib.testing import get_mesh
    run = run_config(cfg)
    trainer = Trainer(run, get_mesh(run.mesh.shape))
    return [trainer.step(i, record=False)["loss"] for i in range(2)]


def test_top_candidates_train_with_equal_finite_losses_on_every_rank(world):
    for devices, mesh in ((4, "dp4"), (8, "2x2x2")):
        for c in sl.autoplan(model="tiny", mesh=mesh, devices=devices, top=1)["candidates"]:
            losses = world(devices, _train, _composed(c["overrides"]))
            assert all(r == losses[0] for r in losses) and all(torch.isfinite(torch.tensor(r)).all() for r in losses)


@pytest.mark.parametrize("kw, match", [
    ({"devices": 7}, r"global batch 16 does not split over any data degree these 7 devices allow \(7\).*train.batch=112"),
    ({"devices": 4, "memory_gib": 1e-6}, r"nothing fits 0 GiB per device — the most frugal plan needs .* GiB \(mesh"),
    ({"devices": 0}, r"devices must be a positive int"),
    ({"devices": 4, "overrides_extra": ("mesh.device_tflops=null", "mesh.calibrated=null")},
     r"gives no device_tflops .* python -m shardlib.calibrate"),
])
def test_bad_input_is_named(kw, match):
    with pytest.raises(sl.ShardingError, match=match):
        sl.autoplan(model="tiny", mesh="dp4", **kw)


def test_a_mesh_preset_axes_are_replaced_whole():
    run = run_config(check_overrides(["model=175b", "mesh=h100_64", "mesh.axes={data:1,pipe:8,tensor:8}", "parallel=3d",
                                      "train.batch=64"]))
    assert list(run.mesh.shape.items()) == [("data", 1), ("pipe", 8), ("tensor", 8)]
    run = run_config(check_overrides(["mesh=dp2_tp2", "mesh.axes={data:4}", "parallel=zero3"]))
    assert run.mesh.shape == {"data": 4}                 # replaced, not merged


def test_explain_json_reports_memory_fit_bubble_and_consistent_step_ms(capsys):
    from shardlib.cli.explain import main
    assert main(["model=tiny", "mesh=2x2x2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(got) >= {"memory_per_rank", "fits", "bytes_per_axis", "bubble", "step_ms", "tokens_per_s"}
    assert got["memory_per_rank"]["total"] > 0
    assert set(got["step_ms"]) == {"no_overlap", "full_overlap", "predicted", "overlap"}
    ms = got["step_ms"]
    assert ms["full_overlap"] <= ms["predicted"] <= ms["no_overlap"] and 0 < got["bubble"] < 1
    assert ms["predicted"] == pytest.approx(ms["no_overlap"] - ms["overlap"] * (ms["no_overlap"] - ms["full_overlap"]))


def test_calibration_measures_and_reads_back(world):
    """``python -m shardlib.calibrate``'s measurement at 2 ranks gives positive figures; a mesh preset's
    ``calibrated`` table replaces the figures for its own rank count, and a bad entry is named."""
    from shardlib.cli.calibrate import measure
    got = world(2, measure, 2)[0]
    assert got["tflops"] > 0 and got["gbps"] > 0 and got["latency_us"] >= 0 and got["layer_us"] >= 0
    assert got["rs_latency_us"] >= 0 and got["ag_latency_us"] >= 0 and 0 <= got["overlap"] <= 1
    raw = check_overrides(["mesh=dp4", "parallel=zero3"])
    raw["mesh"]["calibrated"] = {4: {"tflops": 0.5, "gbps": 2.0, "latency_us": 100, "layer_us": 10}}
    mc = run_config(raw).mesh
    assert mc.at(4).rank_tflops == 0.5 and mc.at(4).link("data").latency == pytest.approx(1e-4) and mc.at(2) == mc
    assert mc.at(4).hop_s == ()                      # none measured apart: the all-reduce's for every op
    raw["mesh"]["calibrated"] = {4: {"tflops": 0.5, "gbps": 2.0, "latency_us": 100, "layer_us": 10,
                                     "rs_latency_us": 300, "ag_latency_us": 200}}
    assert dict(run_config(raw).mesh.at(4).hop_s) == pytest.approx({"reduce_scatter": 3e-4, "all_gather": 2e-4})
    # the overlap factor: the step predicted between the estimate's bounds by it
    raw["mesh"]["calibrated"][4]["overlap"] = 0.25
    run = run_config(raw)
    assert run.mesh.at(4).overlap == 0.25
    from shardlib.frontend.dryrun import dry_run
    e = dry_run(run).estimate
    assert e.overlap == 0.25 and e.step_s == pytest.approx(e.total_s - 0.25 * (e.total_s - e.overlapped_s))
    raw["mesh"]["overlap"] = 1.5
    with pytest.raises(ConfigError, match=r"mesh.overlap: .* a fraction from 0 to 1"):
        run_config(raw)
    del raw["mesh"]["overlap"]
    raw["mesh"]["calibrated"] = {4: {"tflops": 0.5}}
    with pytest.raises(ConfigError, match=r"mesh.calibrated.4: .* expected \{tflops, gbps"):
        run_config(raw)


# ---- a mixture of experts: the expert axis ---------------------------------------------------------

def _moe_costs(memory_gib: float):
    """A Mixtral-8x7B-shaped GPT (32 layers, d 4096, 8 experts of width 14336, top 2) at 4096 tokens, a
    global batch of 256, on 64 devices of the h100_64 machine with ``memory_gib`` each (Korthikanti's
    activations: the block is not probed)."""
    from dataclasses import replace

    from shardlib.models.gpt import GPTConfig
    cfg = check_overrides(["model=1b", "mesh=h100_64", "parallel=zero3"])
    cfg["mesh"]["axes"] = {"data": 1}
    cfg["mesh"]["links"] = {"default": cfg["mesh"]["links"]["default"]}
    machine = ap.Machine.of_mesh(run_config(cfg).mesh, 64)
    shape = model_shape(GPTConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_heads=32, n_layers=32,
                                  n_experts=8, top_k=2, expert_width=14336, shared_experts=0), 4096)
    return ap.Costs(shape, replace(machine, memory=memory_gib * 2**30), batch=256, precision="bf16")


def test_a_moe_models_shape_counts_its_experts_and_the_search_splits_them_where_memory_is_short():
    """The expert axis is in the space: degrees dividing the 8 experts, the batch over data x expert, the
    experts' states 1/ep (and ZeRO-sharded over data alone), the all-to-alls priced. With 80 GiB a pipe of
    data-parallel replicas is fastest; with 40 or 24 GiB the fastest that fits splits the experts. The
    pruned search still finds what brute force finds."""
    costs = _moe_costs(80)
    m = costs.m
    assert (m.experts, m.top_k) == (8, 2) and m.expert_params == 8 * 3 * 4096 * 14336
    assert {s[3] for s in ap.shapes(64, m)} == {1, 2, 4, 8}
    dense = ap.Candidate(8, 8, 1, zero=1, schedule="1f1b", microbatches=4)
    split = ap.Candidate(1, 8, 1, zero=1, schedule="1f1b", microbatches=4, expert=8)
    a, b = costs.memory(dense), costs.memory(split)
    stage_experts = m.layers / 8 * m.expert_params
    # bf16 params and grads: the experts' 2+2 bytes fall by 8 x; the rest is the same, sharded or not
    assert a["params"] - b["params"] == pytest.approx(2 * stage_experts * (1 - 1 / 8))
    assert a["optimizer"] == pytest.approx(b["optimizer"])           # ZeRO-1 over 8 batch ranks either way
    assert "expert" in costs.comm_s(split) and "expert" not in costs.comm_s(dense)
    tokens = 256 * 4096 / 8
    assert costs.comm_s(split)["expert"] >= 4 * 7 / 8 * tokens * 2 * 4096 * 2 * 4 / costs.mc.link("expert")[0]
    for gib, splits in ((80, False), (40, True), (24, True)):
        costs = _moe_costs(gib)
        pruned, _ = ap.search(costs, 64, keep=3)
        brute, _ = ap.search(costs, 64, keep=3, prune=False)
        assert pruned and [(p.cand, p.step_s) for p in pruned] == [(p.cand, p.step_s) for p in brute]
        assert (pruned[0].cand.expert > 1) == splits, (gib, [p.cand for p in pruned])


def test_hsdp_replicas_are_searched_beside_an_expert_axis_and_priced_with_the_experts_shards():
    """HSDP beside an expert axis (the runtime trains it exactly: test_expert_parallel's hsdp case): the space
    holds replicas of the data axis with experts split, and the replicas' all-reduce moves each replica's
    shard — what is not an expert sharded over (data / replica) x expert, an expert's over data / replica."""
    costs = _moe_costs(80)
    m = costs.m
    found = [k for k in ap.configs(4, 2, 1, m, 256, expert=2) if k.replica == 2]
    assert found and all(k.zero >= 1 for k in found)
    k = ap.Candidate(4, 2, 1, replica=2, zero=1, schedule="1f1b", microbatches=4, expert=2)
    assert k.axes == {"replica": 2, "data": 2, "expert": 2, "pipe": 2}
    shard, stage = 4 // 2, m.layers / 2
    dense = stage * (m.block_params - m.expert_params) + max(m.pre_params, m.post_params)
    held = dense / (shard * 2) + stage * m.expert_params / 2 / shard
    bw, lat = costs.mc.link("replica")
    assert costs.comm_s(k)["replica"] == pytest.approx(2 * (2 - 1) / 2 * held * 2 / bw + 2 * lat)   # bf16 grads
    from shardlib.frontend.dryrun import dry_run
    from shardlib.frontend.run import check
    small = ap.Candidate(4, 1, 1, replica=2, zero=1, expert=2)      # its overrides plan: HSDP beside experts
    ov = ap.overrides(small, model="moe_tiny", mesh="dp4", batch=16, precision="fp32", moe=True)
    assert "parallel.replica_axis=replica" in ov, ov
    run = run_config(check_overrides(ov))
    assert check(run) == []
    plan = dry_run(run).plan
    assert (plan.replica_axis, plan.expert_axis) == ("replica", "expert")
    assert plan.param("blocks.0.mlp.experts.gate_up_proj").spec.dim_axes(0) == ("expert",)


def test_an_expert_candidates_overrides_plan_and_hold_their_experts_split():
    """A candidate with an expert axis (model=moe_tiny) runs by its overrides: the rules split the experts
    over ``expert`` (and each expert's width over tensor where there is one), the run check passes, and the
    dry run plans it with each rank holding half the experts, each at half its width."""
    from shardlib.frontend.dryrun import dry_run
    from shardlib.frontend.run import check
    k = ap.Candidate(1, 1, 2, zero=1, expert=2)
    ov = ap.overrides(k, model="moe_tiny", mesh="dp4", batch=16, precision="fp32", moe=True)
    assert "mesh.axes={data:1,expert:2,tensor:2}" in ov, ov
    assert "parallel.rules={heads:tensor,mlp:tensor,vocab:tensor,expert_mlp:tensor,experts:expert}" in ov, ov
    run = run_config(check_overrides(ov))
    assert check(run) == []
    plan = dry_run(run).plan
    # a MoE block's saved bytes on a tensor shard: measured on zeros (routing has no meta kernels), its
    # boundary collectives shapes only on the AbstractMesh
    probe = block_probe(run.model.gpt(), run.seq, "fp32")
    assert 0 < probe(2, False) < probe(1, False)
    gate_up = plan.param("blocks.0.mlp.experts.gate_up_proj")
    assert gate_up.spec.dim_axes(0) == ("expert",) and gate_up.rest.local_shape(gate_up.shape, 0)[:2] == (2, 256)


# ---- long sequences: the context axis -----------------------------------------------------------------

def _long_costs(seq: int, batch: int):
    """A 7B-shaped GPT (32 layers, d 4096, 32 heads) at ``seq`` tokens, ``batch`` sequences a step, on 64 devices
    of the h100_64 machine (Korthikanti's activations)."""
    from shardlib.models.gpt import GPTConfig
    cfg = check_overrides(["model=1b", "mesh=h100_64", "parallel=zero3"])
    cfg["mesh"]["axes"] = {"data": 1}
    cfg["mesh"]["links"] = {"default": cfg["mesh"]["links"]["default"]}
    machine = ap.Machine.of_mesh(run_config(cfg).mesh, 64)
    shape = model_shape(GPTConfig(vocab_size=32000, seq_len=seq, d_model=4096, n_heads=32, n_layers=32), seq)
    return ap.Costs(shape, machine, batch=batch, precision="bf16")


def test_the_search_splits_long_sequences_over_a_context_axis_when_the_batch_cannot_fill_the_devices():
    """The context axis is in the space (degrees splitting the sequence into 2·C chunks): a rank's tokens and
    activations fall as 1/C, attention's keys and values move (the all-gather, or Ulysses where cheaper), and
    the states shard over data x context. With 64 sequences of 4096 tokens data parallel fills the 64 devices;
    with 8 (or 4) sequences of 131,072 tokens the fastest plan that fits splits each sequence. The pruned
    search finds what brute force finds."""
    costs = _long_costs(131072, 8)
    assert {s[4] for s in ap.shapes(64, costs.m)} == {1, 2, 4, 8, 16, 32, 64}
    k = ap.Candidate(8, 1, 1, zero=3, recompute="selective", context=8)
    one = ap.Candidate(8, 1, 1, zero=3, recompute="selective")
    assert costs.activations(k)[0] == pytest.approx(costs.activations(one)[0] / 8)
    assert costs.memory(k)["params"] == pytest.approx(costs.memory(one)["params"] / 8)      # ZeRO over data x context
    assert "context" in costs.comm_s(k) and "context" not in costs.comm_s(one)
    for seq, batch, splits in ((4096, 64, False), (131072, 8, True), (131072, 4, True)):
        costs = _long_costs(seq, batch)
        pruned, _ = ap.search(costs, 64, keep=3)
        brute, _ = ap.search(costs, 64, keep=3, prune=False)
        assert pruned and [(p.cand, p.step_s) for p in pruned] == [(p.cand, p.step_s) for p in brute]
        assert (pruned[0].cand.context > 1) == splits, (seq, batch, [p.cand for p in pruned])
    ov = ap.overrides(ap.Candidate(2, 1, 1, zero=1, context=2), model="tiny_long", mesh="dp4", batch=4,
                      precision="fp32")
    assert "mesh.axes={data:2,context:2}" in ov and "parallel.rules={seq:context}" in ov, ov
    from shardlib.frontend.run import check
    assert check(run_config(check_overrides(ov + ["train.seq=128"]))) == []


# ---- a transformers config as the model ------------------------------------------------------------

def test_flops_of_a_transformers_block_by_hand():
    """A Llama block's dense FLOPs are 2 per matrix element per token: q and o (d x d), k and v
    (d x d·kv/heads: grouped heads), gate, up and down (d x I) — here d=32, 4 heads over 2 key/value
    heads, I=90: 2·32·32 + 2·32·16 + 3·32·90 = 12,352 elements."""
    from llama import tiny_llama

    from shardlib.planner.estimate import ModelDims
    dims = ModelDims.of(tiny_llama())
    assert (dims.layers, dims.d_model, dims.heads, dims.vocab, dims.block_matrix) == (2, 32, 4, 96, 11712)
    tokens, seq = 3, 16
    per_token = 3 * (2 * 11712 + 4 * seq * 32)          # forward + backward of the dense weights and the core
    assert dims.flops(seq=seq, tokens=tokens) == tokens * (2 * per_token + 3 * 2 * 32 * 96)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from test_train_hf import _example
    return _example("make_tiny_hf").make(tmp_path_factory.mktemp("hf") / "tiny-llama", vocab=300, hidden=32,
                                         layers=2, heads=4, kv_heads=2, intermediate=64, positions=64,
                                         megabytes=0.1)


def test_a_transformers_config_is_planned_and_its_plans_run(world, llama_folder):
    """``model=hf model.path=<folder>``: the search prices the folder's own blocks (its config's sizes,
    its blocks' saved bytes as the planner measures them on the shards); every plan returned is one
    the planner accepts, and the first trains at 4 processes."""
    from shardlib.frontend.run import check
    extra = (f"model.path={llama_folder}", "model.seq_len=32")
    got = sl.autoplan(model="hf", mesh="dp4", devices=4, top=3, overrides_extra=extra)
    assert got["candidates"]
    for c in got["candidates"]:
        run = run_config(check_overrides(c["overrides"]))
        assert run.model.kind == "hf" and run.mesh.size == 4 and check(run) == [], c["overrides"]
        assert c["exact"] and c["fits"]
    losses = world(4, _train, _composed(got["candidates"][0]["overrides"]))
    assert all(r == losses[0] for r in losses) and all(torch.isfinite(torch.tensor(r)).all() for r in losses)
