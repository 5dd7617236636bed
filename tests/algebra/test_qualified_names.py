"""The unit containing a module or tensor name: the deepest unit that is the name or a dotted prefix of it."""

from __future__ import annotations

from shardlib.algebra.qualnames import unit_of

UNITS = {"blocks.0", "blocks.1", "blocks.1.attn", "lm_head"}


def test_a_tensor_belongs_to_the_deepest_unit_holding_its_module():
    assert unit_of("blocks.0.attn.qkv.weight", UNITS) == "blocks.0"
    assert unit_of("blocks.1.attn.qkv.weight", UNITS) == "blocks.1.attn"     # nested: the inner unit
    assert unit_of("blocks.1.mlp.fc.bias", UNITS) == "blocks.1"
    assert unit_of("lm_head.weight", UNITS) == "lm_head"


def test_a_module_that_is_a_unit_is_its_own_unit():
    assert unit_of("blocks.1.attn", UNITS) == "blocks.1.attn"
    assert unit_of("blocks.1", UNITS) == "blocks.1"
    assert unit_of("blocks.1.attn.qkv", UNITS) == "blocks.1.attn"


def test_a_name_under_no_unit_is_the_roots():
    assert unit_of("wte.weight", UNITS) == ""
    assert unit_of("blocks", UNITS) == ""                 # the stack holds units, it is not one
    assert unit_of("blocks.10.attn.weight", UNITS) == ""  # a dotted prefix, not a string prefix
    assert unit_of("", UNITS) == ""
    assert unit_of("blocks.0.weight", set()) == ""
