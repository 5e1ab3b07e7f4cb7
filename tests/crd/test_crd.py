"""crds/malleusjob.yaml against the real kube-apiserver (`tests/cluster`).

Skipped unless MALLEUS_K8S_ASSETS names the binaries (see tests/cluster/controlplane.py). One
control plane per session; each test works in a namespace of its own.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from malleus.job import (
    MalleusJob,
    load_job,
    validate_manifest,
)
from tests.job.cases import EXAMPLES, BadCase, bad_cases, base_manifest, load_yaml

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi

pytestmark = pytest.mark.usefixtures("cluster_crd")

GROUP_VERSION = "malleus.io/v1alpha1"
CASES = bad_cases()
TABLE = "application/json;as=Table;g=meta.k8s.io;v=v1"
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


def collection(namespace: str) -> str:
    return f"/apis/{GROUP_VERSION}/namespaces/{namespace}/malleusjobs"


def create(server: AdminApi, namespace: str, manifest: dict[str, Any]) -> httpx.Response:
    return server.client.post(collection(namespace), json=manifest)


def created(server: AdminApi, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    response = create(server, namespace, manifest)
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def causes(response: httpx.Response) -> list[dict[str, Any]]:
    """The causes of a 422, with the object-level one (no field) as field ''."""
    assert response.status_code == 422, response.text
    found: list[dict[str, Any]] = response.json()["details"]["causes"]
    return [{**cause, "field": _field(cause)} for cause in found]


def _field(cause: dict[str, Any]) -> str:
    field = str(cause.get("field") or "")
    return "" if field == "<nil>" else field


# -- the CRD ------------------------------------------------------------------------------------


def test_crd_established(cluster_crd: dict[str, Any]) -> None:
    conditions = {c["type"]: c["status"] for c in cluster_crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema", "False") == "False"
    accepted = cluster_crd["status"]["acceptedNames"]
    assert (accepted["kind"], accepted["plural"]) == ("MalleusJob", "malleusjobs")
    assert accepted["shortNames"] == ["mj"]


def test_discovery(admin_api: AdminApi) -> None:
    resources = admin_api.client.get(f"/apis/{GROUP_VERSION}").json()["resources"]
    by_name = {r["name"]: r for r in resources}
    assert by_name["malleusjobs"]["namespaced"] is True
    assert by_name["malleusjobs"]["shortNames"] == ["mj"]
    assert "malleusjobs/status" in by_name


# -- good manifests -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_accepted_and_defaulted_alike(
    admin_api: AdminApi, job_namespace: str, path: Any
) -> None:
    """The server accepts each example and defaults it exactly as malleus.job does."""
    manifest = load_yaml(path)
    stored = created(admin_api, job_namespace, manifest)
    local, faults = validate_manifest(manifest)
    assert faults == []
    assert stored["spec"] == local["spec"]
    assert load_job(stored).spec == load_job(manifest).spec


def test_server_defaults(admin_api: AdminApi, job_namespace: str) -> None:
    manifest = base_manifest()
    for section in ("emulation", "resources"):
        del manifest["spec"][section]
    manifest["spec"]["metrics"] = {"source": "prometheus", "prometheus": {"url": "http://p:9090"}}
    spec = created(admin_api, job_namespace, manifest)["spec"]
    assert spec["stragglerPolicy"] == {
        "threshold": 1.2,
        "hysteresis": 0.3,
        "windowSteps": 5,
        "cooldownSeconds": 30,
        "minGain": 0.05,
        "horizonSteps": 100,
        "allowExclusion": True,
        "maxExclusionShare": 0.25,
        "planningTimeoutSeconds": 30,
    }
    assert spec["training"]["weightDecay"] == 0.1 and spec["training"]["seed"] == 1234
    assert spec["training"]["dataset"] == "tiny-corpus" and spec["training"]["gradClip"] == 1
    assert spec["metrics"]["prometheus"]["dcgm"] == {
        "smClockMetric": "DCGM_FI_DEV_SM_CLOCK",
        "clockEventReasonsMetric": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
    }
    assert spec["checkpoint"] == {"path": "/checkpoints", "intervalSteps": 0, "keep": 3}
    assert spec["resources"] == {"gpuMemoryMiB": 81559}
    assert spec["emulation"] == {"enabled": False, "layerForwardMs": 10, "layerBackwardMs": 20}
    assert spec["controlPort"] == 8040 and spec["model"]["tiedEmbeddings"] is False
    assert spec == validate_manifest(manifest)[0]["spec"]


def test_unknown_fields_pruned(admin_api: AdminApi, job_namespace: str) -> None:
    manifest = base_manifest()
    manifest["spec"]["gpuPerNode"] = 8
    manifest["spec"]["model"]["dropout"] = 0.1
    manifest["spec"]["emulation"]["schedule"] = [{"step": 1, "rank": 1, "factor": 2, "x": 1}]
    manifest["extra"] = {"a": 1}
    stored = created(admin_api, job_namespace, manifest)
    assert "extra" not in stored
    assert "gpuPerNode" not in stored["spec"] and "dropout" not in stored["spec"]["model"]
    assert stored["spec"]["emulation"]["schedule"] == [{"step": 1, "rank": 1, "factor": 2}]
    lenient, faults = validate_manifest(manifest, strict=False)
    assert faults == [] and lenient["spec"] == stored["spec"]
    # kubectl's default (Strict) field validation rejects them, as malleus.job does.
    manifest["metadata"]["name"] = "strict"
    response = admin_api.client.post(
        collection(job_namespace), json=manifest, params={"fieldValidation": "Strict"}
    )
    assert response.status_code in (400, 422), response.text
    assert 'unknown field "spec.gpuPerNode"' in response.json()["message"]
    strict_paths = {f.path for f in validate_manifest(manifest)[1]}
    assert {"spec.gpuPerNode", "spec.model.dropout"} <= strict_paths


# -- bad manifests ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_server_rejects(admin_api: AdminApi, job_namespace: str, case: BadCase) -> None:
    """The server rejects each bad manifest, blaming the expected fields with a clear message."""
    name = None if "metadata.name" in case.set else "bad"
    found = causes(create(admin_api, job_namespace, case.manifest(name)))
    assert {c["field"] for c in found} == case.fields, found
    assert any(case.message in c["message"] for c in found), found


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_local_validation_agrees_with_server(
    admin_api: AdminApi, job_namespace: str, case: BadCase
) -> None:
    """Both reject, blaming the same fields, and local messages say what the server's say."""
    name = None if "metadata.name" in case.set else "agree"
    manifest = case.manifest(name)
    server = causes(create(admin_api, job_namespace, manifest))
    _, local = validate_manifest(manifest)
    assert {c["field"] for c in server} == {f.path for f in local}
    for fault in local:
        if "must be of type" in fault.message:
            continue  # the server words it as 'Invalid value: "string": ... must be of type ...'
        assert any(
            _words(fault.message) <= _words(c["message"])
            for c in server
            if c["field"] == fault.path
        ), (fault, server)


def _words(text: str) -> set[str]:
    return {w.strip("\"',:()") for w in text.split() if len(w.strip("\"',:()")) > 3}


def test_several_faults_reported_together(admin_api: AdminApi, job_namespace: str) -> None:
    manifest = base_manifest()
    spec = manifest["spec"]
    spec["parallelism"]["tp"] = 3
    spec["training"]["microBatchSize"] = 3
    spec["metrics"] = {"source": "prometheus"}
    spec["emulation"]["schedule"] = [{"step": 0, "rank": 8, "factor": 2.0}]
    found = causes(create(admin_api, job_namespace, manifest))
    expected = {
        "spec.parallelism.tp",
        "spec.training.microBatchSize",
        "spec.metrics.prometheus.url",
        "spec.emulation.schedule",
    }
    assert {c["field"] for c in found} == expected
    assert {f.path for f in validate_manifest(manifest)[1]} == expected


def test_too_many_schedule_entries_block_the_rules(admin_api: AdminApi, job_namespace: str) -> None:
    """Over maxItems, the server skips the CEL rules (their cost bound); so does jobspec."""
    manifest = base_manifest()
    manifest["spec"]["emulation"]["schedule"] = [
        {"step": i, "rank": 9, "factor": 1.5} for i in range(1025)
    ]
    found = causes(create(admin_api, job_namespace, manifest))
    assert {c["field"] for c in found} == {"spec.emulation.schedule", ""}
    assert any("must have at most 1024 items" in c["message"] for c in found)
    assert {f.path for f in validate_manifest(manifest)[1]} == {"spec.emulation.schedule", ""}


# -- status subresource and printer columns -----------------------------------------------------


STATUS = {
    "phase": "Running",
    "observedGeneration": 1,
    "conditions": [
        {
            "type": "Ready",
            "status": "True",
            "observedGeneration": 1,
            "lastTransitionTime": "2026-01-02T03:04:05Z",
            "reason": "PlanApplied",
            "message": "plan 3 in force",
        }
    ],
    "plan": {
        "generation": 3,
        "summary": "2 pipelines [1,1 stages] tp 2/1, 1 GPU out, 2.50x vs static",
        "tp": 2,
        "dp": 2,
        "excluded": [1],
        "predictedSpeedup": 2.5,
        "predictedStepTime": 40.5,
    },
    "stragglers": [{"rank": 1, "node": 0, "rate": 3.0}],
    "stragglerSummary": "1 (r1 3.0x)",
    "gpus": 8,
    "step": 42,
    "tokensPerSecond": 1234.5,
    "lastReplan": {
        "time": "2026-01-02T03:04:05Z",
        "reason": "rank 1 rate 3.0",
        "planningSeconds": 0.25,
        "migrationSeconds": 1.5,
        "migrationBytes": 1048576,
        "generation": 3,
    },
    "pods": ["tiny-cpu-0", "tiny-cpu-1"],
    "message": "training",
}


def test_status_subresource(admin_api: AdminApi, job_namespace: str) -> None:
    client = admin_api.client
    job = created(admin_api, job_namespace, base_manifest())
    url = f"{collection(job_namespace)}/{job['metadata']['name']}"

    # Status through /status: stored as given, spec and generation untouched.
    patch = {"status": STATUS, "spec": {"nodes": 7}}
    response = client.patch(f"{url}/status", json=patch, headers=MERGE_PATCH)
    assert response.status_code == 200, response.text
    after = response.json()
    assert after["status"] == STATUS
    assert after["spec"] == job["spec"]
    assert after["metadata"]["generation"] == job["metadata"]["generation"]
    # The pydantic status model reads what the server stored.
    typed = MalleusJob.model_validate(after)
    assert typed.status is not None and typed.status.plan is not None
    assert typed.status.plan.generation == 3

    # Spec through the main resource: status ignored, generation bumped.
    patch = {"spec": {"stragglerPolicy": {"windowSteps": 7}}, "status": {"phase": "Failed"}}
    response = client.patch(url, json=patch, headers=MERGE_PATCH)
    assert response.status_code == 200, response.text
    later = response.json()
    assert later["spec"]["stragglerPolicy"]["windowSteps"] == 7
    assert later["status"] == STATUS
    assert later["metadata"]["generation"] == job["metadata"]["generation"] + 1

    # The status schema is enforced too.
    bad = {"status": {"phase": "Exploding", "plan": {"dp": -1, "summary": "x" * 300}}}
    response = client.patch(f"{url}/status", json=bad, headers=MERGE_PATCH)
    fields = {c["field"] for c in causes(response)}
    assert {"status.phase", "status.plan.dp", "status.plan.summary"} <= fields


def test_printer_columns(admin_api: AdminApi, job_namespace: str) -> None:
    client = admin_api.client
    job = created(admin_api, job_namespace, base_manifest())
    url = f"{collection(job_namespace)}/{job['metadata']['name']}"
    response = client.patch(f"{url}/status", json={"status": STATUS}, headers=MERGE_PATCH)
    assert response.status_code == 200, response.text

    table = client.get(collection(job_namespace), headers={"Accept": TABLE})
    assert table.status_code == 200, table.text
    body = table.json()
    assert body["kind"] == "Table"
    names = [c["name"] for c in body["columnDefinitions"]]
    assert names == [
        "Name",
        "Phase",
        "Plan",
        "Step",
        "Tokens/s",
        "Stragglers",
        "GPUs",
        "Model",
        "Layout",
        "Age",
    ]
    priority = {c["name"]: c.get("priority", 0) for c in body["columnDefinitions"]}
    assert priority["GPUs"] == priority["Model"] == priority["Layout"] == 1
    assert priority["Phase"] == 0
    [row] = body["rows"]
    cells = dict(zip(names, row["cells"], strict=True))
    assert cells["Name"] == "tiny-cpu"
    assert (cells["Phase"], cells["Plan"], cells["Step"]) == ("Running", 3, 42)
    assert cells["Tokens/s"] == 1234.5 and cells["Stragglers"] == "1 (r1 3.0x)"
    assert (cells["GPUs"], cells["Model"]) == (8, "tiny")
    assert cells["Layout"] == STATUS["plan"]["summary"]  # type: ignore[index]


def test_new_job_has_empty_columns(admin_api: AdminApi, job_namespace: str) -> None:
    """Before the operator writes status, the columns are blank, not an error."""
    manifest = copy.deepcopy(base_manifest())
    created(admin_api, job_namespace, manifest)
    table = admin_api.client.get(collection(job_namespace), headers={"Accept": TABLE})
    [row] = table.json()["rows"]
    assert row["cells"][0] == "tiny-cpu" and row["cells"][1] is None


IMMUTABLE_EDITS: list[tuple[str, dict[str, Any]]] = [
    ("image", {"image": "ghcr.io/example/other:9"}),
    ("nodes", {"nodes": 4}),
    ("gpusPerNode", {"gpusPerNode": 8}),
    ("model", {"model": {"preset": "small"}}),
    ("training", {"training": {"steps": 60}}),
    ("parallelism", {"parallelism": {"tp": 1}}),
    ("failurePolicy", {"failurePolicy": {"maxRestarts": 9}}),
    ("resources", {"resources": {"cpu": "3"}}),
    ("controlPort", {"controlPort": 9000}),
    ("emulation", {"emulation": {"layerForwardMs": 77}}),
    ("podTemplate added", {"podTemplate": {"metadata": {"labels": {"team": "x"}}}}),
    ("podGroup added", {"scheduling": {"podGroup": {"name": "gang"}}}),
]
LIVE_EDITS: list[tuple[str, dict[str, Any]]] = [
    ("suspend", {"suspend": True}),
    ("stragglerPolicy", {"stragglerPolicy": {"windowSteps": 7}}),
    ("metrics", {"metrics": {"scrapeIntervalSeconds": 30}}),
    ("scheduleTimeoutSeconds", {"scheduling": {"scheduleTimeoutSeconds": 600}}),
]


def test_what_the_pods_are_made_from_cannot_change(admin_api: AdminApi, job_namespace: str) -> None:
    """A transition rule: the API server refuses, on update, a change to any field the pods are
    made from (the operator would only say it ignored it), and lets the live ones through."""
    job = created(admin_api, job_namespace, base_manifest())
    url = f"{collection(job_namespace)}/{job['metadata']['name']}"
    refused = []
    for what, spec in IMMUTABLE_EDITS:
        response = admin_api.client.patch(url, json={"spec": spec}, headers=MERGE_PATCH)
        if response.status_code != 422 or "delete and re-create the job" not in response.text:
            refused.append((what, response.status_code, response.text[:300]))
    assert refused == [], refused
    for what, spec in LIVE_EDITS:
        response = admin_api.client.patch(url, json={"spec": spec}, headers=MERGE_PATCH)
        assert response.status_code == 200, (what, response.text)
    after = admin_api.client.get(url).json()["spec"]
    assert after["image"] == job["spec"]["image"] and after["suspend"] is True
