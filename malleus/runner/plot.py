"""The run's picture: throughput over steps with straggler onsets and re-plans marked, above a
heatmap of every GPU's straggling rate over the same steps.

Drawn from the report alone (so a saved report can be re-plotted), with matplotlib's Agg
backend: no display needed, nothing global touched (a Figure object, not pyplot).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot_report", "rate_matrix"]


def rate_matrix(rows: list[Mapping[str, Any]], world: int) -> tuple[list[int], list[list[float]]]:
    """(steps, rates[rank][i]) for the heatmap; NaN where a rank had no sample at a step."""
    steps = [int(r["step"]) for r in rows]
    matrix = [[math.nan] * len(rows) for _ in range(world)]
    for i, row in enumerate(rows):
        for rank, rate in (row.get("rates") or {}).items():
            r = int(rank)
            if 0 <= r < world and rate is not None:
                matrix[r][i] = float(rate)
    return steps, matrix


def plot_report(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the PNG to `path`; returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    rows = [r for r in report["per_step"] if r.get("tokens_per_second") is not None]
    layout = report["layout"]
    world = layout["nodes"] * layout["gpus_per_node"]
    fig = Figure(figsize=(11, 7), constrained_layout=True)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, width_ratios=[60, 1], height_ratios=[3, 2])
    top = fig.add_subplot(grid[0, 0])
    bottom = fig.add_subplot(grid[1, 0], sharex=top)
    scale = fig.add_subplot(grid[1, 1])

    steps = [r["step"] for r in rows]
    top.plot(steps, [r["tokens_per_second"] for r in rows], color="#1f77b4", lw=1.2)
    top.set_ylabel("tokens / s")
    top.set_title(f"{report['job']} ({report['mode']}): throughput, straggler onsets, re-plans")
    top.grid(alpha=0.3)
    top.tick_params(labelbottom=False)
    for s in report.get("schedule", []):
        healthy = s["factor"] <= 1.0
        top.axvline(s["step"], color="#2ca02c" if healthy else "#d62728", ls="--", lw=1)
        change = "recovers" if healthy else "x{:g}".format(s["factor"])
        label = f"rank {s['rank']} {change}"
        top.annotate(
            label,
            (s["step"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="#555555",
        )
    for c in report.get("plan_changes", []):
        if c.get("step_applied") is None:
            continue
        top.axvline(c["step_applied"], color="#9467bd", lw=1.5)
        bottom.axvline(c["step_applied"] - 0.5, color="#9467bd", lw=1.5)
        top.annotate(
            f"gen {c['generation']}",
            (c["step_applied"], 0.02),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="bottom",
            ha="left",
            fontsize=8,
            color="#9467bd",
        )

    all_rows = list(report["per_step"])
    hsteps, matrix = rate_matrix(all_rows, world)
    # The first step of a launch pays one-off warm-up; it should not set the colour scale.
    finite = [v for line in matrix for v in line[1:] if not math.isnan(v)]
    vmax = max([2.0, *finite])
    if hsteps:
        extent = (hsteps[0] - 0.5, hsteps[-1] + 0.5, world - 0.5, -0.5)
        image = bottom.imshow(
            matrix,
            aspect="auto",
            interpolation="nearest",
            cmap="magma_r",
            norm=Normalize(1.0, vmax),
            extent=extent,
        )
        fig.colorbar(image, cax=scale, label="straggling rate")
    bottom.set_ylabel("GPU (rank)")
    bottom.set_xlabel("step")
    bottom.set_yticks(range(world))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
