"""What the decision loop tells the world: one event per decision, in the order they happen.

The operator turns these into Kubernetes events (`kind` is the event reason, `type` Normal or
Warning) and status fields; the local runner prints them; both keep `history` as JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

__all__ = ["DecisionEvent", "EventKind"]


class EventKind(StrEnum):
    STRAGGLER_DETECTED = "StragglerDetected"
    """Rates shifted away from what the plan in force assumed (slowed, recovered, failed...)."""
    PLANNED = "Planned"
    """The planner returned a plan; data holds its prediction."""
    REPLAN_SKIPPED = "ReplanSkipped"
    """No new plan now: cooldown, not worth its migration, or the same layout."""
    REPLANNED = "Replanned"
    """A new plan was published to the trainers."""
    MIGRATED = "Migrated"
    """The trainers acknowledged the switch; data holds the migration time and bytes."""
    REPLAN_FAILED = "ReplanFailed"
    """Planning, validation, publishing or the acknowledgement failed; the old plan stays."""


_WARNINGS = {EventKind.STRAGGLER_DETECTED, EventKind.REPLAN_FAILED}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


@dataclass(frozen=True)
class DecisionEvent:
    kind: EventKind
    step: int
    time: float
    """The controller's clock (seconds since the epoch unless a test injects another clock)."""
    message: str
    data: dict[str, Any] = field(default_factory=dict)

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
            "data": _jsonable(self.data),
        }
