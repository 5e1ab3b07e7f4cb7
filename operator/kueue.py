"""Kueue: a queued MalleusJob is one Workload, admitted, preempted and requeued whole.

A job labelled ``kueue.x-k8s.io/queue-name: <LocalQueue>`` is managed through Kueue's
external-framework support (Kueue's configuration lists ``MalleusJob.v1alpha1.malleus.io`` in
``integrations.externalFrameworks``): the operator makes the job's Workload
(`build_workload`: owned by the job, one pod set of ``spec.nodes`` workers and one of the
store, each with its pod's requests, placement and priority), and the job is held as if
``spec.suspend`` were true (no pods) until Kueue admits it (`state`: quota reserved and
``Admitted``). When Kueue evicts it (a higher-priority workload preempts it, its queue
stopped) the operator suspends it the way ``spec.suspend`` does (``POST /stop`` with a
checkpoint, the pods deleted once they exited: a suspension, never a failure) and, once no
pod is left, gives the quota back (`released`: Kueue's own jobs' "quota reservation unset,
``Requeued``"), so the preemptor runs and the job waits in its queue again; readmitted, it is
resumed from its checkpoint. A finished job's Workload is marked ``Finished`` (`finished`),
which frees its quota.

Why a Workload rather than the plain-pod groups used before: Kueue preempting a pod group
deletes its pods (they end Failed), which the operator could only read as failures, with no
checkpoint asked for, and the store pod is outside the group; a Workload is evicted, and the
operator stops the job itself (tests/e2e/test_kueue_e2e.py shows the whole cycle on Kueue's
real manager). The pods carry no Kueue label (Kueue's pod webhook would gate them again).

Pure builders and readers; the acting is in `admission` (the timer's reconcile).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .identity import JobRef, metadata

__all__ = [
    "API_VERSION",
    "PLURAL",
    "PRIORITY_CLASSES",
    "PRIORITY_LABEL",
    "QUEUE_LABEL",
    "WorkloadState",
    "build_workload",
    "finished",
    "queue_name",
    "released",
    "state",
    "workload_name",
]

API_VERSION = "kueue.x-k8s.io/v1beta2"
PLURAL = "workloads"
PRIORITY_CLASSES = "workloadpriorityclasses"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The job's LocalQueue (Kueue's label): present = the job is managed through Kueue."""
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""The job's WorkloadPriorityClass (Kueue's label), copied to the Workload."""
_POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "restartPolicy")
"""What Kueue reads of a pod set's template besides the containers (flavours, priority)."""


def queue_name(body: Mapping[str, Any]) -> str | None:
    """The job's LocalQueue, or None when Kueue does not manage it."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    value = labels.get(QUEUE_LABEL)
    return str(value) if value else None


def workload_name(job: str) -> str:
    """The job's Workload (Kueue's own jobs are ``<kind>-<name>-<hash>``; one per job here)."""
    return f"malleusjob-{job}"


def _requested(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container's resources with requests defaulted from limits, as the API server defaults
    a pod's (a Workload's template is not defaulted, and Kueue counts requests)."""
    resources = dict(container.get("resources") or {})
    limits = dict(resources.get("limits") or {})
    if limits:
        resources["requests"] = {**limits, **(resources.get("requests") or {})}
    return resources


def _template(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A pod set's template: the pod's containers (name, image, requests and limits) and
    placement, which is all Kueue reads (requests for the quota, placement for flavours)."""
    spec = pod.get("spec") or {}
    containers = [
        {"name": c["name"], "image": c.get("image", ""), "resources": _requested(c)}
        for c in spec.get("containers") or []
    ]
    kept = {k: spec[k] for k in _POD_FIELDS if k in spec}
    return {"spec": {**kept, "containers": containers}}


def build_workload(
    ref: JobRef,
    queue: str,
    worker: Mapping[str, Any],
    store: Mapping[str, Any] | None,
    nodes: int,
    priority_class: str | None = None,
    priority: int | None = None,
) -> dict[str, Any]:
    """The job's Workload: ``nodes`` workers like `worker` (node 0's pod) and the `store` pod
    (None: the job has none), admitted together or not at all; `priority_class` names its
    WorkloadPriorityClass and `priority` is that class's value (Kueue orders and preempts by
    ``spec.priority``, which the maker of a Workload sets)."""
    pod_sets = [{"name": "workers", "count": nodes, "template": _template(worker)}]
    if store is not None:
        pod_sets.append({"name": "store", "count": 1, "template": _template(store)})
    spec: dict[str, Any] = {"queueName": queue, "podSets": pod_sets}
    if priority_class:
        spec["priorityClassRef"] = {
            "group": "kueue.x-k8s.io",
            "kind": "WorkloadPriorityClass",
            "name": priority_class,
        }
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": metadata(ref, workload_name(ref.name)),
        "spec": spec,
    }


@dataclass(frozen=True)
class WorkloadState:
    """Where Kueue has the job: `admitted` (quota reserved and Admitted), `evicted` (Kueue's
    message when it evicts it, else None), `reserved` (quota still held: an evicted job gives
    it back once its pods are gone), `finished`."""

    admitted: bool
    evicted: str | None
    reserved: bool
    finished: bool

    @property
    def may_run(self) -> bool:
        """Pods may exist: admitted and not being evicted."""
        return self.admitted and self.evicted is None and not self.finished


def _conditions(workload: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in (workload.get("status") or {}).get("conditions") or []}


def state(workload: Mapping[str, Any] | None) -> WorkloadState:
    """The job's place in Kueue from its Workload (None: not made yet, so not admitted)."""
    if workload is None:
        return WorkloadState(False, None, False, False)
    conds = _conditions(workload)

    def true(kind: str) -> bool:
        return (conds.get(kind) or {}).get("status") == "True"

    reserved = true("QuotaReserved") and bool((workload.get("status") or {}).get("admission"))
    evicted = (conds["Evicted"].get("message") or "evicted") if true("Evicted") else None
    return WorkloadState(reserved and true("Admitted"), evicted, reserved, true("Finished"))


def _condition(
    kind: str, status: bool, reason: str, message: str, at: dt.datetime
) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _merged(workload: Mapping[str, Any], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Workload's conditions with `new` replacing those of their types (a transition time
    kept where the status did not change)."""
    old = _conditions(workload)
    out = {k: dict(v) for k, v in old.items()}
    for c in new:
        before = old.get(c["type"])
        if before is not None and before.get("status") == c["status"]:
            c = {**c, "lastTransitionTime": before.get("lastTransitionTime")}
        out[c["type"]] = c
    return list(out.values())


def released(workload: Mapping[str, Any], at: dt.datetime) -> dict[str, Any]:
    """The status patch by which an evicted job's Workload gives its quota back once the job's
    pods are gone: no admission, ``QuotaReserved=False``/``Pending``, ``Admitted=False``, and
    ``Requeued=True``, so Kueue queues it again (what Kueue does for its own jobs)."""
    why = _conditions(workload).get("Evicted") or {}
    message = str(why.get("message") or "evicted")
    reason = str(why.get("reason") or "Evicted")
    conditions = _merged(
        workload,
        [
            _condition("QuotaReserved", False, "Pending", message, at),
            _condition("Admitted", False, "NoReservation", "the workload has no reservation", at),
            # a deactivated Workload is not queued again until someone activates it
            _condition("Requeued", reason != "Deactivated", reason, message, at),
        ],
    )
    return {"status": {"admission": None, "conditions": conditions}}


def finished(
    workload: Mapping[str, Any], succeeded: bool, message: str, at: dt.datetime
) -> dict[str, Any]:
    """The status patch marking the Workload ``Finished`` (its quota freed): the job ended."""
    reason = "Succeeded" if succeeded else "Failed"
    cond = _condition("Finished", True, reason, message or reason, at)
    return {"status": {"conditions": _merged(workload, [cond])}}
