"""The host allocator setting every rank gets (``shardlib/allocator.py``): what it sets, and when it
leaves glibc alone. Run in subprocesses: ``mallopt`` changes the process for good."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# one interpreter tries every case in turn (the function reads the environment when called)
_PROBE = """
import json, os
from shardlib.allocator import set_mmap_threshold, applied
out = {"default": set_mmap_threshold(), "applied": applied()}
for key, env in [("65536", {"SHARDLIB_MMAP_THRESHOLD": "65536"}), ("off", {"SHARDLIB_MMAP_THRESHOLD": "0"}),
                 ("glibc var", {"MALLOC_MMAP_THRESHOLD_": "131072"})]:
    os.environ.update(env)
    out[key] = set_mmap_threshold()
    for k in env:
        del os.environ[k]
for key, call in [("bad env", lambda: (os.environ.update(SHARDLIB_MMAP_THRESHOLD="4MB"), set_mmap_threshold())),
                  ("negative", lambda: set_mmap_threshold(-1))]:
    try:
        call()
        out[key] = "no error"
    except (ValueError, TypeError) as e:
        out[key] = str(e)
    os.environ.pop("SHARDLIB_MMAP_THRESHOLD", None)
print(json.dumps(out))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "SHARDLIB_MMAP_THRESHOLD")}
    return {**env, **extra}


def test_mmap_threshold_defaults_to_4mib_obeys_env_and_names_bad_values():
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=_clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if GLIBC:
        assert out["default"] == out["applied"] == 4 * 2**20
        assert out["65536"] == 65536
    else:
        assert out["default"] is None and out["65536"] is None
    assert out["off"] is None and out["glibc var"] is None        # left alone
    assert out["bad env"].startswith("SHARDLIB_MMAP_THRESHOLD: not an integer — got '4MB'")
    assert "threshold must be a non-negative int" in out["negative"]
