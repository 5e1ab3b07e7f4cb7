"""The run report as text: the end-of-run summary table `malleus run` prints.

Pure rendering of the JSON report (`malleus.runner.report.build_report`): it computes nothing
the report does not already hold, so a saved report prints the same table. Apart from the
computation (`build`, `figures`, `baseline`) so that the figures and their wording change
separately.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from malleus.notation import size, speedup

__all__ = ["summary_text"]


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _baseline(report: Mapping[str, Any]) -> list[str]:
    """The static baseline's lines: the prediction against the measured time, or why none."""
    base = report.get("static_baseline")
    if base is None:
        why = report.get("static_baseline_skipped")
        return [f"static baseline: none ({why})"] if why else []
    fit = (
        f"step = {base['intercept_seconds']:.3f} s + "
        f"{base['seconds_per_unit'] * 1000:.1f} ms/unit: {base.get('fit', 'fitted')} in this run"
    )
    model, kind = "cost model", "predicted"
    if base.get("calibrated"):  # the terms measured in the run carry the overhead
        fit = (
            f"{base.get('fit', 'the measured terms')}, "
            f"{base['seconds_per_unit'] * 1000:.1f} ms per layer-time unit"
        )
        model, kind = "calibrated cost model", "predicted, calibrated"
    if base["predicted_seconds"] is None:
        return [f"static baseline ({kind}): the first plan cannot run at the measured rates"]
    smoothing = base.get("smoothing_samples")
    rates = f" (each GPU's median of {smoothing} samples)" if smoothing else ""
    return [
        f"static baseline ({kind}): {base['predicted_seconds']:.1f} s, "
        f"{_num(base['predicted_tokens_per_second'], ',.0f')} tok/s on {base['steps']} "
        f"steps; measured {base['measured_seconds']:.1f} s, "
        f"{_num(base['measured_tokens_per_second'], ',.0f')} tok/s -> speedup "
        f"{speedup(base['gain'])}",
        f"  (the first plan held all run, {model} at the measured rates{rates}, {fit}; every "
        "step after the first, switches included)",
    ]


def summary_text(report: Mapping[str, Any]) -> str:
    """The end-of-run table: steps, time, the static baseline (or why none applies), every
    re-plan window, every re-plan with what it changed, final loss. Speedups are all `x`
    (`malleus.notation`), sizes in binary units."""
    lines = [
        f"malleus run {report['job']} ({report['mode']}): {report['steps']}/"
        f"{report['total_steps']} steps, training {_num(report['training_seconds'], '.1f')} s "
        f"(wall {_num(report['wall_seconds'], '.1f')} s), "
        f"mean {_num(report['mean_tokens_per_second'], ',.0f')} tok/s, "
        f"final loss {_num(report['final_loss'], '.4f')}"
    ]
    resumes = report.get("resumes") or []
    if resumes:  # `malleus run --resume`: one report for the whole run, said so
        at = ", ".join(str(r["step"]) for r in resumes)
        which = "checkpoint of step" if len(resumes) == 1 else "checkpoints of steps"
        lines.append(f"continued with --resume from the {which} {at} (times summed)")
    lines += _baseline(report)
    if report.get("ideal_ratio") is not None:
        lines.append(
            f"ideal bound (cost model, emulated): {report['ideal_seconds']:.1f} s "
            f"= {speedup(report['ideal_ratio'])} the training time"
        )
    windows = report.get("windows") or []
    if windows:
        lines += [
            "",
            "per re-plan window (the same rates: the old plan before the switch, the new after; "
            "tok/s of the median step):",
            "  steps     gen   before tok/s  after tok/s  speedup  shift",
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
            f"{_num(w['after_tokens_per_second'], ',.0f'):>13}{speedup(w['gain']):>9}  "
            f"{w['reason']}"
        )
    changes = report["plan_changes"]
    lines += ["", f"re-plans: {len(changes)}"]
    if changes:
        lines.append("  gen  at step  plan s  migr s   migrated  speedup: pred   meas  reason")
    for c in changes:
        lines.append(
            f"  {c['generation']:>3}  {_num(c['step_applied'], 'd'):>7}  "
            f"{_num(c['planning_seconds']):>6}  {_num(c['migration_seconds']):>6}  "
            f"{size(c['migration_bytes']):>9}  "
            f"{speedup(c.get('predicted_speedup_seconds') or c['predicted_speedup']):>13}  "
            f"{speedup(c['measured_speedup']):>5}  {c['reason']}"
        )
        if c.get("changed"):
            lines.append(f"       changed: {c['changed']['text']}")
    if report["exit"]["code"]:
        lines += ["", f"stopped: {report['exit']['reason']}"]
    return "\n".join(lines)
