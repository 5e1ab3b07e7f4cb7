"""The run report (JSON) and its summary table: pure functions of what the run recorded.

Per plan change the report puts the controller's prediction next to what the trainers then did:
predicted speedup is the cost model's `T_old / T_new` under the rates it planned for; measured
speedup is the measured step time before the switch (the controller's calibration window) over
the median step time under the new plan, taken on the steps after the switch step and before the
next rate shift could have begun (`windowSteps` before it was detected). Their ratio is how much
of the predicted throughput the new plan delivered.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from malleus.controller.events import (
    DecisionEvent,
    Replanned,
    ReplanSkipped,
    StragglerDetected,
    plan_summary,
)
from malleus.job.report import generation_segments

from .record import PlanSwitch

__all__ = ["RunFacts", "build_report", "generation_segments", "plan_changes", "summary_text"]


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


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _finite(x: float) -> float | None:
    """A cost-model step time, None when infinite (a plan that cannot run), as in its JSON."""
    return x if math.isfinite(x) else None


def plan_changes(
    events: Sequence[DecisionEvent],
    switches: Sequence[PlanSwitch],
    rows: Sequence[Mapping[str, Any]],
    window_steps: int,
) -> list[dict[str, Any]]:
    """Every applied plan change, from the controller's events and the observed switches."""
    applied = {s.generation: s for s in switches}
    detections = [e for e in events if isinstance(e.data, StragglerDetected)]
    # Any report of a shift, deferred ones (cooldown) included: each ends a clean stretch.
    shifts = detections + [
        e for e in events if isinstance(e.data, ReplanSkipped) and e.data.shift is not None
    ]
    changes = []
    for ev in events:
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
        changes.append(
            {
                "generation": gen,
                "decided_at_step": ev.step,
                "step_applied": step,
                "reason": shift.message if shift is not None else ev.message,
                "decision": ev.message,
                "plan": plan_summary(ev.data.plan),
                "planning_seconds": decision.planning_seconds,
                "migration_seconds": switch.migration_seconds if switch else None,
                "migration_bytes": switch.migration_bytes if switch else None,
                "predicted_speedup": _ratio(
                    _finite(decision.old_units), _finite(decision.new_units)
                ),
                "measured_speedup": _ratio(decision.old_seconds, measured),
                "predicted_step_seconds": predicted_s,
                "measured_step_seconds": measured,
                "measured_steps": len(clean),
                "throughput_vs_predicted": _ratio(predicted_s, measured),
            }
        )
    return changes


def build_report(
    facts: RunFacts,
    rows: Sequence[Mapping[str, Any]],
    switches: Sequence[PlanSwitch],
    events: Sequence[DecisionEvent],
    *,
    initial_plan: Mapping[str, Any] | None = None,
    ideal_step_seconds: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The JSON run report. `ideal_step_seconds[i]`: the cost model's ideal time of step i."""
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
    return {
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
        "ideal_ratio": _ratio(ideal, training),
        "schedule": [{"step": s, "rank": r, "factor": f} for s, r, f in facts.schedule],
        "initial_plan": dict(initial_plan) if initial_plan is not None else None,
        "generations": generation_segments(rows, facts.tokens_per_step),
        "plan_changes": plan_changes(events, switches, rows, facts.window_steps),
        "switches": [asdict(s) for s in switches],
        "events": [e.to_dict() for e in events],
        "per_step": list(rows),
    }


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_text(report: Mapping[str, Any]) -> str:
    """The end-of-run table: steps, time, throughput per generation, re-plans, final loss."""
    lines = [
        f"malleus run {report['job']} ({report['mode']}): {report['steps']}/"
        f"{report['total_steps']} steps, training {_num(report['training_seconds'], '.1f')} s "
        f"(wall {_num(report['wall_seconds'], '.1f')} s), "
        f"mean {_num(report['mean_tokens_per_second'], ',.0f')} tok/s, "
        f"final loss {_num(report['final_loss'], '.4f')}"
    ]
    if report.get("ideal_ratio") is not None:
        lines.append(
            f"ideal bound (cost model, emulated): {report['ideal_seconds']:.1f} s "
            f"= {report['ideal_ratio']:.0%} of the training time"
        )
    lines += ["", "  gen  steps        tok/s   s/step"]
    for g in report["generations"]:
        lines.append(
            f"  {g['generation']:>3}  {g['first_step']:>4}-{g['last_step']:<5}"
            f"{_num(g['mean_tokens_per_second'], ',.0f'):>9}   {_num(g['median_step_seconds'], '.3f')}"
        )
    changes = report["plan_changes"]
    lines += ["", f"re-plans: {len(changes)}"]
    if changes:
        lines.append("  gen  at step  plan s  migr s  migr KiB  pred x  meas x  reason")
    for c in changes:
        kib = None if c["migration_bytes"] is None else c["migration_bytes"] / 1024
        lines.append(
            f"  {c['generation']:>3}  {_num(c['step_applied'], 'd'):>7}  "
            f"{_num(c['planning_seconds']):>6}  {_num(c['migration_seconds']):>6}  "
            f"{_num(kib, ',.1f'):>8}  {_num(c['predicted_speedup']):>6}  "
            f"{_num(c['measured_speedup']):>6}  {c['reason']}"
        )
    if report["exit"]["code"]:
        lines += ["", f"stopped: {report['exit']['reason']}"]
    return "\n".join(lines)
