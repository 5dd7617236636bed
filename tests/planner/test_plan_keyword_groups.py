"""``sl.plan``'s settings as policies (``planner/policies.py``), pure: the grouped and the flat spellings give
equal plans, every flat keyword is the short form of exactly one field, synonyms set one field, and a field
given twice with two values is refused naming both."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.policies import GROUPS, SHORT_FORMS

TP3D = {"layers": "pipe", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
AXES = ("data_axis", "tensor_axis", "pipe_axis")
CFG = GPTConfig(n_layers=4, vocab_size=64, d_model=32, n_heads=2, seq_len=8)


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    with torch.device("meta"):
        return GPT(CFG)


# (mesh axes, the keywords no group holds, the groups) — every group and almost every field in use
CASES = {
    "3d": ({"data": 2, "pipe": 2, "tensor": 2}, {"rules": TP3D, "batch": "example"}, {
        "memory": sl.MemoryPolicy(zero=3, recompute="selective", reshard_after_forward=False),
        "pipeline": sl.PipelinePolicy(schedule="interleaved_1f1b", virtual_stages=2, pipe_gather="step"),
        "tensor": sl.TensorPolicy(sequence_parallel=True),
        "training": sl.TrainingPolicy(precision="bf16", microbatches=4, clip_grad_norm=1.0, optimizer="adamw"),
    }),
    "hsdp": ({"replica": 2, "data": 2}, {}, {
        "roles": sl.MeshRoles(replica="replica"),
        "data": sl.DataPolicy(bucket_mb=1.0, broadcast_buffers=False),
        "memory": sl.MemoryPolicy(zero=2, units=["blocks.0", "blocks.2"], recompute=["blocks.0"],
                                  offload={"optimizer": "host"}),
        "training": sl.TrainingPolicy(precision="fp16", reduce_dtype="fp32", microbatches=2, optimizer="sgd"),
    }),
    "renamed axes": ({"dp": 2, "pp": 2, "tp": 2}, {"rules": {"layers": "pp", "heads": "tp", "mlp": "tp"}}, {
        "roles": sl.MeshRoles(data="dp", tensor="tp", pipe="pp"),
        "pipeline": sl.PipelinePolicy(schedule="gpipe", stages=[1, 3]),
        "memory": sl.MemoryPolicy(zero=sl.StateLayouts.zero(1, "dp")),
    }),
}


# the short form of each field (the first keyword naming it)
FLAT = {field: flat for flat, field in reversed(SHORT_FORMS.items())}


def _flat(groups: dict) -> dict:
    return {FLAT[key, k]: v for key, g in groups.items() for k, v in g.given().items()}


def _args(model: GPT, case: str) -> tuple[sl.AbstractMesh, dict, dict]:
    axes, common, groups = CASES[case]
    if common.get("batch") == "example":
        common = {**common, "batch": token_batch(CFG, 16, 0)}
    return sl.AbstractMesh(axes), common, groups


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_and_flat_spellings_plan_alike(model, case):
    mesh, common, groups = _args(model, case)
    flat = sl.plan(model, mesh, **common, **_flat(groups))
    grouped = sl.plan(model, mesh, **common, **groups)
    assert grouped == flat
    assert grouped.explain() == flat.explain()
    plain = {k: v for k, v in {**common, **_flat(groups)}.items() if k in ("rules", *AXES)}
    assert sl.plan(model, mesh, **plain) != flat          # the policies made a difference
    # half flat, half grouped: the same plan again
    first, *rest = groups
    mixed = sl.plan(model, mesh, **common, **_flat({first: groups[first]}), **{k: groups[k] for k in rest})
    assert mixed == flat


def test_every_flat_keyword_is_the_short_form_of_one_field():
    params = set(inspect.signature(sl.plan).parameters)
    fields = {(key, f.name) for key, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    assert params == set(SHORT_FORMS) | set(GROUPS) | {"model", "mesh", "rules", "batch"}
    assert set(SHORT_FORMS.values()) == fields, "a field with no short form, or a short form of no field"
    # the synonyms: one field each
    assert SHORT_FORMS["grad_accum"] == SHORT_FORMS["microbatches"] == ("training", "microbatches")
    assert SHORT_FORMS["zero"] == SHORT_FORMS["states"] == ("memory", "zero")
    assert {SHORT_FORMS[a][0] for a in ("data_axis", "tensor_axis", "pipe_axis", "replica_axis")} == {"roles"}
    assert {name: cls.__name__ for name, cls in GROUPS.items()} == {
        "roles": "MeshRoles", "data": "DataPolicy", "tensor": "TensorPolicy", "pipeline": "PipelinePolicy",
        "memory": "MemoryPolicy", "training": "TrainingPolicy"}
    assert all(getattr(sl, cls.__name__) is cls and cls.__name__ in sl.__all__ for cls in GROUPS.values())


def test_a_keyword_given_both_ways_must_agree(model):
    mesh = sl.AbstractMesh({"data": 2})
    with pytest.raises(sl.ShardingError) as err:
        sl.plan(model, mesh, zero=1, memory=sl.MemoryPolicy(zero=3))
    assert str(err.value) == ("plan: zero is given twice and the two disagree — got zero=1 and "
                              "memory=MemoryPolicy(zero=3); expected one value. Drop one of them.")
    with pytest.raises(sl.ShardingError, match=r"zero=1 and memory=MemoryPolicy\(zero=3\)"):
        sl.plan(model, mesh, 1, memory=sl.MemoryPolicy(zero=3))        # zero given by position
    # an explicit default is a value given: it clashes too
    with pytest.raises(sl.ShardingError, match=r"precision='fp32' and training=TrainingPolicy\(precision='bf16'\)"):
        sl.plan(model, mesh, precision="fp32", training=sl.TrainingPolicy(precision="bf16"))
    # every clash at once, one bullet each
    with pytest.raises(sl.ShardingError) as err:
        sl.plan(model, mesh, zero=1, recompute="full", grad_accum=2,
                memory=sl.MemoryPolicy(zero=3, recompute="selective"), training=sl.TrainingPolicy(microbatches=4))
    assert str(err.value).startswith("plan: 3 problems:\n")
    assert [p.split(" is given twice")[0] for p in err.value.problems] == ["plan: zero", "plan: recompute",
                                                                           "plan: microbatches"]
    # two synonyms of one field
    with pytest.raises(sl.ShardingError, match=r"microbatches is given twice .* microbatches=4 and grad_accum=2"):
        sl.plan(model, mesh, grad_accum=2, microbatches=4)
    assert sl.plan(model, mesh, grad_accum=2) == sl.plan(model, mesh, microbatches=2)
    with pytest.raises(sl.ShardingError, match=r"zero is given twice .* zero=1 and states="):
        sl.plan(model, mesh, zero=1, states=sl.StateLayouts.zero(3))
    # the same value both ways is one value
    assert sl.plan(model, mesh, zero=3, memory=sl.MemoryPolicy(zero=3)) == sl.plan(model, mesh, zero=3)


def test_groups_are_checked_as_the_flat_keywords(model):
    mesh = sl.AbstractMesh({"data": 2})
    with pytest.raises(sl.ShardingTypeError, match=r"plan: memory= must be a sl.MemoryPolicy — got dict"):
        sl.plan(model, mesh, memory={"zero": 3})
    with pytest.raises(sl.ShardingTypeError, match=r"pipeline= must be a sl.PipelinePolicy — got TensorPolicy"):
        sl.plan(model, mesh, pipeline=sl.TensorPolicy(sequence_parallel=True))
    for flat, grouped in [({"zero": 5}, {"memory": sl.MemoryPolicy(zero=5)}),
                          ({"precision": "fp8"}, {"training": sl.TrainingPolicy(precision="fp8")}),
                          ({"data_axis": "dp"}, {"roles": sl.MeshRoles(data="dp")})]:
        with pytest.raises(sl.ShardingError) as want:
            sl.plan(model, mesh, **flat)
        with pytest.raises(sl.ShardingError) as got:
            sl.plan(model, mesh, **grouped)
        assert str(got.value) == str(want.value)


def test_policies_are_small_frozen_values():
    p = sl.PipelinePolicy(schedule="gpipe", virtual_stages=2)
    assert repr(p) == "PipelinePolicy(schedule='gpipe', virtual_stages=2)"
    assert repr(sl.MemoryPolicy()) == "MemoryPolicy()"
    assert p == sl.PipelinePolicy(virtual_stages=2, schedule="gpipe") and hash(p) == hash(sl.PipelinePolicy(
        virtual_stages=2, schedule="gpipe"))
    assert p.given() == {"schedule": "gpipe", "virtual_stages": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.schedule = "1f1b"
    with pytest.raises(TypeError):
        sl.PipelinePolicy("gpipe")          # keywords only: a field is named where it is set
    assert dataclasses.replace(p, schedule="zb_h1").schedule == "zb_h1"
