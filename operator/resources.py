"""Pure builders of the Kubernetes objects a MalleusJob owns: plain dicts, no API calls.

Keeping manifests pure (dask-kubernetes style) lets tests assert on every field without a
cluster, and keeps `k8s.py` the one place that talks to the API. A job of ``N`` nodes owns:

- a headless Service named like the job: stable DNS names ``<job>-node-<i>.<job>.<ns>.svc``
  for every worker (the operator scrapes the coordinator and posts plans to it through them);
  it publishes not-ready addresses;
- the rendezvous store ``<job>-store`` (a Pod and a Service, built in `store`): the TCPStore
  the trainers meet in, hosted by no worker;
- a ConfigMap ``<job>-config`` with ``plan.json`` (the plan in force; the operator rewrites it
  at every re-plan, so a restarted operator or trainer finds the latest) and ``job.json`` (the
  manifest the trainers read);
- a Secret ``<job>-control`` with the bearer token that guards the trainers' ``POST /plan``,
  and the job's TLS identity for their control endpoints (`tls`: CA, certificate, key);
- a NetworkPolicy ``<job>-network`` (unless the operator runs without them): only the job's
  own pods reach its pods at all (the rendezvous store and the collectives' sockets have no
  authentication), and besides them only the operator (and configured peers such as a
  Prometheus) reach the control ports;
- a PodDisruptionBudget ``<job>-workers`` with ``minAvailable``: the nodes in the job (N, less
  those ``Out`` for good: `disruption_min_available`): a node drain (a voluntary disruption)
  waits instead of evicting a worker (a lost worker is recovered from, at a cost);
- ``N`` worker Pods ``<job>-node-<i>``, one per node, each running ``torchrun`` with
  ``gpusPerNode`` processes (built in `workers`).

Every object carries a controller ownerReference to the job (the garbage collector deletes them
with it) and the labels in `job_labels`, by which the operator finds them again after a
restart. An object of a child's name that is not controlled by the job (`owned_by`) is never
used, changed or deleted: it may have been planted (a Secret with a known token, a ConfigMap
with a plan of someone else's choosing). The names, labels and owner references live in
`identity` and are re-exported here.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import Any

from malleus.job import API_VERSION, KIND, ResolvedJob, dump_job
from malleus.job.spec import GPU_RESOURCE
from malleus.planner.plan import Plan

from .identity import (
    COMPONENT,
    JOB_LABEL,
    MANAGED_BY,
    NODE_LABEL,
    JobRef,
    configmap_name,
    controller_of,
    coordinator_host,
    describe_owner,
    disruption_budget_name,
    job_labels,
    metadata,
    network_policy_name,
    owned_by,
    owner_reference,
    pod_name,
    secret_name,
    service_name,
    worker_host,
    worker_selector,
)

__all__ = [
    "COMPONENT",
    "CONFIG_MOUNT",
    "CONTROL_PORT_NAME",
    "GPU_RESOURCE",
    "GPU_TOLERATION",
    "JOB_KEY",
    "JOB_LABEL",
    "MANAGED_BY",
    "NODE_LABEL",
    "PLAN_KEY",
    "RENDEZVOUS_PORT",
    "RESTART_ANNOTATION",
    "TOKEN_KEY",
    "JobRef",
    "build_configmap",
    "build_disruption_budget",
    "build_event",
    "build_network_policy",
    "build_secret",
    "build_service",
    "configmap_name",
    "controller_of",
    "coordinator_host",
    "describe_owner",
    "disruption_budget_name",
    "disruption_min_available",
    "job_labels",
    "job_manifest",
    "metadata",
    "network_policy_name",
    "operator_peer",
    "owned_by",
    "owner_reference",
    "pod_name",
    "secret_name",
    "service_name",
    "worker_host",
    "worker_selector",
]

GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
"""The taint GPU nodes commonly carry to keep other pods off them: the job's pods tolerate it
(the store too, which may have to sit on a GPU node)."""

RENDEZVOUS_PORT = 29500
"""The port of torchrun's agent store (the ranks meet in the job's store, `store.STORE_PORT`).
``--master-addr=127.0.0.1`` names where the agent dials, yet torch's TCPStore server listens on
every address of the pod (seen: ``*:29500``): the worker's readiness probe uses that."""
RESTART_ANNOTATION = "malleus.io/restart"
"""On a replacement worker pod: which replacement of its node it is (1, 2, ...)."""
CONTROL_PORT_NAME = "control"
CONFIG_MOUNT = "/etc/malleus"
"""Where the ConfigMap (plan.json, job.json) is mounted in every worker."""
TOKEN_KEY = "token"
PLAN_KEY = "plan.json"
"""ConfigMap key of the plan in force."""
JOB_KEY = "job.json"
"""ConfigMap key of the manifest the trainers run."""


# ---- Service, ConfigMap, Secret -------------------------------------------------------------


def build_service(job: ResolvedJob, ref: JobRef) -> dict[str, Any]:
    """Headless Service giving every worker a stable DNS name (hostname.subdomain)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ref, service_name(ref.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # names resolve before readiness
            "selector": worker_selector(ref.name),
            "ports": [
                {"name": CONTROL_PORT_NAME, "port": job.spec.control_port, "protocol": "TCP"},
            ],
        },
    }


def job_manifest(job: ResolvedJob, ref: JobRef) -> dict[str, Any]:
    """The manifest the trainers read (``job.json``): apiVersion, kind, name, namespace, spec."""
    data = dump_job(job.job)
    return {
        "apiVersion": data["apiVersion"],
        "kind": data["kind"],
        "metadata": {"name": ref.name, "namespace": ref.namespace},
        "spec": data["spec"],
    }


def build_configmap(job: ResolvedJob, ref: JobRef, plan: Plan) -> dict[str, Any]:
    """ConfigMap with the plan in force and the job manifest, mounted in every worker."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ref, configmap_name(ref.name)),
        "data": {
            PLAN_KEY: plan.to_json(),
            JOB_KEY: json.dumps(job_manifest(job, ref), indent=2, sort_keys=True),
        },
    }


def build_secret(ref: JobRef, token: str, files: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Secret with the control token and `files` (the job's TLS identity, `tls.JobCertificates`);
    the caller makes both: builders stay deterministic."""
    entries = {TOKEN_KEY: token, **(files or {})}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(ref, secret_name(ref.name)),
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in entries.items()},
    }


def disruption_min_available(nodes: int, out: Sequence[int] = ()) -> int:
    """Every node still in the job: one ``Out`` has no pod for good (counted, no drain ends)."""
    return max(0, nodes - len(set(out)))


def build_disruption_budget(job: ResolvedJob, ref: JobRef) -> dict[str, Any]:
    """A PodDisruptionBudget asking that all ``nodes`` workers stay: an eviction (``kubectl
    drain``, a cluster autoscaler) waits rather than costing the job a recovery. Involuntary
    failures are recovered from (`failures`); a node that goes ``Out`` lowers it
    (`children.follow_out`)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ref, disruption_budget_name(ref.name)),
        "spec": {
            "minAvailable": disruption_min_available(job.spec.nodes),
            "selector": {
                "matchLabels": {
                    **worker_selector(ref.name),
                    "app.kubernetes.io/managed-by": MANAGED_BY,
                }
            },
        },
    }


# ---- NetworkPolicy --------------------------------------------------------------------------


def operator_peer(namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """The NetworkPolicyPeer of the operator's pod (its namespace by the name label every
    namespace carries since Kubernetes 1.22, and its pod labels)."""
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": dict(labels)},
    }


def build_network_policy(
    job: ResolvedJob, ref: JobRef, control_peers: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Ingress to the job's pods: from each other on every port, from ``control_peers`` (the
    operator, a Prometheus) on the control ports only (``spec.controlPort`` and one more per
    local rank, `workers.control_ports`), from nothing else.

    The job's pods need every port among themselves: the rendezvous store (a TCPStore in the
    ``<job>-store`` pod, `store`, no authentication: whoever reaches it reads and writes the
    job's keys, so it joins or wedges the rendezvous) and the
    collectives' connections (gloo, NCCL sockets on ephemeral ports). The policy is their only
    protection, and its unit of trust is the namespace: a pod labelled as one of the job's is
    admitted, so whoever may create pods in the namespace may join. Egress is left open
    (checkpoint storage, DNS, image registries are the cluster's business).
    """
    own_pods = {"podSelector": {"matchLabels": {JOB_LABEL: ref.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own_pods]}]
    if control_peers:
        ingress.append(
            {
                "from": [dict(p) for p in control_peers],
                "ports": [_control_port_range(job)],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(ref, network_policy_name(ref.name)),
        "spec": {
            "podSelector": {
                "matchLabels": {JOB_LABEL: ref.name, "app.kubernetes.io/managed-by": MANAGED_BY}
            },
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _control_port_range(job: ResolvedJob) -> dict[str, Any]:
    """The NetworkPolicyPort of the ranks' control ports (``endPort`` past one GPU a node)."""
    first, g = job.spec.control_port, job.spec.gpus_per_node
    port: dict[str, Any] = {"port": first, "protocol": "TCP"}
    if g > 1:
        port["endPort"] = first + g - 1
    return port


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
