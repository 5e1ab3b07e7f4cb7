"""The run report's static baseline: the job's first plan, held all run, predicted on its steps.

What a framework without re-planning would have taken on the same steps: the first plan's
cost-model time under each step's measured rates. With the calibration the trainers measured
under the first plan (the report's `calibration`: what /status carried while that plan ran,
the cost model's TP, end, pipeline-transfer, gradient-sync, optimizer and fixed terms and the
links' rates) the prediction is the **calibrated** cost model's, in seconds by its own
`layer_seconds`, as the controller predicts a plan; nothing is fitted. Without one (a run too
short to calibrate, or an older report) it falls back to the layer-compute model in seconds by
this run's own steps (seconds = overhead + seconds per unit x units: the emulated clock's unit
and the median overhead, or a least-squares fit against the cost-model time of the plan each
step ran). A prediction, labelled so everywhere. `static_baseline_of` gives one to a report as
`build_report` writes it (a saved report, or one of an older version, too).

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

__all__ = ["ProblemOf", "static_baseline", "static_baseline_of"]


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

    Per step: the cost-model time of `static` under the rates measured at that step (each rank's
    latest sample, warm-ups' aside; an excluded rank keeps being measured), in seconds by the
    seconds per unit of the emulated clock (`unit_seconds`) plus the median overhead per step,
    else by a least-squares fit of the measured step times against the cost-model time of the
    plan each step ran (warm-up steps left out of either; on the first plan's own steps when it
    ran enough of them, as overhead depends on the layout). Compared on every step after the
    first (which both pay alike) with `elapsed`, the run's time over the same steps (end of the first step to the
    last: switches, restarts and their warm-ups count against the re-planning run), else with the
    sum of their step times. None without timed, rated steps.

    `calibration` (`{"generation", "calibration", "link_rates"}`, as `RunRecord.calibrations`
    keeps them): the trainers' measurement under `static`; with it every step is the
    calibrated model's seconds of `static` (its terms carry the overhead: no fit).
    """
    measured_under = _usable(calibration, problem_of({}), static)
    problem_at = problem_of
    if measured_under is not None:
        terms, links = measured_under

        def problem_at(rates: Mapping[int, float | None]) -> PlanningProblem:
            return calibrated(problem_of(rates), terms, links)

    first = min((r["step"] for r in rows), default=0)
    known: dict[int, float | None] = {}
    cache: dict[tuple[tuple[int, float | None], ...], PlanningProblem] = {}
    per_step = []
    for r in rows:
        warm = r["step"] in warmups
        if not warm:  # a warm-up step's rates are its one-off costs: not carried on
            for k, v in (r.get("rates") or {}).items():
                known[int(k)] = v
        if r["step"] == first or not known or r["generation"] not in plans:
            continue
        key = tuple(sorted(known.items()))
        if key not in cache:
            cache[key] = problem_at(dict(known))
        problem = cache[key]
        ran = plan_step_time(problem, plans[r["generation"]])
        held = plan_step_time(problem, static)
        per_step.append((r["step"], r.get("seconds"), ran, held, None if warm else r["generation"]))
    # Overhead per step depends on the layout (TP collectives, pipeline transfers): fitted on the
    # steps the first plan itself ran when there are enough of them, else on all.
    usable = [(ran, s, gen) for _, s, ran, _, gen in per_step if s and gen is not None]
    usable = [(u, s, gen) for u, s, gen in usable if math.isfinite(u)]
    own = [(u, s) for u, s, gen in usable if gen == static.generation]
    on_own = len(own) >= _OWN_STEPS
    if measured_under is not None:  # seconds by the calibration's own unit, overhead modelled
        if not usable:
            return None
        fit: tuple[float, float] | None = (0.0, float(measured_under[0]["layer_seconds"]))
        how = f"the terms measured under plan generation {calibration_of(calibration)}"
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
