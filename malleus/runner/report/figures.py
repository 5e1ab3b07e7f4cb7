"""The run report's measured figures: per plan change, and per re-plan window.

`plan_changes` puts, for every applied plan change, the controller's prediction next to what
the trainers then did (predicted and measured speedup, migration, what the change changed);
`replan_windows` cuts the run at every rate shift that led to a re-plan and compares the old
plan before the switch with the new one after it on the window's own steps. The small helpers
at the top (medians, ratios, warm-up steps) are shared with `malleus.runner.report.baseline`.

Apart from `malleus.runner.report.build` (which assembles the report from these) so that each
part of the report's computation reads on its own; the static baseline is
`malleus.runner.report.baseline`'s and the text `malleus.runner.report.text`'s.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from malleus.controller.events import (
    DecisionEvent,
    Migrated,
    Replanned,
    ReplanSkipped,
    StragglerDetected,
    plan_summary,
)

from ..changes import describe_summaries
from ..record import PlanSwitch

__all__ = ["finite_or_none", "one_off_steps", "plan_changes", "ratio", "replan_windows"]


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def finite_or_none(x: float) -> float | None:
    """A cost-model step time, None when infinite (a plan that cannot run), as in its JSON."""
    return x if math.isfinite(x) else None


def plan_changes(
    events: Sequence[DecisionEvent],
    switches: Sequence[PlanSwitch],
    rows: Sequence[Mapping[str, Any]],
    window_steps: int,
    initial_plan: Mapping[str, Any] | None = None,
    tp: int | None = None,
) -> list[dict[str, Any]]:
    """Every applied plan change, from the controller's events and the observed switches; with
    `initial_plan` (and the job's `tp`), what each changed against the plan in force before it."""
    applied = {s.generation: s for s in switches}
    in_force = dict(initial_plan) if initial_plan is not None else None
    tp = tp if tp is not None else (in_force or {}).get("tp")
    detections = [e for e in events if isinstance(e.data, StragglerDetected)]
    # Any report of a shift, deferred ones (cooldown) included: each ends a clean stretch.
    shifts = detections + [
        e for e in events if isinstance(e.data, ReplanSkipped) and e.data.shift is not None
    ]
    changes = []
    published = {e.data.generation for e in events if isinstance(e.data, Replanned)}
    for ev in events:
        if isinstance(ev.data, Migrated) and ev.data.generation not in published:
            # A plan the trainers made themselves (a recovery's), adopted by the controller:
            # not a re-plan, but the plan in force that the next one changes.
            if in_force is not None:
                in_force = plan_summary(ev.data.plan)
            continue
        if not isinstance(ev.data, Replanned):
            continue
        gen, decision = ev.data.generation, ev.data.decision
        shift = max(
            (d for d in detections if d.step <= ev.step),
            key=lambda d: d.step,
            default=None,
        )
        later = sorted(d.step for d in shifts if d.step > ev.step)
        switch = applied.get(gen)
        step = switch.step if switch is not None else None
        # Clean steps: under this plan, after its first step, before the next shift could begin.
        end = later[0] - window_steps if later else None
        clean = [
            r["seconds"]
            for r in rows
            if r["generation"] == gen
            and step is not None
            and r["step"] > step
            and (end is None or r["step"] < end)
            and r.get("seconds")
        ]
        measured = _median(clean)
        predicted_s = decision.new_seconds
        summary = plan_summary(ev.data.plan)
        changed = None
        if in_force is not None and tp:
            changed = describe_summaries(
                in_force, summary, tp, switch.migration_bytes if switch else None
            ).to_dict()
            if switch is not None:
                in_force = summary
        changes.append(
            {
                "generation": gen,
                "decided_at_step": ev.step,
                "step_applied": step,
                "reason": shift.message if shift is not None else ev.message,
                "decision": ev.message,
                "plan": summary,
                "changed": changed,
                "planning_seconds": decision.planning_seconds,
                "migration_seconds": switch.migration_seconds if switch else None,
                "migration_bytes": switch.migration_bytes if switch else None,
                "predicted_speedup": ratio(
                    finite_or_none(decision.old_units), finite_or_none(decision.new_units)
                ),
                "predicted_speedup_seconds": ratio(decision.old_seconds, predicted_s),
                "measured_speedup": ratio(decision.old_seconds, measured),
                "before_step_seconds": decision.old_seconds,
                "predicted_step_seconds": predicted_s,
                "measured_step_seconds": measured,
                "measured_steps": len(clean),
                "throughput_vs_predicted": ratio(predicted_s, measured),
            }
        )
    return changes


def one_off_steps(changes: Sequence[Mapping[str, Any]]) -> set[int]:
    """Steps that pay one-off costs: the first of the launch and the first under each new plan."""
    return {0} | {c["step_applied"] for c in changes if c.get("step_applied") is not None}


def _median_seconds(rows: Sequence[Mapping[str, Any]]) -> float | None:
    return _median([r["seconds"] for r in rows if r.get("seconds")])


def replan_windows(
    changes: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    schedule: Sequence[tuple[int, int, float]],
    window_steps: int,
    tokens_per_step: int,
) -> list[dict[str, Any]]:
    """The run cut at every rate shift that led to a re-plan: per window, the plan in force before
    the switch and the new plan after it, on the window's own steps (same rates for both).

    A window starts where its shift began: the latest scheduled change of the emulation at or
    before the step the controller decided on (after the previous switch), else `window_steps`
    before that decision (when the shift could first have shown). It ends where the next begins.
    A plan the trainers made themselves (a recovery's: no re-plan names its generation) starts
    a window at its first step, with nothing before (the old plan could not run: a GPU failed).
    Warm-up steps (the first of the launch, the first under each plan) are left out of both;
    tokens/s are those of the median step (robust to a busy host's odd slow step).
    """
    applied = sorted(
        (c for c in changes if c.get("step_applied") is not None), key=lambda c: c["step_applied"]
    )
    if not rows:
        return []
    ordered = sorted(rows, key=lambda r: r["step"])
    replanned = {c["generation"] for c in applied}
    recovered = [  # (first step, generation) of each recovery's plan
        (r["step"], r["generation"])
        for prev, r in itertools.pairwise(ordered)
        if r["generation"] != prev["generation"] and r["generation"] not in replanned
    ]
    warm = one_off_steps(applied) | {step for step, _ in recovered}
    last = ordered[-1]["step"]
    cuts: list[tuple[int, int, int | None, str]] = []  # (start, generation, applied at, reason)
    previous = 0
    for c in applied:
        decided = c["decided_at_step"]
        onsets = [s for s, _, _ in schedule if previous < s <= decided]
        start = max(onsets) if onsets else max(previous + 1, decided - window_steps)
        cuts.append(
            (min(start, c["step_applied"]), c["generation"], c["step_applied"], c["reason"])
        )
        previous = c["step_applied"]
    cuts += [(step, gen, None, f"(recovery: plan generation {gen})") for step, gen in recovered]
    cuts.sort()
    first_gen = int(ordered[0]["generation"])
    bounds = [0, *(c[0] for c in cuts), last + 1]
    out = []
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        inside = [r for r in rows if lo <= r["step"] < hi and r["step"] not in warm]
        if i == 0:
            new_gen, old_gen, at, reason = first_gen, None, lo, "(start)"
        else:
            _, new_gen, switched, reason = cuts[i - 1]
            at = switched if switched is not None else lo
            # the generation the steps before the switch ran: the previous re-plan's, or a
            # recovery's plan adopted since; none before a recovery's own plan
            ran = [r for r in rows if r["step"] < at and r["generation"] != new_gen]
            old_gen = max(ran, key=lambda r: r["step"])["generation"] if ran else first_gen
            if switched is None:
                old_gen = None
        before = [r for r in inside if old_gen is not None and r["generation"] == old_gen]
        before = [r for r in before if r["step"] < at]
        after = [r for r in inside if r["generation"] == new_gen and r["step"] >= at]
        # Medians: a busy host's odd slow step would sway a mean over a few steps before a switch.
        mb, ma = _median_seconds(before), _median_seconds(after)
        b, a = ratio(float(tokens_per_step), mb), ratio(float(tokens_per_step), ma)
        out.append(
            {
                "first_step": lo,
                "last_step": hi - 1,
                "reason": reason,
                "old_generation": old_gen,
                "generation": new_gen,
                "step_applied": None if i == 0 else at,
                "before_steps": len(before),
                "before_median_step_seconds": mb,
                "before_tokens_per_second": b,
                "after_steps": len(after),
                "after_median_step_seconds": ma,
                "after_tokens_per_second": a,
                "gain": ratio(a, b),
            }
        )
    return out
