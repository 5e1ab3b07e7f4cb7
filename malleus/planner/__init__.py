"""Malleus's planner: contracts (PlanningProblem, Plan), the cost model, validation, search.

On top: the contract (`problem`, `calibration`, `plan`, `validate`) and the cost model (`cost`,
`pace`, `schedule`, `memory`), plus `malleus plan`'s input and output (`cli`). The search is
the `search` package, which imports those and is imported by none of them; `plan` is exported
here.

No torch and no Kubernetes here: the operator, the local runner and the trainer all import it.
"""

from .cost import (
    ideal_step_time,
    plan_step_time,
    reference_step_time,
    step_time_terms,
    uniform_plan,
    uniform_step_time,
)
from .memory import migration_mb
from .plan import Estimate, Pipeline, Plan, Stage
from .problem import Calibration, MemorySpec, ModelSpec, PlanningProblem, ProblemError
from .search import MIGRATION_SLACK, default_budget, plan
from .validate import PlanError, check_plan, validate_plan

__all__ = [
    "MIGRATION_SLACK",
    "Calibration",
    "Estimate",
    "MemorySpec",
    "ModelSpec",
    "Pipeline",
    "Plan",
    "PlanError",
    "PlanningProblem",
    "ProblemError",
    "Stage",
    "check_plan",
    "default_budget",
    "ideal_step_time",
    "migration_mb",
    "plan",
    "plan_step_time",
    "reference_step_time",
    "step_time_terms",
    "uniform_plan",
    "uniform_step_time",
    "validate_plan",
]
