"""The shared argument checks (``shardlib/validate.py``): a bool is never a number, and each check's message
starts with what was checked and the value it got."""

from __future__ import annotations

import pytest

from shardlib.validate import flag, is_int, is_number, non_negative_int, nonempty_str, positive_int, positive_number


@pytest.mark.parametrize("value, int_, number", [
    (3, True, True), (0, True, True), (-2, True, True), (2.5, False, True), (True, False, False),
    (False, False, False), ("3", False, False), (None, False, False),
])
def test_bools_are_neither_ints_nor_numbers(value, int_, number):
    assert is_int(value) is int_ and is_number(value) is number


def test_nonempty_str_rejects_empty_none_and_non_strings():
    assert nonempty_str("tensor") and not nonempty_str("") and not nonempty_str(None) and not nonempty_str(1)


def test_positive_int_rejects_zero_bools_and_floats_naming_the_value():
    assert positive_int(1, "x") is None and positive_int(64, "x") is None
    assert positive_int(0, "plan: microbatches") == "plan: microbatches must be a positive int — got 0"
    for bad in (-1, True, 2.0, "2", None):
        assert positive_int(bad, "n") == f"n must be a positive int — got {bad!r}"


def test_non_negative_int_accepts_zero_and_rejects_negatives_and_bools():
    assert non_negative_int(0, "x") is None and non_negative_int(5, "x") is None
    for bad in (-1, False, 1.0, None):
        assert non_negative_int(bad, "t") == f"t must be a non-negative int — got {bad!r}"


def test_positive_number_rejects_zero_nan_bools_and_strings():
    assert positive_number(0.5, "x") is None and positive_number(2, "x") is None
    for bad in (0, -0.1, float("nan"), True, "1", None):
        assert positive_number(bad, "lr") == f"lr must be a positive number — got {bad!r}"


def test_flag_accepts_only_true_and_false():
    assert flag(True, "x") is None and flag(False, "x") is None
    for bad in (1, 0, "yes", None):
        assert flag(bad, "save: frozen") == f"save: frozen must be True or False — got {bad!r}"
