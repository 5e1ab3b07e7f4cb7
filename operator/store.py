"""Pure builders of a job's rendezvous store: one small Pod and its Service, owned by the job.

The trainers meet in a torch ``TCPStore`` that no rank hosts (``MALLEUS_STORE=host:port`` in
every worker, `STORE_ENV`): they form the process group there at the start, and re-form it there
after a failure, so losing any worker (node 0 included) loses no rendezvous, and a replacement
pod finds the running job there. The store runs the trainer image
(``python -m malleus.trainer store --host 0.0.0.0 --port 29400``) as the workers do: non-root,
read-only root filesystem, no capabilities, no service-account token.

**The store has no authentication and no encryption** (torch's TCPStore cannot have any):
whoever reaches its port can read every key and write any, i.e. join or wedge the job's
rendezvous. Its only protection is the job's NetworkPolicy (`resources.build_network_policy`),
which admits to the job's pods only the job's own pods; on a cluster without a NetworkPolicy
controller, keep the job's namespace closed by other means.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from malleus.job import ResolvedJob

from .resources import GPU_TOLERATION, JOB_LABEL, JobRef, job_labels, metadata

__all__ = [
    "STORE_COMPONENT",
    "STORE_ENV",
    "STORE_PORT",
    "build_store_pod",
    "build_store_service",
    "is_store_pod",
    "store_address",
    "store_labels",
    "store_name",
]

STORE_PORT = 29400
"""The store's TCP port (its Service's too)."""
STORE_ENV = "MALLEUS_STORE"
"""The workers' environment variable naming the store (``host:port``)."""
STORE_COMPONENT = "store"
"""``app.kubernetes.io/component`` of the store pod (the workers' is ``worker``)."""
STORE_RESOURCES = {"cpu": "100m", "memory": "256Mi"}
"""Requests = limits: a TCPStore of a few thousand keys."""


def store_name(job: str) -> str:
    """The store's Pod and Service (``<job>-store``; the CRD's 52-character job names fit)."""
    return f"{job}-store"


def store_address(ref: JobRef) -> str:
    """``host:port`` of the store as the workers reach it: its Service's DNS name."""
    return f"{store_name(ref.name)}.{ref.namespace}.svc:{STORE_PORT}"


def store_labels(job: str) -> dict[str, str]:
    """The job's labels (so the job's NetworkPolicy and list calls find it), as component store."""
    return {**job_labels(job), "app.kubernetes.io/component": STORE_COMPONENT}


def is_store_pod(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` is a job's store pod (by its component label)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get("app.kubernetes.io/component") == STORE_COMPONENT


def build_store_pod(job: ResolvedJob, ref: JobRef) -> dict[str, Any]:
    """The store pod: the trainer image running the store server on `STORE_PORT`.

    ``restartPolicy: Always``: a crashed store restarts in place, empty, at the same address;
    the trainers' clients dial it again (trainer/world/store_client.py), so a later failure is still
    survived.
    """
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(ref, store_name(ref.name), labels=store_labels(ref.name)),
        "spec": {
            "restartPolicy": "Always",
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 5,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "fsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "store",
                    "image": job.spec.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": [
                        "python",
                        "-m",
                        "malleus.trainer",
                        "store",
                        "--host",
                        "0.0.0.0",
                        "--port",
                        str(STORE_PORT),
                    ],
                    "env": [
                        {"name": "HOME", "value": "/tmp"},
                        {"name": "PYTHONUNBUFFERED", "value": "1"},
                    ],
                    "ports": [{"name": "store", "containerPort": STORE_PORT, "protocol": "TCP"}],
                    "readinessProbe": {"tcpSocket": {"port": STORE_PORT}, "periodSeconds": 2},
                    "resources": {"requests": dict(STORE_RESOURCES), "limits": STORE_RESOURCES},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "runAsNonRoot": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            **_pull_secrets(job),
            **_placement(job),
        },
    }


def _placement(job: ResolvedJob) -> dict[str, Any]:
    """Where the store may run: where the job's workers may. On a cluster whose GPU nodes are
    tainted, or a job pinned to a node pool, a store without the job's tolerations, node
    selector, node affinity and priority stays Pending forever while the workers run.

    The operator's GPU toleration comes along (the store asks for no GPU, but may have to sit on
    a GPU node); the workers' pod anti-affinity does not (one worker per node is the workers'
    rule, not the store's), nor their scheduler (a gang scheduler would wait for a pod group the
    store is not part of)."""
    out: dict[str, Any] = {}
    tolerations: list[dict[str, Any]] = []
    if not job.spec.emulation.enabled:
        tolerations.append(dict(GPU_TOLERATION))
    template = job.spec.pod_template
    if template is not None:
        extra = template.spec
        tolerations += [dict(t) for t in extra.tolerations if t not in tolerations]
        if extra.node_selector:
            out["nodeSelector"] = dict(extra.node_selector)
        node_affinity = (extra.affinity or {}).get("nodeAffinity")
        if node_affinity:
            out["affinity"] = {"nodeAffinity": copy.deepcopy(node_affinity)}
        if extra.priority_class_name:
            out["priorityClassName"] = extra.priority_class_name
    if tolerations:
        out["tolerations"] = tolerations
    return out


def _pull_secrets(job: ResolvedJob) -> dict[str, Any]:
    """The workers' image pull secrets (``spec.podTemplate.spec.imagePullSecrets``): same image."""
    template = job.spec.pod_template
    secrets = template.spec.image_pull_secrets if template is not None else []
    return {"imagePullSecrets": [{"name": s.name} for s in secrets]} if secrets else {}


def build_store_service(ref: JobRef) -> dict[str, Any]:
    """A ClusterIP Service in front of the store pod (a stable name, whatever its IP)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ref, store_name(ref.name), labels=store_labels(ref.name)),
        "spec": {
            "selector": {JOB_LABEL: ref.name, "app.kubernetes.io/component": STORE_COMPONENT},
            "publishNotReadyAddresses": True,  # the workers may dial before readiness is seen
            "ports": [
                {"name": "store", "port": STORE_PORT, "targetPort": STORE_PORT, "protocol": "TCP"}
            ],
        },
    }
