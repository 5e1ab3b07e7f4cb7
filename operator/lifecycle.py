"""A job's phase from its worker pods: pure, so every transition is unit-tested without a cluster.

The pod watcher (`handlers.on_pod_event`) lists the job's pods and asks `pods_transition` what
changed: a status patch (a `MalleusJobStatus` holding only what changes) and the events to post.
The run-policy timer asks `run_policy_due` whether a deadline or a TTL is up, given the time.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from malleus.job import Condition, FailurePolicy, MalleusJobStatus, Phase
from malleus.job.spec import RunPolicy
from malleus.job.status import NodeFailure

from . import failures, readiness, scheduling
from .status import (
    ACTIVE_PHASES,
    READY,
    TERMINAL_PHASES,
    condition,
    finished_status,
    merge_conditions,
    phase_of,
)
from .store import store_name

__all__ = [
    "RUN_POLICY_INTERVAL",
    "Event",
    "PodOutcome",
    "RunPolicyDue",
    "Transition",
    "deadline_transition",
    "parse_time",
    "pod_outcome",
    "pods_transition",
    "run_policy_due",
    "schedule_timeout_transition",
]

RUN_POLICY_INTERVAL = 10.0
"""Seconds between the operator's checks of ``spec.runPolicy``: how late a deadline or a TTL
may act."""

PodState = Literal["Pending", "Running", "Succeeded", "Failed"]


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the job."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Transition:
    """What to do about a job: merge ``status`` into ``.status`` and post ``events``."""

    status: MalleusJobStatus | None = None
    events: list[Event] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.status is not None or bool(self.events)


_STUCK_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)


@dataclass(frozen=True)
class PodOutcome:
    """One worker pod's state as the job sees it: running, pending, succeeded or failed."""

    name: str
    state: PodState
    detail: str = ""


def pod_outcome(pod: Mapping[str, Any]) -> PodOutcome:
    """Classify a pod: Failed on phase Failed or any container terminated non-zero.

    A container that exited non-zero fails the pod even before the kubelet moves the phase,
    because with torchrun one dead rank means the others will block in a collective.
    """
    name = pod.get("metadata", {}).get("name", "?")
    st = pod.get("status") or {}
    phase = st.get("phase") or "Pending"
    for cs in st.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and int(term.get("exitCode", 0)) != 0:
            why = term.get("reason") or "Error"
            msg = term.get("message")
            detail = f"container {cs.get('name')} exited with code {term['exitCode']} ({why})"
            return PodOutcome(name, "Failed", detail + (f": {msg}" if msg else ""))
    if phase == "Failed":
        reason = st.get("reason") or "Failed"
        return PodOutcome(
            name, "Failed", f"pod failed ({reason}): {st.get('message', '')}".rstrip(": ")
        )
    if phase in ("Running", "Succeeded"):
        return PodOutcome(name, phase)
    for cs in st.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") in _STUCK_WAITING:
            return PodOutcome(name, "Pending", f"{waiting['reason']}: {waiting.get('message', '')}")
    return PodOutcome(name, "Pending")


def pods_transition(
    job_status: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    expected: Sequence[str],
    generation: int,
    at: dt.datetime,
    *,
    deleted: Sequence[str | Mapping[str, Any]] = (),
    policy: FailurePolicy | None = None,
    gpus_per_node: int = 1,
) -> Transition:
    """The job's phase from its workers' states; empty when nothing changes.

    - a worker failed (or was deleted under a live job) -> recorded in ``failures`` with a
      ``PodFailed`` event and ``Degraded=True`` (`failures`): the others recover without it and
      the operator replaces it after its backoff, up to ``maxRestarts``; the phase stays;
    - no worker left, the trainers found no valid plan, or a trainer refused the job's input
      -> ``Failed`` (``NoWorkersLeft``, ``NoValidPlan``, ``BadInput``);
    - every live worker (not waiting for a replacement nor out) succeeded, or a replacement
      still pending beside the ones that did -> ``Succeeded``;
    - every live worker running -> ``Running`` (from ``Pending``);
    - some still pending -> why, in ``Ready=False`` (`_pending_transition`);
    - terminal phases never change, nor does ``Suspended`` (its pods are deleted on purpose).

    ``deleted``: pods gone (their last body, or a name when only that is known).
    """
    stored = job_status or {}
    phase = phase_of(stored)
    if phase is None or phase in TERMINAL_PHASES or phase == Phase.SUSPENDED:
        return Transition()
    policy = policy or FailurePolicy()
    job = expected[0].rsplit("-node-", 1)[0] if expected else ""
    by_body = {p.get("metadata", {}).get("name"): p for p in pods}
    by_name = {n: pod_outcome(p) for n, p in by_body.items()}
    conds = stored.get("conditions") or []
    seen = [failures.pod_failure(p, job) for n, p in by_body.items() if n in expected]
    for d in deleted:
        body = {"metadata": {"name": d}} if isinstance(d, str) else d
        if body.get("metadata", {}).get("name") in expected:
            seen.append(failures.pod_failure(body, job, deleted=True))
    records, changed = failures.record_failures(
        stored.get("failures"), [f for f in seen if f is not None], policy, at
    )
    fixed = {r.node: r for r in failures.reconcile_replaced(records, by_body, at)}
    if fixed:
        records = [fixed.get(r.node, r) for r in records]
    patch = MalleusJobStatus()
    events = [_failure_event(r, policy) for r in changed]
    if changed or fixed:
        out = failures.gpus_out(records, failures.stored_out(stored), gpus_per_node)
        conds = merge_conditions(conds, failures.degraded_condition(records, out, generation, at))
        patch = MalleusJobStatus(failures=records, gpus_out=out, conditions=conds)
    end = failures.terminal_reason(records, len(expected))
    if end is not None:
        done = finished_status(Phase.FAILED, end[0], end[1], generation, at, conds)
        done.failures, done.gpus_out = patch.failures, patch.gpus_out
        return Transition(status=done, events=[*events, Event("Warning", end[0], end[1])])
    live = [expected[i] for i in failures.live_nodes(records, len(expected))]
    states = [by_name[n].state if n in by_name else "Missing" for n in live]
    # Every rank of the job ends at the same step: once a worker completed, one still pending
    # (a replacement not yet started) has nothing left to join.
    if any(s == "Succeeded" for s in states) and all(s != "Running" for s in states):
        msg = f"all {sum(s == 'Succeeded' for s in states)} worker pod(s) in the job completed"
        done = finished_status(Phase.SUCCEEDED, "Completed", msg, generation, at, conds)
        done.failures, done.gpus_out = patch.failures, patch.gpus_out
        return Transition(status=done, events=[*events, Event("Normal", "Succeeded", msg)])
    stuck = readiness.store_stuck(pods, store_name(job)) if job else None
    rest = _phase_transition(phase, conds, pods, by_name, live, states, generation, at, stuck)
    if rest.status is not None:
        rest.status.failures, rest.status.gpus_out = patch.failures, patch.gpus_out
        return Transition(status=rest.status, events=[*events, *rest.events])
    return Transition(status=patch if (changed or fixed) else None, events=events)


def _failure_event(r: NodeFailure, policy: FailurePolicy) -> Event:
    text = f"{r.pod}: {r.message}"
    decided = f"cause {r.cause}" + (f", rule {r.rule!r}" if r.rule else "")
    if r.action == "FailJob":
        text += f"; {decided}: the job fails"
    elif r.state == "Out":
        final = {
            failures.NO_VALID_PLAN: "no valid plan",
            failures.BAD_INPUT: "its trainers refused the job's input",
        }
        why = final.get(
            r.reason,
            f"{r.counted} counted failure(s), spec.failurePolicy.maxRestarts "
            f"{policy.max_restarts}" + (f", rule {r.rule!r}" if r.rule else ""),
        )
        text += f"; node {r.node} stays out of the job ({why})"
    else:
        wait = failures.backoff_seconds(policy, r.counted if r.action == "RestartWorker" else 1)
        counted = (
            f"counted {r.counted} of maxRestarts {policy.max_restarts}"
            if r.action == "RestartWorker"
            else "not counted"
        )
        text += f"; the other pods go on without it, replacement in {wait} s ({decided}: {counted})"
    return Event("Warning", "PodFailed", text)


def _phase_transition(
    phase: Phase,
    conds: Any,
    pods: Sequence[Mapping[str, Any]],
    by_name: Mapping[str, PodOutcome],
    live: Sequence[str],
    states: Sequence[str],
    generation: int,
    at: dt.datetime,
    stuck: scheduling.PendingReason | None = None,
) -> Transition:
    """Pending -> Running once every live worker runs, ``Ready=False`` until the trainers say
    they train (`readiness`); why not yet, while Pending; the store pod's trouble (``stuck``)
    in ``Ready`` and a Warning event, whatever the phase."""
    if live and all(s in ("Running", "Succeeded") for s in states):
        if phase != Phase.PENDING:
            return _store_transition(conds, stuck, generation, at)
        msg = f"all {len(live)} worker pod(s) running"
        ready = readiness.starting_condition(len(live), stuck, generation, at)
        events = [Event("Normal", "Running", msg)]
        if stuck is not None:
            events.append(Event("Warning", stuck.reason, str(stuck)))
        return Transition(
            status=MalleusJobStatus(
                phase=Phase.RUNNING, message=msg, conditions=merge_conditions(conds, ready)
            ),
            events=events,
        )
    if phase != Phase.PENDING:
        # a running job with a pod not yet "Running" again (a replacement)
        return _store_transition(conds, stuck, generation, at)
    return _pending_transition(conds, pods, by_name, live, states, generation, at, stuck)


def _store_transition(
    conds: Any, stuck: scheduling.PendingReason | None, generation: int, at: dt.datetime
) -> Transition:
    """A running job whose store pod cannot run (a new store, after the first was lost):
    ``Ready=False`` with its reason and a Warning event, once."""
    if stuck is None:
        return Transition()
    conds = [
        c.model_dump(mode="json", by_alias=True) if isinstance(c, Condition) else c
        for c in conds or []
    ]
    old = next((c for c in conds if c.get("type") == READY), None) or {}
    if old.get("reason") == stuck.reason and str(stuck) in str(old.get("message") or ""):
        return Transition()
    message = f"the store cannot run: {stuck}"
    ready = condition(READY, False, stuck.reason, message, generation, at)
    return Transition(
        status=MalleusJobStatus(conditions=merge_conditions(conds, ready)),
        events=[Event("Warning", stuck.reason, str(stuck))],
    )


def _pending_transition(
    conds: Any,
    pods: Sequence[Mapping[str, Any]],
    by_name: Mapping[str, PodOutcome],
    expected: Sequence[str],
    states: Sequence[str],
    generation: int,
    at: dt.datetime,
    stuck: scheduling.PendingReason | None = None,
) -> Transition:
    """Some worker still pending: say why in ``Ready=False`` (the store's trouble too). Its reason is the first stuck
    pod's (`scheduling.UNSCHEDULABLE`, `scheduling.IMAGE_PULL`) with the scheduler's or the
    kubelet's message, else ``PodsPending``; a new stuck reason is also a Warning event, once
    per pod and reason."""
    conds = [  # after a failure was merged in, some are models
        c.model_dump(mode="json", by_alias=True) if isinstance(c, Condition) else c
        for c in conds or []
    ]
    reasons = scheduling.pending_reasons(pods, expected) + ([stuck] if stuck else [])
    stuck_pods = {r.pod for r in reasons}
    others = [by_name[n] for n in expected if n in by_name and by_name[n].detail]
    running = sum(s == "Running" for s in states)
    msg = f"{running}/{len(expected)} worker pod(s) running"
    details = [str(r) for r in reasons] + [
        f"{o.name}: {o.detail}" for o in others if o.name not in stuck_pods
    ]
    if details:
        msg += "; " + "; ".join(details)
    reason = reasons[0].reason if reasons else "PodsPending"
    old = next((c for c in conds if c.get("type") == READY), None)
    if old is not None and old.get("message") == msg and old.get("reason") == reason:
        return Transition()
    # Once per pod and reason: the scheduler's message changes as nodes fill or free ("0/161
    # nodes are available: 120 Insufficient ..."), and a changed message is the same occurrence.
    said = "; " + ((old or {}).get("message") or "")
    events = [
        Event("Warning", r.reason, str(r)) for r in reasons if f"; {r.pod}: {r.reason}" not in said
    ]
    return Transition(
        status=MalleusJobStatus(
            conditions=merge_conditions(conds, condition(READY, False, reason, msg, generation, at))
        ),
        events=events,
    )


def schedule_timeout_transition(
    job_status: Mapping[str, Any] | None, timeout: int, generation: int, at: dt.datetime
) -> Transition:
    """A Pending job whose pods waited ``spec.scheduling.scheduleTimeoutSeconds`` since
    ``startTime`` -> ``Failed``/``ScheduleTimeout`` (naming what the pods last waited for);
    empty before that, or in any other phase. Pure, so tests move ``at``."""
    stored = job_status or {}
    if phase_of(stored) != Phase.PENDING:
        return Transition()
    left = scheduling.schedule_timeout_left(parse_time(stored.get("startTime")), timeout, at)
    if left is None or left > 0:
        return Transition()
    conds = stored.get("conditions") or []
    ready = next((c for c in conds if c.get("type") == READY), None) or {}
    message = f"the worker pods were not all running {timeout} s after creation"
    if ready.get("message"):
        message += f" ({ready['message']})"
    return Transition(
        status=finished_status(
            Phase.FAILED, scheduling.SCHEDULE_TIMEOUT, message, generation, at, conds
        ),
        events=[Event("Warning", scheduling.SCHEDULE_TIMEOUT, message + "; deleting its pods")],
    )


# ---- run policy -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPolicyDue:
    """What ``spec.runPolicy`` asks for now: ``action`` (None: nothing yet) and ``wait``, the
    seconds until something is due (None: nothing ever will be in this phase)."""

    action: Literal["deadline", "expire"] | None = None
    wait: float | None = None


def parse_time(value: Any) -> dt.datetime | None:
    """A stored metav1.Time (RFC 3339 text) as a datetime; None when absent or unreadable."""
    if isinstance(value, dt.datetime):
        return value
    try:
        return dt.datetime.fromisoformat(str(value)) if value else None
    except ValueError:
        return None


def run_policy_due(
    job_status: Mapping[str, Any] | None,
    policy: RunPolicy,
    created: dt.datetime | None,
    at: dt.datetime,
) -> RunPolicyDue:
    """Whether ``activeDeadlineSeconds`` is exceeded (an active job, counted from
    ``startTime``, else the job's creation) or ``ttlSecondsAfterFinished`` has passed (a
    finished job, counted from ``completionTime``). Pure, so tests move ``at`` instead of
    sleeping; the operator's timer calls it every `RUN_POLICY_INTERVAL` seconds."""
    stored = job_status or {}
    phase = phase_of(stored)
    if phase in TERMINAL_PHASES and policy.ttl_seconds_after_finished is not None:
        ended = parse_time(stored.get("completionTime"))
        if ended is None:
            return RunPolicyDue()  # finished before the operator recorded completion times
        left = (ended - at).total_seconds() + policy.ttl_seconds_after_finished
        return RunPolicyDue("expire") if left <= 0 else RunPolicyDue(wait=left)
    if phase in ACTIVE_PHASES and policy.active_deadline_seconds is not None:
        started = parse_time(stored.get("startTime")) or created
        if started is None:
            return RunPolicyDue()
        left = (started - at).total_seconds() + policy.active_deadline_seconds
        return RunPolicyDue("deadline") if left <= 0 else RunPolicyDue(wait=left)
    return RunPolicyDue()


def deadline_transition(
    job_status: Mapping[str, Any] | None, limit: int, generation: int, at: dt.datetime
) -> Transition:
    """``Failed`` with ``DeadlineExceeded`` (Ready=False, Failed=True) and a Warning event."""
    message = f"the job ran longer than spec.runPolicy.activeDeadlineSeconds ({limit} s)"
    conds = (job_status or {}).get("conditions") or []
    return Transition(
        status=finished_status(Phase.FAILED, "DeadlineExceeded", message, generation, at, conds),
        events=[Event("Warning", "DeadlineExceeded", message + "; deleting its worker pods")],
    )
