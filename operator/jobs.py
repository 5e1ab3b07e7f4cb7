"""From a MalleusJob body to a typed job, its semantic faults and its initial plan.

The API server has already checked the schema and the CEL rules; the operator checks them again
(with `malleus.jobspec`, the same schema and rules) because a CRD older than the operator, or a
job created while the CRD was being upgraded, may let through what this version cannot run. It
then checks what no schema can say: that the model fits the GPUs' memory in *some* layout (the
planner is the judge), and that pinned degrees match the cluster. A job that fails here is never
started: phase Failed, reason InvalidSpec, nothing created.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from malleus.controller.planning import Planner, PlanningTimeout, default_planner, run_planner
from malleus.controller.policy import StragglerPolicy
from malleus.controller.problem import build_problem
from malleus.jobspec import JobSpecError, MalleusJob, load_job, micro_batches, resolve_model
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem, ProblemError
from malleus.planner.validate import validate_plan

__all__ = [
    "INITIAL_GENERATION",
    "InvalidSpec",
    "initial_plan",
    "parse_job",
    "semantic_faults",
]

INITIAL_GENERATION = 1
"""Generation of the plan a job starts with; every applied re-plan adds one (0 = none yet)."""


class InvalidSpec(ValueError):
    """A job that can never run as written; ``faults`` has one line per problem."""

    def __init__(self, faults: list[str]) -> None:
        self.faults = list(faults)
        super().__init__("; ".join(self.faults))


def parse_job(body: Mapping[str, Any]) -> MalleusJob:
    """The typed, defaulted job; `InvalidSpec` listing every schema or CEL fault.

    Only apiVersion, kind, metadata and spec are read (status is the operator's own output),
    and unknown fields are pruned as the API server would (not faults).
    """
    manifest = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    meta = dict(manifest.get("metadata") or {})
    meta.pop("managedFields", None)
    manifest["metadata"] = meta
    try:
        return load_job(manifest, strict=False)
    except JobSpecError as e:
        raise InvalidSpec([str(f) for f in e.faults]) from None


def semantic_faults(job: MalleusJob) -> list[str]:
    """Faults the schema cannot express (besides memory, which `initial_plan` checks)."""
    spec = job.spec
    faults: list[str] = []
    try:
        cfg = resolve_model(spec.model)
    except JobSpecError as e:
        return [str(f) for f in e.faults]
    tp = spec.parallelism.tp
    gpus = spec.nodes * spec.gpus_per_node
    if tp & (tp - 1):
        faults.append(f"spec.parallelism.tp: {tp} is not a power of two")
    if spec.gpus_per_node % tp:
        faults.append(
            f"spec.parallelism.tp: tp({tp}) does not divide gpusPerNode({spec.gpus_per_node}); "
            "a tensor-parallel group lives inside one node"
        )
    if cfg.heads % tp:
        faults.append(
            f"spec.parallelism.tp: heads({cfg.heads}) is not divisible by tp({tp}); attention "
            "heads are split into tp shards"
        )
    dp, pp = spec.parallelism.dp, spec.parallelism.pp
    if pp is not None and pp > cfg.layers:
        faults.append(
            f"spec.parallelism.pp: pp({pp}) exceeds the model's layers({cfg.layers}); "
            "every stage needs a layer"
        )
    if dp is not None and pp is not None and dp * pp * tp != gpus:
        faults.append(
            f"spec.parallelism: dp({dp}) * pp({pp}) * tp({tp}) = {dp * pp * tp} does not match "
            f"the GPU count nodes({spec.nodes}) * gpusPerNode({spec.gpus_per_node}) = {gpus}"
        )
    elif dp is not None and dp * tp > gpus:
        faults.append(
            f"spec.parallelism.dp: dp({dp}) * tp({tp}) = {dp * tp} exceeds the GPU count {gpus}"
        )
    if dp is not None and dp > micro_batches(job):
        faults.append(
            f"spec.parallelism.dp: dp({dp}) exceeds the micro-batches per step "
            f"({micro_batches(job)}); every pipeline needs one"
        )
    return faults


def problem_of(job: MalleusJob, rates: Mapping[int, float | None] | None = None) -> PlanningProblem:
    """The planning problem of the job under ``rates`` (default: every GPU healthy)."""
    try:
        return build_problem(job, dict(rates or {}))
    except ProblemError as e:
        raise InvalidSpec(e.faults) from None


async def initial_plan(job: MalleusJob, planner: Planner = default_planner) -> tuple[Plan, float]:
    """The plan for healthy GPUs, generation `INITIAL_GENERATION`, and planning seconds.

    Raises `InvalidSpec` for semantic faults and when no layout fits (the model does not fit
    in memory at all, say). A planner that times out raises `PlanningTimeout` (retry later).
    """
    faults = semantic_faults(job)
    if faults:
        raise InvalidSpec(faults)
    problem = problem_of(job)
    budget = float(StragglerPolicy.from_job(job).planning_timeout_seconds)
    try:
        plan, seconds = await run_planner(planner, problem, time_limit=budget)
    except PlanningTimeout:
        raise
    except (ValueError, RuntimeError) as e:  # ProblemError, PlanError, "nothing fits", ...
        raise InvalidSpec([f"no parallel layout of this job fits its GPUs: {e}"]) from None
    violations = validate_plan(problem, plan)
    if violations:
        raise InvalidSpec([f"the planner's layout is invalid: {v}" for v in violations])
    return plan.model_copy(update={"generation": INITIAL_GENERATION}), seconds
