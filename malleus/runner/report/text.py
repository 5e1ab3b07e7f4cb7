"""The run report as text: the end-of-run summary table `malleus run` prints.

Pure rendering of the JSON report (`malleus.runner.report.build_report`): it computes nothing
the report does not already hold, so a saved report prints the same table. Apart from the
computation (`build`, `figures`, `baseline`) so that the figures and their wording change
separately.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..changes import MIB

__all__ = ["summary_text"]


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _x(x: float | None) -> str:
    """A gain or ratio, always as `1.23x`."""
    return "-" if x is None else f"{x:.2f}x"


def summary_text(report: Mapping[str, Any]) -> str:
    """The end-of-run table: steps, time, the static baseline, every re-plan window, every
    re-plan with what it changed, final loss. Gains and ratios are all `x`."""
    lines = [
        f"malleus run {report['job']} ({report['mode']}): {report['steps']}/"
        f"{report['total_steps']} steps, training {_num(report['training_seconds'], '.1f')} s "
        f"(wall {_num(report['wall_seconds'], '.1f')} s), "
        f"mean {_num(report['mean_tokens_per_second'], ',.0f')} tok/s, "
        f"final loss {_num(report['final_loss'], '.4f')}"
    ]
    base = report.get("static_baseline")
    if base is not None and report["mode"] != "static":
        fit = (
            f"step = {base['intercept_seconds']:.3f} s + "
            f"{base['seconds_per_unit'] * 1000:.1f} ms/unit: {base.get('fit', 'fitted')} in "
            "this run"
        )
        model, kind = "cost model", "predicted"
        if base.get("calibrated"):  # the terms measured in the run carry the overhead: no fit
            fit = (
                f"{base.get('fit', 'the measured terms')}, "
                f"{base['seconds_per_unit'] * 1000:.1f} ms per layer-time unit"
            )
            model, kind = "calibrated cost model", "predicted, calibrated"
        if base["predicted_seconds"] is None:
            lines.append(
                f"static baseline ({kind}): the first plan cannot run at the measured rates"
            )
        else:
            lines += [
                f"static baseline ({kind}): {base['predicted_seconds']:.1f} s, "
                f"{_num(base['predicted_tokens_per_second'], ',.0f')} tok/s on {base['steps']} "
                f"steps; measured {base['measured_seconds']:.1f} s, "
                f"{_num(base['measured_tokens_per_second'], ',.0f')} tok/s -> gain "
                f"{_x(base['gain'])}",
                f"  (the first plan held all run, {model} at the measured rates, {fit}; every "
                "step after the first, switches included)",
            ]
    if report.get("ideal_ratio") is not None:
        lines.append(
            f"ideal bound (cost model, emulated): {report['ideal_seconds']:.1f} s "
            f"= {_x(report['ideal_ratio'])} the training time"
        )
    windows = report.get("windows") or []
    if windows:
        lines += [
            "",
            "per re-plan window (the same rates: the old plan before the switch, the new after; "
            "tok/s of the median step):",
            "  steps     gen   before tok/s  after tok/s   gain  shift",
        ]
    for w in windows:
        gens = (
            f"{w['generation']}"
            if w["old_generation"] is None
            else f"{w['old_generation']}->{w['generation']}"
        )
        lines.append(
            f"  {w['first_step']:>3}-{w['last_step']:<5}{gens:>5}"
            f"{_num(w['before_tokens_per_second'], ',.0f'):>15}"
            f"{_num(w['after_tokens_per_second'], ',.0f'):>13}{_x(w['gain']):>7}  {w['reason']}"
        )
    changes = report["plan_changes"]
    lines += ["", f"re-plans: {len(changes)}"]
    if changes:
        lines.append("  gen  at step  plan s  migr s  migr MiB  pred x  meas x  reason")
    for c in changes:
        mib = None if c["migration_bytes"] is None else c["migration_bytes"] / MIB
        lines.append(
            f"  {c['generation']:>3}  {_num(c['step_applied'], 'd'):>7}  "
            f"{_num(c['planning_seconds']):>6}  {_num(c['migration_seconds']):>6}  "
            f"{_num(mib, ',.1f'):>8}  "
            f"{_x(c.get('predicted_speedup_seconds') or c['predicted_speedup']):>6}  "
            f"{_x(c['measured_speedup']):>6}  {c['reason']}"
        )
        if c.get("changed"):
            lines.append(f"       changed: {c['changed']['text']}")
    if report["exit"]["code"]:
        lines += ["", f"stopped: {report['exit']['reason']}"]
    return "\n".join(lines)
