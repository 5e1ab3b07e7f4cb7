"""The run report (JSON) and its summary table: pure functions of what the run recorded.

Per plan change the report puts the controller's prediction next to what the trainers then did:
predicted speedup is the cost model's `T_old / T_new` under the rates it planned for (and, in
seconds, the controller's calibrated step times of the two plans: `predicted_speedup_seconds`,
the figure the decision was taken on, shown in the summary when it is known); measured
speedup is the measured step time before the switch (the controller's calibration window) over
the median step time under the new plan, taken on the steps after the switch step and before the
next rate shift could have begun (`windowSteps` before it was detected). Their ratio is how much
of the predicted throughput the new plan delivered. Each change also says what it changed
(`malleus.runner.changes`: ranks excluded or re-admitted, TP regrouped, layers moved, MiB
migrated).

Two views of the whole run sit beside the per-change figures:

- *re-plan windows*: the steps between one rate shift and the next, the old plan on the steps of
  the window before the switch against the new plan on the steps after it, so that a re-plan is
  compared with what it replaced under the same rates (a straggler never makes it look a loss);
- *static baseline*: what the job's first plan, held all run (what a framework without
  re-planning does), would have taken on the same steps: its calibrated cost-model time under
  each step's measured rates, with the terms the trainers measured under that plan (the
  report's `calibration`, from /status); without them its layer-compute time in seconds by this
  run's own steps (seconds = overhead + seconds per unit x units: the emulated clock's unit and
  the median overhead, or a least-squares fit against the cost-model time of the plan each step
  ran). A prediction, labelled so everywhere, and made only where it applies: not in static
  mode, not without an applied re-plan, not after a GPU failed (`judge_baseline`, which says
  why in `static_baseline_skipped`; `malleus run` judges again once the failures are in).

The report also keeps every generation's calibration (`calibrations`: the terms the trainers
measured under each plan, as /status carried them), so that a re-plan's prediction can be
checked against the terms it was made with (the latest before it) and against the terms of the
plan it chose.

Layout: this module holds the report's facts (`RunFacts`) and its assembly (`build_report`);
the per-change and per-window figures are `malleus.runner.report.figures`'s, the static
baseline `malleus.runner.report.baseline`'s and the summary table `malleus.runner.report.text`'s.
The public names of all of them are importable from `malleus.runner.report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from malleus.controller.events import DecisionEvent
from malleus.job.report import generation_segments

from ..record import PlanSwitch
from .baseline import ProblemOf, judge_baseline, static_baseline_of
from .figures import plan_changes, ratio, replan_windows

__all__ = ["RunFacts", "build_report", "refigure"]


@dataclass(frozen=True)
class RunFacts:
    """What the report says about the run besides its steps and events."""

    job: str
    mode: str
    nodes: int
    gpus_per_node: int
    tp: int
    tokens_per_step: int
    window_steps: int
    total_steps: int
    started: str
    """ISO 8601 start time."""
    wall_seconds: float
    """Launch to shutdown, start-up included."""
    exit_code: int
    exit_reason: str
    unit_seconds: float | None = None
    """Emulated seconds of one cost-model unit (layer fwd+bwd on a full TP group); None: real."""
    schedule: Sequence[tuple[int, int, float]] = ()
    """Emulated slowdowns (step, rank, factor)."""
    machine: Mapping[str, Any] = field(default_factory=dict)
    command: str = ""


def build_report(
    facts: RunFacts,
    rows: Sequence[Mapping[str, Any]],
    switches: Sequence[PlanSwitch],
    events: Sequence[DecisionEvent],
    *,
    initial_plan: Mapping[str, Any] | None = None,
    ideal_step_seconds: Sequence[float] | None = None,
    problem_of: ProblemOf | None = None,
    calibration: Mapping[str, Any] | None = None,
    calibrations: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The JSON run report. `ideal_step_seconds[i]`: the cost model's ideal time of step i;
    `problem_of` (the job's planning problem under given rates) and `calibration` (what the
    trainers measured under the first plan, `RunRecord.calibrations`): for the static
    baseline. `calibrations`: every generation's (what each re-plan's prediction used: the
    latest terms before it)."""
    timed = [r for r in rows if r.get("seconds")]
    training = None
    if timed and timed[0].get("time") is not None and timed[-1].get("time") is not None:
        training = timed[-1]["time"] - (timed[0]["time"] - timed[0]["seconds"])
    steps_done = len(rows)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    ideal = None
    if ideal_step_seconds is not None and rows:
        ideal = sum(
            ideal_step_seconds[r["step"]] for r in rows if r["step"] < len(ideal_step_seconds)
        )
    mean_tps = facts.tokens_per_step * steps_done / training if training else None
    changes = plan_changes(
        events, switches, rows, facts.window_steps, initial_plan=initial_plan, tp=facts.tp
    )
    report: dict[str, Any] = {
        "job": facts.job,
        "mode": facts.mode,
        "command": facts.command,
        "started": facts.started,
        "machine": dict(facts.machine),
        "layout": {"nodes": facts.nodes, "gpus_per_node": facts.gpus_per_node, "tp": facts.tp},
        "exit": {"code": facts.exit_code, "reason": facts.exit_reason},
        "steps": steps_done,
        "total_steps": facts.total_steps,
        "wall_seconds": facts.wall_seconds,
        "training_seconds": training,
        "tokens_per_step": facts.tokens_per_step,
        "mean_tokens_per_second": mean_tps,
        "final_loss": losses[-1] if losses else None,
        "unit_seconds": facts.unit_seconds,
        "ideal_seconds": ideal,
        "ideal_ratio": ratio(ideal, training),
        "schedule": [{"step": s, "rank": r, "factor": f} for s, r, f in facts.schedule],
        "initial_plan": dict(initial_plan) if initial_plan is not None else None,
        "calibration": dict(calibration) if calibration is not None else None,
        "calibrations": [dict(c) for c in calibrations],
        "generations": generation_segments(rows, facts.tokens_per_step),
        "static_baseline": None,
        "static_baseline_skipped": None,
        "windows": replan_windows(
            changes, rows, facts.schedule, facts.window_steps, facts.tokens_per_step
        ),
        "plan_changes": changes,
        "switches": [asdict(s) for s in switches],
        "events": [e.to_dict() for e in events],
        "per_step": list(rows),
    }
    if problem_of is not None:
        report["static_baseline"] = static_baseline_of(report, problem_of)
    return judge_baseline(report)


def refigure(
    report: dict[str, Any], *, window_steps: int, problem_of: ProblemOf | None
) -> dict[str, Any]:
    """`report` with its whole-run figures (generation segments, re-plan windows, static
    baseline) computed again over all of its rows and plan changes: after `--resume` appended
    a continuation to the run it continues, whose re-plans and first plan came before it."""
    rows = report.get("per_step") or []
    changes = report.get("plan_changes") or []
    schedule = [(s["step"], s["rank"], s["factor"]) for s in report.get("schedule") or []]
    tps = report["tokens_per_step"]
    report["generations"] = generation_segments(rows, tps)
    report["windows"] = replan_windows(changes, rows, schedule, window_steps, tps)
    report["static_baseline"] = None
    if problem_of is not None:
        report["static_baseline"] = static_baseline_of(report, problem_of)
    return judge_baseline(report)
