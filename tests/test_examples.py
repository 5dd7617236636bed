"""End-to-end runs of the examples (slow: each starts its own process world)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int = 300, code: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == code, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_redistribution_demo_checks_every_shard():
    out = _run("examples/demo.py").stdout
    assert "every shard matches the global tensor" in out
    assert out.count("ok") >= 5 * 4          # 5 steps x 4 ranks, each checked against the global tensor
    assert "WRONG" not in out


@pytest.mark.slow
def test_training_run_learns_and_ranks_agree():
    out = _run("examples/train.py", "steps=12", "log_every=6", "zero=3", "mesh=dp2", "model.n_layers=2",
               "model.d_model=64", "batch=8").stdout
    assert "the same on all 2 ranks" in out
    assert "model states held per rank" in out
    first, last = out.split("loss ")[-1].split(" over")[0].split(" -> ")
    assert float(last) < float(first)


# ---- a bad configuration: one message, exit code 2, before any process starts --------------------------

def _example(name: str):
    """Import an example script as a module (its ``main`` is guarded: nothing runs)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_config(**changes) -> dict:
    from omegaconf import OmegaConf

    conf = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "train.yaml"), resolve=True)
    conf.pop("defaults"), conf.pop("hydra")
    conf["mesh"] = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "mesh" / "dp2.yaml"))
    for key, value in changes.items():
        *path, last = key.split("__")
        node = conf
        for part in path:
            node = node[part]
        node[last] = value
    return conf


@pytest.mark.parametrize("changes, expected", [
    ({}, []),
    ({"zero": 5}, ["plan: zero=5 is out of range"]),
    ({"precision": "fp8", "batch": 15, "grad_accum": 2},
     ["plan: precision 'fp8' is unknown",
      "batch=15 does not split over data=2 ranks x grad_accum=2 micro-batches — expected a multiple of 4. "
      "Use batch=12 or 16"]),
    ({"model__d_model": 130}, ["model: GPTConfig: d_model 130 does not divide into 4 heads."]),
    ({"mesh": {"data": 2, "expert": 2}}, ["plan: axes {'expert': 2} are larger than 1"]),
    ({"mesh": {"data": 1, "pipe": 2}, "schedule": "interleaved_1f1b", "grad_accum": 1},
     ["plan: schedule 'interleaved_1f1b'"]),
    ({"steps": 0}, ["steps must be a positive int — got 0."]),
])
def test_training_config_is_checked_whole_without_processes(changes, expected):
    problems = _example("train").check_config(_train_config(**changes))
    assert len(problems) == len(expected), problems
    for got, want in zip(problems, expected):
        assert got.startswith(want), problems


def test_training_config_error_is_one_message_before_any_rank_starts():
    proc = _run("examples/train.py", "precision=fp8", "batch=15", "grad_accum=2", code=2)
    assert proc.stdout == ""                        # no plan printed, no rank started
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "train.py: 2 problems in the configuration:"
    assert lines[1].startswith("  - plan: precision 'fp8' is unknown") and lines[2].startswith("  - batch=15")


def test_demo_config_errors_are_caught_before_any_rank_starts():
    proc = _run("examples/demo.py", "steps=[{from:[bogus,null],to:[null,null]},{from:[data],to:[data,data]}]", code=2)
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "demo.py: 2 problems in the configuration:"
    assert lines[1].startswith("  - steps[0]: Layout: dim 0 of P('bogus', None): unknown mesh axis 'bogus'")
    assert lines[2].startswith("  - steps[1]: P: axis 'data' is used twice")
