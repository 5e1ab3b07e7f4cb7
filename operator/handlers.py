"""kopf handlers: thin adapters from kopf's callbacks to the pure modules and `k8s`.

Each handler parses, calls pure logic (`jobs`, `resources`, `workers`, `status`, `lifecycle`),
writes through the `k8s.Cluster` in its memo's `Context` (`children` for the job's objects, or
kopf's ``patch`` for the job's own status), and posts events. Tests call them directly with ``patch=kopf.Patch()`` and a memo
holding a `Context` aimed at a test API server.

Lifecycle (docs/reference/operator.md, "Architecture"):
- startup: the `Context` (API client, settings, metrics) into kopf's memo;
- create: the job's faults (`ResolvedJob.faults`, the Prometheus allowlist, then the planner)
  -> InvalidSpec (Failed, nothing created, `kopf.PermanentError`) or NetworkPolicy + Service +
  ConfigMap + Secret + worker Pods, phase Pending; a pod template the admin's policy refuses
  (`children.check_pod_policy`, checked again before every pod) -> PolicyViolation (Failed,
  nothing created); a child's name taken by an object the job does not control ->
  NameConflict (condition, event, retried: `kopf.TemporaryError`);
- pod events: Pending -> Running when every worker runs; a worker that fails or disappears is
  recorded (PodFailed, Degraded) and replaced after its backoff by a timer (`failures`); Failed
  only with no worker left or no valid plan; Succeeded when the live workers complete; the
  rendezvous store's pod, deleted or ended while the job is active, is created again
  (`store_recovery`, also on a timer and at resume);
- daemon: the decision loop (`daemon.run_job`) while the job is active, paused while the live
  ``spec.metrics.prometheus.url`` is not on the allowlist;
- resume (operator restart): re-create only what is missing of a Pending job, record workers
  that vanished meanwhile (replaced from ``status.failures``); never reset a plan generation;
  redo create for a job whose status an operator killed mid-patch never wrote;
- run policy (a timer): fail a job past ``activeDeadlineSeconds``, delete a finished job's
  children ``ttlSecondsAfterFinished`` after it ended;
- admission (a timer, and ``spec.suspend`` edits): `admission.tick`, suspend/resume and the
  schedule timeout of Pending pods;
- delete: no finalizer holds a job (`finalizers`): the garbage collector removes its children
  (ownerReferences); the job's DELETED event stops its daemon and timers. Where a job is seen
  Terminating (another finalizer holds it), its children are deleted explicitly too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from malleus.controller.processes import PlannerProcesses
from malleus.errors import BadInput
from malleus.job import (
    API_GROUP,
    PLURAL,
    VERSION,
    MalleusJobStatus,
    Phase,
)

from . import (
    admission,
    children,
    creation,
    daemon,
    failures,
    finalizers,
    jobs,
    kueue,
    lifecycle,
    resources,
    run_policy,
    status,
    store,
    store_recovery,
)
from .children import sync_pods
from .context import MEMO_KEY, Context
from .k8s import Cluster
from .metrics import OperatorMetrics
from .settings import Settings
from .sources import PrometheusAuthError

__all__ = [
    "FINALIZER",
    "POD_SELECTOR",
    "POD_WATCH",
    "close",
    "configure",
    "job_daemon",
    "on_create",
    "on_delete",
    "on_pod_event",
    "on_resume",
    "on_update",
    "pending_timer",
    "probe_jobs",
    "replacement_timer",
    "run_policy_timer",
    "store_timer",
    "sync_pods",
]

log = logging.getLogger(__name__)

FINALIZER = "malleus.io/finalizer"
POD_WATCH = ("v1", "pods")
POD_SELECTOR = f"app.kubernetes.io/managed-by={resources.MANAGED_BY},{resources.JOB_LABEL}"
"""The label selector of the operator's pod watch (server-side): the pods it created, each
labelled with its job (workers and stores alike)."""
METRICS_URL_POLL_SECONDS = 30.0
"""How often a daemon paused on a disallowed Prometheus URL reads the live spec again."""
_LIVE = ("suspend", "scheduling.scheduleTimeoutSeconds")  # read by the admission timer
_POLICY_FIELDS = ("stragglerPolicy", "metrics", "runPolicy", *_LIVE)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's settings, and the `Context` (API client, our settings, metrics) into the memo.

    ``python -m malleus.operator`` puts its `Settings` in the memo; under a bare ``kopf run``
    they come from the environment. A memo that already holds a `Context` (a test's) is kept.
    """
    settings.persistence.finalizer = FINALIZER
    # The CRD's status schema prunes unknown fields, so kopf's progress lives in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="malleus.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="malleus.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # our own events tell the story; not every log line
    # The API server filters the pod watch: a cluster's thousands of other pods never reach us
    # (kopf's handler ``labels=`` filter alone is applied after the event arrived).
    settings.watching.label_selectors[POD_WATCH] = POD_SELECTOR
    existing = memo.get(MEMO_KEY)
    ours = existing.settings if isinstance(existing, Context) else memo.get("settings")
    if not isinstance(ours, Settings):
        ours = Settings.from_env()
    ours.apply_peering(settings.peering)  # standalone unless a peering name is set
    if isinstance(existing, Context):
        return
    cluster = Cluster.connect(ours.kubeconfig or None, ours.context or None)
    metrics = OperatorMetrics()
    metrics.serve(ours.metrics_port)
    memo[MEMO_KEY] = Context(
        cluster=cluster, settings=ours, metrics=metrics, planners=_planner_processes(ours)
    )


def _planner_processes(ours: Settings) -> PlannerProcesses | None:
    """The planner processes every job shares (none when ``planner_processes`` is 0)."""
    if not ours.planner_processes:
        return None
    return PlannerProcesses(ours.planner_processes).start()


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    """Release the API client's connections and the planner processes when the operator
    stops."""
    ctx = memo.get(MEMO_KEY)
    if isinstance(ctx, Context):
        ctx.cluster.close()
        if ctx.planners is not None:
            ctx.planners.close()


@kopf.on.probe(id="jobs")
def probe_jobs(memo: kopf.Memo, **_: Any) -> dict[str, int]:
    """Part of kopf's liveness answer: the jobs this operator tracks, by phase."""
    counts = Context.of(memo).metrics.phases.counts()
    return {phase.value: n for phase, n in counts.items() if n}


# ---- create ---------------------------------------------------------------------------------


@kopf.on.create(API_GROUP, VERSION, PLURAL)
async def on_create(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Check the job, plan it for healthy GPUs, create its children; or fail it as InvalidSpec.

    Returns nothing: kopf would store a result in the status, which the CRD's schema prunes.
    """
    await creation.create_job(Context.of(memo), body, patch)


# ---- update ---------------------------------------------------------------------------------


@kopf.on.update(API_GROUP, VERSION, PLURAL, field="spec")
async def on_update(
    body: kopf.Body, diff: kopf.Diff, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    """Policy and metrics changes apply live (the daemon restarts on them); nothing else can
    change under running pods, which is said in an event rather than silently ignored."""
    cluster = Context.of(memo).cluster
    ref = resources.JobRef.from_body(body)
    changed = sorted({".".join(map(str, d[1])) or "spec" for d in diff})
    structural = [
        f for f in changed if not any(f == p or f.startswith(p + ".") for p in _POLICY_FIELDS)
    ]
    if status.phase_of(body.get("status")) in status.TERMINAL_PHASES:
        return
    if "suspend" in changed:
        await admission.reconcile(Context.of(memo), body, status.now())
    if structural:
        await cluster.post_event(
            ref,
            "Warning",
            "SpecChangeIgnored",
            f"{', '.join(structural)} cannot change while the job runs; delete and re-create "
            "the job (from a checkpoint) to apply it",
        )
    else:
        patch.status.update(status.dump(MalleusJobStatus(observed_generation=ref.generation)))
        await cluster.post_event(
            ref, "Normal", "PolicyUpdated", f"applied changes to {', '.join(changed)}"
        )


# ---- pods -----------------------------------------------------------------------------------


@kopf.on.event(*POD_WATCH, labels={"app.kubernetes.io/managed-by": resources.MANAGED_BY})
async def on_pod_event(
    event: Mapping[str, Any],
    body: kopf.Body,
    namespace: str,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A worker pod changed: maybe the job now runs, failed, or completed. The store pod's
    events go to `store_recovery` (gone or ended: created again)."""
    job_name = labels.get(resources.JOB_LABEL)
    if not job_name:
        return
    ctx = Context.of(memo)
    deleted = event.get("type") == "DELETED"
    if labels.get("app.kubernetes.io/component") == store.STORE_COMPONENT:
        await store_recovery.sync_store(ctx, namespace, job_name, seen=None if deleted else body)
        return
    if deleted:
        await sync_pods(ctx, namespace, job_name, deleted=[body])
    else:
        await sync_pods(ctx, namespace, job_name, fresh=body)


# ---- daemon ---------------------------------------------------------------------------------


def _active(body: kopf.Body, **_: Any) -> bool:
    return status.phase_of(body.get("status")) in status.ACTIVE_PHASES


@kopf.daemon(API_GROUP, VERSION, PLURAL, when=_active, cancellation_timeout=30.0)
async def job_daemon(
    body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any
) -> None:
    """The decision loop of one job, for as long as it is active.

    Not while the live spec names a Prometheus off the allowlist (``metrics`` changes apply
    live, so on.create's check is not enough): a Warning event says so and the loop starts
    once the URL is fixed (the trainers keep training on the plan in force meanwhile). Nor
    while the Secret it names for Prometheus is missing or not marked for the operator
    (`sources.CREDENTIALS_LABEL`): a Warning event, and another try later.
    """
    ctx = Context.of(memo)
    ref = resources.JobRef.from_body(body)
    warned = False
    while faults := ctx.settings.metrics_faults(body.get("spec") or {}):
        if not warned:
            message = "decision loop paused: " + "; ".join(map(str, faults))
            await ctx.cluster.post_event(ref, "Warning", "InvalidSpec", message)
            warned = True
        await stopped.wait(METRICS_URL_POLL_SECONDS)
        if stopped:
            return
    try:
        result = await daemon.run_job(
            ctx, body, stopped, resync=lambda: sync_pods(ctx, ref.namespace, ref.name)
        )
    except PrometheusAuthError as e:  # the user's to fix: said once, tried again later
        await ctx.cluster.post_event(ref, "Warning", "InvalidSpec", f"decision loop paused: {e}")
        raise kopf.TemporaryError(str(e), delay=METRICS_URL_POLL_SECONDS) from None
    if result == daemon.SPEC_CHANGED:
        raise kopf.TemporaryError("spec changed; restarting the controller with it", delay=1)
    if result == daemon.CERTIFICATES_RENEWED:
        raise kopf.TemporaryError("TLS certificates renewed; restarting with the new CA", delay=1)
    if result == daemon.COORDINATOR_MOVED:
        raise kopf.TemporaryError("the coordinator moved; restarting the controller there", delay=1)


# ---- replacing failed workers ---------------------------------------------------------------


def _replacing(status: Mapping[str, Any], **_: Any) -> bool:
    return any(f.get("state") == "Waiting" for f in (status or {}).get("failures") or [])


@kopf.timer(API_GROUP, VERSION, PLURAL, interval=failures.REPLACE_POLL_SECONDS, when=_replacing)
async def replacement_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """`children.replace_failed` now: the failed workers whose backoff is over."""
    await children.replace_failed(Context.of(memo), body, status.now())


# ---- the rendezvous store ------------------------------------------------------------------


@kopf.timer(API_GROUP, VERSION, PLURAL, interval=store_recovery.CHECK_SECONDS, when=_active)
async def store_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """`store_recovery.sync_store` now: a store pod deleted without a watch event telling."""
    ref = resources.JobRef.from_body(body)
    await store_recovery.sync_store(Context.of(memo), ref.namespace, ref.name)


# ---- run policy -----------------------------------------------------------------------------


def _has_run_policy(spec: Mapping[str, Any], **_: Any) -> bool:
    return bool(spec.get("runPolicy"))


@kopf.timer(
    API_GROUP, VERSION, PLURAL, interval=lifecycle.RUN_POLICY_INTERVAL, when=_has_run_policy
)
async def run_policy_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """`run_policy.enforce` now, every `lifecycle.RUN_POLICY_INTERVAL` seconds."""
    await run_policy.enforce(Context.of(memo), body, status.now())


# ---- admission and scheduling ---------------------------------------------------------------


def _pending_or_suspended(spec: Mapping[str, Any], body: kopf.Body, **_: Any) -> bool:
    """Pending, suspended, or queued in Kueue (whose admission and eviction it follows)."""
    phase = status.phase_of(body.get("status"))
    queued = kueue.queue_name(body) is not None
    return bool(spec.get("suspend")) or queued or phase in (Phase.PENDING, Phase.SUSPENDED)


@kopf.timer(
    API_GROUP, VERSION, PLURAL, interval=lifecycle.RUN_POLICY_INTERVAL, when=_pending_or_suspended
)
async def pending_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """`admission.tick` now: ``spec.suspend`` and the schedule timeout of Pending pods."""
    await admission.tick(Context.of(memo), body, status.now())


# ---- resume ---------------------------------------------------------------------------------


@kopf.on.resume(API_GROUP, VERSION, PLURAL)
async def on_resume(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """After an operator restart: pick up where the status says the job is.

    A Pending job gets whatever children are missing (existing ones untouched: create is
    idempotent by name). A running job's worker that vanished while the operator was away is a
    failure (`sync_pods` with it as deleted): recorded, and replaced under
    ``spec.failurePolicy`` by the replacement timer, its trainers joining the running job.
    Either way, a store pod (or Service) deleted or ended meanwhile is created again
    (`store_recovery`).

    A job without a phase had on.create run, but its status never landed: kopf resumes only
    jobs whose on.create it recorded as done (its ``last-handled-configuration`` annotation),
    and it writes that record, then the status subresource, in two requests; an operator killed
    between them (a replica SIGKILLed, the standby taking over) leaves the record without the
    status. Nothing else would ever give the job one (on.create does not run again, no timer
    or daemon matches a job without a phase), so on.create's work is redone, idempotently.
    """
    ctx = Context.of(memo)
    ref = resources.JobRef.from_body(body)
    st = body.get("status") or {}
    phase = status.phase_of(st)
    if phase is None:
        await creation.create_job(ctx, body, patch, resumed=True)
        return
    ctx.metrics.phases.set(ref.namespace, ref.name, phase)
    if phase in status.TERMINAL_PHASES or phase == Phase.SUSPENDED:
        return  # finished, or the admission timer's
    try:
        job = jobs.resolve(body)
    except BadInput as e:
        log.warning("%s/%s: cannot resume: %s", ref.namespace, ref.name, e)
        return
    expected = [resources.pod_name(ref.name, i) for i in range(job.nodes)]
    if phase == Phase.PENDING:
        # The ConfigMap's plan wins when there is one (`children.ensure_children` returns it).
        key = f"{ref.namespace}/{ref.name}"
        plan, _ = await jobs.initial_plan(job, ctx.planner(key), ctx.limits)
        conditions = list(st.get("conditions") or [])
        created, _ = await creation.create_children(ctx, job, ref, plan, patch, conditions)
        if created:
            await ctx.cluster.post_event(
                ref, "Normal", "Resumed", f"re-created {', '.join(created)}"
            )
        await sync_pods(ctx, ref.namespace, ref.name)
        await store_recovery.sync_store(ctx, ref.namespace, ref.name)
        return
    pods = await ctx.cluster.list_children("Pod", ref.namespace, ref.name)
    present = {p["metadata"]["name"] for p in pods if resources.owned_by(p, ref.uid)}
    missing = [n for n in expected if n not in present]
    await sync_pods(ctx, ref.namespace, ref.name, deleted=missing)
    await store_recovery.sync_store(ctx, ref.namespace, ref.name)  # gone while nobody watched


# ---- delete ---------------------------------------------------------------------------------


@kopf.on.delete(API_GROUP, VERSION, PLURAL, optional=True)  # no finalizer: `finalizers`
async def on_delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A job seen Terminating: delete its children (pods first; only those it controls)."""
    ctx = Context.of(memo)
    ref = resources.JobRef.from_body(body)
    nodes = int((body.get("spec") or {}).get("nodes") or 0)
    deleted = await children.delete_children(ctx, ref, nodes)
    log.info("%s/%s: deleted %s", ref.namespace, ref.name, deleted)
    ctx.metrics.phases.forget(ref.namespace, ref.name)


finalizers.release_finalizers()  # the daemon and timers above need no finalizer either
