"""The host allocator setting every rank gets (``shardlib/allocator.py``): what it sets, and when it
leaves glibc alone. Run in subprocesses: ``mallopt`` changes the process for good."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

_PROBE = "from shardlib.allocator import set_mmap_threshold as s; print(s({arg}))"


def _probe(arg: str = "", **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "SHARDLIB_MMAP_THRESHOLD")}
    return subprocess.run([sys.executable, "-c", _PROBE.format(arg=arg)], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_default_is_4_mib_on_glibc_and_nothing_elsewhere():
    out = _probe().stdout.strip()
    assert out == (str(4 * 2**20) if GLIBC else "None")


@pytest.mark.parametrize("env, want", [({"SHARDLIB_MMAP_THRESHOLD": "65536"}, "65536"),
                                       ({"SHARDLIB_MMAP_THRESHOLD": "0"}, "None"),
                                       ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "None")])
def test_the_environment_chooses_or_leaves_the_allocator_alone(env, want):
    assert _probe(**env).stdout.strip() == (want if GLIBC else "None")


def test_bad_values_are_refused_with_the_fix():
    proc = _probe(SHARDLIB_MMAP_THRESHOLD="4MB")
    assert proc.returncode != 0 and "SHARDLIB_MMAP_THRESHOLD: not an integer — got '4MB'" in proc.stderr
    proc = _probe(arg="-1")
    assert proc.returncode != 0 and "threshold must be a non-negative int" in proc.stderr


def test_every_rank_of_a_launch_gets_it(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import shardlib as sl\n"
                      "def f():\n"
                      "    from shardlib.allocator import applied\n"
                      "    return applied()\n"
                      "if __name__ == '__main__':\n"
                      "    print(sl.launch(f, 2))\n")
    clean = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    proc = subprocess.run([sys.executable, str(script)], env={**clean, "SHARDLIB_MMAP_THRESHOLD": "1048576"},
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == ("[1048576, 1048576]" if GLIBC else "[None, None]")
