"""The operator on the real control plane: ``python -m malleus.operator`` with the Helm chart's
ServiceAccount token (so the chart's RBAC is what it may do), a MalleusJob applied by a tenant,
the real scheduler placing its pods on process-kubelet nodes, whose trainers train; deleting the
job lets the real garbage collector remove its children."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.controlplane import RESTRICTED, ControlPlane, ControlPlaneError, wait_until
from tests.cluster.fixtures import SHARED_NODES
from tests.cluster.kubelet import ProcessKubelet
from tests.cluster.operating import Operator, token_kubeconfig

pytestmark = pytest.mark.timeout(300)

NS = "malleus-system"
JOB = "tiny"
JOBS = f"/apis/malleus.io/v1alpha1/namespaces/{NS}/malleusjobs"


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane,
    chart_rbac: list[dict[str, Any]],
    nodes: list[ProcessKubelet],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Operator]:
    folder = tmp_path_factory.mktemp("operator")
    kubeconfig = token_kubeconfig(control_plane, folder / "kubeconfig", NS)
    op = Operator(kubeconfig, NS, folder / "operator.log")
    try:
        yield op
    finally:
        op.stop()


def _job() -> dict[str, Any]:
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": JOB, "namespace": NS},
        "spec": {
            "image": "malleus:test",
            "nodes": 1,
            "gpusPerNode": 2,
            "model": {"preset": "tiny", "layers": 4},
            "training": {
                "globalBatchSize": 4,
                "microBatchSize": 1,
                "steps": 400,  # more than the test needs: still training when it is deleted
                "learningRate": 0.003,
            },
            "parallelism": {"tp": 2},
            "metrics": {"scrapeIntervalSeconds": 1},
            "emulation": {"enabled": True, "layerForwardMs": 10, "layerBackwardMs": 20},
        },
    }


def test_a_job_applied_by_a_tenant_trains_on_process_kubelet_nodes_and_is_collected(
    control_plane: ControlPlane, operator: Operator, nodes: list[ProcessKubelet]
) -> None:
    http = control_plane.http()

    def story(headline: str) -> str:
        job = http.get(f"{JOBS}/{JOB}").json()
        pods = http.get(f"/api/v1/namespaces/{NS}/pods").json()["items"]
        phases = {p["metadata"]["name"]: p["status"].get("phase") for p in pods}
        status = json.dumps(job.get("status") or {}, sort_keys=True)[:3000]
        kubelets = "\n".join(k.logs(15) for k in nodes)
        return (
            f"{headline}\n--- job status\n{status}\n--- pods {phases}\n"
            f"--- operator\n{operator.tail()}\n--- kubelets\n{kubelets}"
        )

    def alive() -> str | None:
        return operator.dead() or nodes[0].check() or nodes[1].check()

    def wait(probe: Any, timeout: float, what: str) -> Any:
        try:
            return wait_until(probe, timeout, what, interval=0.3, alive=alive)
        except ControlPlaneError as e:
            pytest.fail(story(str(e)), pytrace=False)

    # a tenant bound to the chart's malleus-edit role applies the job
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "carol-edit", "namespace": NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "malleus-edit"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "carol"}],
    }  # fmt: skip
    control_plane.apply([binding])
    # the job's pods must pass the restricted Pod Security Standard, enforced for real
    restricted = {"metadata": {"labels": RESTRICTED}}
    labelled = http.patch(
        f"/api/v1/namespaces/{NS}",
        json=restricted,
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert labelled.is_success, labelled.text
    created = control_plane.http(control_plane.identity("carol")).post(JOBS, json=_job())
    assert created.status_code == 201, created.text

    def training() -> dict[str, Any] | None:
        st = http.get(f"{JOBS}/{JOB}").json().get("status") or {}
        ok = st.get("phase") == "Running" and st.get("step", 0) >= 3 and st.get("tokensPerSecond")
        return st if ok else None

    status = wait(training, 240, "job Running with steps and tokens/s")
    assert status["plan"]["generation"] >= 1
    pods = http.get(
        f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": f"malleus.io/job={JOB}"}
    ).json()["items"]
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]  # the worker and the store
    for pod in pods:
        assert pod["spec"]["nodeName"] in SHARED_NODES  # placed by the real scheduler
        assert pod["status"]["phase"] == "Running"
        assert pod["status"]["podIP"].startswith("127.")
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "MalleusJob" and owner["name"] == JOB
    workers = [
        k.pod(NS, p["metadata"]["name"])
        for p in pods
        for k in nodes
        if k.name == p["spec"]["nodeName"]
    ]
    pids = [pid for run in workers if run is not None for pid in run.pids()]
    assert pids, story("no processes")

    # the operator's events, through the real events API
    events = http.get(
        f"/api/v1/namespaces/{NS}/events", params={"fieldSelector": f"involvedObject.name={JOB}"}
    ).json()["items"]
    created = [e["message"] for e in events if e["reason"] == "Created"]
    assert created and "plan generation 1:" in created[0], [e["reason"] for e in events]

    # the job's PodDisruptionBudget, judged by the real disruption controller: a drain's
    # eviction of the worker is refused
    budget = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{JOB}-workers"

    def judged() -> dict[str, Any] | None:
        st = http.get(budget).json().get("status") or {}
        return st if st.get("currentHealthy") == 1 and st.get("expectedPods") == 1 else None

    pdb = wait(judged, 30, "the disruption controller judged the budget")
    assert pdb["disruptionsAllowed"] == 0, pdb
    worker = next(p["metadata"]["name"] for p in pods if "-node-" in p["metadata"]["name"])
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": worker, "namespace": NS},
    }
    refused = http.post(f"/api/v1/namespaces/{NS}/pods/{worker}/eviction", json=eviction)
    assert refused.status_code == 429, refused.text
    assert "disruption budget" in refused.json()["message"], refused.text

    # deleting the job: the garbage collector removes its pods, the kubelets their processes
    assert http.delete(f"{JOBS}/{JOB}").is_success
    wait(
        lambda: (
            True
            if not http.get(
                f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": f"malleus.io/job={JOB}"}
            ).json()["items"]
            else None
        ),
        60,
        "the job's pods collected",
    )
    assert all(run is None or not run.pids() for run in workers)
