"""Global shapes: the one validator every entry that takes a tensor's global shape goes through.

A shape is a sequence of sizes (a tuple, a list, a ``torch.Size``); each size is an integer
(Python ``int``, a numpy integer, anything with ``__index__`` except a bool) and is ``>= 0``.
A bool is not a size even though Python counts it as an int, and ``2.0`` or ``"2"`` are not
sizes either: accepting them silently (``int(2.7) == 2``) would plan for a tensor that does not
exist. Wrong kinds are ``ShardingTypeError``; negative sizes are ``SpecError``. Every bad dim is
reported at once.
"""

from __future__ import annotations

import operator

import numpy as np

from ..errors import ShardingTypeError, SpecError

_FIX = "Pass the tensor's global shape, e.g. tuple(t.shape)."


def _size_kind_problem(size: object, dim: int, where: str, api: str) -> str | None:
    """The message for a size of the wrong kind, or None when ``size`` is an integer."""
    if isinstance(size, (bool, np.bool_)):
        fix = f"Write {int(size)} if you meant a size."
    else:
        try:
            operator.index(size)
            return None
        except TypeError:
            pass
        if isinstance(size, (float, np.floating)) and float(size).is_integer():
            fix = f"Write {int(size)}, not {size!r}."
        elif isinstance(size, str) and size.strip().isdigit():
            fix = f"Convert it first: int({size!r})."
        else:
            fix = _FIX
    return (f"{api}: dim {dim} of {where} is not an integer size — got {size!r} of type "
            f"{type(size).__name__}; expected an int (Python or numpy; a torch.Size entry). {fix}")


def _shown(size: object) -> object:
    """``size`` as it reads best in a message: numpy integers as plain ints."""
    if isinstance(size, (bool, np.bool_)):
        return size
    try:
        return operator.index(size)
    except TypeError:
        return size


def check_shape(shape: object, api: str, name: str | None = None) -> tuple[int, ...]:
    """Validate a global ``shape`` for ``api``; return it as a tuple of Python ints.

    ``name`` (a tensor's name) goes into the messages. Raises ``ShardingTypeError`` when the
    shape is not a sequence or holds a non-integer (listing every bad dim, negative ones too),
    else ``SpecError`` with one problem per negative dim.
    """
    if type(shape) is tuple and all(type(s) is int and s >= 0 for s in shape):
        return shape                      # the common case, checked cheaply (it is on every hot path)
    who = f"the shape of {name!r}" if name else "the shape"
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (tuple, list, range, np.ndarray)):
        try:
            size = operator.index(shape)
        except TypeError:
            size = None
        fix = (f"Write ({size},) for a 1-d tensor." if size is not None and not isinstance(shape, bool)
               else _FIX)
        raise ShardingTypeError(f"{api}: {who} is not a sequence of sizes — got {shape!r} of type "
                                f"{type(shape).__name__}; expected a tuple of ints such as (8, 4), or a "
                                f"torch.Size. {fix}")
    if isinstance(shape, np.ndarray) and shape.ndim != 1:
        raise ShardingTypeError(f"{api}: {who} is a {shape.ndim}-d array — got {shape!r}; expected a "
                                f"1-d sequence of sizes. {_FIX}")
    sizes = list(shape)
    where = f"{who} {tuple(_shown(s) for s in sizes)!r}"
    problems, wrong_kind = [], False
    for d, s in enumerate(sizes):
        problem = _size_kind_problem(s, d, where, api)
        if problem is not None:
            wrong_kind = True
            problems.append(problem)
        elif operator.index(s) < 0:
            problems.append(f"{api}: dim {d} of {where} is negative — got {operator.index(s)}; expected "
                            f"a size >= 0. {_FIX}")
    if wrong_kind:   # a TypeError, listing the negative sizes too: every problem at once
        if len(problems) == 1:
            raise ShardingTypeError(problems[0])
        raise ShardingTypeError(f"{api}: {len(problems)} problems with {where}:\n"
                                + "\n".join(f"  - {p}" for p in problems))
    if problems:
        raise SpecError(problems, api=api)
    return tuple(operator.index(s) for s in sizes)
