"""Why a job's pods are not running yet, and when waiting for them has lasted too long: pure.

A pod the scheduler cannot place (``PodScheduled=False``, reason ``Unschedulable``) or whose
image cannot be pulled waits forever without failing, so without this a job shows only
"1/2 worker pod(s) running" while half its GPUs sit idle. `pending_reasons` names each stuck pod
with the scheduler's or the kubelet's own words (the job's ``Ready`` condition and a Warning
event carry them, see `lifecycle.pods_transition`), and `schedule_timeout_left` says when
``spec.scheduling.scheduleTimeoutSeconds`` is up (the operator's timer then fails the job with
``ScheduleTimeout``). Labels for gang schedulers are in `gang_metadata`, and the PodGroup
object the operator creates for ``spec.scheduling.podGroup.create`` is `build_pod_group`'s.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from malleus.job.spec import MalleusJobSpec, PodGroupApi

from .resources import JobRef, metadata

__all__ = [
    "IMAGE_PULL",
    "POD_GROUP_ANNOTATION",
    "POD_GROUP_APIS",
    "POD_GROUP_LABEL",
    "SCHEDULE_TIMEOUT",
    "UNSCHEDULABLE",
    "PendingReason",
    "PodGroupApiInfo",
    "build_pod_group",
    "gang_metadata",
    "gated",
    "pending_reasons",
    "schedule_timeout_left",
]

UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL = "ImagePullBackOff"
SCHEDULE_TIMEOUT = "ScheduleTimeout"
_IMAGE_PULL_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})

POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
"""scheduler-plugins' coscheduling label naming the PodGroup."""
POD_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
"""Volcano's annotation naming the PodGroup."""


@dataclass(frozen=True)
class PodGroupApiInfo:
    """Where a coscheduler's PodGroup lives: API group, version and plural, and who serves it."""

    group: str
    version: str
    plural: str
    project: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def resource(self) -> str:
        """``plural.group/version``, as a message names it."""
        return f"{self.plural}.{self.api_version}"


POD_GROUP_APIS: dict[PodGroupApi, PodGroupApiInfo] = {
    "scheduler-plugins": PodGroupApiInfo(
        "scheduling.x-k8s.io", "v1alpha1", "podgroups", "scheduler-plugins (coscheduling)"
    ),
    "volcano": PodGroupApiInfo("scheduling.volcano.sh", "v1beta1", "podgroups", "Volcano"),
}
"""``spec.scheduling.podGroup.create`` -> the PodGroup API the operator creates one in."""


@dataclass(frozen=True)
class PendingReason:
    """Why pod ``pod`` is not running: ``reason`` (`UNSCHEDULABLE` or `IMAGE_PULL`) and the
    scheduler's or kubelet's message."""

    pod: str
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.pod}: {self.reason}: {self.message}".rstrip(": ")


def _pending_reason(pod: Mapping[str, Any]) -> PendingReason | None:
    name = (pod.get("metadata") or {}).get("name", "?")
    st = pod.get("status") or {}
    if st.get("phase") not in (None, "Pending"):
        return None
    for cond in st.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == UNSCHEDULABLE
        ):
            return PendingReason(name, UNSCHEDULABLE, cond.get("message") or "")
    statuses = [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _IMAGE_PULL_WAITING:
            message = f"{waiting['reason']}: {waiting.get('message') or ''}".rstrip(": ")
            return PendingReason(name, IMAGE_PULL, f"container {cs.get('name')}: {message}")
    return None


def pending_reasons(
    pods: Sequence[Mapping[str, Any]], expected: Sequence[str]
) -> list[PendingReason]:
    """The expected pods that are stuck unschedulable or on an image pull, in ``expected``'s
    order (unscheduled pods first: a pod not placed anywhere never pulls an image)."""
    by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
    found = [r for n in expected if n in by_name and (r := _pending_reason(by_name[n]))]
    return sorted(found, key=lambda r: r.reason != UNSCHEDULABLE)


def gated(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pods held back by scheduling gates (Kueue's ``kueue.x-k8s.io/admission`` until the
    queue admits the gang): queued, not stuck, so the schedule timeout does not run for them."""
    return [
        (p.get("metadata") or {}).get("name", "?")
        for p in pods
        if (p.get("spec") or {}).get("schedulingGates")
        and (p.get("status") or {}).get("phase") in (None, "Pending")
    ]


def schedule_timeout_left(
    started: dt.datetime | None, timeout_seconds: int, at: dt.datetime
) -> float | None:
    """Seconds until a Pending job's pods have waited ``timeout_seconds`` since ``started``
    (``status.startTime``, when the pods were created); <= 0: the job fails now; None: unknown
    start (nothing to count from)."""
    if started is None:
        return None
    return (started - at).total_seconds() + timeout_seconds


def gang_metadata(spec: MalleusJobSpec) -> tuple[dict[str, str], dict[str, str]]:
    """Labels and annotations for every worker so a gang scheduler admits them together: a
    coscheduler's, the ``spec.scheduling.podGroup`` name as scheduler-plugins' label and
    Volcano's annotation. Kueue's labels are never copied to the pods: Kueue admits the job's
    Workload (`kueue`), and a pod with a queue name would be gated by Kueue's pod webhook."""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    pod_group = spec.scheduling.pod_group
    if pod_group is not None:
        labels[POD_GROUP_LABEL] = pod_group.name
        annotations[POD_GROUP_ANNOTATION] = pod_group.name
    return labels, annotations


def build_pod_group(spec: MalleusJobSpec, ref: JobRef) -> dict[str, Any] | None:
    """The PodGroup ``spec.scheduling.podGroup.create`` asks for (None: none), owned by the job.

    ``minMember`` is ``spec.nodes``: the coscheduler binds no worker until all of them fit, so a
    job never holds half its GPUs. scheduler-plugins' ``scheduleTimeoutSeconds`` is the job's
    ``spec.scheduling.scheduleTimeoutSeconds`` (how long the coscheduler keeps a partial gang's
    reservations); Volcano's ``queue`` is ``podGroup.queue`` when set.
    """
    pod_group = spec.scheduling.pod_group
    if pod_group is None or pod_group.create is None:
        return None
    api = POD_GROUP_APIS[pod_group.create]
    body: dict[str, Any] = {"minMember": spec.nodes}
    if pod_group.create == "scheduler-plugins":
        body["scheduleTimeoutSeconds"] = spec.scheduling.schedule_timeout_seconds
    elif pod_group.queue:
        body["queue"] = pod_group.queue
    return {
        "apiVersion": api.api_version,
        "kind": "PodGroup",
        "metadata": metadata(ref, pod_group.name),
        "spec": body,
    }
