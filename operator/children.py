"""A job's children through the `k8s.Cluster`: create what is missing, delete what is the job's.

Both directions go by name and by controller owner, never by name alone: an object of a child's
name that the job does not control may have been planted (a ``<job>-control`` Secret holding a
token someone knows, a ``<job>-config`` ConfigMap with a plan of their choosing), so it is
neither used (`k8s.NameConflict` stops the creation) nor deleted.

`renew_certificates` renews the job's TLS certificates in its Secret before they expire
(`tls.renewed`): the job's controller calls it while the job is active.

`replace_failed` acts on `failures`: it replaces the worker pods whose backoff is over;
`follow_out` keeps the PodDisruptionBudget at the nodes still in the job.

No worker pod is created before `check_pod_policy` judged the job's ``spec.podTemplate`` by the
admin's policy (`malleus.job.podpolicy`, the operator's settings): the API server's admission
policy judges it too, but a job admitted before that policy existed, or with its binding
removed, must not get a hostPath, a Secret or the operator's ServiceAccount through the
operator's rights. `report_policy_violation` says so (``Ready=False/PolicyViolation``, one
Warning event per occurrence).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from malleus.errors import BadInput, Fault
from malleus.job import FailurePolicy, Phase, ResolvedJob
from malleus.job.podpolicy import policy_faults
from malleus.job.status import MalleusJobStatus, NodeFailure
from malleus.planner.plan import Plan

from . import failures, jobs, lifecycle, monitoring, resources, status, store, tls, workers
from .context import Context
from .k8s import StaleRead
from .settings import Settings
from .syncs import PodEvents

__all__ = [
    "PolicyViolation",
    "check_pod_policy",
    "child_kinds",
    "delete_children",
    "ensure_children",
    "follow_out",
    "network_policy",
    "pod_policy_faults",
    "renew_certificates",
    "replace_failed",
    "report_policy_violation",
    "started_job",
    "sync_pods",
]

log = logging.getLogger(__name__)


class PolicyViolation(BadInput):
    """The job's ``spec.podTemplate`` breaks the operator's pod template policy: its pods are
    not created (``faults`` name the fields and the chart values that would allow them)."""


def pod_policy_faults(settings: Settings, job: ResolvedJob) -> list[Fault]:
    """`malleus.job.podpolicy.policy_faults` of the job's template under the settings' policy,
    the operator's own ServiceAccount refused whatever the policy says."""
    return policy_faults(
        job.spec.pod_template,
        settings.template_policy(),
        operator_service_account=settings.service_account or None,
    )


def check_pod_policy(settings: Settings, job: ResolvedJob) -> None:
    """Raise `PolicyViolation` unless the job's pods may be created as its template asks."""
    faults = pod_policy_faults(settings, job)
    if faults:
        raise PolicyViolation(faults, what="MalleusJob pod template")


async def report_policy_violation(
    ctx: Context,
    ref: resources.JobRef,
    faults: Sequence[Fault],
    conditions: Sequence[Any] | None,
    at: dt.datetime,
    *,
    fail: bool = False,
) -> MalleusJobStatus:
    """The status saying the pods were refused (`status.policy_violation_status`), and a
    Warning ``PolicyViolation`` event unless ``conditions`` already hold this very refusal (a
    timer retrying a replacement or a resume says it once, not every minute)."""
    refused = status.policy_violation_status(faults, ref.generation, at, conditions, fail=fail)
    (ready,) = [c for c in refused.conditions or [] if c.type == status.READY]
    stored = [
        c.model_dump(by_alias=True) if hasattr(c, "model_dump") else c for c in conditions or []
    ]
    said = any(
        isinstance(c, Mapping)
        and c.get("type") == status.READY
        and c.get("status") == "False"
        and c.get("reason") == status.POLICY_VIOLATION
        and c.get("message") == ready.message
        for c in stored
    )
    if not said:
        await ctx.cluster.post_event(ref, "Warning", status.POLICY_VIOLATION, ready.message)
    log.warning("%s/%s: %s", ref.namespace, ref.name, ready.message)
    return refused


def child_kinds(settings: Settings) -> tuple[str, ...]:
    """The kinds a job owns, in deletion order (pods first: they use the rest). NetworkPolicy
    and PodDisruptionBudget only when the operator makes them (without, it may have no right
    to read them)."""
    budget = ("PodDisruptionBudget",) if settings.disruption_budgets else ()
    policy = ("NetworkPolicy",) if settings.network_policies else ()
    return ("Pod", *budget, "Service", "ConfigMap", "Secret", *policy)


def network_policy(
    settings: Settings, job: ResolvedJob, ref: resources.JobRef
) -> dict[str, Any] | None:
    """The job's NetworkPolicy as the settings ask for it (None: the operator makes none)."""
    if not settings.network_policies:
        return None
    peers = settings.control_port_peer_list()
    if settings.operator_namespace:
        peers.insert(
            0, resources.operator_peer(settings.operator_namespace, settings.operator_selector())
        )
    return resources.build_network_policy(job, ref, peers)


async def ensure_children(
    ctx: Context, job: ResolvedJob, ref: resources.JobRef, plan: Plan, *, pods: bool = True
) -> tuple[list[str], Plan]:
    """Create what is missing (idempotent by name): the job's existing objects are left
    untouched, so a Secret keeps its token and a ConfigMap its newer plan.

    Returns the names created and the plan the workers get: the existing ConfigMap's when there
    is one (a retried or resumed create must not show a plan the pods do not run). Raises
    `k8s.NameConflict` at the first name taken by an object the job does not control; what
    comes after it (the pods last) is not created. Without ``pods`` (a job created suspended:
    `admission`), everything but the pods. With them, `PolicyViolation` (nothing created) when
    the pod template breaks the policy.
    """
    if pods:
        check_pod_policy(ctx.settings, job)
    created: list[str] = []
    token = secrets.token_urlsafe(32)
    certificates = tls.issue_for_job(
        ref, job.nodes, dt.datetime.now(dt.UTC), ctx.settings.certificate_validity()
    )
    policy = network_policy(ctx.settings, job, ref)
    built = workers.build_children(
        job, ref, plan, token, policy, certificates, ctx.settings.disruption_budgets
    )
    for obj in built if pods else [o for o in built if o["kind"] != "Pod"]:
        stored, new = await ctx.cluster.create(obj)
        if new:
            created.append(f"{obj['kind']}/{obj['metadata']['name']}")
        elif obj["kind"] == "ConfigMap":
            text = (stored.get("data") or {}).get(resources.PLAN_KEY)
            if text:
                plan = Plan.from_json(text)
    if await monitoring.ensure_pod_monitor(ctx, job, ref):  # never holds the job back
        created.append(f"PodMonitor/{monitoring.pod_monitor_name(ref.name)}")
    return created, plan


def _names(ref: resources.JobRef, nodes: int) -> dict[str, list[str]]:
    return {
        "Pod": [resources.pod_name(ref.name, i) for i in range(nodes)]
        + [store.store_name(ref.name)],
        "Service": [resources.service_name(ref.name), store.store_name(ref.name)],
        "ConfigMap": [resources.configmap_name(ref.name)],
        "Secret": [resources.secret_name(ref.name)],
        "NetworkPolicy": [resources.network_policy_name(ref.name)],
        "PodDisruptionBudget": [resources.disruption_budget_name(ref.name)],
    }


async def renew_certificates(
    ctx: Context, ref: resources.JobRef, nodes: int, now: dt.datetime | None = None
) -> bool:
    """New TLS certificates in the job's Secret when the current ones are due (`tls.renewed`),
    the old CA kept trusted beside the new one until it expires. True when renewed: whoever
    holds the job's CA must read it again (the pods' endpoints switch to the new certificates
    when the kubelet updates their files). A Secret the job does not control is left alone."""
    name = resources.secret_name(ref.name)
    secret = await ctx.cluster.read("Secret", ref.namespace, name)
    if secret is None or not resources.owned_by(secret, ref.uid):
        return False
    data = {
        k: base64.b64decode(v).decode("utf-8", "replace")
        for k, v in (secret.get("data") or {}).items()
        if k == tls.CA_KEY or k.startswith("tls-")
    }
    when = now or dt.datetime.now(dt.UTC)
    fresh = tls.renewed(data, ref, nodes, when, ctx.settings.certificate_validity())
    if fresh is None:
        return False
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in fresh.items()}
    await ctx.cluster.patch("Secret", ref.namespace, name, {"data": encoded})
    _, until = tls.expiry(fresh[tls.worker_cert_key(0)])
    log.info("%s/%s: TLS certificates renewed, valid until %s", ref.namespace, ref.name, until)
    await ctx.cluster.post_event(
        ref,
        "Normal",
        "CertificatesRenewed",
        f"TLS certificates renewed, valid until {until:%Y-%m-%d %H:%M} UTC",
    )
    return True


async def delete_children(
    ctx: Context, ref: resources.JobRef, nodes: int, kinds: tuple[str, ...] | None = None
) -> list[str]:
    """Delete what the job controls of ``kinds`` (default: all, pods first); returns
    ``kind/name`` of what was deleted.

    Pods are found by label (their count may differ from an edited spec) and by name; the rest
    by their fixed names, so the operator needs no right to list Secrets.
    """
    known = _names(ref, nodes)
    deleted: list[str] = []
    for kind in kinds or child_kinds(ctx.settings):
        found: dict[str, dict[str, Any]] = {}
        if kind == "Pod":
            for obj in await ctx.cluster.list_children(kind, ref.namespace, ref.name):
                found[obj["metadata"]["name"]] = obj
        for name in known[kind]:
            if name not in found:
                obj = await ctx.cluster.read(kind, ref.namespace, name)
                if obj is not None:
                    found[name] = obj
        for name, obj in sorted(found.items()):
            if resources.owned_by(obj, ref.uid):
                await ctx.cluster.delete(kind, ref.namespace, name)
                deleted.append(f"{kind}/{name}")
    return deleted


# ---- pods -----------------------------------------------------------------------------------


async def sync_pods(
    ctx: Context,
    namespace: str,
    job_name: str,
    *,
    fresh: Mapping[str, Any] | None = None,
    deleted: list[str | Mapping[str, Any]] | None = None,
) -> lifecycle.Transition:
    """Recompute the job's phase and failures from its pods; apply them (status + events).

    ``fresh``: a pod's body from its watch event (newer than a list may be); ``deleted``: pods
    gone, by body (a watch's DELETED event) or by name. The events of one job are coalesced
    (`syncs.SyncQueue`: one sync runs, one waits and takes in every event that comes meanwhile),
    so a job's start costs a few syncs, not one per pod event. The status is written only onto
    the version of the job it was computed from, else computed again: two syncs at once must
    not both make the same transition (seen on the real control plane: the ``Running`` event
    posted twice)."""

    async def run(events: PodEvents) -> lifecycle.Transition:
        for _ in range(SYNC_ATTEMPTS - 1):
            with contextlib.suppress(StaleRead):
                return await _sync_pods_once(ctx, namespace, job_name, events)
        return await _sync_pods_once(ctx, namespace, job_name, events)

    return await ctx.pod_syncs.sync((namespace, job_name), run, fresh=fresh, deleted=deleted)


SYNC_ATTEMPTS = 8
"""How often `sync_pods` computes again after a concurrent write to the job's status."""


async def _sync_pods_once(
    ctx: Context, namespace: str, job_name: str, events: PodEvents
) -> lifecycle.Transition:
    cluster = ctx.cluster
    job_body = await cluster.get_job(namespace, job_name)
    if job_body is None or (job_body.get("metadata") or {}).get("deletionTimestamp"):
        return lifecycle.Transition()  # the job is going away: its pods do too
    ref = resources.JobRef.from_body(job_body)
    spec = job_body.get("spec") or {}
    expected = [resources.pod_name(job_name, i) for i in range(int(spec.get("nodes") or 0))]
    pods = await cluster.list_children("Pod", namespace, job_name)
    pods = [p for p in pods if resources.owned_by(p, ref.uid)]  # labels can be copied
    deleted = events.deleted
    gone = [d if isinstance(d, str) else (d.get("metadata") or {}).get("name") for d in deleted]
    pods = [p for p in pods if p.get("metadata", {}).get("name") not in gone]
    bodies = [d for d in deleted if isinstance(d, str) or resources.owned_by(d, ref.uid)]
    # An event's body is at least as new as the list's copy of its pod (a list may lag a watch).
    seen = {n: b for n, b in events.fresh.items() if resources.owned_by(b, ref.uid)}
    pods = [p for p in pods if p.get("metadata", {}).get("name") not in seen]
    pods += [dict(b) for b in seen.values()]
    transition = lifecycle.pods_transition(
        job_body.get("status"),
        pods,
        expected,
        ref.generation,
        status.now(),
        deleted=bodies,
        policy=FailurePolicy.model_validate(spec.get("failurePolicy") or {}),
        gpus_per_node=int(spec.get("gpusPerNode") or 1),
    )
    if transition.status is not None:
        version = (job_body.get("metadata") or {}).get("resourceVersion")
        patch = status.dump(transition.status)
        await cluster.patch_job_status(namespace, job_name, patch, resource_version=version)
        if transition.status.phase is not None:
            ctx.metrics.phases.set(namespace, job_name, transition.status.phase)
    records = transition.status.failures if transition.status is not None else None
    if records is None:  # as stored: a restarted operator catches up on a budget not yet lowered
        stored = {"failures": (job_body.get("status") or {}).get("failures") or []}
        records = MalleusJobStatus.model_validate(stored).failures
    if any(r.state == "Out" for r in records or []):
        await follow_out(ctx, ref, len(expected), records or [])
    for event in transition.events:
        if event.reason == "PodFailed":
            ctx.metrics.pod_failures.labels(namespace=namespace, job=job_name).inc()
        await cluster.post_event(ref, event.type, event.reason, event.message)
    return transition


async def follow_out(
    ctx: Context, ref: resources.JobRef, nodes: int, records: Sequence[NodeFailure]
) -> bool:
    """Lower the job's PodDisruptionBudget to the nodes still in the job once one is ``Out``:
    its pod is gone for good, and a budget kept at ``nodes`` would block every drain forever.
    True when patched; a budget the job does not control is left alone."""
    if not ctx.settings.disruption_budgets:
        return False
    out = [r.node for r in records if r.state == "Out"]
    want = resources.disruption_min_available(nodes, out)
    name = resources.disruption_budget_name(ref.name)
    budget = await ctx.cluster.read("PodDisruptionBudget", ref.namespace, name)
    if budget is None or not resources.owned_by(budget, ref.uid):
        return False
    if (budget.get("spec") or {}).get("minAvailable") == want:
        return False
    patch = {"spec": {"minAvailable": want}}
    await ctx.cluster.patch("PodDisruptionBudget", ref.namespace, name, patch)
    log.info("%s/%s: %s minAvailable %d (nodes %s out)", ref.namespace, ref.name, name, want, out)
    return True


# ---- replacing failed workers ---------------------------------------------------------------


async def started_job(ctx: Context, ref: resources.JobRef, body: Mapping[str, Any]) -> ResolvedJob:
    """The job as its pods were started (``job.json`` in the ConfigMap), else the live spec: a
    replacement pod must be its predecessor's twin, whatever was edited since."""
    cm = await ctx.cluster.read("ConfigMap", ref.namespace, resources.configmap_name(ref.name))
    text = ((cm or {}).get("data") or {}).get(resources.JOB_KEY)
    if text:
        try:
            return jobs.resolve({**json.loads(text), "metadata": body.get("metadata") or {}})
        except (ValueError, BadInput) as e:
            log.warning("%s/%s: %s unreadable (%s)", ref.namespace, ref.name, resources.JOB_KEY, e)
    return jobs.resolve(body)


async def _replace(
    ctx: Context, job: ResolvedJob, ref: resources.JobRef, record: NodeFailure, join: bool
) -> bool:
    """One step towards node ``record.node``'s replacement; True once it exists.

    The failed pod is deleted first (same name: its DNS name, certificate and Prometheus
    series stay the node's), and the replacement created as soon as the name is free. The name
    is freed at once (deleted with no grace, `failures.nothing_to_wait_for`) when nothing in the
    old pod runs any more (every container ended) or its node is lost (no kubelet will ever
    confirm); only a pod whose trainers still run gets its grace period to checkpoint and exit,
    and one still there `failures.STUCK_TERMINATING_SECONDS` after that is stuck: a Warning
    ``PodStuckTerminating`` event, ``Ready=False`` with that reason, and a forced deletion. An
    existing pod that is neither the failed one nor failed is the replacement already (created
    before an operator restart). ``join``: its trainers join a running job (a job still Pending
    has not formed its group yet: then the replacement starts like the first pods).
    `PolicyViolation` (nothing deleted, nothing created) when the policy no longer admits the
    job's pod template.
    """
    check_pod_policy(ctx.settings, job)
    pod = await ctx.cluster.read("Pod", ref.namespace, record.pod)
    if pod is not None:
        if not resources.owned_by(pod, ref.uid):
            log.warning("%s/%s: pod %s is not the job's", ref.namespace, ref.name, record.pod)
            return False
        meta = pod.get("metadata") or {}
        if meta.get("uid") != record.pod_uid and failures.pod_failure(pod, ref.name) is None:
            return True
        at = status.now()
        if failures.nothing_to_wait_for(pod, record.cause):
            await ctx.cluster.delete("Pod", ref.namespace, record.pod, grace_period_seconds=0)
        elif not meta.get("deletionTimestamp"):
            await ctx.cluster.delete("Pod", ref.namespace, record.pod)
            return False
        elif failures.stuck_terminating(pod, at):
            await _report_stuck(ctx, ref, pod, at)
            await ctx.cluster.delete("Pod", ref.namespace, record.pod, grace_period_seconds=0)
        else:
            return False  # its trainers' grace period: they checkpoint and exit
        if await ctx.cluster.read("Pod", ref.namespace, record.pod) is not None:
            return False  # not gone yet (a finalizer of someone else's): the next poll
    obj = workers.build_pod(job, ref, record.node, join=join, restart=record.restarts + 1)
    await ctx.cluster.create(obj)
    return True


async def _report_stuck(
    ctx: Context, ref: resources.JobRef, pod: Mapping[str, Any], at: dt.datetime
) -> None:
    """A Warning ``PodStuckTerminating`` event and ``Ready=False`` with that reason: the pod's
    node does not confirm its end (said once: the pod is force-deleted right after)."""
    name = (pod.get("metadata") or {}).get("name")
    node = (pod.get("spec") or {}).get("nodeName") or "its node"
    message = (
        f"pod {name} is still Terminating past its grace period: {node} does not confirm that "
        "its containers ended (a lost or partitioned node?); force-deleting it so that its "
        "replacement can start"
    )
    await ctx.cluster.post_event(ref, "Warning", failures.STUCK_TERMINATING, message)
    job = await ctx.cluster.get_job(ref.namespace, ref.name)
    conds = ((job or {}).get("status") or {}).get("conditions")
    ready = status.condition(
        status.READY, False, failures.STUCK_TERMINATING, message, ref.generation, at
    )
    patch = MalleusJobStatus(conditions=status.merge_conditions(conds, ready))
    await ctx.cluster.patch_job_status(ref.namespace, ref.name, status.dump(patch))
    log.warning("%s/%s: %s", ref.namespace, ref.name, message)


async def replace_failed(ctx: Context, body: Mapping[str, Any], at: dt.datetime) -> list[str]:
    """Replace the worker pods whose backoff is over (`failures.due_replacements`); returns
    the pods created (or found created). Idempotent: a restarted operator resumes from
    ``status.failures`` and never creates a pod twice (the names are the nodes')."""
    ref = resources.JobRef.from_body(body)
    fresh = await ctx.cluster.get_job(ref.namespace, ref.name)
    if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
        return []
    st = fresh.get("status") or {}
    if status.phase_of(st) not in status.ACTIVE_PHASES:
        return []
    records = MalleusJobStatus.model_validate({"failures": st.get("failures") or []}).failures
    due = failures.due_replacements(records or [], at)
    if not due:
        return []
    job = await started_job(ctx, ref, fresh)
    join = status.phase_of(st) != Phase.PENDING
    try:
        done = [r for r in due if await _replace(ctx, job, ref, r, join)]
    except PolicyViolation as e:
        refused = await report_policy_violation(ctx, ref, e.faults, st.get("conditions"), at)
        await ctx.cluster.patch_job_status(ref.namespace, ref.name, status.dump(refused))
        return []
    if not done:
        return []
    # Apply to what the status holds now: a pod event may have marked some Replaced already.
    latest = await ctx.cluster.get_job(ref.namespace, ref.name) or fresh
    lst = latest.get("status") or {}
    current = MalleusJobStatus.model_validate({"failures": lst.get("failures") or []}).failures
    ours = {r.node: r for r in done}
    new = [
        failures.replaced(r, at)
        if r.node in ours and r.state == "Waiting" and r.pod_uid == ours[r.node].pod_uid
        else r
        for r in current or []
    ]
    out = failures.gpus_out(new, failures.stored_out(lst), job.gpus_per_node)
    conds = status.merge_conditions(
        lst.get("conditions"), failures.degraded_condition(new, out, ref.generation, at)
    )
    patch = MalleusJobStatus(failures=new, gpus_out=out, conditions=conds)
    await ctx.cluster.patch_job_status(ref.namespace, ref.name, status.dump(patch))
    names = [r.pod for r in done]
    for r in done:
        await ctx.cluster.post_event(
            ref,
            "Normal",
            "PodReplaced",
            f"created {r.pod} (replacement {r.restarts + 1} of node {r.node}, "
            f"maxRestarts {job.spec.failure_policy.max_restarts}); its trainers join the "
            "running job at a step boundary",
        )
    return names
