"""``spec.suspend``: a job with no pods, until someone (a user, Kueue) admits it.

Kueue and batch schedulers admit a workload by flipping its ``spec.suspend`` to false, and
preempt it by setting it true again, so suspending must give the GPUs back without losing the
work: a running job is asked to checkpoint and stop (``POST /stop`` on its coordinator, with a
checkpoint when ``spec.checkpoint`` is configured), its pods are deleted once they have exited
(or after `STOP_GRACE_SECONDS`), and its Service, ConfigMap and Secret stay. Resuming recreates
the pods, which continue from the checkpoint (the trainer resumes ``spec.checkpoint.path``).

`admission_action` is the pure decision; `reconcile` acts on it through the `k8s.Cluster` and is
called when ``spec.suspend`` changes and by the operator's timer, with the time as an argument.
The phase is ``Suspended`` from the moment the suspension is decided, so the pods' exit is never
mistaken for the job's end (`lifecycle.pods_transition` leaves a Suspended job alone).

A job labelled ``kueue.x-k8s.io/queue-name`` is held the same way while Kueue has not
admitted its Workload, or evicts it (`ensure_workload`, `kueue.state`): no pods until
admitted, a checkpointed stop when evicted, and once its pods are gone the Workload's quota
given back (`kueue.released`); a finished job's Workload is marked ``Finished``.

`ensure_pod_group` creates the coscheduler's PodGroup of ``spec.scheduling.podGroup.create``
(`scheduling.build_pod_group`) before the job's pods, and says how that went in the
``PodGroupCreated`` condition; a PodGroup that could not be made (its CRD absent, no right to
it) is retried by the timer while the job is Pending.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from malleus.control import ControlError
from malleus.errors import BadInput
from malleus.job import MalleusJobStatus, Phase
from malleus.job.spec import MalleusJobSpec, SchedulingSpec
from malleus.planner.plan import Plan

from . import children, jobs, kueue, resources, store, tls, workers
from .context import Context
from .k8s import ApiError, NameConflict
from .lifecycle import parse_time, pod_outcome, schedule_timeout_transition
from .scheduling import POD_GROUP_APIS, build_pod_group, gated
from .status import READY, TERMINAL_PHASES, condition, dump, merge_conditions, phase_of
from .trainers import Endpoints

__all__ = [
    "POD_GROUP_CREATED",
    "STOP_GRACE_SECONDS",
    "SUSPENDED",
    "Action",
    "admission_action",
    "created_suspended",
    "ensure_pod_group",
    "reconcile",
    "resumed_status",
    "suspended_status",
    "tick",
]

log = logging.getLogger(__name__)

SUSPENDED = "Suspended"
"""The condition type (and reason) of a suspended job."""
STOP_GRACE_SECONDS = 300.0
"""How long the trainers of a suspended job may take to checkpoint and exit before their pods
are deleted anyway (a checkpoint is written at the next step boundary)."""

POD_GROUP_CREATED = "PodGroupCreated"
"""The condition type saying whether the PodGroup of ``spec.scheduling.podGroup.create`` exists."""

Action = Literal["suspend", "delete-pods", "resume"]


def admission_action(
    suspend: bool,
    phase: Phase | None,
    live_pods: int,
    since: dt.datetime | None,
    at: dt.datetime,
    grace: float = STOP_GRACE_SECONDS,
) -> Action | None:
    """What ``spec.suspend`` asks for now (None: nothing).

    ``live_pods`` counts the job's pods that have not exited; ``since`` is when the job was
    suspended (the ``Suspended`` condition's transition time). A finished job never changes;
    a suspended job resumes only once its last pod is gone, so two sets of workers never
    share a rendezvous.
    """
    if phase is None or phase in TERMINAL_PHASES:
        return None
    if suspend and phase != Phase.SUSPENDED:
        return "suspend"
    if phase != Phase.SUSPENDED:
        return None
    if live_pods:
        overdue = since is None or (at - since).total_seconds() >= grace
        return "delete-pods" if overdue else None
    return None if suspend else "resume"


def suspended_status(
    stored: Mapping[str, Any] | None, message: str, generation: int, at: dt.datetime
) -> MalleusJobStatus:
    """Phase ``Suspended``: ``Suspended=True`` and ``Ready=False``, both reason Suspended."""
    conds = (stored or {}).get("conditions") or []
    return MalleusJobStatus(
        phase=Phase.SUSPENDED,
        message=message,
        conditions=merge_conditions(
            conds,
            condition(SUSPENDED, True, SUSPENDED, message, generation, at),
            condition(READY, False, SUSPENDED, message, generation, at),
        ),
    )


def created_suspended(
    created: Mapping[str, Any], generation: int, at: dt.datetime, queue: str | None = None
) -> dict[str, Any]:
    """The status patch of a job created with ``spec.suspend`` or queued in Kueue (`queue`,
    its LocalQueue): the created status (plan, pods it will have), but ``Suspended`` and no
    ``startTime`` (nothing runs yet; it is set when the job is resumed)."""
    message = (
        "created suspended (spec.suspend): no worker pods until it is false"
        if queue is None
        else f"queued in Kueue (LocalQueue {queue}): no worker pods until it is admitted"
    )
    held = dump(suspended_status(created, message, generation, at))
    return {**created, **held, "startTime": None}


def resumed_status(
    stored: Mapping[str, Any] | None, pods: Sequence[str], generation: int, at: dt.datetime
) -> MalleusJobStatus:
    """Back to ``Pending`` with new pods: ``Suspended=False/Resumed``; ``startTime`` restarts,
    so the schedule timeout and the active deadline count from the new pods."""
    conds = (stored or {}).get("conditions") or []
    message = f"resumed: created {len(pods)} worker pod(s); waiting for them to run"
    return MalleusJobStatus(
        phase=Phase.PENDING,
        start_time=at,
        message=message,
        conditions=merge_conditions(
            conds,
            condition(SUSPENDED, False, "Resumed", message, generation, at),
            condition(READY, False, "PodsPending", "worker pods are starting", generation, at),
        ),
    )


def _since(stored: Mapping[str, Any]) -> dt.datetime | None:
    for c in stored.get("conditions") or []:
        if c.get("type") == SUSPENDED and c.get("status") == "True":
            return parse_time(c.get("lastTransitionTime"))
    return None


async def _ask_stop(
    ctx: Context, ref: resources.JobRef, port: int, checkpoint: bool, gpus_per_node: int = 1
) -> bool:
    """``POST /stop`` to the coordinator; False when it cannot be asked (then the pods go now).

    The coordinator is found as the daemon finds it (`trainers.Endpoints.coordinator`: the
    lowest running rank that answers ``/status``), not taken to be node 0: after a failure of
    rank 0 it is the lowest survivor, and node 0 may serve nothing or be gone."""
    name = resources.secret_name(ref.name)
    token = await ctx.cluster.read_secret_value(ref.namespace, name, resources.TOKEN_KEY)
    ca = await ctx.cluster.read_secret_value(ref.namespace, name, tls.CA_KEY)
    template = ctx.settings.endpoint_template
    endpoints = Endpoints(
        ctx.cluster,
        ref,
        port,
        template,
        gpus_per_node=gpus_per_node,
        ca=ca,
        token=token,
        max_bytes=ctx.settings.max_response_bytes,
    )
    timeout = ctx.settings.http_timeout_seconds
    try:
        found = await endpoints.coordinator(timeout)
        async with endpoints.client(found.url, found.tls, timeout) as client:
            await client.stop(checkpoint=checkpoint)
    except (ConnectionError, ControlError) as e:
        log.warning("%s/%s: could not ask the trainers to stop: %s", ref.namespace, ref.name, e)
        return False
    return True


async def _resume(ctx: Context, body: Mapping[str, Any], ref: resources.JobRef) -> list[str]:
    """Recreate the pods (and anything else missing) under the plan in the job's ConfigMap."""
    job = jobs.resolve(body)
    stored = await ctx.cluster.read("ConfigMap", ref.namespace, resources.configmap_name(ref.name))
    text = ((stored or {}).get("data") or {}).get(resources.PLAN_KEY)
    planner = ctx.planner(f"{ref.namespace}/{ref.name}")
    plan = Plan.from_json(text) if text else (await jobs.initial_plan(job, planner, ctx.limits))[0]
    await children.ensure_children(ctx, job, ref, plan)
    return [resources.pod_name(ref.name, i) for i in range(job.nodes)]


async def ensure_workload(
    ctx: Context, body: Mapping[str, Any], ref: resources.JobRef, queue: str
) -> dict[str, Any] | None:
    """The job's Kueue Workload (`kueue.build_workload`), made when missing; None when it
    cannot be made (Kueue not installed, no right to it, a name taken: logged), and then the
    job stays queued."""
    try:
        found = await ctx.cluster.read_custom(
            kueue.API_VERSION, kueue.PLURAL, ref.namespace, kueue.workload_name(ref.name)
        )
        if found is not None:
            if (resources.controller_of(found) or {}).get("uid") != ref.uid:
                log.warning("%s/%s: Workload %s is not the job's", ref.namespace, ref.name,
                            kueue.workload_name(ref.name))  # fmt: skip
                return None
            return found
        job = jobs.resolve(body)
        labels = (body.get("metadata") or {}).get("labels") or {}
        priority_class = labels.get(kueue.PRIORITY_LABEL)
        priority = None
        if priority_class:
            found_class = await ctx.cluster.read_cluster_custom(
                kueue.API_VERSION, kueue.PRIORITY_CLASSES, priority_class
            )
            if found_class is None:  # Kueue would refuse it too: the job waits, and says why
                log.warning("%s/%s: no WorkloadPriorityClass %s", ref.namespace, ref.name,
                            priority_class)  # fmt: skip
                return None
            priority = int(found_class.get("value") or 0)
        wanted = kueue.build_workload(
            ref,
            queue,
            workers.build_pod(job, ref, 0),
            store.build_store_pod(job, ref),
            job.nodes,
            priority_class,
            priority,
        )
        made, _ = await ctx.cluster.create_custom(wanted, kueue.PLURAL)
        return made
    except (ApiError, NameConflict, BadInput) as e:
        log.warning("%s/%s: no Kueue Workload: %s", ref.namespace, ref.name, e)
        return None


async def _finish_workload(
    ctx: Context, body: Mapping[str, Any], ref: resources.JobRef, at: dt.datetime
) -> None:
    """A finished job's Workload marked ``Finished`` (once), which frees its Kueue quota."""
    name = kueue.workload_name(ref.name)
    try:
        found = await ctx.cluster.read_custom(kueue.API_VERSION, kueue.PLURAL, ref.namespace, name)
        if found is None or kueue.state(found).finished:
            return
        stored = body.get("status") or {}
        succeeded = phase_of(stored) == Phase.SUCCEEDED
        patch = kueue.finished(found, succeeded, str(stored.get("message") or ""), at)
        await ctx.cluster.patch_custom_status(
            kueue.API_VERSION, kueue.PLURAL, ref.namespace, name, patch
        )
    except ApiError as e:
        log.warning("%s/%s: Workload %s not marked Finished: %s", ref.namespace, ref.name, name, e)


async def _kueue_state(
    ctx: Context, body: Mapping[str, Any], ref: resources.JobRef
) -> tuple[kueue.WorkloadState | None, dict[str, Any] | None]:
    """(where Kueue has the job, its Workload); (None, None) when Kueue does not manage it."""
    queue = kueue.queue_name(body)
    if queue is None:
        return None, None
    workload = await ensure_workload(ctx, body, ref, queue)
    return kueue.state(workload), workload


def _condition_of(conditions: Sequence[Any] | None, type_: str) -> Mapping[str, Any] | None:
    for c in conditions or []:
        c = c.model_dump(by_alias=True) if hasattr(c, "model_dump") else c
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


async def ensure_pod_group(
    ctx: Context,
    spec: MalleusJobSpec,
    ref: resources.JobRef,
    conditions: Sequence[Any] | None,
    at: dt.datetime,
) -> list[Any] | None:
    """Create the PodGroup ``spec.scheduling.podGroup.create`` asks for (idempotent by name
    and owner); ``conditions`` with ``PodGroupCreated`` merged in, or None when no PodGroup is
    asked for.

    Never blocks the workers (a coscheduler holds pods whose PodGroup is missing; the
    schedule timeout ends a wait that never ends): a PodGroup that cannot be made gives
    ``PodGroupCreated=False`` with the reason (``CRDMissing``: its API is not served;
    ``Forbidden``: the operator has no right to it; ``NameConflict``; ``ApiError``) and one
    Warning event ``PodGroupFailed`` per new reason; a new one gives a ``PodGroupCreated`` event.
    """
    wanted = build_pod_group(spec, ref)
    pod_group = spec.scheduling.pod_group
    if wanted is None or pod_group is None or pod_group.create is None:
        return None
    api = POD_GROUP_APIS[pod_group.create]
    name = wanted["metadata"]["name"]
    try:
        _, created = await ctx.cluster.create_custom(wanted, api.plural)
    except NameConflict as e:
        reason, message = "NameConflict", str(e)
    except ApiError as e:
        if e.status == 404:
            reason = "CRDMissing"
            message = (
                f"PodGroup {name}: {api.resource} is not served here: install {api.project} "
                "(its PodGroup CRD), or drop spec.scheduling.podGroup.create; the workers wait "
                "for their PodGroup until spec.scheduling.scheduleTimeoutSeconds"
            )
        elif e.status == 403:
            reason = "Forbidden"
            message = (
                f"PodGroup {name}: the operator may not create {api.resource} (the chart's "
                f"rbac.podGroups.{_CHART_VALUE[pod_group.create]}=true grants it)"
            )
        else:
            reason, message = "ApiError", f"PodGroup {name}: {e}"
    else:
        message = f"PodGroup {name} ({api.api_version}, minMember {spec.nodes})"
        if created:
            await ctx.cluster.post_event(ref, "Normal", "PodGroupCreated", "created " + message)
        done = condition(POD_GROUP_CREATED, True, "Created", message, ref.generation, at)
        return list(merge_conditions(conditions, done))
    before = _condition_of(conditions, POD_GROUP_CREATED)
    if before is None or before.get("status") != "False" or before.get("reason") != reason:
        await ctx.cluster.post_event(ref, "Warning", "PodGroupFailed", message)
    log.warning("%s/%s: %s", ref.namespace, ref.name, message)
    failed = condition(POD_GROUP_CREATED, False, reason, message, ref.generation, at)
    return list(merge_conditions(conditions, failed))


_CHART_VALUE = {"scheduler-plugins": "schedulerPlugins", "volcano": "volcano"}


async def _retry_pod_group(
    ctx: Context, fresh: Mapping[str, Any], ref: resources.JobRef, at: dt.datetime
) -> None:
    """The timer's retry of a PodGroup that is not there yet (a Pending job's)."""
    stored = fresh.get("status") or {}
    spec = fresh.get("spec") or {}
    pod_group = (spec.get("scheduling") or {}).get("podGroup") or {}
    if not pod_group.get("create"):
        return
    before = _condition_of(stored.get("conditions"), POD_GROUP_CREATED)
    if before is not None and before.get("status") == "True":
        return
    try:
        job = jobs.resolve(fresh)
    except BadInput:
        return
    merged = await ensure_pod_group(ctx, job.spec, ref, stored.get("conditions"), at)
    if merged is not None:
        patch = dump(MalleusJobStatus(conditions=merged))
        await ctx.cluster.patch_job_status(ref.namespace, ref.name, patch)


async def reconcile(ctx: Context, body: Mapping[str, Any], at: dt.datetime) -> Action | None:
    """Act on ``spec.suspend`` at time ``at`` (the job read again first); returns the action.

    Suspending: phase Suspended (status first, so the pods' exit is not the job's end), a
    ``Suspended`` event, ``POST /stop`` to a running coordinator, or the pods deleted at once
    when there is none to ask. While suspended: exited pods are deleted, the rest after
    `STOP_GRACE_SECONDS`. Resuming: once no pod is left, the pods are recreated (Pending).
    """
    ref = resources.JobRef.from_body(body)
    fresh = await ctx.cluster.get_job(ref.namespace, ref.name)
    if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
        return None
    spec = fresh.get("spec") or {}
    stored = fresh.get("status") or {}
    nodes = int(spec.get("nodes") or 0)
    pods = [
        p
        for p in await ctx.cluster.list_children("Pod", ref.namespace, ref.name)
        if resources.owned_by(p, ref.uid)
    ]
    # The store outlives its workers (it serves no one once they exited): it goes with the
    # last of them, and does not hold the resume (on the real cluster, a suspended job whose
    # trainers stopped when asked kept its store Running and never resumed).
    stores = [p for p in pods if store.is_store_pod(p)]
    outcomes = [pod_outcome(p) for p in pods if not store.is_store_pod(p)]
    live = [o for o in outcomes if o.state in ("Pending", "Running")]
    phase = phase_of(stored)
    queued, workload = (
        (None, None)
        if phase is None or phase in TERMINAL_PHASES
        else await _kueue_state(ctx, fresh, ref)
    )
    # Kueue holds the job as spec.suspend does: no pods until admitted, stopped when evicted
    held = queued is not None and not queued.may_run
    suspend = bool(spec.get("suspend")) or held
    action = admission_action(suspend, phase, len(live), _since(stored), at)
    if phase == Phase.SUSPENDED:  # exited workers are done: give their resources back
        for o in outcomes:
            if o.state in ("Succeeded", "Failed"):
                await ctx.cluster.delete("Pod", ref.namespace, o.name)
        if not live:
            for pod in stores:
                await ctx.cluster.delete("Pod", ref.namespace, pod["metadata"]["name"])
            if queued is not None and workload is not None and queued.evicted and queued.reserved:
                # the pods are gone: the quota goes back, and the job waits in its queue again
                await ctx.cluster.patch_custom_status(
                    kueue.API_VERSION, kueue.PLURAL, ref.namespace,
                    workload["metadata"]["name"], kueue.released(workload, at),
                )  # fmt: skip
                await ctx.cluster.post_event(
                    ref,
                    "Normal",
                    "Requeued",
                    f"Kueue quota given back, queued again: {queued.evicted}",
                )
    if action == "suspend":
        checkpoint = bool((spec.get("checkpoint") or {}).get("intervalSteps"))
        stopping = (
            "checkpointing and stopping the trainers" if checkpoint else "stopping the trainers"
        )
        if spec.get("suspend") or queued is None:
            message = "spec.suspend is true: " + stopping
        elif queued.evicted:
            message = f"evicted by Kueue ({queued.evicted}): {stopping}"
        else:
            message = f"not admitted by Kueue (LocalQueue {kueue.queue_name(fresh)}): {stopping}"
        new = suspended_status(stored, message, ref.generation, at)
        await ctx.cluster.patch_job_status(ref.namespace, ref.name, dump(new))
        ctx.metrics.phases.set(ref.namespace, ref.name, Phase.SUSPENDED)
        await ctx.cluster.post_event(ref, "Normal", SUSPENDED, message)
        running = any(o.state == "Running" for o in outcomes)
        port = int(spec.get("controlPort") or 8040)
        gpus = int(spec.get("gpusPerNode") or 1)
        if not (running and await _ask_stop(ctx, ref, port, checkpoint, gpus)):
            await children.delete_children(ctx, ref, nodes, kinds=("Pod",))
    elif action == "delete-pods":
        await children.delete_children(ctx, ref, nodes, kinds=("Pod",))
    elif action == "resume":
        try:
            names = await _resume(ctx, fresh, ref)
        except children.PolicyViolation as e:  # stays Suspended, without pods, and says why
            conds = stored.get("conditions")
            refused = await children.report_policy_violation(ctx, ref, e.faults, conds, at)
            await ctx.cluster.patch_job_status(ref.namespace, ref.name, dump(refused))
            return None
        except BadInput as e:
            log.warning("%s/%s: cannot resume: %s", ref.namespace, ref.name, e)
            return None
        new = resumed_status(stored, names, ref.generation, at)
        await ctx.cluster.patch_job_status(ref.namespace, ref.name, dump(new))
        ctx.metrics.phases.set(ref.namespace, ref.name, Phase.PENDING)
        await ctx.cluster.post_event(ref, "Normal", "Resumed", new.message or "")
    return action


async def tick(ctx: Context, body: Mapping[str, Any], at: dt.datetime) -> str | None:
    """The operator's timer at time ``at``: `reconcile`, then the schedule timeout of a Pending
    job (``spec.scheduling.scheduleTimeoutSeconds``): ``Failed``/``ScheduleTimeout`` first,
    then its pods deleted, so a gang that got half its GPUs gives them back. While a pod is
    still gated (queued), ``startTime`` moves with ``at`` instead."""
    action = await reconcile(ctx, body, at)
    if action is not None:
        return action
    ref = resources.JobRef.from_body(body)
    fresh = await ctx.cluster.get_job(ref.namespace, ref.name)
    if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
        return None
    spec = fresh.get("spec") or {}
    if kueue.queue_name(fresh) and phase_of(fresh.get("status")) in TERMINAL_PHASES:
        await _finish_workload(ctx, fresh, ref, at)
        return None
    if phase_of(fresh.get("status")) == Phase.PENDING:
        await _retry_pod_group(ctx, fresh, ref, at)
        pods = await ctx.cluster.list_children("Pod", ref.namespace, ref.name)
        if gated([p for p in pods if resources.owned_by(p, ref.uid)]):
            # Queued (Kueue gates the gang until its quota is there): the clock of the
            # timeout, and of the active deadline, starts when the pods are admitted.
            patch = dump(MalleusJobStatus(start_time=at))
            await ctx.cluster.patch_job_status(ref.namespace, ref.name, patch)
            return "queued"
    scheduling = SchedulingSpec.model_validate(spec.get("scheduling") or {})
    timeout = scheduling.schedule_timeout_seconds
    transition = schedule_timeout_transition(fresh.get("status"), timeout, ref.generation, at)
    if transition.status is None:
        return None
    await ctx.cluster.patch_job_status(ref.namespace, ref.name, dump(transition.status))
    ctx.metrics.phases.set(ref.namespace, ref.name, Phase.FAILED)
    for event in transition.events:
        await ctx.cluster.post_event(ref, event.type, event.reason, event.message)
    await children.delete_children(ctx, ref, int(spec.get("nodes") or 0), kinds=("Pod",))
    return "timeout"
