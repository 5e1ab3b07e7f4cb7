"""The pod template policy at the API server: the attacks a MalleusJob's author could try through
``spec.podTemplate``, each refused by ``kubectl apply`` with the chart's
ValidatingAdmissionPolicy in place, and a compliant job accepted.

`check_admission_policy` is a test body for a real control plane (the shared ``tests/cluster/``
harness, or ``scripts/check-pod-policy-vap.sh``): the CRD and the chart's
``templates/admission-policy.yaml`` (default values, release ``malleus`` in namespace
``malleus-system``, so the operator's ServiceAccount is `OPERATOR_SA`) must be applied, and
``namespace`` must be one the binding matches (the release namespace or a ``watchNamespaces``
entry). The same manifests are judged by `malleus.job.podpolicy.policy_faults` in
``tests/security/test_pod_policy.py``, so the two judges are checked against one list.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.jobs import job_body, manifest

__all__ = [
    "ATTACKS",
    "OPERATOR_SA",
    "Attack",
    "check_admission_policy",
    "compliant_job",
    "job_manifest",
]

OPERATOR_SA = "malleus-malleus-operator"
"""The operator's ServiceAccount under ``helm template malleus`` with the default values."""


def job_manifest(name: str, namespace: str, pod_template: dict[str, Any]) -> dict[str, Any]:
    """A MalleusJob the CRD accepts (`tests.jobs.job_body` with emulated GPUs) with
    ``pod_template`` as its ``spec.podTemplate``."""
    return manifest(
        job_body(name, namespace, emulation={"enabled": True}, podTemplate=pod_template)
    )


def _trainer(*env: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "trainer", "env": list(env)}]}}


COMPLIANT_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "pretraining"}},
    "spec": {
        "serviceAccountName": "default",
        "volumes": [
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}},
            {"name": "settings", "configMap": {"name": "settings"}},
            {"name": "meta", "projected": {"sources": [{"configMap": {"name": "settings"}}]}},
        ],
        "containers": [
            {
                "name": "trainer",
                "env": [
                    {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
                    {"name": "NCCL_DEBUG", "value": "WARN"},
                    {"name": "HF_HOME", "value": "/data/hf"},
                    {"name": "OWN_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                ],
                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
            }
        ],
        "initContainers": [
            {
                "name": "fabric-check",
                "image": "ghcr.io/example/fabric-check:1.0",
                "command": ["fabric-check", "--quick"],
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
            },
            {
                "name": "log-shipper",
                "image": "ghcr.io/example/log-shipper:1.0",
                "restartPolicy": "Always",
                "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
            },
        ],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"team": "pretraining"}},
            }
        ],
        "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
    },
}
"""Everything the default policy allows: a sized /dev/shm, a claim, a ConfigMap (also
projected), NCCL's interface and log level, a field reference, the ``default`` account, an
init container and a native sidecar, a topology spread and DNS options."""


@dataclass(frozen=True)
class Attack:
    """One violating pod template and the field path both judges must name."""

    id: str
    template: dict[str, Any]
    field: str


ATTACKS = (
    Attack(
        "hostpath-volume",
        {
            "spec": {
                "volumes": [
                    {"name": "ok", "emptyDir": {}},
                    {"name": "root", "hostPath": {"path": "/"}},
                ]
            }
        },
        "spec.podTemplate.spec.volumes[1].hostPath",
    ),
    Attack(
        "secret-volume",
        {"spec": {"volumes": [{"name": "loot", "secret": {"secretName": "db-password"}}]}},
        "spec.podTemplate.spec.volumes[0].secret",
    ),
    Attack(
        "projected-token",
        {
            "spec": {
                "volumes": [
                    {
                        "name": "token",
                        "projected": {
                            "sources": [
                                {"configMap": {"name": "settings"}},
                                {"serviceAccountToken": {"path": "token"}},
                            ]
                        },
                    }
                ]
            }
        },
        "spec.podTemplate.spec.volumes[0].projected.sources[1].serviceAccountToken",
    ),
    Attack(
        "operator-service-account",
        {"spec": {"serviceAccountName": OPERATOR_SA}},
        "spec.podTemplate.spec.serviceAccountName",
    ),
    Attack(
        "other-service-account",
        {"spec": {"serviceAccountName": "ci-deployer"}},
        "spec.podTemplate.spec.serviceAccountName",
    ),
    Attack(
        "ld-preload",
        _trainer(
            {"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "LD_PRELOAD", "value": "/data/x.so"}
        ),
        "spec.podTemplate.spec.containers[0].env[1].name",
    ),
    Attack(
        "pythonpath",
        _trainer({"name": "PYTHONPATH", "value": "/data/evil"}),
        "spec.podTemplate.spec.containers[0].env[0].name",
    ),
    Attack(
        "nccl-net-plugin",
        _trainer({"name": "NCCL_NET_PLUGIN", "value": "/data/libnccl-net.so"}),
        "spec.podTemplate.spec.containers[0].env[0].name",
    ),
    Attack(
        "secret-env",
        _trainer(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
        ),
        "spec.podTemplate.spec.containers[0].env[0].valueFrom.secretKeyRef",
    ),
    Attack(
        "trainer-ipc-lock",
        {
            "spec": {
                "containers": [
                    {"name": "trainer", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}
                ]
            }
        },
        "spec.podTemplate.spec.containers[0].securityContext.capabilities.add[0]",
    ),
    Attack(
        "init-capability",
        {
            "spec": {
                "initContainers": [
                    {"name": "fine", "image": "busybox:1.36"},
                    {
                        "name": "net",
                        "image": "busybox:1.36",
                        "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
                    },
                ]
            }
        },
        "spec.podTemplate.spec.initContainers[1].securityContext.capabilities.add[0]",
    ),
    Attack(
        "init-secret-env",
        {
            "spec": {
                "initContainers": [
                    {
                        "name": "fetch",
                        "image": "busybox:1.36",
                        "env": [
                            {
                                "name": "DB_PASSWORD",
                                "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}},
                            }
                        ],
                    }
                ]
            }
        },
        "spec.podTemplate.spec.initContainers[0].env[0].valueFrom.secretKeyRef",
    ),
    Attack(
        "sidecar-ld-preload",
        {
            "spec": {
                "initContainers": [
                    {
                        "name": "agent",
                        "image": "busybox:1.36",
                        "restartPolicy": "Always",
                        "env": [{"name": "LD_PRELOAD", "value": "/data/x.so"}],
                    }
                ]
            }
        },
        "spec.podTemplate.spec.initContainers[0].env[0].name",
    ),
)
"""Each violates the default policy in exactly one field."""


def compliant_job(name: str, namespace: str) -> dict[str, Any]:
    """A job using everything the default policy allows."""
    return job_manifest(name, namespace, COMPLIANT_TEMPLATE)


def check_admission_policy(
    kubectl: Callable[..., subprocess.CompletedProcess[str]], namespace: str
) -> dict[str, str]:
    """``kubectl apply`` every attack (refused, naming its field and the chart value that would
    allow it), then the compliant job (accepted), then an edit of the compliant job that adds a
    hostPath (refused: the template cannot change once the job exists); returns what kubectl printed, by case.

    ``kubectl(*args, input=TEXT)`` runs kubectl against the cluster and returns the completed
    process (text mode, not checked).
    """
    seen: dict[str, str] = {}
    for attack in ATTACKS:
        manifest = job_manifest(f"attack-{attack.id}", namespace, attack.template)
        done = kubectl("apply", "-f", "-", input=json.dumps(manifest))
        seen[attack.id] = done.stderr.strip()
        assert done.returncode != 0, f"{attack.id}: admitted: {done.stdout}"
        assert "ValidatingAdmissionPolicy" in done.stderr, (attack.id, done.stderr)
        assert attack.field in done.stderr, (attack.id, done.stderr)
        if attack.id == "operator-service-account":
            assert "operator's own ServiceAccount" in done.stderr, done.stderr
        else:
            assert "podTemplatePolicy." in done.stderr, (attack.id, done.stderr)
        absent = kubectl("get", "malleusjob", f"attack-{attack.id}", "-n", namespace)
        assert absent.returncode != 0 and "NotFound" in absent.stderr, absent
    job = compliant_job("compliant", namespace)
    done = kubectl("apply", "-f", "-", input=json.dumps(job))
    seen["compliant"] = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, done.stderr
    assert "malleusjob.malleus.io/compliant created" in done.stdout, done.stdout
    edited = copy.deepcopy(job)
    edited["spec"]["podTemplate"]["spec"]["volumes"].append(
        {"name": "root", "hostPath": {"path": "/"}}
    )
    done = kubectl("apply", "-f", "-", input=json.dumps(edited))
    seen["compliant-edited-to-hostpath"] = done.stderr.strip()
    assert done.returncode != 0, done.stdout
    # Refused before the admission policy sees it: the CRD's transition rule keeps the pod
    # template as the job was created (what its pods are made from cannot change).
    assert "delete and re-create the job" in done.stderr, done.stderr
    # An update that keeps the template (what kopf's finalizer patch is) still goes through.
    done = kubectl("label", "malleusjob", "compliant", "-n", namespace, "team=other", "--overwrite")
    seen["compliant-relabelled"] = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, done.stderr
    return seen
