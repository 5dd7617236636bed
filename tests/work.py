"""A measure of work that does not depend on the machine's load, for tests that check how planning
scales (timings are in ``benchmarks/``; tests never assert on time)."""

from __future__ import annotations

import sys


def steps(fn) -> int:
    """Python lines executed and C functions called while ``fn()`` runs: a measure of work that
    does not depend on the machine's load (a loop over every parameter counts each turn)."""
    n = 0

    def local(frame, event, arg):
        nonlocal n
        n += 1
        return local

    def count(frame, event, arg):
        nonlocal n
        n += 1
        return local

    def c_calls(frame, event, arg):
        nonlocal n
        n += event == "c_call"

    sys.settrace(count)
    sys.setprofile(c_calls)
    try:
        fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return n
