"""From a MalleusJob body to a `ResolvedJob` and its initial plan, judged as every entry point
judges it.

The API server has already checked the schema and the CEL rules; the operator checks them again
(`malleus.job`, the same schema and rules) because a CRD older than the operator, or a job
created while the CRD was being upgraded, may let through what this version cannot run. What
no schema can say (degrees that do not fit the cluster, a model that fits no layout) is
`ResolvedJob.faults` and the planner's verdict, exactly what ``malleus check`` reports. A job
that fails here is never started: phase Failed, reason InvalidSpec, nothing created.

The operator's planning limits (`malleus.job.limits.PlanningLimits`, the chart's
``planningLimits``) are applied here, in `limited`, the one place both the initial plan and the
per-job controller (operator/daemon.py) take a job's policy from: a job beyond ``maxGpus`` is
`OverLimit` (Failed, ``Ready=False/OverLimit``, never planned), and its planning budget and
cooldown are clamped.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from malleus.controller.planning import Planner, default_planner, run_planner
from malleus.job import ResolvedJob
from malleus.job.limits import PlanningLimits
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem

__all__ = ["initial_plan", "limited", "resolve"]


def resolve(body: Mapping[str, Any]) -> ResolvedJob:
    """The typed, defaulted job of a custom resource; `BadInput` listing every schema fault.

    Only apiVersion, kind, metadata and spec are read (status is the operator's own output),
    and unknown fields are pruned as the API server would (not faults).
    """
    manifest = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    meta = dict(manifest.get("metadata") or {})
    meta.pop("managedFields", None)
    manifest["metadata"] = meta
    return ResolvedJob.load(manifest, strict=False)


def limited(job: ResolvedJob, limits: PlanningLimits) -> tuple[ResolvedJob, list[str]]:
    """``job`` with its ``stragglerPolicy`` within ``limits``, and one line per field a limit
    changed (``planningTimeoutSeconds 3600 -> 60 (...)``); `OverLimit` (a `BadInput`) when
    the job has more GPUs than ``limits.max_gpus``. Idempotent."""
    policy, changes = limits.limit(job.policy, job.world)
    if not changes:
        return job, []
    spec = job.spec.model_copy(update={"straggler_policy": policy})
    return ResolvedJob.of(job.job.model_copy(update={"spec": spec}), job.source), changes


async def initial_plan(
    job: ResolvedJob,
    planner: Planner = default_planner,
    limits: PlanningLimits | None = None,
) -> tuple[Plan, float]:
    """The plan for healthy GPUs (generation `malleus.job.INITIAL_GENERATION`) and its seconds.

    The job is `limited` first (``limits`` None: the defaults), so the planner gets at most
    ``maxPlanningSeconds`` and a job beyond ``maxGpus`` is never planned (`OverLimit`).
    `BadInput` for semantic faults and when no layout fits; `PlanningTimeout` when the planner
    overruns the policy's budget (retry later). The planner runs in a worker thread, as the
    controller runs it, so a slow one never freezes the operator's event loop; in a pool of its
    own, so a planner that ignores its time limit does not hold up the operator's shutdown.
    """
    job, _ = limited(job, limits or PlanningLimits())
    job.check()

    def plan_job(_: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        return job.initial_plan(planner=planner, time_limit=time_limit)

    budget = float(job.policy.planning_timeout_seconds)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="malleus-initial-plan")
    try:
        return await run_planner(plan_job, job.problem(), time_limit=budget, executor=pool)
    finally:
        pool.shutdown(wait=False)
