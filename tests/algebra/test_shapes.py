"""Global shapes are validated where they enter (``algebra/shape.py``): a negative, float, str or
bool size is refused with a message naming the dim, instead of planning a tensor that cannot
exist (``local_shape((-5,))`` used to return ``(-1,)``; ``plan_redistribute`` reported ``-32 B``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardlib as sl
from shardlib.errors import ShardingTypeError, SpecError

MESH = sl.AbstractMesh({"data": 2, "tensor": 2})
ROW = sl.Layout(MESH, sl.P("data"))


@pytest.mark.parametrize("call", [
    lambda s: ROW.local_shape(s, rank=0),
    lambda s: ROW.local_slices(s, rank=1),
    lambda s: ROW.local_numel(s, rank=0),
    lambda s: ROW.padded_local_shape(s),
    lambda s: sl.plan_redistribute(sl.Layout(MESH, sl.P()), ROW, s),
], ids=["local_shape", "local_slices", "local_numel", "padded_local_shape", "plan_redistribute"])
@pytest.mark.parametrize("shape, error, words", [
    ((-5,), SpecError, ["dim 0", "negative", "got -5"]),
    ((-32,), SpecError, ["dim 0", "negative", "got -32"]),
    ((2.5,), ShardingTypeError, ["dim 0", "not an integer size", "got 2.5", "float"]),
    ((4.0,), ShardingTypeError, ["dim 0", "not an integer size", "Write 4"]),
    (("8",), ShardingTypeError, ["dim 0", "not an integer size", "int('8')"]),
    ((True,), ShardingTypeError, ["dim 0", "not an integer size", "bool"]),
    (8, ShardingTypeError, ["not a sequence of sizes", "(8,)"]),
    ("8", ShardingTypeError, ["not a sequence of sizes"]),
])
def test_bad_sizes_are_refused_naming_the_dim(call, shape, error, words):
    with pytest.raises(error) as info:
        call(shape)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_every_bad_dim_is_reported_at_once():
    with pytest.raises(ShardingTypeError) as info:
        ROW.local_shape((4, -3, "x", 2.5), rank=0)
    msg = str(info.value)
    assert "3 problems" in msg
    assert "dim 1" in msg and "negative" in msg and "dim 2" in msg and "dim 3" in msg
    with pytest.raises(SpecError) as info:
        sl.Layout(MESH, sl.P("data", "tensor")).local_shape((-1, -2), rank=0)
    assert len(info.value.problems) == 2


@pytest.mark.parametrize("shape", [(6, 4), [6, 4], torch.Size([6, 4]), (np.int64(6), np.int32(4)),
                                   np.array([6, 4])])
def test_integer_sizes_of_every_kind_are_accepted_as_plain_ints(shape):
    got = sl.Layout(MESH, sl.P("data", "tensor")).local_shape(shape, rank=3)
    assert got == (3, 2) and all(type(d) is int for d in got)


def test_zero_sizes_are_legal():
    assert ROW.local_shape((0, 3), rank=1) == (0, 3)
    plan = sl.plan_redistribute(sl.Layout(MESH, sl.P()), ROW, (0, 3))
    assert plan.bytes == 0
