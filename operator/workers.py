"""Pure builders of a job's worker Pods: one per node, ``gpusPerNode`` trainers under torchrun.

Beside `identity` (names, labels) and `resources` (the Service, ConfigMap, Secret and Events)
because a pod is most of what a job owns: its command line, environment, resources, volumes and
security context.
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
    COMPONENT,
    CONFIG_MOUNT,
    CONTROL_PORT_NAME,
    GPU_RESOURCE,
    GPU_TOLERATION,
    JOB_LABEL,
    NODE_LABEL,
    RENDEZVOUS_PORT,
    RESTART_ANNOTATION,
    TOKEN_KEY,
    JobRef,
    build_configmap,
    build_disruption_budget,
    build_secret,
    build_service,
    configmap_name,
    job_labels,
    metadata,
    pod_name,
    secret_name,
    service_name,
)
from .scheduling import gang_metadata
from .store import STORE_ENV, build_store_pod, build_store_service, store_address

__all__ = [
    "HF_EXPORT",
    "READINESS_PROBE",
    "RUN_AS_USER",
    "build_children",
    "build_pod",
    "control_ports",
    "torchrun_command",
]

HF_EXPORT = "hf-final"
"""Folder under `spec.checkpoint.path` where a job with a persistent checkpoint volume leaves its
trained model in the Hugging Face layout (config.json + safetensors)."""

RUN_AS_USER = 1000
"""The non-root user of the trainer image (Dockerfile's ``malleus`` user)."""
TLS_MOUNT = "/etc/malleus-tls"
"""Where the job Secret's server certificate, key and CA are mounted (the trainer's
``MALLEUS_CONTROL_TLS_CERT`` / ``_KEY`` point there; the CA is for clients run in the pod),
and its control token (``MALLEUS_CONTROL_TOKEN_FILE``: a file, not an environment variable,
which every process of the pod would inherit and which pod inspection shows); beside, not
inside, the ConfigMap's mount."""


READINESS_PROBE = {
    "tcpSocket": {"port": RENDEZVOUS_PORT},
    "periodSeconds": 10,
    "failureThreshold": 3,
}
"""The worker pod's readiness: torchrun's agent store accepts (it listens on every address of
the pod from the launcher's start to its end, and torchrun ends with the pod's ranks). Not the
control endpoint: only the job's coordinator serves one, so every other pod would never be
Ready (blocking drains through the PodDisruptionBudget, and Kueue's ``waitForPodsReady``).
Whether the trainers train is the job's ``Ready`` condition (`readiness`), the coordinator's
word for every rank."""


def control_ports(job: ResolvedJob) -> list[int]:
    """The control ports of a node's ranks: ``spec.controlPort + local rank``. Whichever rank is
    the job's coordinator (the lowest GPU still in the job) serves its own."""
    return [job.spec.control_port + local for local in range(job.spec.gpus_per_node)]


def torchrun_command(job: ResolvedJob, ref: JobRef, index: int, *, join: bool = False) -> list[str]:
    """``torchrun ... -m malleus.trainer job.json --plan plan.json`` as the pod's own launcher.

    torchrun only starts and watches this pod's ``gpusPerNode`` ranks (``--nnodes=1``, its
    agent's store on the pod's loopback): the ranks meet in the job's store (``MALLEUS_STORE``,
    `store`), which no rank and no pod of a worker hosts, and take their global ranks from
    ``MALLEUS_NODE_RANK`` (``node * gpusPerNode + local``), so a pod replaced mid-run starts
    alone and its ranks join the running job (``join``: the trainer's ``--join``; they enter as
    excluded GPUs at a step boundary and a later plan may re-admit them).
    ``--max-restarts=0``: a rank that dies takes its pod down, and the operator replaces the pod
    (`failures`); the other pods' ranks recover without it meanwhile.
    """
    del ref  # the rendezvous is the job's store, not a worker's name
    cmd = [
        "torchrun",
        "--nnodes=1",
        f"--nproc-per-node={job.spec.gpus_per_node}",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        f"--master-port={RENDEZVOUS_PORT}",
        "--max-restarts=0",
        "-m",
        "malleus.trainer",
        f"{CONFIG_MOUNT}/job.json",
    ]
    # A joining rank takes the running job's plan at admission: the plan file (the operator's
    # record, which may place no rank of this pod) is only for the first pods.
    cmd.append("--join" if join else f"--plan={CONFIG_MOUNT}/plan.json")
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
        # The job's rendezvous store (`store`): no rank hosts it; every rank meets there.
        {"name": STORE_ENV, "value": store_address(ref)},
        {"name": "MALLEUS_JOB", "value": f"{CONFIG_MOUNT}/job.json"},
        {"name": "MALLEUS_PLAN", "value": f"{CONFIG_MOUNT}/plan.json"},
        {"name": "MALLEUS_CONTROL_TOKEN_FILE", "value": f"{TLS_MOUNT}/{TOKEN_KEY}"},
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


def _volumes(
    job: ResolvedJob, ref: JobRef, index: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
                # This worker's own certificate and key only: no pod can answer as another.
                "items": [
                    {"key": tls.worker_cert_key(index), "path": tls.CERT_KEY},
                    {"key": tls.worker_key_key(index), "path": tls.KEY_KEY},
                    {"key": tls.CA_KEY, "path": tls.CA_KEY},
                    {"key": TOKEN_KEY, "path": TOKEN_KEY},
                ],
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


def build_pod(
    job: ResolvedJob, ref: JobRef, index: int, *, join: bool = False, restart: int = 0
) -> dict[str, Any]:
    """Worker pod of node ``index``: ``gpusPerNode`` trainer processes under torchrun.

    ``restartPolicy: Never``: a pod whose rank died is replaced by the operator, under
    ``spec.failurePolicy`` (`failures`), by a pod of the same name (its DNS name and TLS
    certificate stay valid) whose trainers ``join`` the running job; ``restart`` (the
    replacement's number, annotated `RESTART_ANNOTATION`) is 0 for the first pod.
    ``terminationGracePeriodSeconds`` is ``spec.failurePolicy.gracePeriodSeconds``: the time a
    trainer told to stop (SIGTERM) has to checkpoint and exit. Without emulation, a required
    anti-affinity keeps one worker per node (the plan's node = the pod index).
    ``spec.podTemplate`` is merged in last, the operator's fields winning (`overrides`).
    """
    volumes, mounts = _volumes(job, ref, index)
    port = job.spec.control_port
    name = pod_name(ref.name, index)
    gang_labels, gang_annotations = gang_metadata(job.spec)
    labels = {**job_labels(ref.name), NODE_LABEL: str(index), **gang_labels}
    spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": service_name(ref.name),
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": job.spec.failure_policy.grace_period_seconds,
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
                "command": torchrun_command(job, ref, index, join=join),
                # A failed trainer's last lines become the pod's termination message, which
                # the PodFailed event and status.failures quote.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "env": _env(job, ref, index),
                "ports": [
                    {
                        "name": CONTROL_PORT_NAME
                        if p == port
                        else f"{CONTROL_PORT_NAME}-{p - port}",
                        "containerPort": p,
                        "protocol": "TCP",
                    }
                    for p in control_ports(job)
                ],
                "readinessProbe": dict(READINESS_PROBE),
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
        spec["tolerations"] = [dict(GPU_TOLERATION)]
        spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {
                            "matchLabels": {
                                JOB_LABEL: ref.name,
                                "app.kubernetes.io/component": COMPONENT,
                            }
                        },
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
            # No prometheus.io/scrape: the common annotation-driven scrape job keeps the
            # series' own `pod` and `namespace` (honor_labels: true), so any scraped pod could
            # speak for these. Prometheus comes in through the job's PodMonitor (`resources`).
            annotations={
                **({RESTART_ANNOTATION: str(restart)} if restart else {}),
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
    ConfigMap, Secret, PodDisruptionBudget (unless ``disruption_budget`` is false), the
    rendezvous store's Service and Pod (`store`), then the worker pods.

    ``certificates`` (`tls.issue_for_job`) go into the Secret, which the pods mount: a job that runs
    needs them; None only for manifests that are inspected, never run.

    The policy comes first so that no pod ever runs unprotected (the store has no
    authentication: the policy is what keeps other pods from it); the workers come last
    because they mount the ConfigMap, read the Secret and dial the store.
    """
    return [
        *([dict(network_policy)] if network_policy is not None else []),
        build_service(job, ref),
        build_configmap(job, ref, plan),
        build_secret(ref, token, certificates.secret_data() if certificates else None),
        *([build_disruption_budget(job, ref)] if disruption_budget else []),
        build_store_service(ref),
        build_store_pod(job, ref),
        *(build_pod(job, ref, i) for i in range(job.spec.nodes)),
    ]
