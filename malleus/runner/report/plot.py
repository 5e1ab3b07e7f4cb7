"""The run's picture: throughput over steps beside the static baseline, straggler onsets and
re-plans marked with what each changed, above a heatmap of every GPU's straggling rate.

Drawn from the report alone (so a saved report can be re-plotted), with matplotlib's Agg
backend: no display needed, nothing global touched (a Figure object, not pyplot).

Only events inside the run's steps are drawn: a scheduled slowdown after the last step (a short
`--steps` run of a longer job) would otherwise stretch the layout until it collapses. Warm-up
steps (the first of the launch and the first under each new plan, which pay one-off costs) are
hatched and left out of the colour scale; the launch's first step (start-up) is not drawn in
the throughput panel. The static baseline is drawn only where it applies (the report says why
not otherwise: static mode, no re-plan, a failed GPU), and a step no scrape saw shows every
GPU's latest rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot_report", "rate_matrix", "replan_label", "throughput_series", "warmup_steps"]

_SLOW, _HEAL, _REPLAN, _STATIC = "#d62728", "#2ca02c", "#9467bd", "#7f7f7f"


def rate_matrix(rows: list[Mapping[str, Any]], world: int) -> tuple[list[int], list[list[float]]]:
    """(steps, rates[rank][i]) for the heatmap. A step no scrape saw (the controller busy
    planning, a scrape slower than the step) shows each rank's latest sample, so the map has no
    blank columns; NaN before a rank's first sample and where it had none to give (None: a
    failed or unusable GPU)."""
    steps = [int(r["step"]) for r in rows]
    matrix = [[math.nan] * len(rows) for _ in range(world)]
    latest: dict[int, float] = {}
    for i, row in enumerate(rows):
        rates = row.get("rates") or {}
        if rates:
            latest = {}
            for rank, rate in rates.items():
                if rate is not None:
                    latest[int(rank)] = float(rate)
        for r, rate in latest.items():
            if 0 <= r < world:
                matrix[r][i] = rate
    return steps, matrix


def warmup_steps(report: Mapping[str, Any]) -> list[int]:
    """The first step of the run, the first under each applied plan and the step a replacement
    joined at (each pays one-off costs: start-up, new groups, a join)."""
    rows = report.get("per_step") or []
    first = [int(rows[0]["step"])] if rows else []
    applied = [
        int(c["step_applied"])
        for c in report.get("plan_changes", [])
        if c.get("step_applied") is not None
    ]
    joined = [
        int(r["joined_step"])
        for r in report.get("replacements") or []
        if r.get("joined_step") is not None
    ]
    return sorted(set(first + applied + joined))


def replan_label(change: Mapping[str, Any], sep: str = ", ") -> str:
    """`gen 2: rank 1 out, TP regrouped, layers moved, 2.6 MiB`: the change's description
    (`malleus.runner.changes`, stored in the report) in short; `sep="\\n"`: one per line."""
    head = f"gen {change['generation']}"
    labels = (change.get("changed") or {}).get("labels") or []
    if not labels:
        return head
    return f"{head}{sep}{sep.join(labels)}" if sep == "\n" else f"{head}: {sep.join(labels)}"


def throughput_series(report: Mapping[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """The throughput panel's (step, tokens/s) points: `measured` (warm-up steps aside),
    `warm-up` (the first step under each new plan, measured) and `baseline` (the static
    baseline's prediction; none where the report has none: it does not apply). The launch's
    first step pays the start-up (seconds of it, not a throughput): in none of them."""
    rows = [r for r in report.get("per_step") or [] if r.get("tokens_per_second") is not None]
    first = min((int(r["step"]) for r in report.get("per_step") or []), default=None)
    rows = [r for r in rows if int(r["step"]) != first]
    warm = set(warmup_steps(report))
    base = report.get("static_baseline")
    tokens = report.get("tokens_per_step")
    baseline: list[tuple[int, float]] = []
    if base and tokens and report.get("mode") != "static":
        baseline = [
            (int(p["step"]), tokens / p["predicted_seconds"])
            for p in base.get("per_step", [])
            if p.get("predicted_seconds") and int(p["step"]) != first
        ]
    return {
        "measured": [
            (int(r["step"]), r["tokens_per_second"]) for r in rows if r["step"] not in warm
        ],
        "warm-up": [(int(r["step"]), r["tokens_per_second"]) for r in rows if r["step"] in warm],
        "baseline": baseline,
    }


def plot_report(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the PNG to `path`; returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    all_rows = list(report["per_step"])
    layout = report["layout"]
    world = layout["nodes"] * layout["gpus_per_node"]
    fig = Figure(figsize=(11, 7), constrained_layout=True)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, width_ratios=[60, 1], height_ratios=[3, 2])
    top = fig.add_subplot(grid[0, 0])
    bottom = fig.add_subplot(grid[1, 0], sharex=top)
    scale = fig.add_subplot(grid[1, 1])

    all_steps = [int(r["step"]) for r in all_rows]
    lo, hi = (min(all_steps), max(all_steps)) if all_steps else (0, 0)

    def inside(step: Any) -> bool:
        return step is not None and lo <= step <= hi

    warm = set(warmup_steps(report))
    series = throughput_series(report)
    top.plot(
        [s for s, _ in series["measured"]],
        [v for _, v in series["measured"]],
        color="#1f77b4",
        lw=1.2,
        label="measured tokens/s",
    )
    if series["warm-up"]:
        top.plot(
            [s for s, _ in series["warm-up"]],
            [v for _, v in series["warm-up"]],
            ls="none",
            marker="x",
            ms=5,
            color="#4c9be8",
            label="warm-up step (measured)",
        )
    skipped = report.get("static_baseline_skipped")
    if report.get("static_baseline") is None and skipped:  # why no baseline is drawn
        top.annotate(
            f"no static baseline: {skipped.split(':')[0]}",  # the summary says the rest
            (1.0, 1.0),
            xycoords="axes fraction",
            xytext=(-4, -4),
            textcoords="offset points",
            ha="right",
            va="top",
            fontsize=7,
            color="#555555",
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
        )
    if series["baseline"]:
        top.plot(
            [s for s, _ in series["baseline"]],
            [v for _, v in series["baseline"]],
            color=_STATIC,
            ls="--",
            lw=1.2,
            label="static baseline: first plan all run (predicted)",
        )
    top.set_ylabel("tokens / s")
    fig.suptitle(f"{report['job']} ({report['mode']}): throughput, straggler onsets, re-plans")
    top.grid(alpha=0.3)
    top.tick_params(labelbottom=False)
    shown: set[str] = set()

    def once(label: str) -> str:
        if label in shown:
            return "_nolegend_"
        shown.add(label)
        return label

    # One line and label per step and kind: GPUs that heal together are one event.
    events: dict[tuple[int, bool], list[str]] = {}
    for s in report.get("schedule", []):
        if inside(s["step"]):
            healthy = s["factor"] <= 1.0
            change = "" if healthy else " x{:g}".format(s["factor"])
            events.setdefault((s["step"], healthy), []).append(f"{s['rank']}{change}")
    for (step, healthy), ranks in sorted(events.items()):
        top.axvline(
            step,
            color=_HEAL if healthy else _SLOW,
            ls="--",
            lw=1,
            label=once("GPU recovers (emulated)" if healthy else "GPU slows (emulated)"),
        )
        many = len(ranks) > 1
        text = f"rank{'s' if many else ''} {', '.join(ranks)}"
        text += (" recover" if many else " recovers") if healthy else ""
        top.annotate(
            text,
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-2, -2),
            textcoords="offset points",
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="#555555",
        )
    for c in report.get("plan_changes", []):
        step = c.get("step_applied")
        if not inside(step):
            continue
        top.axvline(step, color=_REPLAN, lw=1.5, label=once("re-plan (applied)"))
        bottom.axvline(step - 0.5, color=_REPLAN, lw=1.5)
        top.annotate(
            replan_label(c, sep="\n"),
            (step, 0.03),
            xycoords=("data", "axes fraction"),
            xytext=(3, 0),
            textcoords="offset points",
            va="bottom",
            ha="left",
            fontsize=7,
            color=_REPLAN,
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": _REPLAN, "alpha": 0.85},
        )
    for f in report.get("failures", []):  # failed ranks (malleus.runner.failures)
        if inside(f.get("step")):
            top.axvline(f["step"], color="#000000", ls=":", lw=1.2, label=once("rank failed"))
            bottom.axvline(f["step"] - 0.5, color="#000000", ls=":", lw=1.2)
    top.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=7.5, frameon=False)

    hsteps, matrix = rate_matrix(all_rows, world)
    # Warm-up steps pay one-off costs (start-up, the first step under a new plan): hatched, and
    # left out of the colour scale so that they do not wash the rest out.
    cols = [i for i, s in enumerate(hsteps) if s not in warm]
    finite = [v for line in matrix for i in cols if not math.isnan(v := line[i])]
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
        fig.colorbar(image, cax=scale, label="straggling rate (warm-up steps left out)")
        for s in sorted(warm):
            bottom.axvspan(s - 0.5, s + 0.5, facecolor="none", edgecolor="#4c9be8", hatch="///")
        bottom.legend(
            handles=[
                Patch(facecolor="none", edgecolor="#4c9be8", hatch="///", label="warm-up step")
            ],
            loc="upper right",
            fontsize=7.5,
            framealpha=0.85,
        )
        top.set_xlim(extent[0], extent[1])
    bottom.set_ylabel("GPU (rank)")
    bottom.set_xlabel("step")
    bottom.set_yticks(range(world))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
