"""PartitionSpec: construction, normalization, printing, errors."""

import pickle

import pytest

import shardlib as sl
from shardlib import P


def test_repr_is_itself_and_hashable():
    assert repr(P("data", None)) == "P('data', None)"
    assert repr(P(("data", "tensor"))) == "P(('data', 'tensor'))"
    assert repr(P()) == "P()"
    assert len({P("data"), P("data"), P(None, "data")}) == 2
    assert pickle.loads(pickle.dumps(P(("data", "tensor"), None))) == P(("data", "tensor"), None)


def test_equivalent_entries_normalize_and_dims_past_the_spec_replicate():
    assert P(("data",)) == P("data")          # one-axis tuple is the axis
    assert P(()) == P(None)                    # empty tuple is replicated
    assert P(["data", "tensor"]) == P(("data", "tensor"))
    assert P("data", ("pipe", "tensor")).axes == ("data", "pipe", "tensor")
    assert P("data", None).dim_axes(0) == ("data",)
    assert P("data", None).dim_axes(1) == ()
    assert P("data").dim_axes(5) == ()        # beyond the spec: replicated


def test_wrong_kinds_are_type_errors():
    with pytest.raises(TypeError, match="dim 0 is 0 of type int"):
        P(0, None)
    with pytest.raises(sl.ShardingTypeError, match="dim 1 holds 3"):
        P(None, ("data", 3))


def test_axis_used_twice_is_a_value_error_naming_both_dims():
    with pytest.raises(sl.SpecError) as info:
        P("data", ("tensor", "data"))
    msg = str(info.value)
    assert "'data'" in msg and "dim 0" in msg and "dim 1" in msg


def test_several_problems_reported_at_once():
    with pytest.raises(sl.SpecError) as info:
        P("data", "data", "tensor", "tensor")
    assert len(info.value.problems) == 2


# ---- Fused --------------------------------------------------------------------------------------

def test_fused_is_an_immutable_hashable_entry_with_a_short_repr():
    f = sl.Fused(3, "tensor")
    assert repr(f) == "Fused(3, 'tensor')" and repr(P(None, f)) == "P(None, Fused(3, 'tensor'))"
    assert f == sl.Fused(3, "tensor") and hash(f) == hash(sl.Fused(3, "tensor"))
    assert f != sl.Fused(2, "tensor") and f != "tensor" and f != ("tensor",) and ("tensor",) != f
    assert P(None, f) != P(None, "tensor")
    assert len({P(None, f), P(None, sl.Fused(3, "tensor"))}) == 1
    with pytest.raises(AttributeError):
        f.parts = 2
    spec = P(sl.Fused(2, ("data", "tensor")), None)
    assert pickle.loads(pickle.dumps(spec)) == spec and repr(spec[0]) == "Fused(2, ('data', 'tensor'))"
    assert spec.axes == ("data", "tensor") and tuple(spec.dim_axes(0)) == ("data", "tensor") and spec.fused() == {0: 2}
    assert P.from_dim_axes([(), f]) == P(None, f)


def test_fused_bad_parts_axis_nesting_and_reuse_are_refused():
    with pytest.raises(sl.ShardingTypeError, match="parts must be an int >= 1"):
        sl.Fused(0, "tensor")
    with pytest.raises(sl.ShardingTypeError, match="axis must be a mesh axis name"):
        sl.Fused(3, 3)
    with pytest.raises(sl.ShardingTypeError, match="Fused entry on its own"):
        P(("data", sl.Fused(3, "tensor")))
    with pytest.raises(sl.SpecError, match="used twice"):
        P(sl.Fused(3, "tensor"), "tensor")
