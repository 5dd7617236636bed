"""Configs: ``conf/`` composed by Hydra at the edge, checked whole by the library's own dataclasses.

Pure: no process starts. Every preset of every group composes and validates; each kind of bad input
is one message naming its config key; the library itself never imports Hydra.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardlib.cli.compose import check_overrides, presets
from shardlib.frontend.config.run_config import ConfigError, RunConfig, run_config
from shardlib.frontend.run import check, lr_factor

# a mesh for each parallel preset
MESH_FOR = {"dp": "dp4", "zero1": "dp4", "zero2": "dp4", "zero3": "dp4", "hsdp": "hsdp2x2", "tp": "tp2",
            "tp_sp": "dp2_tp2", "pp_gpipe": "pp2", "pp_1f1b": "pp2_dp2", "pp_interleaved": "pp2", "pp_zb": "pp4",
            "3d": "2x2x2", "zero_offload": "dp2", "zero_infinity": "dp2", "ep": "dp2_ep2", "ep_tp": "ep2_tp2",
            "cp": "dp2_cp2"}
MODEL_FOR = {"ep": "moe_tiny", "ep_tp": "moe_tiny"}          # a preset that needs a model of its kind (default: the tiny GPT)


def compose(*overrides: str) -> RunConfig:
    return run_config(check_overrides(list(overrides)))


def problems_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        compose(*overrides)
    return e.value.problems


def test_every_preset_is_listed_and_every_parallel_preset_plans_on_its_mesh():
    assert set(presets("parallel")) == set(MESH_FOR)
    assert {"single", "dp4", "dp2_tp2", "hsdp2x2", "2x2x2", "h100_1024", "h100_16384"} <= set(presets("mesh"))
    assert {"tiny", "70b", "1t", "moe_tiny"} <= set(presets("model"))
    for parallel, mesh in MESH_FOR.items():
        run = compose(f"parallel={parallel}", f"mesh={mesh}", "train=quick", f"model={MODEL_FOR.get(parallel, 'tiny')}")
        assert run.parallel.name == parallel and run.mesh.name == mesh
        assert check(run) == [], (parallel, mesh, check(run))


def test_the_default_is_the_3d_main_job():
    run = compose()
    assert run.mesh.shape == {"data": 2, "pipe": 2, "tensor": 2} and run.parallel.name == "3d"
    kw = run.plan_kwargs()
    assert kw["rules"] == {"layers": "pipe", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    assert kw["schedule"] == "1f1b" and kw["microbatches"] == 2 and kw["sequence_parallel"] is True
    assert run.mesh.link("tensor").bandwidth == 1e9 and run.mesh.link("data").latency == pytest.approx(150e-6)


def test_overrides_reach_the_dataclasses():
    run = compose("mesh=dp2_tp2", "parallel=zero3", "train.precision=bf16", "train.steps=7", "model.n_layers=3",
                  "parallel.rules={heads: tensor, mlp: tensor}")
    assert (run.parallel.zero, run.train.precision, run.train.steps, run.model.n_layers) == (3, "bf16", 7, 3)
    assert run.rules() == {"heads": "tensor", "mlp": "tensor"}
    # the rules merge into the preset's: a dim added, one unmapped (null: replicated)
    run = compose("mesh=dp2_tp2", "parallel=tp", "parallel.rules.vocab=null", "parallel.rules.embed=null")
    assert run.rules() == {"heads": "tensor", "mlp": "tensor", "vocab": None, "embed": None}


def test_every_plan_key_of_the_config_is_one_policy_field_by_the_plan_keyword_of_its_name():
    """No hand map between Hydra and sl.plan: a key of ``parallel`` or ``train`` is either sl.plan's short form
    of the same name (one policy field) or a setting of the training loop that the plan never sees."""
    from dataclasses import fields

    from shardlib.frontend.config.run_config import ParallelConfig, TrainConfig
    from shardlib.planner.policies import SHORT_FORMS
    parallel = {f.name for f in fields(ParallelConfig)} - {"name", "rules"}
    assert parallel <= set(SHORT_FORMS), parallel - set(SHORT_FORMS)
    loop = {"steps", "batch", "seq", "lr", "lr_schedule", "warmup_steps", "min_lr", "weight_decay", "seed",
            "log_every"}
    assert {f.name for f in fields(TrainConfig)} - loop <= set(SHORT_FORMS)
    # each override reaches the plan's policy field it names, through sl.plan's own table
    import shardlib as sl
    from shardlib.models.gpt import GPT
    run = compose("mesh=pp2_dp2", "parallel=pp_1f1b", "parallel.zero=1", "parallel.microbatches=4",
                  "parallel.schedule=gpipe", "train.precision=bf16", "train.recompute=selective",
                  "train.clip_grad_norm=0.5", "+parallel.offload.optimizer=host")
    plan = sl.plan(GPT(run.model.gpt()), sl.AbstractMesh(run.mesh.shape), **run.plan_kwargs())
    assert (plan.states.optim is not None, plan.grad_accum, plan.pipeline.schedule, plan.precision,
            plan.recompute, plan.clip_grad_norm, dict(plan.offload)) == \
        (True, 4, "gpipe", "bf16", "selective", 0.5, {"optimizer": "host"})
    # a pipeline's keys are left out where the mesh has no pipe (the 3d preset's schedule on a data mesh)
    assert "schedule" not in compose("mesh=dp4", "parallel=zero1", "parallel.schedule=1f1b").plan_kwargs()


@pytest.mark.parametrize("overrides, expected", [
    (["mesh=nope"], "mesh=nope: no such mesh preset — expected one of"),
    (["parallel=zero9"], "parallel=zero9: no such parallel preset — expected one of"),
    (["train.stpes=5"], "train.stpes: no such config key — train has"),
    (["model.depth=5"], "model.depth: no such config key"),
    (["steps=5"], "steps: no such config key — the config has"),
    (["train.precision=fp8"], "train.precision: got 'fp8'; expected one of fp32, bf16, fp16."),
    (["train.steps=0"], "train.steps: got 0; expected an int >= 1."),
    (["train.lr=-1"], "train.lr: got -1; expected a number > 0."),
    (["train.clip_grad_norm=null"], None),
    (["parallel.zero=5"], "parallel.zero: got 5; expected 0, 1, 2 or 3."),
    (["parallel.schedule=zigzag"], "parallel.schedule: got 'zigzag'; expected one of gpipe, 1f1b"),
    (["mesh=dp4", "parallel=tp"], "parallel.rules: parallel=tp maps heads, mlp, vocab to the axis 'tensor', but "
                                  "mesh=dp4 has axes ('data',)"),
    (["mesh=dp4", "parallel=hsdp"], "parallel.replica_axis: parallel=hsdp replicates over 'replica'"),
    (["mesh=2x2x2", "parallel=dp"], "parallel: mesh=2x2x2 has pipe=2, but parallel=dp maps no logical dim to 'pipe'"),
    (["train.batch=15"], "train.batch: 15 sequences do not split over 2 data-parallel ranks x 2 micro-batches = 4"),
    (["train.seq=100"], "train.seq: 100 tokens is longer than model.seq_len=64 positions"),
    (["model.n_heads=3"], "model.n_heads: 3 heads do not divide model.d_model=128"),
    (["data=file"], "data.path: missing — data=file reads a text file of yours"),
    (["data=dataset"], "data.path: missing — data=dataset reads a local dataset"),
    (["data=dataset", "data.path=x.jsonl", "data.format=csv"], "data.format: got 'csv'; expected one of text, json, "
                                                              "parquet or null."),
    (["model=hf"], "model.path: missing — model=hf trains a local transformers causal-LM folder"),
    (["model=hf", "model.path=x", "model.n_layers=3"], "model.n_layers: no such config key — model has kind, name, "
                                                       "path, seq_len."),
    (["model=hf", "model.path=x", "model.kind=bert"], "model.kind: got 'bert'; expected one of gpt, hf."),
    (["mesh.links.expert={gbps: 1}"], "no such config key"),
    (["mesh.axes.data=0", "mesh=dp2"], "mesh.axes.data: got 0; expected a positive int."),
    (["train"], "train: not an override — expected key=value"),
])
def test_each_bad_value_is_named_by_its_key(overrides, expected):
    if expected is None:
        assert compose(*overrides).train.clip_grad_norm is None
        return
    got = problems_of(*overrides)
    assert any(expected in p for p in got), got


def test_a_transformers_folder_takes_its_sizes_from_its_own_config():
    run = compose("model=hf", "model.path=some/folder", "mesh=dp2_tp2", "parallel=tp", "train.seq=256")
    assert (run.model.kind, run.model.path, run.seq) == ("hf", "some/folder", 256)    # no model.seq_len bound here
    raw = check_overrides(["model=hf", "model.path=f"])
    raw["model"]["d_model"] = 64
    with pytest.raises(ConfigError) as e:
        run_config(raw)
    assert e.value.problems == ["model.d_model: not used with model.kind=hf — the folder's config.json sets the "
                                "model's sizes. Remove it, or edit the folder's config."]
    raw = check_overrides([])
    raw["model"]["path"] = "f"
    with pytest.raises(ConfigError) as e:
        run_config(raw)
    assert e.value.problems[0].startswith("model.path: 'f' is only read with model.kind=hf")


def test_all_problems_at_once():
    got = problems_of("train.precision=fp8", "train.steps=-1", "parallel.zero=7")
    assert len(got) == 3


def test_the_planner_and_the_data_are_checked_before_any_process(tmp_path):
    run = compose("mesh=pp4", "parallel=pp_1f1b", "model.n_layers=3")
    got = check(run)
    assert len(got) == 1 and got[0].startswith("model.n_layers with the mesh's pipe axis: plan (mesh=pp4")
    short = tmp_path / "short.txt"
    short.write_text("hello")
    got = check(compose("data=file", f"data.path={short}"))
    assert got == [f"data.path: {short} holds 5 bytes — expected at least one sequence of train.seq=64 tokens and "
                   "its target (66 bytes). Use a longer text or a shorter train.seq."]
    assert check(compose("data=file", f"data.path={tmp_path}"))[0].startswith(f"data.path: {tmp_path} is not a file")
    assert "vocab_size: 128 is smaller" in " ".join(check(compose("model.vocab_size=128")))


def test_learning_rate_schedule():
    run = compose("train.steps=110", "train.warmup_steps=10", "train.min_lr=0.1")
    t = run.train
    assert lr_factor(t, 0) == pytest.approx(0.1) and lr_factor(t, 9) == pytest.approx(1.0)
    assert lr_factor(t, 10) == pytest.approx(1.0) and lr_factor(t, 60) == pytest.approx(0.55)
    assert lr_factor(t, 110) == pytest.approx(0.1)
    flat = compose("train.lr_schedule=constant").train
    assert {lr_factor(flat, i) for i in range(flat.warmup_steps, 50)} == {1.0}


def test_the_library_never_imports_hydra():
    code = ("import sys, torch, shardlib as sl\n"
            "from shardlib.frontend.config.run_config import run_config\n"
            "from shardlib.frontend.run import Trainer, check\n"
            "from shardlib.models import GPT, GPTConfig\n"
            "sl.plan(GPT(GPTConfig()), sl.AbstractMesh({'data': 2}), zero=3).explain()\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')], 'hydra imported'\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_composition_is_remembered_until_conf_changes(tmp_path):
    """``check_overrides`` composes once per (overrides, conf/ as it is): an edited preset is read again,
    and each call gets its own copy (a caller's edit never reaches the next caller)."""
    import shutil

    from shardlib.cli.compose import conf_dir
    root = tmp_path / "conf"
    shutil.copytree(conf_dir(), root)
    first = check_overrides(["mesh=dp4"], root=root)
    assert first["mesh"]["axes"] == {"data": 4}
    first["mesh"]["axes"]["data"] = 99
    assert check_overrides(["mesh=dp4"], root=root)["mesh"]["axes"] == {"data": 4}
    preset = root / "mesh" / "dp4.yaml"
    preset.write_text(preset.read_text().replace("axes: {data: 4}", "axes: {data: 2, tensor: 2}"))
    assert check_overrides(["mesh=dp4"], root=root)["mesh"]["axes"] == {"data": 2, "tensor": 2}
