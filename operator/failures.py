"""Worker pod failures as recovery, not the job's end: pure, so every rule is unit-tested.

A worker pod that fails (phase Failed, a container terminated non-zero, deleted or evicted)
does not fail the job: the trainers of the other pods recover without its GPUs (they re-form
the process group through the job's store, `store`) and the operator replaces the pod under
``spec.failurePolicy``:

- the failure is recorded in ``status.failures`` (one `NodeFailure` per node: failures,
  replacements, the last reason, its time, the failed pod's uid), with a ``PodFailed``
  Warning event and the ``Degraded`` condition (True, naming the nodes and GPUs out and why);
- a pod is counted once, by its uid, however often it is seen (watch events, a restarted
  operator listing it again), so no failure is counted twice and none is lost;
- ``restartBackoffSeconds`` later (doubled per failure of the same node, at most
  `MAX_BACKOFF_SECONDS`), state ``Waiting``, the failed pod is deleted and a replacement of
  the same name (its DNS name and TLS certificate stay valid) is created whose trainers
  ``--join`` the running job (`due_replacements`, acted on by `replacement`);
- a node that failed more than ``maxRestarts`` times stays ``Out``: not replaced, its GPUs
  planned around (its last pod is kept for its logs);
- the job fails only when no worker is left (every node ``Out``: reason ``NoWorkersLeft``),
  the trainers say no valid plan exists on the GPUs left (a rank exits `NO_PLAN_EXIT`:
  reason ``NoValidPlan``), or a trainer refused the job's input before training (a mistyped
  ``spec.model.path``, data that is not there: exit `BAD_INPUT_EXIT`, or a termination message
  headed ``BadInput`` since torchrun exits 1 whatever its ranks' codes: reason ``BadInput``,
  with the trainer's faults), which no replacement pod could train on.

Deterministic pod names make a restarted operator safe: a node ``Waiting`` whose replacement
already exists (created just before a crash, status not yet written) is marked ``Replaced``
without a second create (`reconcile_replaced`), and creating an existing name never duplicates.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from malleus.errors import (
    BAD_INPUT_REASON,
    ENDING_REASONS,
    NO_PLAN_REASON,
)
from malleus.job import Condition, FailurePolicy
from malleus.job.spec import FailureCause, FailureRule
from malleus.job.status import GpuOut, NodeFailure

from .status import condition

__all__ = [
    "BAD_INPUT",
    "DEGRADED",
    "DISRUPTION_CAUSES",
    "FAILED_BY_RULE",
    "KUEUE_STOPPED",
    "MAX_BACKOFF_SECONDS",
    "NO_VALID_PLAN",
    "NO_WORKERS_LEFT",
    "REPLACE_POLL_SECONDS",
    "STUCK_TERMINATING",
    "STUCK_TERMINATING_SECONDS",
    "PodFailure",
    "backoff_seconds",
    "degraded_condition",
    "due_replacements",
    "failure_cause",
    "gpus_out",
    "live_nodes",
    "nothing_to_wait_for",
    "pod_failure",
    "reconcile_replaced",
    "record_failures",
    "replaced",
    "stored_out",
    "stuck_terminating",
    "terminal_reason",
]

DEGRADED = "Degraded"
"""Condition type: True while some node or GPU is out of the job."""
NO_VALID_PLAN = NO_PLAN_REASON
BAD_INPUT = BAD_INPUT_REASON
"""A trainer refused the job's input (`BAD_INPUT_EXIT`, or its termination message says so)."""
NO_WORKERS_LEFT = "NoWorkersLeft"
FAILED_BY_RULE = "FailedByRule"
"""The job's ``Failed`` reason when a ``spec.failurePolicy.rules`` entry with action
``FailJob`` matched a worker's failure."""
MAX_BACKOFF_SECONDS = 300
STUCK_TERMINATING = "PodStuckTerminating"
"""Warning event and ``Ready=False`` reason: a failed worker's pod still Terminating past its
grace period (`stuck_terminating`), force-deleted for its replacement."""
STUCK_TERMINATING_SECONDS = 15
"""How long past the end of its grace period (its ``deletionTimestamp``) a pod may stay
Terminating before the operator force-deletes it (`stuck_terminating`)."""
REPLACE_POLL_SECONDS = 2.0
"""How often the operator looks for failed workers whose backoff is over."""


@dataclass(frozen=True)
class PodFailure:
    """One failed worker pod, as seen now."""

    node: int
    pod: str
    uid: str | None
    reason: str
    message: str
    exit_code: int | None = None
    cause: FailureCause = "Failed"
    """What `failure_cause` tells from the pod."""


def _node_of(name: str, job: str) -> int | None:
    prefix = f"{job}-node-"
    tail = name[len(prefix) :] if name.startswith(prefix) else ""
    # exactly the name the operator gives: `<job>-node-01` is not node 1
    return int(tail) if tail.isdigit() and str(int(tail)) == tail else None


DISRUPTION_CAUSES: dict[str, FailureCause] = {
    "PreemptionByScheduler": "Preempted",
    "EvictionByEvictionAPI": "Evicted",
    "TerminationByKubelet": "Evicted",
    "DeletionByTaintManager": "NodeLost",
    "DeletionByPodGC": "NodeLost",
}
"""The ``DisruptionTarget`` condition's reasons (set by Kubernetes before it deletes or stops a
pod) -> the failure's cause."""
KUEUE_STOPPED = "TerminationTarget"
"""The condition Kueue's pod integration sets on the pods of a workload it stops (preempted,
evicted from its queue): the cause is ``Preempted`` whatever its reason."""
_KUBELET_REASONS: dict[str, FailureCause] = {
    "Evicted": "Evicted",
    "Shutdown": "Evicted",
    "Terminated": "Evicted",
}
"""Pod ``status.reason``s of a kubelet that stopped the pod (node pressure, a node shutdown)."""


def failure_cause(pod: Mapping[str, Any], *, exit_code: int | None, reason: str) -> FailureCause:
    """Why the pod failed (`malleus.job.spec.FailureCause`): the disruption Kubernetes or
    Kueue announced on it first (a preempted or evicted pod's containers then exit non-zero
    too, which must not make it an ``Error``), then the kubelet's reason, an out-of-memory
    kill, a non-zero exit, a deletion."""
    st = pod.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == KUEUE_STOPPED:
            return "Preempted"
        if c.get("type") == "DisruptionTarget" and c.get("reason") in DISRUPTION_CAUSES:
            return DISRUPTION_CAUSES[str(c["reason"])]
    if st.get("reason") in _KUBELET_REASONS:
        return _KUBELET_REASONS[str(st["reason"])]
    if st.get("reason") == "NodeLost":
        return "NodeLost"
    for cs in st.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("reason") == "OOMKilled":
            return "OOMKilled"
    if exit_code is not None:
        return "Error"
    return "Deleted" if reason == "Deleted" else "Failed"


def pod_failure(pod: Mapping[str, Any], job: str, *, deleted: bool = False) -> PodFailure | None:
    """The failure of a worker pod, with its cause (`failure_cause`), or None when it has not
    failed.

    Failed: phase ``Failed`` (evicted, node lost), any container terminated with a non-zero
    code (one dead rank takes its pod down under ``--max-restarts=0``), or the pod deleted (or
    being deleted) under a live job.
    """
    found = _pod_failure(pod, job, deleted=deleted)
    if found is None:
        return None
    cause = failure_cause(pod, exit_code=found.exit_code, reason=found.reason)
    return dataclasses.replace(found, cause=cause)


def _pod_failure(pod: Mapping[str, Any], job: str, *, deleted: bool = False) -> PodFailure | None:
    meta = pod.get("metadata") or {}
    name = str(meta.get("name") or "")
    node = _node_of(name, job)
    if node is None:
        return None
    uid = meta.get("uid") or None
    st = pod.get("status") or {}
    for cs in st.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and int(term.get("exitCode", 0)) != 0:
            code = int(term["exitCode"])
            said = str(term.get("message") or "")
            # The rank's own code where the pod shows it (a process kubelet, a one-rank pod);
            # under torchrun, which exits 1 whatever its ranks' codes, the termination message
            # the rank wrote (`say_ending`) says how it ended.
            why = ENDING_REASONS.get(code) or str(term.get("reason") or "Error")
            for reason in ENDING_REASONS.values():
                if said.startswith(f"{reason}: "):
                    why, said = reason, said.removeprefix(f"{reason}: ")
            text = f"container {cs.get('name')} exited with code {code} ({why})"
            if said:
                text += f": {said}"
            return PodFailure(node, name, uid, why, text, code)
    if st.get("phase") == "Failed":
        why = str(st.get("reason") or "Failed")
        text = f"pod failed ({why})" + (f": {st['message']}" if st.get("message") else "")
        return PodFailure(node, name, uid, why, text)
    if deleted or meta.get("deletionTimestamp"):
        return PodFailure(node, name, uid, "Deleted", "pod was deleted")
    return None


def backoff_seconds(policy: FailurePolicy, failures: int) -> int:
    """``restartBackoffSeconds`` doubled per earlier failure of the node, at most 300 s."""
    base = policy.restart_backoff_seconds
    return min(MAX_BACKOFF_SECONDS, base * 2 ** max(0, failures - 1))


def _records(stored: Iterable[Mapping[str, Any] | NodeFailure] | None) -> list[NodeFailure]:
    out: list[NodeFailure] = []
    for r in stored or []:
        try:
            out.append(r if isinstance(r, NodeFailure) else NodeFailure.model_validate(r))
        except ValueError:
            continue
    return out


def _reset(old: NodeFailure, policy: FailurePolicy, at: dt.datetime) -> bool:
    """Whether ``old``'s counters are forgotten: its replacement has run ``resetAfterSeconds``
    (from its creation; a record older than ``replacedAt`` from its failure) with no failure."""
    if policy.reset_after_seconds is None or old.state != "Replaced":
        return False
    since = old.replaced_at or old.time
    return (at - since).total_seconds() >= policy.reset_after_seconds


def _over_budget(
    policy: FailurePolicy, rule: FailureRule | None, counted: int, rule_counts: Mapping[str, int]
) -> bool:
    if counted > policy.max_restarts:
        return True
    return bool(
        rule is not None
        and rule.max_restarts is not None
        and rule_counts.get(rule.name, 0) > rule.max_restarts
    )


def record_failures(
    stored: Iterable[Mapping[str, Any] | NodeFailure] | None,
    seen: Sequence[PodFailure],
    policy: FailurePolicy,
    at: dt.datetime,
) -> tuple[list[NodeFailure], list[NodeFailure]]:
    """(every node's record, the records that changed) after the failures ``seen`` now.

    A pod already recorded (same uid) is not counted again; a pod seen missing (no uid) counts
    only when its node was not already waiting for, or done with, its replacement. Each new
    failure is decided by ``policy`` (`FailurePolicy.decide`, by its cause and exit code):
    ``RestartWorker`` counts it (the node is ``Out`` past ``maxRestarts`` or the rule's own
    budget), ``Ignore`` replaces the pod uncounted, ``FailJob`` fails the job
    (`terminal_reason`); a node whose replacement ran ``resetAfterSeconds`` starts from zero.
    """
    records = {r.node: r for r in _records(stored)}
    changed: dict[int, NodeFailure] = {}
    for f in seen:
        old = records.get(f.node)
        if old is not None:
            if f.uid is not None and f.uid == old.pod_uid:
                continue  # this pod's failure is counted already
            if old.state in ("Waiting", "Out") and (f.uid is None or f.reason == "Deleted"):
                continue  # the failed pod going away (deleted for its replacement, or by hand)
        fresh = old is None or _reset(old, policy, at)
        counted = 0 if fresh or old is None else old.counted
        causes = {} if fresh or old is None else dict(old.causes)
        rule_counts = {} if fresh or old is None else dict(old.rule_counts)
        causes[f.cause] = causes.get(f.cause, 0) + 1
        rule = policy.decide(f.cause, f.exit_code)
        action = rule.action if rule is not None else "RestartWorker"
        if action == "RestartWorker":
            counted += 1
            if rule is not None:
                rule_counts[rule.name] = rule_counts.get(rule.name, 0) + 1
        out = (
            action == "FailJob"
            or f.reason in (NO_VALID_PLAN, BAD_INPUT)
            or (action == "RestartWorker" and _over_budget(policy, rule, counted, rule_counts))
        )
        wait = backoff_seconds(policy, counted if action == "RestartWorker" else 1)
        new = NodeFailure(
            node=f.node,
            pod=f.pod,
            failures=(old.failures if old else 0) + 1,
            restarts=old.restarts if old else 0,
            state="Out" if out else "Waiting",
            reason=f.reason,
            message=f.message[:4096],
            time=at,
            pod_uid=f.uid,
            replace_at=None if out else at + dt.timedelta(seconds=wait),
            cause=f.cause,
            rule=rule.name if rule is not None else None,
            action=action,
            counted=counted,
            causes=causes,
            rule_counts=rule_counts,
            replaced_at=old.replaced_at if old else None,
        )
        records[f.node] = changed[f.node] = new
    return sorted(records.values(), key=lambda r: r.node), sorted(
        changed.values(), key=lambda r: r.node
    )


def stored_out(job_status: Mapping[str, Any]) -> list[GpuOut]:
    """The stored ``gpusOut`` (the trainers' entries are kept when the pods' view changes)."""
    out = []
    for o in job_status.get("gpusOut") or []:
        try:
            out.append(GpuOut.model_validate(o))
        except ValueError:
            continue
    return out


def live_nodes(records: Iterable[NodeFailure], nodes: int) -> list[int]:
    """Nodes whose current pod is expected to run: neither waiting for a replacement nor out."""
    down = {r.node for r in records if r.state in ("Waiting", "Out")}
    return [i for i in range(nodes) if i not in down]


def due_replacements(records: Iterable[NodeFailure], at: dt.datetime) -> list[NodeFailure]:
    """The ``Waiting`` records whose backoff is over at ``at``, lowest node first."""
    return [
        r
        for r in sorted(records, key=lambda r: r.node)
        if r.state == "Waiting" and (r.replace_at is None or r.replace_at <= at)
    ]


def replaced(record: NodeFailure, at: dt.datetime) -> NodeFailure:
    """``record`` once its replacement pod exists (created at ``at``): one more restart,
    state ``Replaced``; its healthy time (``resetAfterSeconds``) runs from ``at``."""
    return record.model_copy(
        update={
            "state": "Replaced",
            "restarts": record.restarts + 1,
            "replace_at": None,
            "replaced_at": at,
        }
    )


def reconcile_replaced(
    records: Iterable[NodeFailure], pods: Mapping[str, Mapping[str, Any]], at: dt.datetime
) -> list[NodeFailure]:
    """``Waiting`` records whose node already has a pod other than the failed one, not failed
    itself (a replacement created just before an operator restart): now ``Replaced`` (as of
    ``at``, the pod's creation time when it says)."""
    fixed: list[NodeFailure] = []
    for r in records:
        pod = pods.get(r.pod)
        if r.state != "Waiting" or pod is None:
            continue
        uid = (pod.get("metadata") or {}).get("uid")
        if uid and uid != r.pod_uid and pod_failure(pod, r.pod.rsplit("-node-", 1)[0]) is None:
            fixed.append(replaced(r, _created(pod) or at))
    return fixed


def _created(pod: Mapping[str, Any]) -> dt.datetime | None:
    stamp = (pod.get("metadata") or {}).get("creationTimestamp")
    try:
        return dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")) if stamp else None
    except ValueError:
        return None


def terminal_reason(records: Iterable[NodeFailure], nodes: int) -> tuple[str, str] | None:
    """(reason, message) when the job cannot go on, else None."""
    records = list(records)
    refused = [r for r in records if r.reason == BAD_INPUT]
    if refused:
        return BAD_INPUT, (
            f"a trainer refused the job's input before training ({refused[0].pod}: "
            f"{refused[0].message}); correct the spec and create the job again"
        )
    no_plan = [r for r in records if r.reason == NO_VALID_PLAN]
    if no_plan:
        return NO_VALID_PLAN, (
            f"no valid plan exists on the GPUs left ({no_plan[0].pod}: {no_plan[0].message})"
        )
    ruled = [r for r in records if r.action == "FailJob"]
    if ruled:
        r = ruled[0]
        return FAILED_BY_RULE, (
            f"spec.failurePolicy rule {r.rule!r} fails the job on {r.cause}: {r.pod}: {r.message}"
        )
    out = sorted(r.node for r in records if r.state == "Out")
    if nodes and len(out) >= nodes:
        return NO_WORKERS_LEFT, (
            f"every worker pod failed past spec.failurePolicy.maxRestarts (nodes {out})"
        )
    return None


def gpus_out(
    records: Iterable[NodeFailure],
    trainers: Mapping[int, str] | Iterable[GpuOut] | None,
    gpus_per_node: int,
) -> list[GpuOut]:
    """The GPUs out of the job and why: the trainers' word (``/status`` ``out``) for each GPU
    they name, and every GPU of a node waiting for its replacement or out for good."""
    result: dict[int, GpuOut] = {}
    if isinstance(trainers, Mapping):
        items = [(int(g), str(w)) for g, w in trainers.items()]
    else:
        items = [(o.gpu, o.reason) for o in trainers or [] if o.source == "trainers"]
    for gpu, why in items:
        result[gpu] = GpuOut(gpu=gpu, node=gpu // gpus_per_node, reason=why, source="trainers")
    for r in records:
        if r.state not in ("Waiting", "Out"):
            continue
        why = f"pod {r.pod} {r.reason}" + (
            " (past spec.failurePolicy.maxRestarts)" if r.state == "Out" else ""
        )
        for g in range(r.node * gpus_per_node, (r.node + 1) * gpus_per_node):
            result.setdefault(g, GpuOut(gpu=g, node=r.node, reason=why, source="pod"))
    return [result[g] for g in sorted(result)]


def _describe(r: NodeFailure) -> str:
    text = f"node {r.node} ({r.pod}): {r.reason}, failure {r.failures}"
    if r.state == "Waiting" and r.replace_at is not None:
        text += f", replacement due {r.replace_at.strftime('%H:%M:%SZ')}"
    elif r.state == "Out":
        text += ", out for good (past maxRestarts)"
    return text


def degraded_condition(
    records: Iterable[NodeFailure],
    out: Sequence[GpuOut],
    generation: int,
    at: dt.datetime,
) -> Condition:
    """``Degraded``: True while a node waits for its replacement or is out, or the trainers
    leave GPUs out; False (``AllGpusIn``) when nothing is out."""
    down = [r for r in records if r.state in ("Waiting", "Out")]
    if not down and not out:
        return condition(DEGRADED, False, "AllGpusIn", "every GPU is in the job", generation, at)
    reason = "PodFailed" if any(r.state == "Waiting" for r in down) else "GpusOut"
    if down and all(r.state == "Out" for r in down):
        reason = "NodesOut"
    parts = [_describe(r) for r in down]
    trainers = [o for o in out if o.source == "trainers"]
    if trainers:
        shown = ", ".join(f"{o.gpu} ({o.reason})" for o in trainers[:16])
        parts.append(f"trainers leave GPUs out: {shown}" + (", ..." if len(trainers) > 16 else ""))
    gpus = sorted({o.gpu for o in out})
    head = f"{len(gpus)} GPU(s) out" if gpus else "GPUs out"
    return condition(DEGRADED, True, reason, f"{head}; " + "; ".join(parts), generation, at)


def stuck_terminating(pod: Mapping[str, Any], at: dt.datetime) -> bool:
    """Whether ``pod`` was deleted and is still there `STUCK_TERMINATING_SECONDS` after its
    grace period ended (its ``deletionTimestamp``): its node's kubelet is not confirming, the
    node is lost (unreachable, its pods evicted by the taint manager). Only a force deletion
    frees the pod's name for its replacement then; a real cluster's pod GC would wait for the
    node object to go, which a lost node's never does by itself."""
    stamp = (pod.get("metadata") or {}).get("deletionTimestamp")
    if not stamp:
        return False
    try:
        ends = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return False
    return (at - ends).total_seconds() >= STUCK_TERMINATING_SECONDS


def nothing_to_wait_for(pod: Mapping[str, Any], cause: str | None) -> bool:
    """Whether a failed worker's pod may be deleted with no grace period, its name freed for
    the replacement at once: every container of it has ended (a failed or completed pod: no
    process left to stop), or its node is lost (``NodeLost``: the kubelet that would confirm
    is gone, and the job's survivors re-formed without its ranks already)."""
    if cause == "NodeLost":
        return True
    st = pod.get("status") or {}
    if st.get("phase") in ("Failed", "Succeeded"):
        return True
    # a native sidecar (a log shipper) still running is given its grace to flush, too
    statuses = [*(st.get("containerStatuses") or []), *(st.get("initContainerStatuses") or [])]
    return bool(statuses) and all((c.get("state") or {}).get("terminated") for c in statuses)
