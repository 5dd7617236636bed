"""Planning at scale (no processes): linear in the number of parameter tensors, and an
``explain()`` of a 1000-layer model that reads in one screen.

Linearity is checked by counting the lines of
Python run (deterministic, unlike time): 10x the layers may cost at most ~10x the steps. Timings are in
``benchmarks/bench_planning_model.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

import shardlib as sl
from shardlib.models import GPT, GPTConfig
from work import steps

MESH = sl.AbstractMesh({"data": 8})


def gpt(layers: int) -> torch.nn.Module:
    """A GPT of ``layers`` blocks of 12 tensors (+ 5 at the root), tiny enough to build on the CPU
    (``torch.device("meta")`` construction is several times slower than these few floats)."""
    return GPT(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=layers), seed=0)


@pytest.mark.parametrize("zero", [0, 3])
def test_planning_and_explaining_are_linear_in_the_parameters(zero):
    """10 -> 100 layers (125 -> 1,205 tensors): each of plan, explain and the accounting it prints
    grows about 10x in steps (a scan of every unit per parameter, or of every parameter per unit,
    grows ~100x in its part and pushes the total ratio well above 11)."""
    small, large = gpt(10), gpt(100)
    queries = {
        "plan": lambda m: lambda: sl.plan(m, MESH, zero=zero),
        "explain": lambda m: sl.plan(m, MESH, zero=zero).explain,
        "explain(full)": lambda m: lambda: sl.plan(m, MESH, zero=zero).explain(full=True),
        "accounting": lambda m: (lambda p: lambda: (p.memory_per_rank(), p.comm_per_step(), p.transient_per_rank(),
                                                    p.gather_schedule(), p.ring_minimum(),
                                                    [p.param(q.name) for q in p.params],
                                                    [p.unit_params(u.name) for u in p.units]))(
            sl.plan(m, MESH, zero=zero)),
    }
    for name, make in queries.items():
        a, b = steps(make(small)), steps(make(large))
        assert b <= 11 * a, (name, a, b, b / a)


def test_units_are_found_by_name_prefix_not_by_scanning():
    """Units nested in units, tied weights across units (root) and a unit whose name is a prefix
    of another's without containing it (``blocks.1`` vs ``blocks.10``)."""
    model = gpt(12)
    plan = sl.plan(model, MESH, zero=3)
    assert plan.param("blocks.10.attn.qkv.weight").unit == "blocks.10"
    assert plan.param("blocks.1.attn.qkv.weight").unit == "blocks.1"
    assert [p.name for p in plan.unit_params("blocks.10")][:2] == ["blocks.10.ln1.weight", "blocks.10.ln1.bias"]
    nested = sl.plan(model, MESH, zero=3, units=["blocks.1", "blocks.1.attn", "blocks.10.mlp"])
    unit = {p.name: p.unit for p in nested.params}
    assert unit["blocks.1.attn.qkv.bias"] == "blocks.1.attn"        # the innermost unit
    assert unit["blocks.1.mlp.fc.weight"] == "blocks.1"
    assert unit["blocks.10.attn.qkv.weight"] == ""                  # blocks.10 is not blocks.1
    assert unit["blocks.10.mlp.out.bias"] == "blocks.10.mlp"
    model.blocks[3].mlp.fc.weight = model.blocks[4].mlp.fc.weight    # tied across two units: root
    assert sl.plan(model, MESH, zero=3).param("blocks.3.mlp.fc.weight").unit == ""
    with pytest.raises(KeyError):
        plan.param("blocks.12.ln1.weight")
    assert plan.unit_params("blocks.12") == []


# ---------------------------------------------------------------------------------------------
# explain(): one screen for a large plan, everything with full=True
# ---------------------------------------------------------------------------------------------

def test_explain_of_a_1000_layer_plan_reads_in_one_screen():
    plan = sl.plan(gpt(1000), MESH, zero=3, precision="bf16")
    text = plan.explain()
    lines = text.splitlines()
    assert len(lines) < 60 and max(map(len, lines)) <= 200, (len(lines), max(map(len, lines)))
    # 1000 blocks of 12 tensors: each block tensor one row with its count; the units one entry
    assert "blocks.0..999 (1000 units x 12 params)" in text
    row = next(line for line in lines if "blocks.*.attn.qkv.weight" in line)
    assert row.split()[1:3] == ["[24,", "8]"] and row.split()[-1] == "1000"
    # forward: after the root and block 0, block i is waited for, then block i+1 prefetched, then
    # block i freed, for i = 0..998; backward gathers block i only once block i+1 is freed
    flat = " ".join(text.split())                           # the schedule wraps at the screen's width
    assert "[W(blocks.i) G(blocks.i+1) F(blocks.i)] x999 (i = 0..998)" in flat
    assert "[G(blocks.i) W(blocks.i) F(blocks.i)] x1000 (i = 999..0)" in flat
    assert "(x1000)" in text and "[blocks.0..999]" in text
    # every number the plan states is printed
    mem, formula = plan.memory_per_rank(), plan.zero_formula()
    for k in ("params", "grads", "optimizer", "total"):
        assert re.search(rf"{k}\s+{re.escape(sl.format_bytes(mem[k]))}\s+\(ZeRO formula "
                         rf"{re.escape(sl.format_bytes(formula[k]))}\)", text), k
    assert sl.format_bytes(plan.transient_per_rank()["gathered"]) in text
    assert (f"total {sl.format_bytes(plan.comm_bytes_per_step())}; params+grads "
            f"{sl.format_bytes(plan.comm_bytes_per_step('params') + plan.comm_bytes_per_step('grads'))} "
            f"vs ring minimum {sl.format_bytes(plan.ring_minimum())}") in text


def test_explain_full_lists_every_parameter_unit_and_collective():
    plan = sl.plan(gpt(30), MESH, zero=3)
    rows = plan.explain(full=True).splitlines()
    names = [line.split()[0] for line in rows if line.startswith("  ") and not line.startswith("    ")]
    assert [p.name for p in plan.params] == [n for n in names if n in {p.name for p in plan.params}]
    assert len(plan.params) == 5 + 30 * 12
    assert all(f"blocks.{i}(12)" in "\n".join(rows) for i in range(30))
    assert sum(line.endswith("[blocks.7]") for line in rows) == 3      # gather, gather again, reduce-scatter
    assert len(plan.explain(max_params=3, full=True).splitlines()) < len(rows)
    assert "... and 362 more parameters" in plan.explain(max_params=3, full=True)


def test_max_params_caps_the_rows():
    plan = sl.plan(gpt(4), MESH, zero=0)
    text = plan.explain(max_params=2)
    assert "wte.weight" in text and "wpe.weight" in text and "ln1" not in text
    assert "... and 15 more rows (51 parameters)" in text   # 12 block rows of 4 + 3 root rows


def unfold(folded: str) -> list[str]:
    """Expand ``[A(x.i+1) B(x.i)] xK (i = a..b)`` back into events (the inverse of the folding)."""
    out: list[str] = []
    for m in re.finditer(r"\[([^\]]*)\] x(\d+)(?: \(i = (\d+)\.\.(\d+)(?: step (-?\d+))?\))?|(\S+)", folded):
        if m.group(6):
            out.append(m.group(6))
            continue
        block, k = m.group(1).split(), int(m.group(2))
        if m.group(3) is None:
            out += block * k
            continue
        a, b = int(m.group(3)), int(m.group(4))
        step = int(m.group(5) or (1 if b >= a else -1))
        assert (b - a) // step + 1 == k
        for i in range(a, b + step, step):
            out += [re.sub(r"(?<=\.)i([+-]\d+)?(?=[.)])", lambda g: str(i + int(g.group(1) or 0)), e) for e in block]
    return out


@pytest.mark.parametrize("layers, kw", [(7, {}), (7, {"reshard_after_forward": False}),
                                        (40, {"units": [f"blocks.{i}" for i in range(0, 40, 2)]}), (3, {})])
def test_the_folded_gather_schedule_is_the_schedule(layers, kw):
    plan = sl.plan(gpt(layers), MESH, zero=3, **kw)
    text = plan.explain()
    start = text.index("in this order:)") + len("in this order:)")
    folded = " ".join(text[start:text.index("collectives per step")].split())
    assert unfold(folded) == list(plan.gather_schedule())
    if layers >= 7:
        assert "] x" in folded                                  # it did fold
