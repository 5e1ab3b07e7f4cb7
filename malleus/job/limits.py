"""Planning limits: what the cluster admin lets any one job ask of the operator's planner.

A job's author writes its ``stragglerPolicy``; the operator plans for every job in one process,
so one job's policy must not be able to starve the others. `PlanningLimits` (the Helm chart's
``planningLimits`` values, the operator's ``MALLEUS_OPERATOR_PLANNING_LIMITS`` setting) bounds
it: a job larger than ``maxGpus`` is refused (never planned), a job's planning budget is
clamped to ``maxPlanningSeconds`` and its cooldown raised to ``minCooldownSeconds``.
`PlanningLimits.limit` is the one place that applies them; the operator's initial plan and its
per-job controller both go through it (operator/jobs.py ``limited``).

Pure and torch-free: a model, its faults and the clamped policy.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from malleus.errors import BadInput, Fault

from .spec import StragglerPolicy
from .spec_base import StrictModel

__all__ = ["OVER_LIMIT", "OverLimit", "PlanningLimits"]

OVER_LIMIT = "OverLimit"
"""The reason (condition, event) of a job refused by a planning limit."""


class OverLimit(BadInput):
    """A job beyond the operator's planning limits (a `BadInput`: never started, never planned)."""


class PlanningLimits(StrictModel):
    """Per-job bounds on planning, set by the cluster admin (camelCase keys, as in the chart).

    Defaults: ``maxGpus`` 4096 — the planner plans 4,096 GPUs in ~4 CPU seconds on a 2-core
    machine (docs/benchmarks.md, "Planner"), and a larger job should be let in on purpose;
    ``maxPlanningSeconds`` 60 — the planner's own target at 4,096 GPUs and twice the policy's
    default budget (30 s), so no default job is clamped, yet no job holds a planner process
    for up to an hour; ``minCooldownSeconds`` 10 — a job with ``cooldownSeconds: 0`` whose
    rates move at every scrape would re-plan back to back and keep a planner process busy for
    good; 10 s between plans leaves the pool to the others, and it is below the policy's
    default (30 s), so no default job is changed.
    """

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    max_gpus: int = Field(4096, ge=1)
    """The largest world (``nodes * gpusPerNode``) a job may have; a larger job is refused
    (Failed, ``Ready=False/OverLimit``) and never planned."""
    max_planning_seconds: int = Field(60, ge=1, le=3600)
    """The most ``stragglerPolicy.planningTimeoutSeconds`` a job gets: a larger budget is
    clamped to it (the initial plan and every re-plan); a planner process that overruns it
    (plus a grace) is killed."""
    min_cooldown_seconds: int = Field(10, ge=0, le=86400)
    """The least ``stragglerPolicy.cooldownSeconds`` a job gets: a smaller one is raised to it.
    A rank's death still re-plans at once (the cooldown never delays an urgent shift)."""

    @classmethod
    def from_json_text(cls, text: str) -> PlanningLimits:
        """The limits of a JSON object (the chart's values as the operator's setting); the
        defaults for an empty text. pydantic's ValidationError when malformed."""
        return cls.model_validate_json(text) if text.strip() else cls()

    def faults(self, world: int) -> list[Fault]:
        """A fault naming the limit and the chart value that raises it, for a too-large job."""
        if world <= self.max_gpus:
            return []
        return [
            Fault(
                "spec.nodes",
                f"the job has {world} GPUs (nodes * gpusPerNode), more than the operator's "
                f"planning limit of {self.max_gpus} (the chart's planningLimits.maxGpus raises it)",
            )
        ]

    def limit(self, policy: StragglerPolicy, world: int) -> tuple[StragglerPolicy, list[str]]:
        """``policy`` within the limits, and one line per field a limit changed.

        `OverLimit` when ``world`` is beyond ``maxGpus`` (such a job is never planned).
        """
        faults = self.faults(world)
        if faults:
            raise OverLimit(faults)
        changes: dict[str, int] = {}
        said: list[str] = []
        if policy.planning_timeout_seconds > self.max_planning_seconds:
            changes["planning_timeout_seconds"] = self.max_planning_seconds
            said.append(
                f"planningTimeoutSeconds {policy.planning_timeout_seconds} -> "
                f"{self.max_planning_seconds} (the operator's planningLimits.maxPlanningSeconds)"
            )
        if policy.cooldown_seconds < self.min_cooldown_seconds:
            changes["cooldown_seconds"] = self.min_cooldown_seconds
            said.append(
                f"cooldownSeconds {policy.cooldown_seconds} -> {self.min_cooldown_seconds} "
                "(the operator's planningLimits.minCooldownSeconds)"
            )
        return (policy.model_copy(update=changes) if changes else policy), said
