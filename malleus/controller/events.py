"""What the decision loop tells the world: one event per decision, in the order they happen.

Each kind of event has its own typed payload, so the operator (Kubernetes events, status fields,
metrics), the local runner (progress lines, the run report) and tests read fields, not keys of
a dict. `DecisionEvent.to_dict()` is the JSON form kept in `Controller.history` and the report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from malleus.planner.plan import Plan

from .decision import Decision
from .detector import Shift

__all__ = [
    "DecisionEvent",
    "EventData",
    "EventKind",
    "Migrated",
    "Planned",
    "ReplanFailed",
    "ReplanSkipped",
    "Replanned",
    "StragglerDetected",
    "plan_summary",
]


class EventKind(StrEnum):
    """The event reasons (Kubernetes ``reason``), one per payload type."""

    STRAGGLER_DETECTED = "StragglerDetected"
    PLANNED = "Planned"
    REPLAN_SKIPPED = "ReplanSkipped"
    REPLANNED = "Replanned"
    MIGRATED = "Migrated"
    REPLAN_FAILED = "ReplanFailed"


def _rate(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _rates(rates: Mapping[int, float | None]) -> dict[str, float | None]:
    return {str(r): _rate(v) for r, v in sorted(rates.items())}


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A plan's layout as JSON (generation, stages, exclusions; no estimate)."""
    return {
        "generation": plan.generation,
        "pipelines": [
            {
                "micro_batches": p.micro_batches,
                "stages": [{"ranks": s.ranks, "layers": list(s.layers)} for s in p.stages],
            }
            for p in plan.pipelines
        ],
        "excluded": sorted(plan.excluded),
    }


@dataclass(frozen=True)
class StragglerDetected:
    """Rates shifted away from what the plan in force assumed (slowed, recovered, failed...)."""

    kind: ClassVar[EventKind] = EventKind.STRAGGLER_DETECTED
    shift: Shift
    rates: Mapping[int, float | None]
    """The smoothed rates a new plan will be made for (None = unusable)."""
    evidence: Mapping[int, str] = field(default_factory=dict)
    """Corroboration from outside the trainers (DCGM) for the shifted ranks that have some."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.shift.to_dict(),
            "urgent": self.shift.urgent,
            "rates": _rates(self.rates),
            "evidence": {str(r): e for r, e in sorted(self.evidence.items())},
        }


@dataclass(frozen=True)
class Planned:
    """The planner returned a valid plan; `decision` holds its prediction against the old one."""

    kind: ClassVar[EventKind] = EventKind.PLANNED
    plan: Plan
    decision: Decision

    def to_dict(self) -> dict[str, Any]:
        return {"plan": plan_summary(self.plan), "decision": self.decision.to_dict()}


@dataclass(frozen=True)
class ReplanSkipped:
    """No new plan now: a cooldown or retry wait (`shift` waits), or not worth it (`decision`)."""

    kind: ClassVar[EventKind] = EventKind.REPLAN_SKIPPED
    reason: str
    decision: Decision | None = None
    shift: Shift | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "decision": self.decision.to_dict() if self.decision is not None else None,
            "shift": self.shift.to_dict() if self.shift is not None else None,
        }


@dataclass(frozen=True)
class Replanned:
    """A new plan was published to the trainers (not yet acknowledged)."""

    kind: ClassVar[EventKind] = EventKind.REPLANNED
    generation: int
    plan: Plan
    decision: Decision

    def to_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "plan": plan_summary(self.plan),
            "decision": self.decision.to_dict(),
        }


@dataclass(frozen=True)
class Migrated:
    """The trainers run plan `generation` from step `step` on; what the switch cost."""

    kind: ClassVar[EventKind] = EventKind.MIGRATED
    generation: int
    step: int
    seconds: float | None
    """Wall seconds of the switch (None: the trainers did not say)."""
    bytes: float | None
    """Bytes moved (None: the trainers did not say)."""
    plan: Plan
    """The plan now in force."""
    reason: str
    """Why it was planned: the shift that started it."""
    planning_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "step": self.step,
            "migration_seconds": self.seconds,
            "migration_bytes": self.bytes,
            "reason": self.reason,
            "planning_seconds": self.planning_seconds,
        }


@dataclass(frozen=True)
class ReplanFailed:
    """Planning, validation, publishing or the acknowledgement failed; the old plan stays."""

    kind: ClassVar[EventKind] = EventKind.REPLAN_FAILED
    reason: str
    violations: tuple[str, ...] = ()
    """What was wrong with the planner's plan, when that was the failure."""

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "violations": list(self.violations)}


EventData = StragglerDetected | Planned | ReplanSkipped | Replanned | Migrated | ReplanFailed

_WARNINGS = {EventKind.STRAGGLER_DETECTED, EventKind.REPLAN_FAILED}


@dataclass(frozen=True)
class DecisionEvent:
    """One decision: its payload `data` says which kind it is."""

    step: int
    """The last step observed when it was decided."""
    time: float
    """The controller's clock (seconds since the epoch unless a test injects another clock)."""
    message: str
    """One line for people (the Kubernetes event message)."""
    data: EventData

    @property
    def kind(self) -> EventKind:
        return self.data.kind

    @property
    def type(self) -> str:
        """Kubernetes event type."""
        return "Warning" if self.kind in _WARNINGS else "Normal"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "type": self.type,
            "step": self.step,
            "time": self.time,
            "message": self.message,
            "data": self.data.to_dict(),
        }
