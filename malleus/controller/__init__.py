"""Malleus's controller: the decision loop shared by the operator and the local runner.

rates -> detect a shift (detector) -> plan (planning) -> is it worth the migration (decision)
-> publish -> wait for the acknowledgement (loop; the switch itself: switching), with the job's `spec.stragglerPolicy`
(`malleus.job.StragglerPolicy`) and planning problem (`malleus.job.ResolvedJob.problem`).
Every decision is a `DecisionEvent` with a typed payload (events).
Where rates come from and how plans reach the trainers are the ports (RateSource, PlanSink):
HTTP to the trainers (sources), Prometheus (prometheus), or a simulation (simulate). The
trainers own the plan generations and the loop follows them (generations); reported rates are
bounded and cannot write off more than a share of the job at once (guard). The operator's jobs
plan in one shared pool of planner processes (processes), so no job's planning stalls another's;
the local runner plans in a thread (planning).

No torch and no Kubernetes here; prometheus-client is imported only to parse /metrics.
"""

from .decision import MIB, Decision, MigrationModel, decide, same_layout
from .detector import Shift, ShiftDetector
from .events import (
    DecisionEvent,
    EventData,
    EventKind,
    Migrated,
    Planned,
    ReplanFailed,
    Replanned,
    ReplanSkipped,
    StragglerDetected,
    plan_summary,
)
from .generations import Generations
from .guard import ExclusionGuard
from .loop import Controller, EventCallback, ProblemBuilder
from .planning import Planner, PlanningTimeout, default_planner, run_planner
from .ports import (
    Ack,
    AckTimeout,
    GenerationConflict,
    Observation,
    PlanRecords,
    PlanRejected,
    PlanSink,
    RateSource,
)
from .prometheus import PrometheusSource, default_queries
from .simulate import ManualClock, SimulatedJob
from .sources import HttpPlanSink, TrainerScrapeSource

__all__ = [
    "MIB",
    "Ack",
    "AckTimeout",
    "Controller",
    "Decision",
    "DecisionEvent",
    "EventCallback",
    "EventData",
    "EventKind",
    "ExclusionGuard",
    "GenerationConflict",
    "Generations",
    "HttpPlanSink",
    "ManualClock",
    "Migrated",
    "MigrationModel",
    "Observation",
    "PlanRecords",
    "PlanRejected",
    "PlanSink",
    "Planned",
    "Planner",
    "PlanningTimeout",
    "ProblemBuilder",
    "PrometheusSource",
    "RateSource",
    "ReplanFailed",
    "ReplanSkipped",
    "Replanned",
    "Shift",
    "ShiftDetector",
    "SimulatedJob",
    "StragglerDetected",
    "TrainerScrapeSource",
    "decide",
    "default_planner",
    "default_queries",
    "plan_summary",
    "run_planner",
    "same_layout",
]
