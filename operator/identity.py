"""Who a MalleusJob's children are: `JobRef`, their names, labels and controller owner.

Split from `resources` (which builds the manifests themselves) because naming and ownership are
what the rest of the operator uses to find a job's objects again and to tell them from planted
ones (`owned_by`), with or without building anything; `resources` re-exports every name here.
Pure: no API calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from malleus.job import API_VERSION, KIND

__all__ = [
    "COMPONENT",
    "JOB_LABEL",
    "MANAGED_BY",
    "NODE_LABEL",
    "JobRef",
    "configmap_name",
    "controller_of",
    "coordinator_host",
    "describe_owner",
    "disruption_budget_name",
    "job_labels",
    "metadata",
    "network_policy_name",
    "owned_by",
    "owner_reference",
    "pod_name",
    "secret_name",
    "service_name",
    "worker_host",
    "worker_selector",
]

MANAGED_BY = "malleus-operator"
"""Value of ``app.kubernetes.io/managed-by`` on everything the operator creates."""
COMPONENT = "worker"
JOB_LABEL = "malleus.io/job"
"""Label holding the owning job's name: the selector of the Service and of every list call."""
NODE_LABEL = "malleus.io/node-rank"


@dataclass(frozen=True)
class JobRef:
    """Identity of a MalleusJob: enough for owner references, events and API paths."""

    namespace: str
    name: str
    uid: str = ""
    generation: int = 0

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobRef:
        meta = body.get("metadata", {})
        return cls(
            namespace=meta.get("namespace") or "default",
            name=meta["name"],
            uid=meta.get("uid") or "",
            generation=int(meta.get("generation") or 0),
        )


# ---- names ---------------------------------------------------------------------------------
# The CRD caps job names at 52 characters so that "<job>-node-4095" (62) is still a DNS label.


def service_name(job: str) -> str:
    """The headless Service: its name is the pods' DNS subdomain."""
    return job


def pod_name(job: str, index: int) -> str:
    """Worker pod of node ``index`` (also its hostname)."""
    return f"{job}-node-{index}"


def configmap_name(job: str) -> str:
    return f"{job}-config"


def secret_name(job: str) -> str:
    return f"{job}-control"


def network_policy_name(job: str) -> str:
    return f"{job}-network"


def disruption_budget_name(job: str) -> str:
    return f"{job}-workers"


def worker_host(ref: JobRef, index: int) -> str:
    """Stable DNS name of worker ``index`` (in the job's TLS certificate)."""
    return f"{pod_name(ref.name, index)}.{service_name(ref.name)}.{ref.namespace}.svc"


def coordinator_host(ref: JobRef) -> str:
    """Stable DNS name of node 0, the coordinator until a failure moves it (`trainers`)."""
    return worker_host(ref, 0)


def worker_selector(job: str) -> dict[str, str]:
    """Labels that select the job's worker pods (not its store)."""
    return {JOB_LABEL: job, "app.kubernetes.io/component": COMPONENT}


def job_labels(job: str) -> dict[str, str]:
    """Labels on every child of a job; `JOB_LABEL` is what selectors use."""
    return {
        "app.kubernetes.io/name": "malleus",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        JOB_LABEL: job,
    }


def owner_reference(ref: JobRef) -> dict[str, Any]:
    """Controller owner reference: the garbage collector deletes children with the job."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference with ``controller: true`` of ``obj`` (at most one), or None."""
    for owner in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(owner, Mapping) and owner.get("controller") is True:
            return owner
    return None


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether the job of uid ``uid`` controls ``obj``: what makes an object of a child's
    name the job's own. Labels and names prove nothing (anyone may copy them); a uid is the
    API server's and a controller reference can only be set by whoever writes the object."""
    owner = controller_of(obj)
    return bool(uid) and owner is not None and owner.get("uid") == uid


def describe_owner(obj: Mapping[str, Any]) -> str:
    """Who controls ``obj``, for messages: ``controlled by MalleusJob other (uid u-2)``."""
    owner = controller_of(obj)
    if owner is None:
        return "no controller owner"
    return (
        f"controlled by {owner.get('kind', '?')} {owner.get('name', '?')} "
        f"(uid {owner.get('uid', '?')})"
    )


def metadata(ref: JobRef, name: str, **extra: Any) -> dict[str, Any]:
    """Name, namespace, the job's labels and its owner reference: what every child carries."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ref.namespace,
        "labels": job_labels(ref.name),
        "ownerReferences": [owner_reference(ref)],
    }
    meta.update(extra)
    return meta
