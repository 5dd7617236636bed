"""What the machine computes natively: a warning where bf16/fp16 compute would run in software."""

from __future__ import annotations

import functools
import warnings

import torch

# CPU features that compute in each low precision natively (x86 flags, then Arm's)
_NATIVE = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512fp16", "amx_fp16", "fphp")}


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags (``/proc/cpuinfo``), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def warn_slow_precision(precision: str, device: torch.device | str) -> None:
    """Warn (once per process and precision) when bf16/fp16 compute lands on a CPU that has no native
    instructions for it: torch then converts in software (measured here: bf16 ~5x slower than fp32
    on AVX2, dp4 ZeRO-3 1088 vs 221 ms/step)."""
    if precision in _NATIVE and torch.device(device).type == "cpu":
        flags = _cpu_flags()
        if flags is not None and not flags & set(_NATIVE[precision]):
            _warn_once(precision)


@functools.cache
def _warn_once(precision: str) -> None:
    capability = torch.backends.cpu.get_cpu_capability().lower()
    native = "/".join(f for f in _NATIVE[precision] if f != "bf16")
    warnings.warn(f"parallelize: {precision} compute on this CPU ({capability}, no {native}) runs in software, "
                  f"several times slower than fp32 (bf16 on AVX2: ~5x) — expected a CPU with native {precision} "
                  f"instructions ({native}) or a GPU. Use precision='fp32' on this CPU.", RuntimeWarning, stacklevel=5)
