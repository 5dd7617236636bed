"""Qualified names (``blocks.0.attn.qkv.weight``) of a model's modules and tensors: the unit holding one.

A unit is a module named by its qualified name (the planner chooses them: ``planner/units.py``); the
root unit ``""`` holds whatever no other unit does. A tensor's name is never a module's, so never a unit.
"""

from __future__ import annotations

from collections.abc import Collection


def unit_of(name: str, units: Collection[str]) -> str:
    """The unit containing module or tensor ``name``: the deepest of ``units`` that is ``name`` itself
    or a dotted prefix of it (``"blocks.0"`` for ``"blocks.0.attn.qkv.weight"`` and for ``"blocks.0"``),
    ``""`` when none is. For a tensor, whose name is never a unit, that is the deepest unit among its
    module and that module's ancestors.
    O(depth of ``name``) when ``units`` is a set."""
    while name and name not in units:
        name = name.rpartition(".")[0]
    return name
