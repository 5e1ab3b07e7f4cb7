"""Pure builders of a job's worker Pods: one per node, ``gpusPerNode`` trainers under torchrun.

Beside `resources` (names, labels, the Service, ConfigMap, Secret and Events) because a pod is
most of what a job owns: its command line, environment, resources, volumes and security context.
Plain dicts, no API calls, so tests assert on every field without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from malleus.job import ResolvedJob
from malleus.planner.plan import Plan

from . import tls
from .overrides import apply_pod_template
from .resources import (
    CONFIG_MOUNT,
    CONTROL_PORT_NAME,
    JOB_LABEL,
    NODE_LABEL,
    RENDEZVOUS_PORT,
    TOKEN_KEY,
    JobRef,
    build_configmap,
    build_disruption_budget,
    build_secret,
    build_service,
    configmap_name,
    coordinator_host,
    job_labels,
    metadata,
    pod_name,
    secret_name,
    service_name,
)
from .scheduling import gang_metadata

__all__ = [
    "GPU_RESOURCE",
    "HF_EXPORT",
    "RUN_AS_USER",
    "build_children",
    "build_pod",
    "torchrun_command",
]

HF_EXPORT = "hf-final"
"""Folder under `spec.checkpoint.path` where a job with a persistent checkpoint volume leaves its
trained model in the Hugging Face layout (config.json + safetensors)."""

RUN_AS_USER = 1000
"""The non-root user of the trainer image (Dockerfile's ``malleus`` user)."""
GPU_RESOURCE = "nvidia.com/gpu"
TLS_MOUNT = "/etc/malleus-tls"
"""Where the job Secret's server certificate, key and CA are mounted (the trainer's
``MALLEUS_CONTROL_TLS_CERT`` / ``_KEY`` point there; the CA is for clients run in the pod);
beside, not inside, the ConfigMap's mount."""


def torchrun_command(job: ResolvedJob, ref: JobRef, index: int) -> list[str]:
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
    if ckpt.claim_name:
        # The trained model, as a Hugging Face folder, on the job's persistent volume at the end
        # (rank 0 writes it; an emptyDir would vanish with the pod, so only with a claim).
        cmd.append(f"--save-hf={ckpt.path.rstrip('/')}/{HF_EXPORT}")
    return cmd


def _env(job: ResolvedJob, ref: JobRef, index: int) -> list[dict[str, Any]]:
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
        # The control endpoint serves HTTPS with the job's certificate, on the pod IP only.
        {"name": "MALLEUS_CONTROL_TLS_CERT", "value": f"{TLS_MOUNT}/{tls.CERT_KEY}"},
        {"name": "MALLEUS_CONTROL_TLS_KEY", "value": f"{TLS_MOUNT}/{tls.KEY_KEY}"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # The Kubernetes node, a label of the trainer metrics (an admin cordons by it).
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "MALLEUS_EMULATION", "value": "1" if job.spec.emulation.enabled else "0"},
        {"name": "HOME", "value": "/tmp"},  # read-only root: caches (torch, triton) go to /tmp
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _resources(job: ResolvedJob) -> dict[str, Any]:
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


def _volumes(job: ResolvedJob, ref: JobRef) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ckpt = job.spec.checkpoint
    checkpoint_volume: dict[str, Any] = (
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": ckpt.claim_name}}
        if ckpt.claim_name
        else {"name": "checkpoints", "emptyDir": {}}
    )
    volumes = [
        {"name": "config", "configMap": {"name": configmap_name(ref.name)}},
        {
            "name": "control-tls",
            "secret": {
                "secretName": secret_name(ref.name),
                "items": [{"key": k, "path": k} for k in (tls.CERT_KEY, tls.KEY_KEY, tls.CA_KEY)],
                "defaultMode": 0o440,  # owner root, group fsGroup (the trainer's)
            },
        },
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL/gloo shared memory
        {"name": "tmp", "emptyDir": {}},
        checkpoint_volume,
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "control-tls", "mountPath": TLS_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "checkpoints", "mountPath": ckpt.path},
    ]
    return volumes, mounts


def build_pod(job: ResolvedJob, ref: JobRef, index: int) -> dict[str, Any]:
    """Worker pod of node ``index``: ``gpusPerNode`` trainer processes under torchrun.

    ``restartPolicy: Never``: a restarted worker cannot rejoin the running process group, so a
    failure is reported on the job instead of being hidden by a restart loop. Without emulation,
    a required anti-affinity keeps one worker per node (the plan's node = the pod index).
    ``spec.podTemplate`` is merged in last, the operator's fields winning (`overrides`).
    """
    volumes, mounts = _volumes(job, ref)
    port = job.spec.control_port
    name = pod_name(ref.name, index)
    gang_labels, gang_annotations = gang_metadata(job.spec, job.job.metadata.labels, ref.name)
    labels = {**job_labels(ref.name), NODE_LABEL: str(index), **gang_labels}
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
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(
            ref,
            name,
            labels=labels,
            annotations={
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics",
                "prometheus.io/scheme": "https",
                **gang_annotations,
            },
        ),
        "spec": spec,
    }
    return apply_pod_template(pod, job.spec.pod_template)


def build_children(
    job: ResolvedJob,
    ref: JobRef,
    plan: Plan,
    token: str,
    network_policy: Mapping[str, Any] | None = None,
    certificates: tls.JobCertificates | None = None,
    disruption_budget: bool = True,
) -> list[dict[str, Any]]:
    """Everything a job owns, in creation order: its NetworkPolicy (when given), Service,
    ConfigMap, Secret, PodDisruptionBudget (unless ``disruption_budget`` is false), then the
    pods.

    ``certificates`` (`tls.issue`) go into the Secret, which the pods mount: a job that runs
    needs them; None only for manifests that are inspected, never run.

    The policy comes first so that no pod ever runs unprotected; the pods come last because
    they mount the ConfigMap and read the Secret.
    """
    return [
        *([dict(network_policy)] if network_policy is not None else []),
        build_service(job, ref),
        build_configmap(job, ref, plan),
        build_secret(ref, token, certificates.secret_data() if certificates else None),
        *([build_disruption_budget(job, ref)] if disruption_budget else []),
        *(build_pod(job, ref, i) for i in range(job.spec.nodes)),
    ]
