"""Pure builders of the Kubernetes objects a MalleusJob owns: plain dicts, no API calls.

Keeping manifests pure (dask-kubernetes style) lets tests assert on every field without a
cluster, and keeps `k8s.py` the one place that talks to the API. A job of ``N`` nodes owns:

- a headless Service named like the job: stable DNS names ``<job>-node-<i>.<job>.<ns>.svc``
  for every worker (torchrun's static rendezvous uses node 0's, the operator scrapes and posts
  plans to it); it publishes not-ready addresses so that rendezvous works before readiness;
- a ConfigMap ``<job>-config`` with ``plan.json`` (the plan in force; the operator rewrites it
  at every re-plan, so a restarted operator or trainer finds the latest) and ``job.json`` (the
  manifest the trainers read);
- a Secret ``<job>-control`` with the bearer token that guards the trainers' ``POST /plan``;
- ``N`` worker Pods ``<job>-node-<i>``, one per node, each running ``torchrun`` with
  ``gpusPerNode`` processes.

Every object carries an ownerReference to the job (the garbage collector deletes them with it)
and the labels in `job_labels`, by which the operator finds them again after a restart.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from malleus.jobspec import API_VERSION, KIND, MalleusJob, dump_job
from malleus.planner.plan import Plan

__all__ = [
    "COMPONENT",
    "CONFIG_MOUNT",
    "CONTROL_PORT_NAME",
    "GPU_RESOURCE",
    "JOB_LABEL",
    "MANAGED_BY",
    "NODE_LABEL",
    "RENDEZVOUS_PORT",
    "RUN_AS_USER",
    "TOKEN_KEY",
    "JobRef",
    "build_children",
    "build_configmap",
    "build_event",
    "build_pod",
    "build_secret",
    "build_service",
    "configmap_name",
    "coordinator_host",
    "job_labels",
    "job_manifest",
    "owner_reference",
    "pod_name",
    "secret_name",
    "service_name",
    "torchrun_command",
]

MANAGED_BY = "malleus-operator"
"""Value of ``app.kubernetes.io/managed-by`` on everything the operator creates."""
COMPONENT = "worker"
JOB_LABEL = "malleus.io/job"
"""Label holding the owning job's name: the selector of the Service and of every list call."""
NODE_LABEL = "malleus.io/node-rank"
RENDEZVOUS_PORT = 29500
"""torchrun's static rendezvous (TCPStore) port on node 0."""
CONTROL_PORT_NAME = "control"
CONFIG_MOUNT = "/etc/malleus"
"""Where the ConfigMap (plan.json, job.json) is mounted in every worker."""
RUN_AS_USER = 1000
"""The non-root user of the trainer image (Dockerfile's ``malleus`` user)."""
TOKEN_KEY = "token"
GPU_RESOURCE = "nvidia.com/gpu"


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


def coordinator_host(ref: JobRef) -> str:
    """Stable DNS name of node 0 (the coordinator and torchrun's rendezvous host)."""
    return f"{pod_name(ref.name, 0)}.{service_name(ref.name)}.{ref.namespace}.svc"


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


def _metadata(ref: JobRef, name: str, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ref.namespace,
        "labels": job_labels(ref.name),
        "ownerReferences": [owner_reference(ref)],
    }
    meta.update(extra)
    return meta


# ---- Service, ConfigMap, Secret -------------------------------------------------------------


def build_service(job: MalleusJob, ref: JobRef) -> dict[str, Any]:
    """Headless Service giving every worker a stable DNS name (hostname.subdomain)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ref, service_name(ref.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rendezvous must resolve before readiness
            "selector": {JOB_LABEL: ref.name},
            "ports": [
                {"name": CONTROL_PORT_NAME, "port": job.spec.control_port, "protocol": "TCP"},
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "protocol": "TCP"},
            ],
        },
    }


def job_manifest(job: MalleusJob, ref: JobRef) -> dict[str, Any]:
    """The manifest the trainers read (``job.json``): apiVersion, kind, name, namespace, spec."""
    data = dump_job(job)
    return {
        "apiVersion": data["apiVersion"],
        "kind": data["kind"],
        "metadata": {"name": ref.name, "namespace": ref.namespace},
        "spec": data["spec"],
    }


def build_configmap(job: MalleusJob, ref: JobRef, plan: Plan) -> dict[str, Any]:
    """ConfigMap with the plan in force and the job manifest, mounted in every worker."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ref, configmap_name(ref.name)),
        "data": {
            "plan.json": plan.to_json(),
            "job.json": json.dumps(job_manifest(job, ref), indent=2, sort_keys=True),
        },
    }


def build_secret(ref: JobRef, token: str) -> dict[str, Any]:
    """Secret with the control token (the caller makes it: builders stay deterministic)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(ref, secret_name(ref.name)),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


# ---- worker pods ----------------------------------------------------------------------------


def torchrun_command(job: MalleusJob, ref: JobRef, index: int) -> list[str]:
    """``torchrun ... -m malleus.trainer job.json --plan plan.json`` on a static rendezvous.

    Static (not c10d/etcd) rendezvous on node 0's stable DNS name: the world never changes size
    in Malleus (stragglers are re-planned around, not removed), and node ranks are the pod
    indices, which the plan's global ranks (``node * gpusPerNode + local``) depend on.
    ``--max-restarts=0``: a worker that dies cannot rejoin the job's process group, so failures
    go to the operator. Each node's first rank serves the control port (``spec.controlPort``).
    """
    cmd = [
        "torchrun",
        f"--nnodes={job.spec.nodes}",
        f"--nproc-per-node={job.spec.gpus_per_node}",
        f"--node-rank={index}",
        f"--master-addr={coordinator_host(ref)}",
        f"--master-port={RENDEZVOUS_PORT}",
        "--max-restarts=0",
        "-m",
        "malleus.trainer",
        f"{CONFIG_MOUNT}/job.json",
        f"--plan={CONFIG_MOUNT}/plan.json",
    ]
    ckpt = job.spec.checkpoint
    if ckpt.interval_steps:
        cmd += [f"--checkpoint-dir={ckpt.path}", f"--checkpoint-every={ckpt.interval_steps}"]
    return cmd


def _env(job: MalleusJob, ref: JobRef, index: int) -> list[dict[str, Any]]:
    return [
        {"name": "MALLEUS_JOB_NAME", "value": ref.name},
        {"name": "MALLEUS_NAMESPACE", "value": ref.namespace},
        {"name": "MALLEUS_NODE_RANK", "value": str(index)},
        {"name": "MALLEUS_NODES", "value": str(job.spec.nodes)},
        {"name": "MALLEUS_GPUS_PER_NODE", "value": str(job.spec.gpus_per_node)},
        {"name": "MALLEUS_CONTROL_PORT", "value": str(job.spec.control_port)},
        {"name": "MALLEUS_JOB", "value": f"{CONFIG_MOUNT}/job.json"},
        {"name": "MALLEUS_PLAN", "value": f"{CONFIG_MOUNT}/plan.json"},
        {
            "name": "MALLEUS_CONTROL_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": secret_name(ref.name), "key": TOKEN_KEY}},
        },
        {"name": "MALLEUS_EMULATION", "value": "1" if job.spec.emulation.enabled else "0"},
        {"name": "HOME", "value": "/tmp"},  # read-only root: caches (torch, triton) go to /tmp
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _resources(job: MalleusJob) -> dict[str, Any]:
    """Requests = limits (Guaranteed QoS); GPUs unless the emulated clock runs on CPUs."""
    amounts: dict[str, Any] = {}
    r = job.spec.resources
    if r.cpu is not None:
        amounts["cpu"] = str(r.cpu)
    if r.memory is not None:
        amounts["memory"] = str(r.memory)
    if not job.spec.emulation.enabled:
        amounts[GPU_RESOURCE] = str(job.spec.gpus_per_node)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _volumes(job: MalleusJob, ref: JobRef) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ckpt = job.spec.checkpoint
    checkpoint_volume: dict[str, Any] = (
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": ckpt.claim_name}}
        if ckpt.claim_name
        else {"name": "checkpoints", "emptyDir": {}}
    )
    volumes = [
        {"name": "config", "configMap": {"name": configmap_name(ref.name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL/gloo shared memory
        {"name": "tmp", "emptyDir": {}},
        checkpoint_volume,
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "checkpoints", "mountPath": ckpt.path},
    ]
    return volumes, mounts


def build_pod(job: MalleusJob, ref: JobRef, index: int) -> dict[str, Any]:
    """Worker pod of node ``index``: ``gpusPerNode`` trainer processes under torchrun.

    ``restartPolicy: Never``: a restarted worker cannot rejoin the running process group, so a
    failure is reported on the job instead of being hidden by a restart loop. Without emulation,
    a required anti-affinity keeps one worker per node (the plan's node = the pod index).
    """
    volumes, mounts = _volumes(job, ref)
    port = job.spec.control_port
    name = pod_name(ref.name, index)
    labels = {**job_labels(ref.name), NODE_LABEL: str(index)}
    spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": service_name(ref.name),
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "trainer",
                "image": job.spec.image,
                "imagePullPolicy": "IfNotPresent",
                "command": torchrun_command(job, ref, index),
                "env": _env(job, ref, index),
                "ports": [
                    {"name": CONTROL_PORT_NAME, "containerPort": port, "protocol": "TCP"},
                    {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
                ],
                "resources": _resources(job),
                "volumeMounts": mounts,
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
        "volumes": volumes,
    }
    if not job.spec.emulation.enabled:
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {JOB_LABEL: ref.name}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(
            ref,
            name,
            labels=labels,
            annotations={
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics",
            },
        ),
        "spec": spec,
    }


def build_children(job: MalleusJob, ref: JobRef, plan: Plan, token: str) -> list[dict[str, Any]]:
    """Everything a job owns, in creation order: Service, ConfigMap, Secret, then the pods.

    The pods come last because they mount the ConfigMap and read the Secret.
    """
    return [
        build_service(job, ref),
        build_configmap(job, ref, plan),
        build_secret(ref, token),
        *(build_pod(job, ref, i) for i in range(job.spec.nodes)),
    ]


# ---- events ---------------------------------------------------------------------------------


def build_event(
    ref: JobRef,
    type_: str,
    reason: str,
    message: str,
    now: dt.datetime,
    *,
    component: str = MANAGED_BY,
) -> dict[str, Any]:
    """A core/v1 Event on the job (what ``kubectl describe mj`` lists)."""
    stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{ref.name}.", "namespace": ref.namespace},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": ref.name,
            "namespace": ref.namespace,
            "uid": ref.uid,
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
