"""Memory kinds in the plan (issue 20): ``sl.plan(..., offload=..., offload_dir=...)`` splits each rank's model
states into ``device``, ``host`` and ``disk`` (``memory_per_rank(kind=...)``), lists the copies between kinds
among the step's entries, explains them, and refuses bad input by key before any process starts. The runs
themselves: ``test_offload.py``."""

from __future__ import annotations

import pytest

import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def _plan(**kw):
    return sl.plan(GPT(CFG), sl.AbstractMesh({"data": 2}), **kw)


CASES = [(z, o) for z in (0, 1, 2, 3) for o in ({"optimizer": "host"}, {"optimizer": "disk"})]
# params offload needs ZeRO-3 (test_bad_offload_input_is_refused_naming_the_key)
CASES.append((3, {"optimizer": "host", "params": "disk"}))


@pytest.mark.parametrize("zero, offload", CASES)
def test_kinds_split_the_states(zero, offload, tmp_path):
    plan = _plan(zero=zero, offload=offload, offload_dir=tmp_path if "disk" in offload.values() else None)
    whole = plan.memory_per_rank(0, kind="all")
    kinds = {k: plan.memory_per_rank(0, kind=k) for k in ("device", "host", "disk")}
    for key in ("params", "grads", "optimizer", "total"):
        assert sum(kinds[k][key] for k in kinds) == whole[key], (key, kinds, whole)
    opt = offload["optimizer"]
    assert kinds[opt]["optimizer"] == whole["optimizer"] > 0 and kinds["device"]["optimizer"] == 0
    # sharded gradients (ZeRO-2/3) persist with the update (on the host when it reads from disk); ZeRO-0/1's
    # full local ones stay on the device
    assert kinds[("host" if opt == "disk" else opt) if zero >= 2 else "device"]["grads"] == whole["grads"]
    # in fp32 too the offloaded master is a copy of its own (4 bytes per trainable element more)
    plain = _plan(zero=zero).memory_per_rank(0, kind="all")
    assert whole["optimizer"] == plain["optimizer"] + 4 * (plain["optimizer"] // 8)
    assert kinds[offload.get("params", "device")]["params"] == whole["params"]
    assert plan.memory_per_rank(0) == kinds["device"]
    assert "by memory kind" in plan.explain()


def test_no_offload_is_all_device():
    plan = _plan(zero=3)
    assert plan.memory_per_rank(0) == plan.memory_per_rank(0, kind="all")
    assert plan.memory_per_rank(0, kind="host")["total"] == plan.memory_per_rank(0, kind="disk")["total"] == 0


@pytest.mark.parametrize("kw, match", [
    ({"offload": {"optimiser": "host"}}, r"state 'optimiser' — expected one of optimizer, params, activations; the closest names are 'optimizer'"),
    ({"offload": {"optimizer": "cpu"}}, r"offload\['optimizer'\] is 'cpu' — expected a memory kind among device, host, disk"),
    ({"offload": {"optimizer": "disk"}}, r"on 'disk' but offload_dir is not given"),
    ({"offload": {"params": "host"}, "zero": 2}, r"without zero=3 .* nothing at rest to move"),
    ({"offload": {"activations": "host"}, "recompute": True}, r"with recompute .* nothing of it to move"),
    ({"offload": {"optimizer": "host"}, "offload_dir": "/tmp"}, r"nothing is offloaded to 'disk'"),
])
def test_bad_offload_input_is_refused_naming_the_key(kw, match):
    with pytest.raises(sl.ShardingError, match=match):
        _plan(**kw)
    with pytest.raises(sl.ShardingTypeError, match="offload must be a mapping"):
        _plan(offload="host")


def test_disk_offload_checks_the_folder_and_holds_two_generations(tmp_path):
    model = GPT(CFG)
    mesh = sl.Mesh({"data": 1})
    with pytest.raises(sl.ShardingError, match="is not a folder"):
        sl.plan(model, mesh, offload={"optimizer": "disk"}, offload_dir=tmp_path / "missing")
    plan = sl.plan(model, mesh, offload={"optimizer": "disk"}, offload_dir=tmp_path)
    # two generations per rank: a step writes the next while the last stays whole
    assert 0 < plan.disk_bytes() == 2 * plan.memory_per_rank(0, kind="disk")["total"]
    # a CPU mesh: explain says the host is the device's memory here
    assert "'host' is the same memory as 'device'" in plan.explain()


# ---- the config groups and the dry run ------------------------------------------------------------

def test_dry_run_shows_each_kind():
    from shardlib.frontend.dryrun import dry_run, report
    from test_dryrun import run_of

    plain = dry_run(run_of("model=small", "mesh=dp2", "parallel=zero3"))
    off = dry_run(run_of("model=small", "mesh=dp2", "parallel=zero3", "+parallel.offload.optimizer=host"))
    assert off.plan.offload == (("optimizer", "host"),)
    host = off.plan.memory_per_rank(off.worst_rank, kind="host")
    # (fp32 Adam: the moments' 8 bytes per element, and 4 of the master's own copy once offloaded)
    assert off.memory["optimizer"] == 0 and host["optimizer"] == plain.memory["optimizer"] * 3 // 2 > 0
    assert off.memory["total"] == plain.memory["total"] - plain.memory["optimizer"] - plain.memory["grads"]
    text = report(off)
    assert "(device)" in text and "offload: optimizer -> host" in text


def test_bad_offload_config_keys_are_refused_with_the_close_name():
    from shardlib.frontend.config.run_config import ConfigError
    from test_dryrun import run_of

    with pytest.raises(ConfigError, match=r"parallel.offload.optimiser: unknown state .* Did you mean parallel.offload.optimizer"):
        run_of("model=small", "mesh=dp2", "parallel=zero3", "+parallel.offload.optimiser=host")
    with pytest.raises(ConfigError, match=r"parallel.offload.optimizer: got 'cpu'; expected a memory kind"):
        run_of("model=small", "mesh=dp2", "parallel=zero3", "+parallel.offload.optimizer=cpu")


def test_copies_are_entries_of_the_step():
    """Offload adds the copies between kinds to ``comm_per_step`` (no axes), apart from the bytes sent."""
    plain = _plan(zero=3)
    off = _plan(zero=3, offload={"optimizer": "host", "params": "host"})
    copies = [e for e in off.comm_per_step(0) if not e.axes]
    assert {e.op for e in copies} == {"d2h", "h2d"} and off.comm_bytes_per_step() == plain.comm_bytes_per_step()
    got = off.copy_bytes_per_step(0)
    n_opt = plain.memory_per_rank(0)["grads"] // 4          # this rank's trainable elements (fp32 grads)
    assert got["d2h"] == 4 * n_opt                          # each reduced gradient piece to the host, fp32
    assert got["disk_read"] == got["disk_write"] == 0 and got["h2d"] > 4 * plain.memory_per_rank(0)["params"] // 4
    assert plain.copy_bytes_per_step(0) == {"d2h": 0, "h2d": 0, "disk_read": 0, "disk_write": 0}
