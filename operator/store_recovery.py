"""The job's rendezvous store pod, brought back while the job is active: created again when gone.

The store pod (`store.build_store_pod`, ``restartPolicy: Always``) outlives a crashed container
(its kubelet restarts it in place), but not its deletion (``kubectl delete``, the node lifecycle
controller removing the pods of a dead node) nor an eviction (phase Failed: ``restartPolicy``
no longer applies). Nothing else would bring it back, and the trainers, whose store clients
dial the Service's address again for up to a minute a call (trainer/world/store_client.py), would
lose their rendezvous at the next failure. So while the job is active (`status.ACTIVE_PHASES`,
not being deleted):

- a store pod that is gone is created again from the job as it was started
  (`children.started_job`, the builder its creation used), idempotent by name: the API server
  keeps one pod of a name, so a restarted operator or two racing events never make two;
- an ended one (Failed, Succeeded) that the job controls is deleted first and created once the
  name is free (its DELETED event, or the next check), as `children` replaces a failed worker;
- a pod of that name that the job does not control is left alone (`resources.owned_by`): it
  may have been planted, and deleting it is its owner's call;
- the store's Service (the address the trainers dial), when gone, is created again too.

A job that is not active never gets one back: Suspended, Succeeded and Failed are set before
their pods are deleted (`admission`, `run_policy`), so the deletion this module sees then is
the operator's own. `sync_store` runs on every store pod event
(`handlers.on_pod_event`), at an operator's resume, and every `CHECK_SECONDS` on a timer, which
heals a deletion no watch event brought (a watch that broke, an operator that was away).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from malleus.errors import BadInput

from . import children, resources, status, store
from .context import Context
from .k8s import NameConflict

__all__ = [
    "CHECK_SECONDS",
    "ENDED_PHASES",
    "FAILED",
    "RECREATED",
    "Action",
    "active",
    "store_action",
    "sync_store",
]

log = logging.getLogger(__name__)

CHECK_SECONDS = 15.0
"""How often the timer looks at an active job's store pod: well within the minute a trainer's
store call waits for a lost store, so a missed watch event still costs no rendezvous."""
ENDED_PHASES = frozenset({"Failed", "Succeeded"})
"""Pod phases its kubelet never restarts from (an eviction, a node's graceful shutdown)."""
RECREATED = "StoreRecreated"
"""The event reason of a store pod created again."""
FAILED = "StoreFailed"
"""The event reason of an ended store pod deleted to make room for a new one."""

Action = Literal["create", "delete", "wait", "foreign"]


def active(job: Mapping[str, Any] | None) -> bool:
    """Whether ``job`` (as stored) should have a store: active and not being deleted."""
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return status.phase_of(job.get("status")) in status.ACTIVE_PHASES


def store_action(pod: Mapping[str, Any] | None, uid: str) -> Action | None:
    """What the store pod ``pod`` (None: there is none) of the job of uid ``uid`` needs.

    ``create``: gone; ``delete``: the job's, ended; ``wait``: the job's, being deleted (it is
    created again once gone); ``foreign``: not the job's, left alone; None: nothing.
    """
    if pod is None:
        return "create"
    if not resources.owned_by(pod, uid):
        return "foreign"
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "wait"
    if (pod.get("status") or {}).get("phase") in ENDED_PHASES:
        return "delete"
    return None


def _why(pod: Mapping[str, Any]) -> str:
    """``Failed: Evicted: The node was low on resource: memory.``, for the event."""
    st = pod.get("status") or {}
    parts = [st.get("phase"), st.get("reason"), st.get("message")]
    return ": ".join(str(p) for p in parts if p)


async def sync_store(
    ctx: Context, namespace: str, job_name: str, *, seen: Mapping[str, Any] | None = None
) -> Action | None:
    """One step towards the job's store pod being there (`store_action`); returns the action.

    ``seen``: the pod of a watch event other than a deletion; one that has not ended needs
    nothing, so the store's ordinary events cost no API call. The job and the pod are read
    afresh otherwise: an event's view may be older than the operator's own last step.
    """
    name = store.store_name(job_name)
    if seen is not None:
        phase = (seen.get("status") or {}).get("phase")
        if (seen.get("metadata") or {}).get("name") != name or phase not in ENDED_PHASES:
            return None
    job_body = await ctx.cluster.get_job(namespace, job_name)
    if job_body is None or not active(job_body):
        return None
    ref = resources.JobRef.from_body(job_body)
    await _ensure_service(ctx, ref)
    pod = await ctx.cluster.read("Pod", namespace, name)
    if pod is None:
        return await _create(ctx, ref, job_body)
    action = store_action(pod, ref.uid)
    if action == "foreign":
        owner = resources.describe_owner(pod)
        log.warning(
            "%s/%s: pod %s is not the job's (%s): left alone", namespace, job_name, name, owner
        )
    elif action == "delete" and await ctx.cluster.delete("Pod", namespace, name):
        message = f"Pod/{name} ended ({_why(pod)}); deleted, to be created again"
        await ctx.cluster.post_event(ref, "Warning", FAILED, message)
    return action


async def _ensure_service(ctx: Context, ref: resources.JobRef) -> bool:
    """Create the store's Service again if it is gone (its name is the address every trainer
    dials); True when this call made it. One of that name the job does not control is left
    alone, as a foreign pod is."""
    name = store.store_name(ref.name)
    if await ctx.cluster.read("Service", ref.namespace, name) is not None:
        return False
    try:
        _, new = await ctx.cluster.create(store.build_store_service(ref))
    except NameConflict as e:
        log.warning("%s/%s: %s", ref.namespace, ref.name, e)
        return False
    if new:
        await ctx.cluster.post_event(
            ref,
            "Warning",
            RECREATED,
            f"Service/{name} was gone: created it again, so that {store.store_address(ref)} "
            "reaches the store pod",
        )
    return new


async def _create(
    ctx: Context, ref: resources.JobRef, job_body: Mapping[str, Any]
) -> Action | None:
    """Create the store pod as the job was started; an event only when this call made it (None:
    another step made it first)."""
    name = store.store_name(ref.name)
    try:
        job = await children.started_job(ctx, ref, job_body)
    except BadInput as e:
        log.warning("%s/%s: cannot re-create %s: %s", ref.namespace, ref.name, name, e)
        return None
    try:
        _, new = await ctx.cluster.create(store.build_store_pod(job, ref))
    except NameConflict as e:  # someone else's pod took the name in between
        log.warning("%s/%s: %s", ref.namespace, ref.name, e)
        return "foreign"
    if new:
        log.info("%s/%s: re-created the store pod %s", ref.namespace, ref.name, name)
        await ctx.cluster.post_event(
            ref,
            "Warning",
            RECREATED,
            f"Pod/{name} was gone: created it again; the trainers' store clients dial it again "
            f"at {store.store_address(ref)}, where it starts empty (the keys written before "
            "are lost; a recovery writes its own afresh)",
        )
    return "create" if new else None
