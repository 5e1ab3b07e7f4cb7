"""Is a new plan worth switching to? Predicted gain over a horizon against migration and planning.

The cost model predicts step times in layer-time units, not seconds, and it does not know the
machine. The measured step time of the plan in force calibrates it: a plan predicted to take
`T_new` units when the plan in force takes `T_old` units (both under today's rates) is predicted
to take `measured * T_new / T_old` seconds. The migration cost comes from the bytes the layout
change moves (the cost model's `migration_mb`) over a bandwidth that starts at a configured
value and is learned from the migrations the trainers acknowledge (an EWMA of bytes/second).

A plan is applied when, over `horizon_steps`, the seconds it saves pay for its migration and for
the planning that produced it, *and* the relative gain is at least `min_gain` (so a plan that
saves 1 % is not worth disturbing a healthy run for, however long the horizon). Counting the
planning time is conservative: a planner that took long must have found a proportionally
better plan.

Calibrated: the trainers measure what a step costs besides layer compute (TP collectives,
embedding and head, pipeline transfers, gradient sync, optimizer, the rest) and each node's link
rate; `calibrated` puts them into the problem, so every prediction here (the gain, the Replanned
event's estimate) is the calibrated cost model's, and a unit's seconds are measured too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from malleus.errors import BadInput
from malleus.job.memory import MIB
from malleus.job.spec import StragglerPolicy
from malleus.notation import speedup, time_saved
from malleus.planner.cost import (
    ideal_step_time,
    migration_mb,
    plan_step_time,
    reference_step_time,
    uniform_step_time,
)
from malleus.planner.plan import Estimate, Plan
from malleus.planner.problem import MAX_RATE, PlanningProblem

log = logging.getLogger(__name__)

__all__ = [
    "MIB",
    "Decision",
    "MigrationModel",
    "calibrated",
    "decide",
    "same_layout",
    "with_estimate",
]


def calibrated(
    problem: PlanningProblem,
    calibration: Mapping[str, Any] | None,
    link_rates: Mapping[int, float] | None = None,
) -> PlanningProblem:
    """`problem` with the trainers' measured cost terms and per-node link rates (as
    `ResolvedJob.problem(..., calibration, link_rates)` builds it); unchanged without them.
    Link rates are kept for the job's nodes, finite, 1.0 to MAX_RATE; a calibration the
    problem refuses (a term out of bounds) is logged and left out."""
    if calibration is None and not link_rates:
        return problem
    links = {
        int(n): min(MAX_RATE, max(1.0, float(v)))
        for n, v in (link_rates or {}).items()
        if 0 <= int(n) < problem.nodes and math.isfinite(float(v))
    }
    data = {name: getattr(problem, name) for name in PlanningProblem.model_fields}
    data.update(link_rates=links or dict(problem.link_rates))
    if calibration is not None:
        data["calibration"] = dict(calibration)
    try:
        return PlanningProblem.load(data)
    except BadInput as e:  # a figure out of bounds must not stop every re-plan
        log.warning("the trainers' calibration is not usable, planning without it: %s", e)
        return problem


class MigrationModel:
    """Predicted migration seconds = MB moved / bandwidth, the bandwidth learned from migrations.

    The bandwidth is the *effective* one of a whole switch (all senders at once, plus the step
    boundary and group creation), which is what the horizon arithmetic needs. A fixed per-switch
    overhead is folded into it, so tiny migrations (emulation on CPUs) teach a low bandwidth.
    """

    def __init__(self, bandwidth_bytes_per_s: float = 5e9, smoothing: float = 0.5) -> None:
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s: {bandwidth_bytes_per_s}; need > 0")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: {smoothing}; need 0 < smoothing <= 1")
        self.bandwidth = float(bandwidth_bytes_per_s)
        self.smoothing = smoothing
        self.samples = 0

    def predict_seconds(self, mb: float) -> float:
        return mb * MIB / self.bandwidth

    def observe(self, migration_bytes: float | None, seconds: float | None) -> None:
        """Learn from an acknowledged switch; meaningless samples (no bytes, no time) are ignored."""
        if not migration_bytes or not seconds or migration_bytes <= 0 or seconds <= 0:
            return
        sample = migration_bytes / seconds
        a = self.smoothing
        self.bandwidth = sample if self.samples == 0 else a * sample + (1 - a) * self.bandwidth
        self.samples += 1


@dataclass(frozen=True)
class Decision:
    """Whether to apply a new plan, why, and the numbers it was decided on."""

    apply: bool
    reason: str
    old_units: float
    """Cost-model step time of the plan in force under today's rates (inf: cannot run)."""
    new_units: float
    old_seconds: float | None
    """Predicted (calibrated) seconds per step of the plan in force; None: not calibrated yet."""
    new_seconds: float | None
    relative_gain: float
    """(old - new) / old in cost-model units; 1.0 when the plan in force cannot run."""
    gain_seconds: float | None
    """Seconds saved over the horizon; None: not calibrated yet."""
    migration_mb: float
    migration_seconds: float
    planning_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_number(v) for k, v in asdict(self).items()}


def _json_number(v: Any) -> Any:
    """JSON has no infinity: an infinite step time (a plan that cannot run) becomes null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def same_layout(a: Plan, b: Plan) -> bool:
    """Same stages, micro-batches and exclusions (generation and estimate aside)."""
    return a.pipelines == b.pipelines and sorted(a.excluded) == sorted(b.excluded)


def decide(
    problem: PlanningProblem,
    current: Plan,
    new: Plan,
    *,
    policy: StragglerPolicy,
    seconds_per_unit: float | None,
    planning_seconds: float,
    migration: MigrationModel,
) -> Decision:
    """Apply `new` instead of `current`? `problem` carries today's rates.

    `seconds_per_unit` calibrates the cost model (measured step seconds / `T_old` under the
    rates they were measured at); None when no step of the plan in force has been measured.
    """
    t_old = plan_step_time(problem, current)
    t_new = plan_step_time(problem, new)
    mb = migration_mb(problem, current, new)
    mig_s = migration.predict_seconds(mb)
    spu = seconds_per_unit
    if spu is None and problem.calibration is not None:  # measured by the trainers
        spu = problem.calibration.layer_seconds
    old_s = t_old * spu if spu is not None else None
    new_s = t_new * spu if spu is not None else None

    def result(apply: bool, reason: str, rel: float, gain: float | None) -> Decision:
        return Decision(
            apply=apply,
            reason=reason,
            old_units=t_old,
            new_units=t_new,
            old_seconds=old_s,
            new_seconds=new_s,
            relative_gain=rel,
            gain_seconds=gain,
            migration_mb=mb,
            migration_seconds=mig_s,
            planning_seconds=planning_seconds,
        )

    if not math.isfinite(t_new):
        return result(False, "the new plan cannot run under the current rates", 0.0, None)
    if same_layout(current, new):
        return result(False, "the planner chose the layout in force", 0.0, 0.0)
    if not math.isfinite(t_old):
        return result(True, "the plan in force cannot run (a GPU in it is unusable)", 1.0, None)

    rel = (t_old - t_new) / t_old
    # time saved as %, speedup as x, each named (malleus.notation)
    x = speedup(t_old / t_new) if t_new > 0 else "-"
    saved = f"predicted time saved {time_saved(rel)} (speedup {x})"
    gain = (
        (old_s - new_s) * policy.horizon_steps if old_s is not None and new_s is not None else None
    )
    # Only the migration is weighed: planning is spent by now (the trainers trained meanwhile),
    # and charging it would count a planner's queue on a busy operator as the switch's cost
    # (docs/benchmarks.md "Operator at scale": 17 of 20 re-plans skipped so at load 33).
    cost = mig_s
    if rel < policy.min_gain:
        return result(
            False,
            f"{saved} is below minGain {time_saved(policy.min_gain)}",
            rel,
            gain,
        )
    if gain is None:
        return result(
            True,
            f"{saved} >= minGain {time_saved(policy.min_gain)} "
            "(no step time measured yet, so the migration cost is not weighed)",
            rel,
            gain,
        )
    if gain < cost:
        return result(
            False,
            f"saves {gain:.1f} s over {policy.horizon_steps} steps, less than the migration "
            f"({mig_s:.1f} s)",
            rel,
            gain,
        )
    return result(
        True,
        f"{saved}: saves {gain:.1f} s over {policy.horizon_steps} steps for a "
        f"migration of {mig_s:.1f} s (planned in {planning_seconds:.1f} s)",
        rel,
        gain,
    )


def _finite(x: float) -> float | None:
    """JSON has no infinity: a reference step time of a job that cannot run is None."""
    return x if math.isfinite(x) else None


def with_estimate(
    problem: PlanningProblem, plan: Plan, decision: Decision, planning_seconds: float
) -> Plan:
    """The plan with its cost-model estimate (filled in if the planner gave none)."""
    est = plan.estimate
    if est is None:
        est = Estimate(
            step_time=decision.new_units,
            uniform_step_time=_finite(uniform_step_time(problem)),
            ideal_step_time=_finite(ideal_step_time(problem)),
            reference_step_time=_finite(reference_step_time(problem)),
        )
    est = est.model_copy(
        update={"migration_mb": decision.migration_mb, "planning_seconds": planning_seconds}
    )
    return plan.model_copy(update={"estimate": est})
