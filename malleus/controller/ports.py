"""The two seams of the decision loop: where rates come from and how plans reach the trainers.

The operator and the local runner differ only here: one reads Prometheus or scrapes
pods and posts to a Service, the other talks to processes on localhost, a test or a simulation
talks to objects in memory. The loop sees these protocols and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from malleus.planner.plan import Plan

__all__ = [
    "Ack",
    "AckTimeout",
    "GenerationConflict",
    "Observation",
    "PlanRecords",
    "PlanRejected",
    "PlanSink",
    "RateSource",
]


@dataclass(frozen=True)
class Observation:
    """What the trainers reported after one training step."""

    step: int
    step_seconds: float | None
    """Wall seconds of that step under plan `generation`; None when not measured."""
    rates: Mapping[int, float | None]
    """Straggling rate per global rank (absent: no sample this step; None: unusable)."""
    generation: int
    """Generation of the plan in force when the step ran."""
    evidence: Mapping[int, str] = field(default_factory=dict)
    """Corroboration per rank from outside the trainer (e.g. DCGM: 'SM clock 45% of peak')."""
    calibration: Mapping[str, Any] | None = None
    """The cost model's terms as the trainers measured them (the planner's `calibration` shape:
    `layer_seconds` in seconds, the rest in layer-time units); None: not measured (yet)."""
    link_rates: Mapping[int, float] = field(default_factory=dict)
    """Per node: its links' slowdown as measured (1.0 = healthy; absent: no figure)."""


@dataclass(frozen=True)
class Ack:
    """The trainers switched to a published plan."""

    generation: int
    step: int
    """First step that runs under the new plan (or the step at which the switch was seen)."""
    migration_seconds: float | None
    migration_bytes: float | None


class PlanRejected(RuntimeError):
    """The trainers refused a plan (stale generation, or invalid with reasons)."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(f"plan refused ({status}): {reason}")


class GenerationConflict(PlanRejected):
    """The trainers refused a plan's generation (409): it is not the next one they expect.

    The trainers own the generation counter; `generation` is the one in force there and
    `newest` the highest they know (pending included), so the next plan must be `newest + 1`.
    """

    def __init__(self, generation: int, newest: int, reason: str) -> None:
        super().__init__(409, reason)
        self.generation, self.newest = generation, newest


class AckTimeout(TimeoutError):
    """A published plan was not acknowledged in time."""


@runtime_checkable
class RateSource(Protocol):
    async def read(self) -> Observation | None:
        """The next step's observation; waits for it. None: the job has ended (stop the loop)."""
        ...


@runtime_checkable
class PlanSink(Protocol):
    async def publish(self, plan: Plan) -> int:
        """Hand `plan` to the trainers; returns its generation. Raises PlanRejected."""
        ...

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        """Wait until the trainers run `generation`. Raises AckTimeout."""
        ...


@runtime_checkable
class PlanRecords(Protocol):
    """A sink that also remembers plans (the operator's ConfigMap, a simulation).

    When the trainers turn out to run a generation the controller did not see applied (after a
    restart, a manual ``POST /plan``), it asks here for that plan so that it re-plans from the
    layout really in force.
    """

    async def recorded_plan(self, generation: int) -> Plan | None:
        """The plan of `generation` if it is on record, else None."""
        ...
