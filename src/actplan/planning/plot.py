"""The Pareto plot: peak memory against step time for the presets, the planner's plans and
the requested plan, as a PNG; ``ParetoPoint``, one point of it.

Imports point one way: ``budget`` makes the points and imports this module (``ParetoPoint``
lives here so that this module never imports ``budget``). Imports matplotlib (the ``cli``
extra) when a plot is drawn, and of the planning package only its extra check.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actplan.planning._extra import require

__all__ = ["ParetoPoint", "pareto_axes", "write_pareto_plot"]


@dataclass
class ParetoPoint:
    """One point of the plot: a preset or plan (predicted) or a measured run."""

    label: str
    kind: str  # "preset" and "plan" (predicted), "measured"
    peak_bytes: float
    time_ratio: float


@contextlib.contextmanager
def pareto_axes(
    path: str | Path,
    title: str,
    *,
    ylabel: str = "step time / no checkpointing",
    figsize: tuple[float, float] = (7.5, 4.8),
    dpi: int = 120,
) -> Iterator[Any]:
    """Axes for a memory / step-time plot (peak MiB on x, time ratio on y): the caller draws,
    then the labels, title, grid and legend are set and the PNG is written to ``path``.
    The one set-up behind every Pareto plot (this module's, the peers bench's). Needs the
    ``cli`` extra (matplotlib)."""
    require("matplotlib", extra="cli")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        ax.set_xlabel("peak memory of a training step (MiB)")
        ax.set_ylabel(ylabel)
        ax.set_title(textwrap.fill(title, 100), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def write_pareto_plot(
    points: list[ParetoPoint], path: str | Path, title: str, requested: dict[str, float] | None = None
) -> None:
    """Memory (x) against step-time ratio (y): presets labelled, planner plans as a line,
    the requested plan's prediction and measurement highlighted. Needs the ``cli`` extra."""
    with pareto_axes(path, title) as ax:
        _draw(ax, points, requested)


def _draw(ax: Any, points: list[ParetoPoint], requested: dict[str, float] | None) -> None:
    plans = sorted((p for p in points if p.kind == "plan"), key=lambda p: p.peak_bytes)
    ax.plot(
        [p.peak_bytes / 2**20 for p in plans],
        [p.time_ratio for p in plans],
        "o-",
        drawstyle="steps-post",
        color="tab:blue",
        label="planner (budget sweep)",
    )
    for p in points:
        if p.kind == "preset":
            ax.plot(p.peak_bytes / 2**20, p.time_ratio, "s", color="tab:gray")
            ax.annotate(
                p.label, (p.peak_bytes / 2**20, p.time_ratio), textcoords="offset points", xytext=(5, 4)
            )
        elif p.kind == "measured":
            ax.plot(p.peak_bytes / 2**20, p.time_ratio, "o", mfc="none", color="tab:orange")
            ax.annotate(
                p.label,
                (p.peak_bytes / 2**20, p.time_ratio),
                textcoords="offset points",
                xytext=(5, -10),
                fontsize=7,
            )
    if requested is not None:
        ax.plot(
            requested["predicted_peak_bytes"] / 2**20,
            requested["predicted_ratio"],
            "*",
            color="tab:red",
            markersize=15,
            label="requested plan (predicted)",
        )
        if "measured_peak_bytes" in requested:
            ax.plot(
                requested["measured_peak_bytes"] / 2**20,
                requested["measured_ratio"],
                "X",
                color="tab:green",
                markersize=11,
                label="requested plan (measured)",
            )
        ax.axvline(requested["budget_bytes"] / 2**20, color="tab:red", linestyle=":", label="budget")
