"""What the failure contract adds to the CRD, on a real API server: ``spec.failurePolicy``
defaulted by the server as the local loader does, and the status fields the operator writes
across faults (``failures``, ``gpusOut``, ``lastRecovery``) stored as written, nothing pruned.

Skipped unless MALLEUS_K8S_ASSETS names the binaries (see tests/cluster/controlplane.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from malleus.job import MalleusJob, validate_manifest
from malleus.job.status import MalleusJobStatus
from malleus.operator import status as operator_status
from tests.job.cases import base_manifest

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi

pytestmark = pytest.mark.usefixtures("cluster_crd")

MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


def _url(namespace: str, name: str = "") -> str:
    base = f"/apis/malleus.io/v1alpha1/namespaces/{namespace}/malleusjobs"
    return f"{base}/{name}" if name else base


def test_failure_policy_defaults_on_the_server(admin_api: AdminApi, job_namespace: str) -> None:
    manifest = base_manifest()
    manifest["metadata"]["name"] = "faults-defaults"
    manifest["spec"].pop("failurePolicy", None)
    response = admin_api.client.post(_url(job_namespace), json=manifest)
    assert response.status_code == 201, response.text
    spec = response.json()["spec"]
    assert spec["failurePolicy"] == {
        "maxRestarts": 3,
        "restartBackoffSeconds": 10,
        "gracePeriodSeconds": 60,
        "resetAfterSeconds": 3600,
    }
    assert spec == validate_manifest(manifest)[0]["spec"]  # the loader defaults alike


def test_failure_policy_bounds_on_the_server(admin_api: AdminApi, job_namespace: str) -> None:
    manifest = base_manifest()
    manifest["metadata"]["name"] = "faults-bounds"
    manifest["spec"]["failurePolicy"] = {"maxRestarts": -1, "gracePeriodSeconds": 0}
    response = admin_api.client.post(_url(job_namespace), json=manifest)
    assert response.status_code == 422, response.text
    fields = {c.get("field") for c in response.json()["details"]["causes"]}
    assert {"spec.failurePolicy.maxRestarts", "spec.failurePolicy.gracePeriodSeconds"} <= fields


STATUS: dict[str, Any] = {
    "phase": "Running",
    "failures": [
        {
            "node": 1,
            "pod": "faults-node-1",
            "failures": 2,
            "restarts": 1,
            "state": "Waiting",
            "reason": "Error",
            "message": "container trainer exited with code 137 (Error)",
            "time": "2026-01-02T03:04:05Z",
            "podUid": "5b7c-0000",
            "replaceAt": "2026-01-02T03:04:25Z",
            "cause": "OOMKilled",
            "rule": "oom",
            "action": "RestartWorker",
            "counted": 2,
            "causes": {"Preempted": 1, "OOMKilled": 1},
            "ruleCounts": {"oom": 1},
            "replacedAt": "2026-01-02T03:00:00Z",
        }
    ],
    "gpusOut": [
        {"gpu": 2, "node": 1, "reason": "killed", "source": "trainers"},
        {"gpu": 3, "node": 1, "reason": "pod faults-node-1 Error", "source": "pod"},
    ],
    "lastRecovery": {
        "epoch": 1,
        "time": "2026-01-02T03:04:07Z",
        "failed": [2, 3],
        "step": 41,
        "stepsLost": 0,
        "seconds": 2.5,
        "bytesRestored": 1048576,
        "mode": "replicas",
        "generation": 3,
    },
}


def test_failure_status_is_stored_as_written(admin_api: AdminApi, job_namespace: str) -> None:
    client = admin_api.client
    manifest = base_manifest()
    manifest["metadata"]["name"] = "faults"
    assert client.post(_url(job_namespace), json=manifest).status_code == 201
    # what the operator's typed models dump is what the server keeps
    typed = MalleusJobStatus.model_validate(STATUS)
    dumped = operator_status.dump(typed)
    assert dumped == STATUS
    response = client.patch(
        f"{_url(job_namespace, 'faults')}/status", json={"status": dumped}, headers=MERGE_PATCH
    )
    assert response.status_code == 200, response.text
    stored = client.get(_url(job_namespace, "faults")).json()
    assert stored["status"] == STATUS
    assert MalleusJob.model_validate(stored).status == typed
    bad = {"status": {"failures": [{**STATUS["failures"][0], "state": "Gone"}]}}
    response = client.patch(
        f"{_url(job_namespace, 'faults')}/status", json=bad, headers=MERGE_PATCH
    )
    assert response.status_code == 422, response.text
