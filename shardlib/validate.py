"""Checks of arguments that recur across the package.

The predicates (``is_int``, ``is_number``, ``nonempty_str``) say whether a value is of a kind; the
checks (``positive_int``, ``non_negative_int``, ``positive_number``, ``flag``) return the problem as the
start of a message, ``"<what> must be a positive int — got 0"``, or None when the value is fine: the
caller finishes the message (its advice, a period) and raises it or collects it. A bool is never a
number here: ``True`` is an ``int`` to Python, never a count or a size to a caller.
"""

from __future__ import annotations


def is_int(value: object) -> bool:
    """An ``int`` that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or a ``float`` that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def nonempty_str(value: object) -> bool:
    """A ``str`` with at least one character."""
    return isinstance(value, str) and bool(value)


def positive_int(value: object, what: str) -> str | None:
    """``"<what> must be a positive int — got <value!r>"`` unless ``value`` is an int >= 1."""
    return None if is_int(value) and value >= 1 else f"{what} must be a positive int — got {value!r}"


def non_negative_int(value: object, what: str) -> str | None:
    """``"<what> must be a non-negative int — got <value!r>"`` unless ``value`` is an int >= 0."""
    return None if is_int(value) and value >= 0 else f"{what} must be a non-negative int — got {value!r}"


def positive_number(value: object, what: str) -> str | None:
    """``"<what> must be a positive number — got <value!r>"`` unless ``value`` is an int or float > 0."""
    return None if is_number(value) and value > 0 else f"{what} must be a positive number — got {value!r}"


def flag(value: object, what: str) -> str | None:
    """``"<what> must be True or False — got <value!r>"`` unless ``value`` is a bool."""
    return None if isinstance(value, bool) else f"{what} must be True or False — got {value!r}"
