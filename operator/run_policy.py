"""``spec.runPolicy`` enforced: a job's deadline and the lifetime of its objects after it ends.

The decision is `lifecycle.run_policy_due` (pure, given the time); this module acts on it
through the `k8s.Cluster`, and `handlers.run_policy_timer` calls it every
`lifecycle.RUN_POLICY_INTERVAL` seconds. Tests call `enforce` with the time they choose.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from malleus.job import Phase
from malleus.job.spec import RunPolicy

from . import children, lifecycle, resources, status
from .context import Context

__all__ = ["enforce"]


async def enforce(ctx: Context, body: Mapping[str, Any], at: dt.datetime) -> str | None:
    """Act on ``spec.runPolicy`` at time ``at``; returns the action taken, if any.

    Past ``activeDeadlineSeconds`` an active job is failed (``DeadlineExceeded``) and then its
    pods are deleted (in that order, so the pod watcher does not call it ``PodFailed``);
    ``ttlSecondsAfterFinished`` after it ended, its children are deleted, the job and its
    status kept as the record. The job is read again first: the pods may have just finished.
    """
    ref = resources.JobRef.from_body(body)
    fresh = await ctx.cluster.get_job(ref.namespace, ref.name)
    if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
        return None
    spec = fresh.get("spec") or {}
    try:
        policy = RunPolicy.model_validate(spec.get("runPolicy") or {})
    except ValidationError:
        return None
    created = lifecycle.parse_time((fresh.get("metadata") or {}).get("creationTimestamp"))
    due = lifecycle.run_policy_due(fresh.get("status"), policy, created, at)
    nodes = int(spec.get("nodes") or 0)
    if due.action == "deadline" and policy.active_deadline_seconds is not None:
        limit = policy.active_deadline_seconds
        transition = lifecycle.deadline_transition(fresh.get("status"), limit, ref.generation, at)
        if transition.status is not None:
            patch = status.dump(transition.status)
            await ctx.cluster.patch_job_status(ref.namespace, ref.name, patch)
            ctx.metrics.phases.set(ref.namespace, ref.name, Phase.FAILED)
        for event in transition.events:
            await ctx.cluster.post_event(ref, event.type, event.reason, event.message)
        await children.delete_children(ctx, ref, nodes, kinds=("Pod",))
    elif due.action == "expire":
        deleted = await children.delete_children(ctx, ref, nodes)
        if not deleted:
            return None  # already done (an earlier tick, or a restarted operator)
        await ctx.cluster.post_event(
            ref,
            "Normal",
            "Expired",
            f"ttlSecondsAfterFinished ({policy.ttl_seconds_after_finished} s) passed: deleted "
            + ", ".join(deleted),
        )
    return due.action
