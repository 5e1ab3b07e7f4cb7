"""The "End to end" section of docs/benchmarks.md: the tables and notes bench/e2e.py writes.

Kept apart from bench/e2e.py (which runs the modes and collects their reports) so that the
section's text, a pure function of the reports, reads and changes on its own.
"""

from __future__ import annotations

from typing import Any

from benchdoc import machine  # bench/ is on sys.path when run as a script


def _event(entry: dict[str, Any]) -> str:
    factor = entry["factor"]
    change = "recovers" if factor <= 1 else f"x{factor:g}"
    return f"rank {entry['rank']} {change} at step {entry['step']}"


def render(
    rows: list[dict[str, Any]],
    reports: dict[str, dict[str, Any]],
    command: str,
    meta: dict[str, Any],
) -> str:
    any_report = next(iter(reports.values()))
    layout = any_report["layout"]
    schedule = ", ".join(_event(s) for s in any_report["schedule"])
    static = next((r for r in rows if r["mode"] == "static"), None)
    lines = [
        "## End to end",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}  ",
        f"Date: {meta['date']} (load average {meta['load_before']:.1f} before, "
        f"{meta['load_after']:.1f} after: the CPUs are shared with other work)",
        "",
        f"Scenario: `{any_report['job']}` — {layout['nodes']} nodes x {layout['gpus_per_node']} "
        f"emulated GPUs, tp {layout['tp']}, {any_report['total_steps']} steps; {schedule}. "
        "Each mode is one `malleus run` (trainer processes, the controller on rank 0's /metrics). "
        "Wall = launch to exit (start-up included); training = first step to last; tokens/s "
        "over the training time; ideal = the cost model's bound (every usable GPU busy at its "
        "emulated speed, no bubble, no overhead) over the training time; switch s = time spent "
        "switching plans (live: migration; restart: stop to first step after relaunch); "
        "modeled s = the training time if only the emulated compute counted (each step's "
        "cost-model time under the plan it ran, in emulated seconds).",
        "",
        "| mode | wall s | training s | tokens/s | vs static | ideal / actual | re-plans "
        "| switch s | modeled s | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        vs = f"{r['tps'] / static['tps']:.2f}x" if static and static["tps"] else "—"
        modeled = "—" if r["modeled"] is None else f"{r['modeled']:.1f}"
        lines.append(
            f"| {r['mode']} | {r['wall']:.1f} | {r['training']:.1f} | {r['tps']:,.0f} | {vs} | "
            f"{r['ideal']:.2f} | {r['replans']} | {r['switch_seconds']:.2f} | {modeled} | "
            f"{r['loss']:.4f} |"
        )
    live = reports.get("live")
    if live and live["plan_changes"]:
        lines += [
            "",
            "Live re-plans, what each changed and its speedup: predicted by the cost model "
            "(T_old / T_new in layer units) and in seconds (the controller's calibrated step "
            "times of both plans, the figure it decided on); measured = step time before the "
            "switch / median after it, on steps clean of the next shift; error = measured / "
            "predicted (s) - 1, target within +-10%:",
            "",
            "| gen | at step | reason | changed | plan s | migration s | MiB "
            "| predicted x (units) | predicted x (s) | measured x | error | hindsight x |",
            "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in live["plan_changes"]:
            lines.append(replan_row(c, hindsight(live, c)))
        errors = [e for c in live["plan_changes"] if (e := _error(c)) is not None]
        if errors:
            within = sum(abs(e) <= 0.10 for e in errors)
            lines += [
                "",
                f"Measured within 10% of the predicted speedup (s): {within} of {len(errors)} "
                f"re-plans (errors {', '.join(f'{e:+.0%}' for e in errors)}).",
            ]
        base = live.get("static_baseline")
        if base and not base.get("calibrated"):  # calibrated: the units already hold overhead
            lines += [
                "",
                "*hindsight x*: the same two (uncalibrated) cost-model times in seconds by the "
                f"live run's own overhead (step seconds = {base['intercept_seconds']:.3f} + "
                f"{base['seconds_per_unit'] * 1000:.1f} ms x units, the static baseline's "
                "below): a constant overhead per step counted, known only after the run.",
            ]
    if live and live.get("windows"):
        lines += [
            "",
            "Live run per re-plan window (the steps between one shift and the next: the old plan "
            "before the switch, the new plan after it, under the same rates; tokens/s of the "
            "median step, warm-up steps left out):",
            "",
            "| steps | generation | shift | before tok/s | after tok/s | speedup |",
            "|---|---|---|---:|---:|---:|",
        ]
        for w in live["windows"]:
            gens = (
                str(w["generation"])
                if w["old_generation"] is None
                else f"{w['old_generation']} -> {w['generation']}"
            )
            lines.append(
                f"| {w['first_step']}-{w['last_step']} | {gens} | {w['reason']} | "
                f"{_fmt(w['before_tokens_per_second'], ',.0f')} | "
                f"{_fmt(w['after_tokens_per_second'], ',.0f')} | {_fmt(w['gain'], '.2f', 'x')} |"
            )
    lines += baseline_lines(reports)
    lines += ["", *notes(rows)]
    return "\n".join(lines) + "\n"


def _fmt(x: float | None, fmt: str, suffix: str = "") -> str:
    return "—" if x is None else f"{format(x, fmt)}{suffix}"


def _error(change: dict[str, Any]) -> float | None:
    """Measured speedup over the predicted one in seconds, minus 1."""
    predicted = change.get("predicted_speedup_seconds")
    measured = change.get("measured_speedup")
    return measured / predicted - 1 if predicted and measured is not None else None


def hindsight(report: dict[str, Any], change: dict[str, Any]) -> float | None:
    """The change's predicted speedup with the cost-model times of both plans in seconds by the
    run's own affine fit (its static baseline's): overhead per step counted, in hindsight."""
    base = report.get("static_baseline")
    decision = next(
        (
            e["data"]["decision"]
            for e in report["events"]
            if e["kind"] == "Replanned" and e["data"].get("generation") == change["generation"]
        ),
        None,
    )
    if not base or not decision or None in (decision["old_units"], decision["new_units"]):
        return None
    if base.get("calibrated"):  # seconds = units x the layer time: the units' own ratio
        return None
    a, b = base["intercept_seconds"], base["seconds_per_unit"]
    return (a + b * decision["old_units"]) / (a + b * decision["new_units"])


def replan_row(c: dict[str, Any], hindsight_x: float | None = None) -> str:
    """One row of the live re-plans table."""
    mib = (c["migration_bytes"] or 0) / (1 << 20)
    changed = (c.get("changed") or {}).get("text", "—")
    error = _error(c)
    return (
        f"| {c['generation']} | {c['step_applied']} | {c['reason']} | {changed} | "
        f"{c['planning_seconds']:.2f} | {c['migration_seconds'] or 0:.3f} | {mib:.1f} | "
        f"{_fmt(c['predicted_speedup'], '.2f')} | "
        f"{_fmt(c.get('predicted_speedup_seconds'), '.2f')} | "
        f"{_fmt(c['measured_speedup'], '.2f')} | {_fmt(error, '+.0%')} | "
        f"{_fmt(hindsight_x, '.2f')} |"
    )


def baseline_lines(reports: dict[str, dict[str, Any]]) -> list[str]:
    """The live run's predicted static baseline against the static run's measured steps."""
    live, static = reports.get("live"), reports.get("static")
    base = (live or {}).get("static_baseline")
    if not base or base.get("predicted_seconds") is None:
        return []
    how = (
        f"calibrated cost model, the terms measured under the first plan, one layer-time unit "
        f"= {base['seconds_per_unit'] * 1000:.1f} ms"
        if base.get("calibrated")
        else f"cost model, step seconds = {base['intercept_seconds']:.3f} + "
        f"{base['seconds_per_unit'] * 1000:.1f} ms x units: {base.get('fit', 'a fit')} in the "
        "live run"
    )
    out = [
        "",
        f"Static baseline predicted from the live run (the first plan held all run, at the live "
        f"run's measured rates; {how}): "
        f"{base['predicted_seconds']:.1f} s over {base['steps']} steps against "
        f"{base['measured_seconds']:.1f} s measured live: a predicted speedup of "
        f"{base['gain']:.2f}x.",
    ]
    if static:
        predicted = {p["step"]: p["predicted_seconds"] for p in base["per_step"]}
        same = [
            (r["seconds"], predicted[r["step"]])
            for r in static["per_step"]
            if r.get("seconds") and predicted.get(r["step"])
        ]
        if same:
            measured = sum(s for s, _ in same)
            guess = sum(p for _, p in same)
            out[-1] += (
                f" The static run, on the same {len(same)} steps, measured {measured:.1f} s "
                f"(the prediction {guess / measured - 1:+.0%})."
            )
    return out


def notes(rows: list[dict[str, Any]]) -> list[str]:
    by = {r["mode"]: r for r in rows}
    out = []
    if {"static", "live"} <= by.keys():
        out.append(
            f"Live re-planning trains {by['live']['tps'] / by['static']['tps']:.2f}x as fast as "
            "the static plan over the whole run."
        )
    if {"static", "live"} <= by.keys() and by["static"]["modeled"] and by["live"]["modeled"]:
        out.append(
            f"On emulated compute alone the live plans would be "
            f"{by['static']['modeled'] / by['live']['modeled']:.2f}x faster than the static one "
            f"({by['live']['modeled']:.0f} s against {by['static']['modeled']:.0f} s); the rest "
            "of the measured time is overhead the CPUs add to every step, whatever the plan."
        )
    if {"restart", "live"} <= by.keys() and by["restart"]["replans"]:
        per = by["restart"]["switch_seconds"] / by["restart"]["replans"]
        live_per = by["live"]["switch_seconds"] / max(1, by["live"]["replans"])
        out.append(
            f"A restart costs {per:.1f} s per re-plan (stop with checkpoint, start "
            f"every process, rejoin, resume) against {live_per:.2f} s for a live migration."
        )
        if by["restart"]["declined"]:
            out.append(
                f"Having learned that cost, the restart controller declined "
                f"{by['restart']['declined']} re-plan(s) whose predicted saving over the "
                "horizon did not pay for another restart; live migration is cheap enough to take "
                "them."
            )
    losses = {round(r["loss"], 4) for r in rows if r["loss"] is not None}
    if len(losses) == 1:
        out.append(
            f"All modes end at the same loss ({losses.pop():.4f}): the plans change the "
            "layout, never the training."
        )
    out.append(
        "The ideal bound ignores what emulation cannot hide on shared CPUs: the real (small) "
        "math, gloo collectives between 8 processes on 2 cores, and Python overhead per step; "
        "compare the modes with each other, not with 1.0."
    )
    return out
