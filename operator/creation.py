"""A job's creation: check it, plan it for healthy GPUs, create its children, write its first
status; or fail it as InvalidSpec.

Apart from the handlers (operator/handlers.py) because two of them run it: on.create, and
on.resume for a job whose creation kopf recorded but whose status never landed (an operator
killed between kopf's two patches). Idempotent: children are created by name (what exists is
kept, the ConfigMap's plan included).
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import kopf

from malleus.controller.planning import PlanningTimeout
from malleus.errors import BadInput
from malleus.job import Phase, ResolvedJob
from malleus.job.limits import OVER_LIMIT, OverLimit
from malleus.planner.plan import Plan

from . import admission, children, jobs, kueue, resources, status
from .context import Context
from .k8s import NameConflict

__all__ = ["NAME_CONFLICT_RETRY_SECONDS", "create_children", "create_job"]

log = logging.getLogger(__name__)

NAME_CONFLICT_RETRY_SECONDS = 60
"""How often a job blocked by a `NameConflict` looks again whether the name is free."""


async def create_children(
    ctx: Context,
    job: ResolvedJob,
    ref: resources.JobRef,
    plan: Plan,
    patch: kopf.Patch,
    conditions: list[Any],
    pods: bool = True,
) -> tuple[list[str], Plan]:
    """`children.ensure_children` (without the pods of a suspended job); on a `NameConflict` the job says so (condition, Warning
    event) and kopf retries later, so deleting the impostor is all the user has to do. A
    `children.PolicyViolation` (the policy changed since the job was created) gives
    ``Ready=False/PolicyViolation`` and no retry: a spec edit or a policy change is needed."""
    try:
        return await children.ensure_children(ctx, job, ref, plan, pods=pods)
    except children.PolicyViolation as e:
        at = status.now()
        refused = await children.report_policy_violation(ctx, ref, e.faults, conditions, at)
        patch.status.update(status.dump(refused))
        raise kopf.PermanentError(str(e)) from None
    except NameConflict as e:
        blocked = status.name_conflict_status(str(e), ref.generation, status.now(), conditions)
        patch.status.update(status.dump(blocked))
        await ctx.cluster.post_event(ref, "Warning", "NameConflict", str(e))
        raise kopf.TemporaryError(str(e), delay=NAME_CONFLICT_RETRY_SECONDS) from None


async def create_job(
    ctx: Context, body: kopf.Body, patch: kopf.Patch, *, resumed: bool = False
) -> None:
    """on.create's work, idempotent (children by name, the ConfigMap's plan kept): ``resumed``
    (`handlers.on_resume` redoing it) posts ``Resumed`` naming what it re-created instead of
    ``Created``, which the first run posted."""
    ref = resources.JobRef.from_body(body)
    at = status.now()
    conditions = (body.get("status") or {}).get("conditions") or []
    try:
        job = jobs.resolve(body)
        url_faults = ctx.settings.metrics_faults(body.get("spec") or {})
        if url_faults:
            raise BadInput(url_faults)
        # Before anything is made, suspended or not: the pods would come on resume.
        children.check_pod_policy(ctx.settings, job)
        job, limited = jobs.limited(job, ctx.limits)  # OverLimit: never planned
        plan, seconds = await jobs.initial_plan(job, ctx.planner(_key(ref)), ctx.limits)
    except OverLimit as e:
        await _refuse_over_limit(ctx, ref, e, patch, conditions, at)
    except children.PolicyViolation as e:
        refused = await children.report_policy_violation(
            ctx, ref, e.faults, conditions, at, fail=True
        )
        patch.status.update(status.dump(refused))
        ctx.metrics.phases.set(ref.namespace, ref.name, Phase.FAILED)
        raise kopf.PermanentError(str(e)) from None
    except BadInput as e:
        invalid = status.invalid_spec_status(e.faults, ref.generation, at, conditions)
        patch.status.update(status.dump(invalid))
        ctx.metrics.phases.set(ref.namespace, ref.name, Phase.FAILED)
        message = status.invalid_spec_message(e.faults)
        await ctx.cluster.post_event(ref, "Warning", "InvalidSpec", message)
        raise kopf.PermanentError(message) from None
    except PlanningTimeout as e:
        raise kopf.TemporaryError(f"initial planning timed out: {e}", delay=30) from None
    ctx.metrics.planning_seconds.observe(seconds)
    queue = kueue.queue_name(body)
    suspended = job.spec.suspend or queue is not None  # Kueue admits a queued job later
    if queue is not None:  # its Workload, which Kueue admits (or not) as one gang
        await admission.ensure_workload(ctx, body, ref, queue)
    # A coscheduler's PodGroup before the pods it gangs (spec.scheduling.podGroup.create).
    conditions = await admission.ensure_pod_group(ctx, job.spec, ref, conditions, at) or conditions
    created, plan = await create_children(
        ctx, job, ref, plan, patch, conditions, pods=not suspended
    )
    pods = [resources.pod_name(ref.name, i) for i in range(job.nodes)]
    new = status.dump(status.created_status(plan, pods, job.world, ref.generation, at, conditions))
    if suspended:  # admitted later (spec.suspend false, Kueue's admission): no pods until then
        new = admission.created_suspended(new, ref.generation, at, queue)
    patch.status.update(new)
    ctx.metrics.phases.set(ref.namespace, ref.name, status.phase_of(new))
    if resumed:
        if created:
            await ctx.cluster.post_event(
                ref, "Normal", "Resumed", f"re-created {', '.join(created)}"
            )
        log.info("%s/%s: creation redone, re-created %s", ref.namespace, ref.name, created)
        return
    await ctx.cluster.post_event(
        ref,
        "Normal",
        "Created",
        f"created {0 if suspended else len(pods)} worker pod(s) on {job.world} GPU(s); plan "
        f"generation {plan.generation}: {status.plan_summary(plan)}",
    )
    if limited:
        await ctx.cluster.post_event(ref, "Normal", "PlanningLimited", "; ".join(limited))
    log.info("%s/%s: created %s (planning %.3f s)", ref.namespace, ref.name, created, seconds)


def _key(ref: resources.JobRef) -> str:
    return f"{ref.namespace}/{ref.name}"


async def _refuse_over_limit(
    ctx: Context,
    ref: resources.JobRef,
    error: OverLimit,
    patch: kopf.Patch,
    conditions: list[Any],
    at: Any,
) -> NoReturn:
    """Failed with ``Ready=False/OverLimit`` naming the limit and the chart value raising it,
    a Warning event; kopf does not retry (a spec edit or a higher limit is needed)."""
    message = "over the operator's planning limits: " + "; ".join(str(f) for f in error.faults)
    failed = status.finished_status(
        Phase.FAILED, OVER_LIMIT, message, ref.generation, at, conditions
    )
    failed.observed_generation = ref.generation
    patch.status.update(status.dump(failed))
    ctx.metrics.phases.set(ref.namespace, ref.name, Phase.FAILED)
    await ctx.cluster.post_event(ref, "Warning", OVER_LIMIT, message)
    raise kopf.PermanentError(message) from None
