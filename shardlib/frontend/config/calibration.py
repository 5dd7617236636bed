"""A machine's measured figures in a mesh preset: ``calibrated:`` (``python -m shardlib.calibrate``, per rank
count) and the overlap factor — their data and their checking."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...validate import is_number


@dataclass(frozen=True)
class Calibration:
    """Figures measured with ``ranks`` ranks running (``python -m shardlib.calibrate``): a rank's sustained
    TFLOP/s, an all-reduce's bandwidth (GB/s) and latency per ring hop (µs), and the fixed cost of one
    layer's forward and backward for one micro-batch (µs: Python and kernel launches)."""

    tflops: float
    gbps: float
    latency_us: float
    layer_us: float
    # per ring hop of a reduce-scatter and an all-gather, where measured (gloo's run several times an
    # all-reduce's per hop once ranks outnumber cores); absent, the all-reduce's
    rs_latency_us: float | None = None
    ag_latency_us: float | None = None
    # the fraction of a collective's time hidden when it runs asynchronously beside a block's compute
    overlap: float | None = None


def calibrated(raw: Any, problems: list[str]) -> tuple:
    """``mesh.calibrated``: ``{ranks: {tflops, gbps, latency_us, layer_us[, rs_latency_us, ag_latency_us]}}``."""
    if not raw:
        return ()
    if not isinstance(raw, Mapping):
        problems.append(f"mesh.calibrated: got {raw!r}; expected {{ranks: {{tflops, gbps, latency_us, layer_us}}}} "
                        "as python -m shardlib.calibrate prints it.")
        return ()
    out = []
    fields, extra = ("tflops", "gbps", "latency_us", "layer_us"), ("rs_latency_us", "ag_latency_us", "overlap")
    for ranks, spec in raw.items():
        if not (isinstance(ranks, int) and ranks > 0 and isinstance(spec, Mapping) and set(fields) <= set(spec)
                and set(spec) <= set(fields + extra)
                and all(is_number(v) and v >= 0 for v in spec.values())):
            problems.append(f"mesh.calibrated.{ranks}: got {spec!r}; expected {{tflops, gbps, latency_us, layer_us}} "
                            "(and rs_latency_us, ag_latency_us, overlap where measured), non-negative numbers, under a "
                            "positive rank count.")
            continue
        out.append((ranks, Calibration(**{f: float(v) for f, v in spec.items()})))
    return tuple(sorted(out))


def fraction(c, key: str) -> float | None:
    v = c.number(key, None, optional=True)
    if v is not None and v > 1:
        c.bad(key, v, "a fraction from 0 to 1 (of communication hidden behind compute) or null")
        return None
    return v
