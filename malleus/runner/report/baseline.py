"""The run report's static baseline: the job's first plan, held all run, predicted on its steps.

What a framework without re-planning would have taken on the same steps: the first plan's
cost-model time under each step's measured rates. The rates are each GPU's samples smoothed by a
centred median of `SMOOTHING` samples (a one- or two-step spike of a busy host never wins it,
while a lasting shift shows from its first step on) and carried over the steps no scrape saw.
With the calibration the trainers measured under the first plan (the report's `calibration`:
what /status carried while that plan ran, the cost model's TP, end, pipeline-transfer,
gradient-sync, optimizer and fixed terms and the links' rates) the prediction is the
**calibrated** cost model's, in seconds by its own `layer_seconds`, as the controller predicts a
plan, anchored to the first plan's own steps (what the calibration left out on this host): a
line over the model's units through the median step of each rate level the first plan ran at
(the quickstart's healthy steps and its few at 4x before the first re-plan), else, at one level,
their median residual: the first plan's measured steps are what it does. Without a calibration
(a run too short to calibrate, or an older report) it falls back to the layer-compute model in
seconds by this run's own steps (seconds = overhead + seconds per unit x units: the emulated
clock's unit and the median overhead, or a least-squares fit against the cost-model time of the
plan each step ran). A prediction, labelled so everywhere.
`static_baseline_of` gives one to a report as `build_report` writes it (a saved report, or one
of an older version, too).

The comparison applies only where it means what it says (`baseline_verdict`): not in static
mode (the run is the static run), not when no re-plan was applied (the run held its first plan:
it is its own baseline), and not when a GPU failed (the prediction has no failure in it, while
the run paid for one: live mode went on without the GPU, restart mode restarted every process;
the two modes are compared with each other by bench/faults.py).
`judge_baseline` drops a baseline that does not apply and says why (`static_baseline_skipped`).

Apart from `malleus.runner.report.build` because it alone needs the planner's cost model and a
planning problem per set of rates (`ProblemOf`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from malleus.controller.decision import calibrated
from malleus.planner.cost import plan_step_time
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem

from .figures import finite_or_none, one_off_steps, ratio

__all__ = [
    "SMOOTHING",
    "ProblemOf",
    "baseline_verdict",
    "judge_baseline",
    "static_baseline",
    "static_baseline_of",
]


ProblemOf = Callable[[Mapping[int, float | None]], PlanningProblem]
"""The job's planning problem under given rates (`ResolvedJob.problem`)."""


def _affine(
    points: Sequence[tuple[float, float]], slope: float | None = None
) -> tuple[float, float] | None:
    """(intercept, slope) of seconds over cost-model units. With `slope` known (an emulated
    clock charges exactly that per unit), the intercept is the median overhead per step;
    otherwise a least-squares line (a line through the origin when the units never vary or the
    slope comes out negative). None without points."""
    if not points:
        return None
    if slope is not None:
        return statistics.median(s - slope * u for u, s in points), slope
    n = len(points)
    mu = sum(u for u, _ in points) / n
    ms = sum(s for _, s in points) / n
    var = sum((u - mu) ** 2 for u, _ in points)
    b = sum((u - mu) * (s - ms) for u, s in points) / var if var > 1e-12 * max(mu, 1.0) else 0.0
    if b <= 0:
        return 0.0, statistics.median(s / u for u, s in points if u > 0)
    return ms - b * mu, b


_OWN_STEPS = 5
"""Steps under the first plan enough to fit its own overhead."""

_LEVEL_STEPS = 3
"""Steps at one rate level enough for its median to place the baseline's line."""


def _levels(points: Sequence[tuple[float, float]]) -> list[tuple[float, float, int]]:
    """(units, median seconds, steps) per level of cost-model units (within 2% of each other:
    the same rates, bar jitter) with at least `_LEVEL_STEPS` steps, by units."""
    groups: list[list[tuple[float, float]]] = []
    for u, sec in sorted(points):
        if groups and u <= groups[-1][0][0] * 1.02:
            groups[-1].append((u, sec))
        else:
            groups.append([(u, sec)])
    return [
        (statistics.median(u for u, _ in g), statistics.median(sec for _, sec in g), len(g))
        for g in groups
        if len(g) >= _LEVEL_STEPS
    ]


def _line(levels: Sequence[tuple[float, float, int]]) -> tuple[float, float] | None:
    """(intercept, slope) of seconds over units through the levels' medians, weighted by their
    steps; None unless the slope comes out positive."""
    n = sum(w for _, _, w in levels)
    mu = sum(u * w for u, _, w in levels) / n
    ms = sum(sec * w for _, sec, w in levels) / n
    var = sum(w * (u - mu) ** 2 for u, _, w in levels)
    if var <= 1e-12 * max(mu, 1.0):
        return None
    b = sum(w * (u - mu) * (sec - ms) for u, sec, w in levels) / var
    return (ms - b * mu, b) if b > 0 else None


SMOOTHING = 5
"""Samples of a GPU's rate in the centred median the baseline predicts with (the controller's
default `windowSteps`: a spike of one or two samples never wins it)."""


def smoothed_rates(
    rows: Sequence[Mapping[str, Any]],
    warmups: set[int] | frozenset[int] = frozenset({0}),
    samples: int = SMOOTHING,
) -> dict[int, dict[int, float | None]]:
    """Per step (every row's), each GPU's rate: the centred median of `samples` of its samples
    (warm-up steps' left out: their rates are one-off costs), carried over the steps without
    one, and before its first sample its first. None: the GPU was unusable at that sample."""
    ordered = sorted(rows, key=lambda r: r["step"])
    series: dict[int, list[tuple[int, float | None]]] = {}
    for r in ordered:
        if r["step"] in warmups:
            continue
        for k, v in (r.get("rates") or {}).items():
            series.setdefault(int(k), []).append((r["step"], v))
    half = max(0, samples // 2)
    smooth: dict[int, dict[int, float | None]] = {}
    for rank, points in series.items():
        values = [v for _, v in points]
        at: dict[int, float | None] = {}
        for i, (step, v) in enumerate(points):
            near = [x for x in values[max(0, i - half) : i + half + 1] if x is not None]
            at[step] = None if v is None or not near else statistics.median(near)
        smooth[rank] = at
    known = {rank: next(iter(at.values())) for rank, at in smooth.items() if at}
    out: dict[int, dict[int, float | None]] = {}
    for r in ordered:
        for rank, at in smooth.items():
            if r["step"] in at:
                known[rank] = at[r["step"]]
        out[r["step"]] = dict(known)
    return out


def static_baseline(
    rows: Sequence[Mapping[str, Any]],
    plans: Mapping[int, Plan],
    static: Plan,
    problem_of: ProblemOf,
    *,
    tokens_per_step: int,
    warmups: set[int] | frozenset[int] = frozenset({0}),
    elapsed: float | None = None,
    unit_seconds: float | None = None,
    calibration: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The predicted time of `static` (the first plan, held all run) on this run's steps.

    Per step: the cost-model time of `static` under the rates of that step (`smoothed_rates`:
    each GPU's centred median, warm-ups' aside; an excluded rank keeps being measured), in
    seconds by the seconds per unit of the emulated clock (`unit_seconds`) plus the median
    overhead per step, else by a least-squares fit of the measured step times against the
    cost-model time of the plan each step ran (warm-up steps left out of either; on the first
    plan's own steps when it ran enough of them, as overhead depends on the layout). Compared on
    every step after the first (which both pay alike) with `elapsed`, the run's time over the
    same steps (end of the first step to the last: switches, restarts and their warm-ups count
    against the re-planning run), else with the sum of their step times. Every step after the
    first is predicted, whichever plan it ran (a plan the report does not hold, a recovery's,
    is left out of the fit only). None without timed, rated steps.

    `calibration` (`{"generation", "calibration", "link_rates"}`, as `RunRecord.calibrations`
    keeps them): the trainers' measurement under `static`; with it every step is the
    calibrated model's units of `static`, in seconds by a line through the median step of each
    rate level the first plan ran at (`_levels`: two of `_LEVEL_STEPS` steps or more), else by
    the calibration's own unit plus the model's median residual on the first plan's own steps
    (when it ran `_OWN_STEPS` of them; else nothing added).
    """
    measured_under = _usable(calibration, problem_of({}), static)
    problem_at = problem_of
    if measured_under is not None:
        terms, links = measured_under

        def problem_at(rates: Mapping[int, float | None]) -> PlanningProblem:
            return calibrated(problem_of(rates), terms, links)

    first = min((r["step"] for r in rows), default=0)
    rates_at = smoothed_rates(rows, warmups)
    cache: dict[tuple[tuple[int, float | None], ...], PlanningProblem] = {}

    def problem_with(rates: Mapping[int, float | None]) -> PlanningProblem:
        key = tuple(sorted(rates.items()))
        if key not in cache:
            cache[key] = problem_at(dict(rates))
        return cache[key]

    per_step = []
    for r in rows:
        known = rates_at.get(r["step"]) or {}
        if r["step"] == first or not known:
            continue
        problem = problem_with(known)
        plan = plans.get(r["generation"])  # a plan the report does not hold: predicted, not fitted
        ran = plan_step_time(problem, plan) if plan is not None else math.inf
        held = plan_step_time(problem, static)
        warm = r["step"] in warmups or plan is None
        per_step.append((r["step"], r.get("seconds"), ran, held, None if warm else r["generation"]))
    # Overhead per step depends on the layout (TP collectives, pipeline transfers): fitted on the
    # steps the first plan itself ran when there are enough of them, else on all.
    usable = [(ran, s, gen) for _, s, ran, _, gen in per_step if s and gen is not None]
    usable = [(u, s, gen) for u, s, gen in usable if math.isfinite(u)]
    own = [(u, s) for u, s, gen in usable if gen == static.generation]
    on_own = len(own) >= _OWN_STEPS
    if measured_under is not None:  # seconds by the calibration's own unit, overhead modelled
        if not per_step:
            return None
        unit = float(measured_under[0]["layer_seconds"])
        fit: tuple[float, float] | None = (0.0, unit)
        how = f"the terms measured under plan generation {calibration_of(calibration)}"
        # What the calibrated model leaves out of the first plan's own steps on this host: the
        # median of each rate level the first plan ran at, on a line over the model's units
        # (two levels or more), else their median residual. Without it the baseline would run
        # beside the measured line where both are the same plan at the same rates.
        levels = _levels(own)
        line = _line(levels) if len(levels) >= 2 else None
        if line is not None:
            fit = line
            counts = ", ".join(str(n) for _, _, n in levels)
            how += (
                f", on a line through the median step of each rate level the first plan ran "
                f"at ({len(levels)} levels of {counts} steps): {line[0]:+.3f} s per step"
            )
        elif on_own:
            residual = statistics.median(s - unit * u for u, s in own)
            fit = (residual, unit)
            how += f" {residual:+.3f} s per step, its median residual on its {len(own)} steps"
    else:
        fit = _affine(own if on_own else [(u, s) for u, s, _ in usable], unit_seconds)
        how = (
            "emulated unit + median overhead" if unit_seconds is not None else "least squares"
        ) + (" of the first plan's steps" if on_own else " of all steps")
    if fit is None:
        return None
    a, b = fit
    steps = [(step, s, a + b * held) for step, s, _, held, _ in per_step]
    measured = elapsed if elapsed is not None else sum(s or 0.0 for _, s, _ in steps)
    predicted = sum(p for _, _, p in steps)  # inf when the static plan cannot run (a dead GPU)
    n = len(steps)
    model = "calibrated cost model" if measured_under is not None else "cost model"
    return {
        "label": f"predicted: the first plan held all run, {model} at the measured rates",
        "calibrated": measured_under is not None,
        "smoothing_samples": SMOOTHING,
        "intercept_seconds": a,
        "seconds_per_unit": b,
        "fit": how,
        "steps": n,
        "measured_seconds": measured,
        "measured_is_elapsed": elapsed is not None,
        "predicted_seconds": finite_or_none(predicted),
        "measured_tokens_per_second": ratio(tokens_per_step * n, measured),
        "predicted_tokens_per_second": tokens_per_step * n / predicted
        if predicted and math.isfinite(predicted)
        else 0.0,
        "gain": predicted / measured if measured and math.isfinite(predicted) else None,
        "per_step": [
            {"step": step, "predicted_seconds": finite_or_none(p)} for step, _, p in steps
        ],
    }


def calibration_of(calibration: Mapping[str, Any] | None) -> int | None:
    """The plan generation a recorded calibration was measured under."""
    return None if calibration is None else calibration.get("generation")


def _usable(
    calibration: Mapping[str, Any] | None, problem: PlanningProblem, static: Plan
) -> tuple[dict[str, Any], dict[int, float]] | None:
    """(terms, link rates) of a calibration measured under `static`, if the planner takes
    them; None otherwise (measured under another plan, absent, or out of bounds)."""
    if calibration is None or calibration_of(calibration) != static.generation:
        return None
    terms = calibration.get("calibration")
    if not terms:
        return None
    links = {int(n): float(v) for n, v in (calibration.get("link_rates") or {}).items()}
    if calibrated(problem, terms, links).calibration is None:  # refused: logged there
        return None
    return dict(terms), links


def static_baseline_of(report: Mapping[str, Any], problem_of: ProblemOf) -> dict[str, Any] | None:
    """`static_baseline` of a report as `build_report` writes it (so a saved report, or one of
    an older version, can be given one again): its first plan, plan changes and steps."""
    rows = report.get("per_step") or []
    if report.get("initial_plan") is None or not rows:
        return None
    tp = report["layout"]["tp"]
    changes = report.get("plan_changes") or []
    first = Plan.model_validate(dict(report["initial_plan"]))
    plans = {first.generation: first}
    for c in changes:
        plans[c["generation"]] = Plan.model_validate({"tp": tp, **c["plan"]})
    timed = [r for r in rows if r.get("seconds")]
    training = report.get("training_seconds")
    elapsed = None
    if training is not None and timed and timed[0]["step"] == rows[0]["step"]:
        elapsed = training - timed[0]["seconds"]
    return static_baseline(
        rows,
        plans,
        first,
        problem_of,
        tokens_per_step=report["tokens_per_step"],
        warmups=one_off_steps(changes),
        elapsed=elapsed,
        unit_seconds=report.get("unit_seconds"),
        calibration=report.get("calibration"),
    )


def baseline_verdict(report: Mapping[str, Any]) -> str | None:
    """Why the static baseline does not apply to this run (None: it does), in the summary's
    words: static mode, no re-plan applied, or a GPU that failed."""
    if report.get("mode") == "static":
        return "static mode: this run held the first plan all run"
    failures = report.get("failures") or []
    if failures:
        f = min(failures, key=lambda f: f.get("step", 0))
        more = f" (and {len(failures) - 1} more failures)" if len(failures) > 1 else ""
        return (  # live mode ran on without the GPU, restart mode restarted every process
            f"rank {f['rank']} {f['why']} at step {f['step']}{more}: the first plan held all "
            "run, predicted without a failure, would not compare like with like"
        )
    last = max((r["step"] for r in report.get("per_step") or []), default=-1)
    applied = [
        c
        for c in report.get("plan_changes") or []
        if c.get("step_applied") is not None and c["step_applied"] <= last
    ]
    if not applied:  # (a re-plan applied after the last step recorded ran no step)
        return "no re-plan was applied: this run held the first plan, it is its own baseline"
    return None


def judge_baseline(report: dict[str, Any]) -> dict[str, Any]:
    """`report` with its static baseline dropped where it does not apply (`baseline_verdict`),
    the reason in `static_baseline_skipped` (None when it applies)."""
    why = baseline_verdict(report)
    report["static_baseline_skipped"] = why
    if why is not None:
        report["static_baseline"] = None
    return report
