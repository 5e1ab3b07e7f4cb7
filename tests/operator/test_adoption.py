"""Never adopt what the job does not own: a planted Secret or ConfigMap is neither used nor
touched, the job says why, and it starts once the impostor is gone.

Against kmock (`tests.operator.kube`) for the handlers, and against the real API server
(`tests/cluster`) for `k8s.Cluster.create` and the condition's shape.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import kopf
import pytest

from malleus.operator import creation, handlers, resources
from malleus.operator.context import Context
from malleus.operator.k8s import Cluster, NameConflict
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.settings import Settings
from tests.jobs import manifest
from tests.operator.kube import Kube

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi

KNOWN_TOKEN = base64.b64encode(b"the attacker knows this").decode()


def _planted_secret(namespace: str = "ml") -> dict[str, Any]:
    """``<job>-control`` with a known token and the job's labels copied, but no owner."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": "demo-control",
            "namespace": namespace,
            "labels": resources.job_labels("demo"),
        },
        "data": {"token": KNOWN_TOKEN},
    }


def _planted_configmap(owner_uid: str) -> dict[str, Any]:
    """``<job>-config`` with a plan of someone else's choosing, controlled by another job."""
    other = resources.JobRef(namespace="ml", name="intruder", uid=owner_uid)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "demo-config",
            "namespace": "ml",
            "labels": resources.job_labels("demo"),
            "ownerReferences": [resources.owner_reference(other)],
        },
        "data": {"plan.json": '{"generation": 99}', "job.json": "{}"},
    }


def _create(memo: kopf.Memo, body: dict[str, Any]) -> tuple[kopf.Patch, str]:
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError) as raised:
        asyncio.run(handlers.on_create(body=body, patch=patch, memo=memo))
    assert raised.value.delay == creation.NAME_CONFLICT_RETRY_SECONDS
    return patch, str(raised.value)


@pytest.mark.parametrize(
    ("kind", "name", "planted", "owner"),
    [
        ("Secret", "demo-control", _planted_secret(), "no controller owner"),
        (
            "ConfigMap",
            "demo-config",
            _planted_configmap("uid-intruder"),
            "controlled by MalleusJob intruder (uid uid-intruder)",
        ),
    ],
)
def test_a_planted_child_is_neither_used_nor_touched(
    kube: Kube,
    memo: kopf.Memo,
    make_job: Any,
    kind: str,
    name: str,
    planted: dict[str, Any],
    owner: str,
) -> None:
    kube.put(kind, planted)
    before = kube.get(kind, "ml", name)
    body = make_job()
    kube.add_job(body)
    patch, error = _create(memo, body)
    assert f"{kind}/{name}" in error and owner in error
    st = patch["status"]
    assert "phase" not in st  # not started: no daemon, no pod watching
    (cond,) = st["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "False", "NameConflict")
    assert f"{kind}/{name}" in cond["message"] and owner in cond["message"]
    assert kube.events[-1]["reason"] == "NameConflict" and kube.events[-1]["type"] == "Warning"
    assert kube.of_kind("Pod") == []  # nothing runs on the impostor's token or plan
    assert kube.get(kind, "ml", name) == before  # not modified

    # the job's own deletion spares the impostor, and deletes what the job did create
    asyncio.run(handlers.on_delete(body=body, memo=memo))
    assert kube.get(kind, "ml", name) == before
    assert kube.names() == [(kind, name)]


def test_the_job_starts_once_the_impostor_is_gone(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    kube.put("Secret", _planted_secret())
    body = make_job()
    kube.add_job(body)
    _create(memo, body)
    kube.remove("Secret", "ml", "demo-control")
    patch = kopf.Patch()
    asyncio.run(handlers.on_create(body=body, patch=patch, memo=memo))  # kopf's retry
    assert patch["status"]["phase"] == "Pending"
    secret = kube.get("Secret", "ml", "demo-control")
    assert secret is not None and secret["data"]["token"] != KNOWN_TOKEN
    assert resources.owned_by(secret, "uid-1234")
    assert len(kube.of_kind("Pod")) == 3  # two workers and the store


def test_a_reference_to_the_job_that_is_not_its_controller_is_not_ownership(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    """Copying the job's uid into a non-controller ownerReference does not make it the job's."""
    cm = _planted_configmap("uid-1234")
    cm["metadata"]["ownerReferences"][0]["controller"] = False
    kube.put("ConfigMap", cm)
    body = make_job()
    kube.add_job(body)
    _, error = _create(memo, body)
    assert "ConfigMap/demo-config" in error and "no controller owner" in error


def test_a_pod_labelled_as_a_worker_does_not_count_as_one(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """The pod watcher goes by owner too: a stranger's pod with the job's labels and a
    worker's name cannot make the job Running (nor fail it)."""
    stranger = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-node-1",
            "namespace": "ml",
            "labels": resources.job_labels("demo"),
        },
        "status": {"phase": "Running"},
    }
    kube.put("Pod", stranger)
    body = make_job()
    kube.add_job(body)
    patch, error = _create(memo, body)
    assert "Pod/demo-node-1" in error
    kube.merge_status("ml", "demo", {**patch["status"], "phase": "Pending"})
    kube.set_pod_phase("ml", "demo-node-0", "Running")
    transition = asyncio.run(handlers.sync_pods(ctx, "ml", "demo"))
    assert transition.status is None or transition.status.phase is None
    assert kube.job("ml", "demo")["status"]["phase"] == "Pending"


# ---- the real API server --------------------------------------------------------------------


def test_a_planted_secret_is_refused_by_the_real_cluster_path(
    admin_api: AdminApi, job_namespace: str, make_job: Any
) -> None:
    """On the real API server: the handler refuses the planted Secret, the NameConflict status
    passes the CRD's status schema, the Secret keeps its known token, and nothing else is
    created after it."""
    ns = job_namespace
    http = admin_api.client
    planted = http.post(f"/api/v1/namespaces/{ns}/secrets", json=_planted_secret(ns))
    assert planted.status_code == 201, planted.text
    body = manifest(make_job(namespace=ns))
    url = f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs"
    assert http.post(url, json=body).status_code == 201
    cluster = Cluster.connect(str(admin_api.kubeconfig))
    ctx = Context(cluster, Settings(metrics_port=0), OperatorMetrics())
    memo = kopf.Memo({"malleus": ctx})

    async def go() -> dict[str, Any]:
        stored = await cluster.get_job(ns, "demo")
        assert stored is not None
        ref = resources.JobRef.from_body(stored)
        with pytest.raises(NameConflict):
            await cluster.create(resources.build_secret(ref, "another"))
        patch = kopf.Patch()
        with pytest.raises(kopf.TemporaryError, match="Secret/demo-control"):
            await handlers.on_create(body=stored, patch=patch, memo=memo)
        await cluster.patch_job_status(ns, "demo", patch["status"])
        job = await cluster.get_job(ns, "demo")
        assert job is not None
        status: dict[str, Any] = job["status"]
        return status

    try:
        st = asyncio.run(go())
    finally:
        cluster.close()
    (cond,) = st["conditions"]
    assert (cond["reason"], cond["status"]) == ("NameConflict", "False")
    assert "Secret/demo-control" in cond["message"] and "no controller owner" in cond["message"]

    def listed(plural: str) -> list[dict[str, Any]]:
        got = http.get(f"/api/v1/namespaces/{ns}/{plural}")
        assert got.status_code == 200, got.text
        return list(got.json()["items"])

    (secret,) = [s for s in listed("secrets") if s["metadata"]["name"] == "demo-control"]
    assert secret["data"]["token"] == KNOWN_TOKEN
    assert listed("pods") == []
    names = [c["metadata"]["name"] for c in listed("configmaps")]
    assert [n for n in names if n != "kube-root-ca.crt"] == ["demo-config"]  # + the cluster's


def test_a_resumed_pending_job_does_not_adopt_a_replaced_secret(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    """After an operator restart, re-creating what a Pending job lacks refuses a Secret that
    was swapped for a planted one while the operator was away."""
    body = make_job()
    kube.add_job(body)
    patch = kopf.Patch()
    asyncio.run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    kube.remove("Secret", "ml", "demo-control")
    kube.put("Secret", _planted_secret())
    resumed = kopf.Patch()
    with pytest.raises(kopf.TemporaryError, match="Secret/demo-control"):
        asyncio.run(handlers.on_resume(body=kube.job("ml", "demo"), patch=resumed, memo=memo))
    ready = [c for c in resumed["status"]["conditions"] if c["type"] == "Ready"]
    assert [c["reason"] for c in ready] == ["NameConflict"]
    secret = kube.get("Secret", "ml", "demo-control")
    assert secret is not None and secret["data"]["token"] == KNOWN_TOKEN
