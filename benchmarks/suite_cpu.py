"""A pytest plugin: the CPU-seconds each test costs, counted over its whole process tree.

    PYTHONPATH=benchmarks python3 -m pytest -p suite_cpu -n 0            # one process: every test's cost
    python3 benchmarks/suite_cpu.py suite_cpu.json                       # per file, then the costliest tests

A multi-process test's work runs in pool ranks (forked by a fork server), subprocesses and torchrun
workers, not in pytest's process, so ``--durations`` (wall time) hides what a test costs a busy
machine. Before and after each test this sums, over pytest's process and every descendant alive,
user + system time plus what each has reaped of its children (``/proc/<pid>/stat``: utime, stime,
cutime, cstime). A descendant that exits and is reaped by no process of the tree is missed.
Writes ``[[nodeid, wall_s, cpu_s], ...]`` to ``$SUITE_CPU_OUT`` (default ``suite_cpu.json``; under
pytest-xdist, one file per worker, its name suffixed). ``tests/conftest.py``'s ``HEAVY_FIRST`` comes
from this count.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")       # Linux: /proc counts CPU time in clock ticks
_rows: list = []


def tree_cpu(root: int | None = None) -> float:
    """CPU-seconds of ``root`` (default: this process) and its live descendants, with what they reaped."""
    root = os.getpid() if root is None else root
    procs, kids = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        ppid, ut, st, cut, cst = int(fields[1]), *(int(x) for x in fields[11:15])
        procs[int(d)] = ut + st + cut + cst
        kids.setdefault(ppid, []).append(int(d))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += procs.get(pid, 0)
        stack.extend(kids.get(pid, []))
    return total / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = tree_cpu(), time.monotonic()
    yield
    _rows.append([item.nodeid, time.monotonic() - wall, tree_cpu() - cpu])


def pytest_sessionfinish(session):
    if not _rows:          # pytest-xdist's controller: its workers ran the tests
        return
    out = os.environ.get("SUITE_CPU_OUT", "suite_cpu.json")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        out = f"{out}.{worker}"
    with open(out, "w") as f:
        json.dump(_rows, f)


def report(paths: list[str], top: int = 25) -> str:
    rows = [r for p in paths for r in json.load(open(p))]
    per_file: dict[str, list[float]] = {}
    for node, wall, cpu in rows:
        acc = per_file.setdefault(node.split("::")[0], [0.0, 0.0, 0])
        acc[0] += wall
        acc[1] += cpu
        acc[2] += 1
    lines = [f"{len(rows)} tests: wall {sum(r[1] for r in rows):.0f} s, CPU {sum(r[2] for r in rows):.0f} s",
             "", "| file | tests | wall s | CPU s |", "|---|---:|---:|---:|"]
    for name, (wall, cpu, n) in sorted(per_file.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {n} | {wall:.1f} | {cpu:.1f} |")
    lines += ["", "| test | wall s | CPU s |", "|---|---:|---:|"]
    for node, wall, cpu in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"| {node} | {wall:.1f} | {cpu:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1:] or ["suite_cpu.json"]))
