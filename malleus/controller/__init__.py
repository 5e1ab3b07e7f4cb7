"""Malleus's controller: the decision loop shared by the operator and the local runner.

rates -> detect a shift (detector) -> plan (planning, problem) -> is it worth the migration
(decision) -> publish -> wait for the acknowledgement (loop), with the policy's knobs (policy).
Where rates come from and how plans reach the trainers are the ports (RateSource, PlanSink):
HTTP to the trainers (sources), Prometheus (prometheus), or a simulation (simulate).

No torch and no Kubernetes here; prometheus-client is imported only to parse /metrics.
"""

from .decision import MIB, Decision, MigrationModel, decide, same_layout
from .detector import Shift, ShiftDetector
from .events import DecisionEvent, EventKind
from .loop import Controller, EventCallback, ProblemBuilder
from .planning import Planner, PlanningTimeout, default_planner, run_planner
from .policy import StragglerPolicy
from .ports import Ack, AckTimeout, Observation, PlanRejected, PlanSink, RateSource
from .problem import build_problem, memory_model
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
    "EventKind",
    "HttpPlanSink",
    "ManualClock",
    "MigrationModel",
    "Observation",
    "PlanRejected",
    "PlanSink",
    "Planner",
    "PlanningTimeout",
    "ProblemBuilder",
    "PrometheusSource",
    "RateSource",
    "Shift",
    "ShiftDetector",
    "SimulatedJob",
    "StragglerPolicy",
    "TrainerScrapeSource",
    "build_problem",
    "decide",
    "default_planner",
    "default_queries",
    "memory_model",
    "run_planner",
    "same_layout",
]
