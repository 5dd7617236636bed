"""Spec front end: ``@sl.shard`` tables, ``sl.AxisRules`` and ``resolve_specs`` (no processes)."""

import copy
import pickle

import pytest
import torch
from torch import nn

import shardlib as sl
from shardlib import P
from shardlib.planner.specs import resolve_specs

MESH = sl.AbstractMesh({"data": 2, "tensor": 2})
RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


@sl.shard({"qkv.weight": ("heads", "embed"), "qkv.bias": ("heads",), "proj.weight": ("embed", "heads")})
class Attn(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(q * k + v)


class PlainAttn(nn.Module):      # the same module, never decorated
    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)


class Net(nn.Module):
    def __init__(self, d: int = 8, n: int = 2):
        super().__init__()
        self.wte = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Attn(d) for _ in range(n))
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)


def problems_of(info) -> list[str]:
    return info.value.problems


# ---- decoration ---------------------------------------------------------------------------------

def test_class_decoration_applies_to_every_instance():
    specs = resolve_specs(Net(), MESH, RULES)
    for i in range(2):
        assert specs[f"blocks.{i}.qkv.weight"] == P("tensor", None)
        assert specs[f"blocks.{i}.qkv.bias"] == P("tensor")
        assert specs[f"blocks.{i}.proj.weight"] == P(None, "tensor")
        assert specs[f"blocks.{i}.proj.bias"] == P()          # no pattern: replicated
    assert specs["wte.weight"] == P() and specs["fc.weight"] == P()
    assert list(specs) == [n for n, _ in Net().named_parameters()]


def test_class_decoration_leaves_class_and_instances_plain():
    torch.manual_seed(0)
    a = Attn()
    torch.manual_seed(0)
    b = PlainAttn()
    assert Attn.__dict__.keys() - {"__init__", "forward"} == PlainAttn.__dict__.keys() - {"__init__"}
    assert a.__dict__.keys() == b.__dict__.keys()
    assert all(p.__dict__ == {} for p in a.parameters())                 # nothing on the tensors
    x = torch.randn(2, 8)
    clone = pickle.loads(pickle.dumps(a))
    torch.testing.assert_close(clone(x), a(x))
    assert type(clone) is Attn and pickle.loads(pickle.dumps(Attn)) is Attn
    deep = copy.deepcopy(a)
    torch.testing.assert_close(deep(x), a(x))
    assert resolve_specs(deep, MESH, RULES)["qkv.weight"] == P("tensor", None)   # class tables follow copies


def test_instance_decoration_returns_the_instance_and_touches_only_it():
    a, b = PlainAttn(), PlainAttn()
    assert sl.shard(MESH, {"qkv.weight": P("tensor", None), "*.bias": P()})(a) is a
    assert resolve_specs(a, MESH)["qkv.weight"] == P("tensor", None)
    assert resolve_specs(b, MESH)["qkv.weight"] == P()
    assert all(p.__dict__ == {} for p in a.parameters())


def test_spec_axes_are_checked_on_the_scoped_mesh_or_at_resolve():
    a, b, c = PlainAttn(), PlainAttn(), PlainAttn()
    sl.shard({"qkv.weight": P("tensor", None)})(a)           # no mesh anywhere: checked at resolve time
    with sl.use_mesh(MESH):
        sl.shard(spec={"qkv.weight": P("tensor", None)})(b)
        assert resolve_specs(b)["qkv.weight"] == P("tensor", None)        # mesh from the scope
        with pytest.raises(sl.SpecError, match="unknown mesh axis 'tensr'.*Did you mean 'tensor'"):
            sl.shard({"qkv.weight": P("tensr", None)})               # checked against the scope's mesh now
    sl.shard({"qkv.weight": P("tensr", None)})(c)                    # no mesh: deferred ...
    with pytest.raises(sl.SpecError, match="'qkv.weight' of shape \\(24, 8\\).*unknown mesh axis 'tensr'"):
        resolve_specs(c, MESH)                                         # ... to the plan's mesh
    assert resolve_specs(a, MESH)["qkv.weight"] == P("tensor", None)


def test_wrong_kinds_are_type_errors():
    with pytest.raises(sl.ShardingTypeError, match="where the mesh belongs"):
        sl.shard(PlainAttn(), {"qkv.weight": P()})
    with pytest.raises(sl.ShardingTypeError, match="no table given"):
        sl.shard(MESH)
    with pytest.raises(sl.ShardingTypeError, match="expected an nn.Module subclass or instance"):
        sl.shard(MESH, {"w": P()})(object())
    with pytest.raises(sl.ShardingTypeError) as info:
        sl.shard(MESH, {"a": "tensor", "b": ("heads", 3), 4: P()})
    msg = str(info.value)
    assert "several table entries" in msg and "'a' maps to 'tensor'" in msg and "'b'" in msg and "pattern 4" in msg
    with pytest.raises(sl.ShardingTypeError, match="P\\(\\) replicates"):
        sl.shard(MESH, {"a": None})


# ---- rules --------------------------------------------------------------------------------------

def test_logical_names_resolve_through_rules_and_default_to_replicated():
    assert resolve_specs(Net(), MESH)["blocks.0.qkv.weight"] == P(None, None)     # no rules: replicated
    rules = sl.AxisRules({"heads": "tensor", "embed": None})
    assert resolve_specs(Net(), MESH, rules)["blocks.1.proj.weight"] == P(None, "tensor")
    m = sl.shard({"fc.weight": ("mlp", "embed"), "out.weight": ("embed", "mlp")})(Net())
    specs = resolve_specs(m, MESH, {"mlp": ("data", "tensor")[1:], "embed": None})
    assert specs["fc.weight"] == P("tensor", None) and specs["out.weight"] == P(None, "tensor")


def test_axis_rules_coerce_pickle_resolve_and_refuse_bad_rules():
    rules = sl.AxisRules({"heads": "tensor", "embed": None, "mlp": ["tensor"], "x": ("a", "b")})
    assert rules["mlp"] == "tensor" and rules["x"] == ("a", "b") and dict(rules)["embed"] is None
    assert sl.AxisRules.coerce(None) == {} and sl.AxisRules.coerce(rules) is rules
    assert sl.AxisRules.coerce({"heads": "tensor"}) == sl.AxisRules({"heads": "tensor"})
    assert pickle.loads(pickle.dumps(rules)) == rules
    assert rules.resolve(("heads", None, "embed", "unnamed")) == P("tensor", None, None, None)
    assert rules.resolve(("heads", "embed"), mesh=MESH, name="w", shape=(4, 4)) == P("tensor", None)
    with pytest.raises(sl.ShardingTypeError) as info:
        sl.AxisRules({"heads": 1, 2: "tensor"})
    assert "several rules" in str(info.value) and "'heads' maps to 1" in str(info.value)
    with pytest.raises(sl.SpecError, match="rule 'x' names a mesh axis twice"):
        sl.AxisRules({"x": ("tensor", "tensor")})
    with pytest.raises(sl.ShardingTypeError, match="expected a mapping"):
        sl.AxisRules.coerce(["heads"])
    with pytest.raises(sl.ShardingTypeError, match="tuple of logical dim names"):
        rules.resolve(P("tensor"))
    with pytest.raises(sl.SpecError) as info:        # every problem at once
        sl.AxisRules({"a": "tensor", "b": "tensor", "c": "tensr"}).resolve(
            ("a", "b", "c"), mesh=MESH, name="w", shape=(2, 2))
    assert len(problems_of(info)) == 3
    msg = str(info.value)
    assert "of 'w'" in msg and "mesh axis 'tensor'" in msg and "rank 2" in msg and "unknown mesh axis 'tensr'" in msg


# ---- nesting and conflicts ----------------------------------------------------------------------

def test_nested_tables_compose_relative_to_their_module():
    m = Net()
    sl.shard(MESH, {"blocks.*.qkv.weight": P("tensor", None),          # agrees with Attn's table
                    "blocks.1.proj.bias": P("tensor"),                # only the outer table names it
                    "fc.*": ("mlp",)})(m)
    sl.shard(MESH, {"weight": P(None, "tensor")})(m.out)           # relative to m.out
    specs = resolve_specs(m, MESH, RULES)
    assert specs["blocks.0.qkv.weight"] == P("tensor", None)
    assert specs["blocks.1.proj.bias"] == P("tensor") and specs["blocks.0.proj.bias"] == P()
    assert specs["fc.weight"] == P("tensor") and specs["fc.bias"] == P("tensor")
    assert specs["out.weight"] == P(None, "tensor") and specs["out.bias"] == P()


def test_different_specs_for_one_parameter_are_an_error_naming_both_patterns():
    m = Net(n=1)
    sl.shard(MESH, {"blocks.0.qkv.weight": P(None, "tensor"),          # Attn's table says ("heads", "embed")
                    "fc.weight": P("tensor"), "f?.weight": P("tensor", None),   # same layout twice: fine
                    "out.*": P(None, "tensor"), "out.w*": P("tensor", None)})(m)
    with pytest.raises(sl.SpecError) as info:
        resolve_specs(m, MESH, RULES)
    msgs = problems_of(info)
    qkv = [p for p in msgs if "'blocks.0.qkv.weight'" in p]
    assert len(qkv) == 1 and "of shape (24, 8)" in qkv[0] and "different specs" in qkv[0]
    assert "pattern 'blocks.0.qkv.weight'" in qkv[0] and "pattern 'qkv.weight' of @sl.shard on class Attn" in qkv[0]
    assert "Narrow the patterns" in qkv[0]
    out = [p for p in msgs if "'out.weight'" in p]
    assert len(out) == 1 and "'out.*'" in out[0] and "'out.w*'" in out[0]   # two patterns of one table
    assert len(msgs) == 3 and "'out.bias'" in msgs[2] and "rank 1" in msgs[2]      # 'fc.weight' is fine


def test_tied_parameters_are_matched_under_every_name():
    m = Net()
    m.head = nn.Linear(8, 16, bias=False)
    m.head.weight = m.wte.weight
    sl.shard(MESH, {"head.weight": P("tensor", None)})(m)
    specs = resolve_specs(m, MESH)
    assert specs["wte.weight"] == P("tensor", None) and "head.weight" not in specs
    sl.shard(MESH, {"wte.weight": P(None, "tensor")})(m)
    with pytest.raises(sl.SpecError, match="'wte.weight' of shape \\(16, 8\\) gets different specs"):
        resolve_specs(m, MESH)


# ---- bad specs ----------------------------------------------------------------------------------

def test_unknown_axis_names_parameter_shape_spec_and_fix():
    m = sl.shard({"fc.weight": P("tensr", None)})(Net())
    with pytest.raises(sl.ShardingError) as info:
        resolve_specs(m, MESH)
    msg = str(info.value)
    assert "'fc.weight' of shape (32, 8)" in msg and "P('tensr', None)" in msg and "dim 0" in msg
    assert "Did you mean 'tensor'?" in msg and "add the axis to the mesh" in msg


def test_a_rule_mapping_two_dims_to_one_axis_is_refused_naming_both():
    m = sl.shard({"fc.weight": ("mlp", "embed")})(Net())
    with pytest.raises(sl.SpecError) as info:
        resolve_specs(m, MESH, {"embed": "tensor", "mlp": "tensor"})
    (msg,) = problems_of(info)
    assert "'fc.weight' of shape (32, 8)" in msg and "('mlp', 'embed')" in msg
    assert "dim 0 'mlp' -> 'tensor' and dim 1 'embed' -> 'tensor'" in msg
    assert "Map at most one of 'mlp' and 'embed' to 'tensor'" in msg


def test_a_spec_longer_than_the_rank_or_naming_an_axis_twice_is_refused():
    m = sl.shard({"fc.*": P("tensor", None)})(Net())                # fc.bias has rank 1
    with pytest.raises(sl.SpecError) as info:
        resolve_specs(m, MESH)
    (msg,) = problems_of(info)
    assert "'fc.bias' of shape (32,)" in msg and "P('tensor', None)" in msg and "rank 1" in msg
    assert "narrow the pattern" in msg
    with pytest.raises(sl.SpecError, match="axis 'tensor' is used twice, by dim 0 and dim 1"):
        P("tensor", "tensor")                                       # the algebra refuses it first


@pytest.mark.parametrize("spec, fix", [(P("data", None), "zero=3"), (P(("tensor", "data")), "zero=3"),
                                       (P(None, "pipe"), "{'layers': 'pipe'}")])
def test_data_or_pipe_on_a_parameter_is_refused_naming_the_fix(spec, fix):
    mesh = sl.AbstractMesh({"data": 2, "pipe": 1, "tensor": 2})
    with pytest.raises(sl.SpecError, match=fix):                     # at decoration, when the table says it
        sl.shard(mesh, {"fc.weight": spec})
    m = sl.shard({"fc.weight": ("x", "y")})(Net())                  # through rules: at resolve time
    rules = {"x": spec[0], "y": spec[1] if len(spec) > 1 else None}
    with pytest.raises(sl.SpecError) as info:
        resolve_specs(m, mesh, rules)
    (msg,) = problems_of(info)
    assert "'fc.weight' of shape (32, 8)" in msg and "on a parameter" in msg and fix in msg


def test_a_mesh_axis_written_as_a_logical_name_is_refused_with_the_fix():
    m = sl.shard({"fc.weight": ("tensor", None)})(Net())            # meant P("tensor", None)
    with pytest.raises(sl.SpecError, match="'tensor' is a mesh axis but no logical dim name.*Write P"):
        resolve_specs(m, MESH)
    assert resolve_specs(m, MESH, {"tensor": "tensor"})["fc.weight"] == P("tensor", None)


def test_all_problems_in_one_error():
    m = sl.shard({"fc.weight": P("tensr"), "fc.bias": P(None, None), "out.weight": ("mlp", "embed"),
                  "wte.weight": ("vocab",)})(Net())
    with pytest.raises(sl.ShardingError) as info:
        resolve_specs(m, MESH, {"mlp": "tensor", "embed": "tensor", "vocab": "data"})
    assert len(problems_of(info)) == 4
    msg = str(info.value)
    assert msg.startswith("sl.shard: 4 problems:")
    for name in ("'fc.weight'", "'fc.bias'", "'out.weight'", "'wte.weight'"):
        assert name in msg


# ---- strict -------------------------------------------------------------------------------------

def test_strict_table_requires_every_parameter_and_pattern_to_match():
    a = sl.shard(MESH, {"qkv.*": P("tensor")}, strict=True)(PlainAttn())
    with pytest.raises(sl.SpecError) as info:
        resolve_specs(a, MESH)
    msgs = problems_of(info)
    assert len(msgs) == 2
    assert all("matches no pattern" in p and "of shape (8" in p and "Add a pattern" in p for p in msgs)
    assert {"'proj.weight'", "'proj.bias'"} == {p.split()[2] for p in msgs}
    b = sl.shard(MESH, {"*": P(), "qkv.wieght": P("tensor", None)}, strict=True)(PlainAttn())
    with pytest.raises(sl.SpecError, match="pattern 'qkv.wieght' .* matches no parameter"):
        resolve_specs(b, MESH)
    c = sl.shard(MESH, {"qkv.*": P("tensor"), "proj.*": P()}, strict=True)(PlainAttn())
    assert resolve_specs(c, MESH)["proj.weight"] == P()


def test_strict_table_covers_only_its_subtree_and_strict_argument_covers_all():
    m = Net(n=1)
    sl.shard(MESH, {"proj.bias": P()}, strict=True)(m.blocks[0])     # with Attn's table: all covered
    assert resolve_specs(m, MESH, RULES)["fc.weight"] == P()          # outside the strict table: fine
    with pytest.raises(sl.SpecError) as info:
        resolve_specs(Net(n=1), MESH, RULES, strict=True)
    names = {p.split()[2] for p in problems_of(info)}
    assert names == {"'wte.weight'", "'fc.weight'", "'fc.bias'", "'out.weight'", "'out.bias'",
                     "'blocks.0.proj.bias'"}
    assert all("resolve_specs(strict=True)" in p for p in problems_of(info))


# ---- scale --------------------------------------------------------------------------------------

def test_twelve_thousand_parameters_resolve():
    with torch.device("meta"):
        m = nn.ModuleList(nn.Linear(2, 2) for _ in range(6000))        # 12,000 parameters
    sl.shard(MESH, {"*.weight": ("mlp", None), "1.bias": P("tensor"), "59??.bias": P("tensor")})(m)
    specs = resolve_specs(m, MESH, RULES)
    assert len(specs) == 12000
    assert specs["0.weight"] == specs["5999.weight"] == P("tensor", None)
    assert specs["1.bias"] == specs["5999.bias"] == specs["5900.bias"] == P("tensor")
    assert specs["0.bias"] == specs["599.bias"] == P()
    assert sum(s == P("tensor") for s in specs.values()) == 101


def test_a_pattern_that_matches_nothing_is_an_error_naming_the_closest_names():
    """Not only under strict: a typo in a table is named, with the parameter names it most likely meant."""
    a = sl.shard(MESH, {"qkv.weight": P("tensor", None), "*.prj.weight": P(None, "tensor")})(PlainAttn())
    with pytest.raises(sl.SpecError) as info:
        resolve_specs(a, MESH)
    (msg,) = problems_of(info)
    assert "pattern '*.prj.weight'" in msg and "matches no parameter" in msg
    assert "'proj.weight'" in msg.split("closest names are", 1)[1], msg
    b = sl.shard(MESH, {"qkv.wieght": P("tensor", None)})(PlainAttn())
    with pytest.raises(sl.SpecError, match=r"pattern 'qkv.wieght' .* closest names are 'qkv.weight'"):
        resolve_specs(b, MESH)


def test_a_mesh_without_a_data_axis_plans_with_data_one():
    """sl.plan on a mesh of only 'tensor' reads it as data = 1 (the same ranks, one more axis name);
    a data_axis= naming no axis of the mesh is still refused."""
    model = sl.shard({"qkv.weight": P("tensor", None), "qkv.bias": P("tensor"),
                      "proj.weight": P(None, "tensor")})(PlainAttn())
    plan = sl.plan(model, sl.AbstractMesh({"tensor": 2}), zero=1)
    assert plan.data_size == 1 and plan.tensor_size == 2
    assert plan.mesh.axis_sizes == {"data": 1, "tensor": 2}
    assert [plan.mesh.coords(r) for r in range(2)] == [(0, 0), (0, 1)]
    with pytest.raises(sl.ShardingError, match="has no 'dat' axis"):
        sl.plan(model, sl.AbstractMesh({"tensor": 2}), data_axis="dat")
