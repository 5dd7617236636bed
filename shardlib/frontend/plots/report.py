"""What a run shows and writes next to its metrics: its progress, the loss curve and per-rank
memory bars (PNG), and the summary. The pipeline timeline of a real step is
``frontend/timeline.plot_timeline``.

matplotlib is imported inside the plotting functions only, on an Agg canvas (no pyplot state).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ...comm.core import format_bytes

KINDS = ("params", "grads", "optimizer", "activations")
_COLORS = {"params": "#4c78a8", "grads": "#e45756", "optimizer": "#54a24b", "activations": "#f58518"}


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def plot_loss(metrics: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str = "") -> None:
    """Loss per step (and the learning rate on a second axis)."""
    fig = _figure(7, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["loss"] for m in metrics], color="#4c78a8", linewidth=1.2, label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean cross-entropy, nats)")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    lr.plot(steps, [m["lr"] for m in metrics], color="#bbbbbb", linewidth=1, linestyle="--", label="lr")
    lr.set_ylabel("learning rate", color="#888888")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")


def plot_expert_load(metrics: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str = "") -> None:
    """Per step, each MoE layer's tokens per expert (``tokens_per_expert`` in the metrics: the whole batch's,
    each token once per chosen expert) as a share of the layer's tokens — one heat map per layer (up to 8), the
    even share marked on the colour bar — and the step's imbalance (the most loaded expert over the mean, the
    worst layer's) below."""
    import numpy as np
    rows = [m for m in metrics if m.get("tokens_per_expert")]
    if not rows:
        return
    layers = list(rows[0]["tokens_per_expert"])[:8]
    fig = _figure(7, 1.5 * len(layers) + 2.4)
    grid = fig.add_gridspec(len(layers) + 1, 1, height_ratios=[1.0] * len(layers) + [1.3])
    steps = [m["step"] for m in rows]
    image = None
    for i, name in enumerate(layers):
        ax = fig.add_subplot(grid[i, 0])
        load = np.array([m["tokens_per_expert"][name] for m in rows], dtype=float)
        share = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
        image = ax.imshow(share.T, aspect="auto", cmap="viridis", vmin=0,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, share.shape[1] - 0.5, -0.5))
        ax.set_ylabel("expert", fontsize=8)
        ax.set_title(f"{name}: share of the tokens (even: {1 / share.shape[1]:.2f})", fontsize=8)
        ax.tick_params(labelsize=7, labelbottom=False)
    ax = fig.add_subplot(grid[len(layers), 0])
    ax.plot(steps, [m.get("expert_imbalance") or 1.0 for m in rows], color="#e45756", linewidth=1.2, marker=".")
    ax.axhline(1.0, color="#888888", linewidth=0.8, linestyle="--")
    ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean", fontsize=8)
    ax.grid(alpha=0.3)
    if image is not None:
        fig.colorbar(image, ax=fig.axes[:len(layers)], fraction=0.03, pad=0.02)
    fig.suptitle(title, fontsize=9)
    fig.savefig(os.fspath(path), format="png")


def plot_memory(planned: Sequence[Mapping[str, int | None]], measured: Sequence[Mapping[str, int | None]],
                path: str | os.PathLike, *, title: str = "") -> None:
    """Per rank, two stacked bars — planned (``plan.memory_per_rank`` + the plan's activations) and
    measured (the storage the engine holds by kind + the peak of bytes saved for backward) — of
    parameters, gradients, optimizer state and activations. A kind the plan cannot tell is left out
    of its bar (None)."""
    fig = _figure(max(6.0, 1.1 * len(planned) + 2), 3.8)
    ax = fig.add_subplot(1, 1, 1)
    width, mib = 0.38, 2**20
    for r, (p, m) in enumerate(zip(planned, measured)):
        for dx, row, hatch in ((-width / 2, p, ""), (width / 2, m, "//")):
            bottom = 0.0
            for k in KINDS:
                v = row.get(k)
                if v is None:
                    continue
                ax.bar(r + dx, v / mib, width * 0.95, bottom=bottom, color=_COLORS[k], hatch=hatch,
                       edgecolor="white", linewidth=0.5)
                bottom += v / mib
    from matplotlib.patches import Patch
    handles = [Patch(color=_COLORS[k], label=k) for k in KINDS]
    handles += [Patch(facecolor="white", edgecolor="black", label="left: planned"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="right: measured")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_xticks(range(len(planned)))
    ax.set_xticklabels([f"rank {r}" for r in range(len(planned))], fontsize=8)
    ax.set_ylabel("MiB")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")


def summary_lines(metrics: Sequence[Mapping[str, Any]], *, warmup: int = 2) -> list[str]:
    """The run in a few lines: loss first -> last, median step time and throughput (after ``warmup``
    steps), peak memory per rank, bytes per step and axis."""
    timed = metrics[warmup:] or metrics
    last = metrics[-1]
    peaks = last.get("peak_rss") or []
    axes = last.get("bytes_per_axis", {})
    return [f"loss {metrics[0]['loss']:.4f} -> {last['loss']:.4f} over {len(metrics)} steps",
            f"step {statistics.median(m['step_ms'] for m in timed):.0f} ms median, "
            f"{statistics.median(m['tokens_per_s'] for m in timed):,.0f} tokens/s",
            "peak resident memory per rank: " + " ".join(format_bytes(b) for b in peaks),
            "bytes rank 0 sent per step: " + (", ".join(f"{a} {format_bytes(b)}" for a, b in axes.items()) or "none"),
            *_expert_lines(metrics)]


def _expert_lines(metrics: Sequence[Mapping[str, Any]]) -> list[str]:
    """With an expert axis: the worst step's imbalance; with a capacity: the (token, expert) rows dropped."""
    out = []
    worst = [m["expert_imbalance"] for m in metrics if m.get("expert_imbalance")]
    if worst:
        out.append(f"experts: the most loaded expert at {min(worst):.2f}-{max(worst):.2f}x the mean over the steps")
    dropped = sum(sum(m.get("dropped_tokens", {}).values()) for m in metrics)
    routed = sum(sum(sum(c) for c in m.get("tokens_per_expert", {}).values()) for m in metrics)
    if any("dropped_tokens" in m for m in metrics):
        share = f" ({dropped / (dropped + routed):.1%} of the rows routed)" if routed else ""
        out.append(f"capacity: {dropped:,} (token, expert) rows dropped over the run{share}")
    return out


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A run's progress on rank 0 (``show``): at a terminal a tqdm bar on stderr (loss, tokens/s,
    step time, ETA) and a log line every ``every`` steps; anywhere else (stdout or stderr is a log
    file, a pipe, CI) no bar — its carriage returns make a log unreadable — but the same plain line
    every ``every`` steps or ``seconds`` seconds, whichever comes first, and after the first and the
    last step. A line: ``step 12/200  loss 3.2100  lr 3.00e-03  124 ms  4,130 tok/s  ETA 0m23s``."""

    def __init__(self, total: int, start: int, *, every: int, show: bool = True, seconds: float = 30.0,
                 terminal: bool | None = None):
        self.total, self.start, self.every, self.seconds, self.show = total, start, every, seconds, show
        self.terminal = sys.stdout.isatty() and sys.stderr.isatty() if terminal is None else terminal
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if show and self.terminal:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, file=sys.stderr, mininterval=1.0, unit="step",
                            dynamic_ncols=True)

    def line(self, m: Mapping[str, Any]) -> str:
        done = m["step"] - self.start
        eta = (time.monotonic() - self.t0) / done * (self.total - m["step"]) if done > 0 else 0.0
        return (f"step {m['step']:5d}/{self.total}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  {m['step_ms']:6.0f} ms  "
                f"{m['tokens_per_s']:8,.0f} tok/s  ETA {_duration(eta)}")

    def update(self, m: Mapping[str, Any]) -> None:
        """After step ``m["step"]`` (1-based) with its metrics."""
        if not self.show:
            return
        now, step = time.monotonic(), m["step"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:,.0f}", ms=f"{m['step_ms']:.0f}")
            self.bar.update()
            due = step % self.every == 0 or step == self.start + 1
        else:
            due = (step % self.every == 0 or step == self.start + 1 or step == self.total
                   or now - self.last >= self.seconds)
        if due:
            self.last = now
            print(self.line(m), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
