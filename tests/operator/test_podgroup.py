"""The coscheduler's PodGroup the operator creates for ``spec.scheduling.podGroup.create``.

`scheduling.build_pod_group` is pure; the rest runs against the real API server (the test
cluster's proxy for the core API) with PodGroup CRDs written after the upstream ones
(``data/podgroup-crds.yaml``): on.create makes the PodGroup before the pods, owned by the job,
and says so in the ``PodGroupCreated`` condition; without the CRD the job says
``CRDMissing`` (condition and one Warning event) and the timer makes the PodGroup once the CRD
is installed. Also the CRD's own checks and the chart's RBAC for it. The real-server tests skip
without ``MALLEUS_K8S_ASSETS``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kopf
import pytest
import yaml

from malleus.operator import admission, handlers, jobs, scheduling, status
from malleus.operator.context import MEMO_KEY, Context
from malleus.operator.k8s import Cluster
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.resources import JobRef
from malleus.operator.settings import Settings
from tests.chart import of_kind, operator_rules, render

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi

CRDS = {
    d["spec"]["group"]: d
    for d in yaml.safe_load_all((Path(__file__).parent / "data" / "podgroup-crds.yaml").read_text())
}
REF = JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)


def _spec(make_job: Any, **pod_group: Any) -> Any:
    body = make_job(scheduling={"podGroup": {"name": "demo-gang", **pod_group}})
    return jobs.resolve(body).spec


# ---- pure -----------------------------------------------------------------------------------


def test_no_pod_group_object_unless_create_is_set(make_job: Any) -> None:
    assert scheduling.build_pod_group(_spec(make_job), REF) is None
    no_group = jobs.resolve(make_job()).spec
    assert scheduling.build_pod_group(no_group, REF) is None


def test_scheduler_plugins_pod_group_gangs_every_worker(make_job: Any) -> None:
    pg = scheduling.build_pod_group(_spec(make_job, create="scheduler-plugins"), REF)
    assert pg is not None
    assert (pg["apiVersion"], pg["kind"]) == ("scheduling.x-k8s.io/v1alpha1", "PodGroup")
    assert pg["metadata"]["name"] == "demo-gang" and pg["metadata"]["namespace"] == "ml"
    (owner,) = pg["metadata"]["ownerReferences"]
    assert owner["uid"] == "uid-1234" and owner["controller"] is True
    assert pg["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 600}  # spec.nodes


def test_volcano_pod_group_takes_the_queue(make_job: Any) -> None:
    pg = scheduling.build_pod_group(_spec(make_job, create="volcano", queue="research"), REF)
    assert pg is not None and pg["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert pg["spec"] == {"minMember": 2, "queue": "research"}
    bare = scheduling.build_pod_group(_spec(make_job, create="volcano"), REF)
    assert bare is not None and bare["spec"] == {"minMember": 2}


def test_the_chart_grants_pod_groups_only_when_asked() -> None:
    assert not [r for r in operator_rules(render()) if "podgroups" in r[2]]
    docs = render("rbac.podGroups.schedulerPlugins=true", "rbac.podGroups.volcano=true")
    granted = {(kind, group, res): verbs for kind, group, res, verbs in operator_rules(docs)}
    for group in ("scheduling.x-k8s.io", "scheduling.volcano.sh"):
        assert granted[("Role", group, "podgroups")] == {"create", "get"}
    wide = render("rbac.clusterWide=true", "rbac.podGroups.volcano=true")
    assert {(k, g) for k, g, r, _ in operator_rules(wide) if r == "podgroups"} == {
        ("ClusterRole", "scheduling.volcano.sh")
    }
    assert of_kind(docs, "Deployment")


# ---- the real API server ----------------------------------------------------------------------


@pytest.fixture
def cluster_ctx(admin_api: AdminApi) -> Iterator[Context]:
    """A `Context` on the real API server, as admin."""
    cluster = Cluster.connect(str(admin_api.kubeconfig))
    settings = Settings(metrics_port=0)
    yield Context(cluster=cluster, settings=settings, metrics=OperatorMetrics())
    cluster.close()


def _create_job(server: AdminApi, make_job: Any, ns: str, **pod_group: Any) -> dict[str, Any]:
    body = make_job(namespace=ns, scheduling={"podGroup": {"name": "demo-gang", **pod_group}})
    body["metadata"] = {"name": "demo", "namespace": ns}
    # no node may run its pods (the session's kubelets would): they stay Pending
    body["spec"]["podTemplate"] = {"spec": {"nodeSelector": {"malleus.io/test": "nowhere"}}}
    made = server.client.post(f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs", json=body)
    assert made.status_code == 201, made.text
    stored: dict[str, Any] = made.json()
    return stored


def _on_create(ctx: Context, body: dict[str, Any]) -> dict[str, Any]:
    patch = kopf.Patch()
    memo = kopf.Memo({MEMO_KEY: ctx})
    asyncio.run(handlers.on_create(body=kopf.Body(body), patch=patch, memo=memo))
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    asyncio.run(ctx.cluster.patch_job_status(ns, name, dict(patch["status"])))  # the schema's say
    job = asyncio.run(ctx.cluster.get_job(ns, name))
    assert job is not None
    return job


def _condition(job: dict[str, Any]) -> dict[str, Any]:
    conds = {c["type"]: c for c in job["status"]["conditions"]}
    return conds[admission.POD_GROUP_CREATED]


def _events(server: AdminApi, ns: str) -> list[tuple[str, str]]:
    """The events on the job (not those the scheduler posts on its pods)."""
    got = server.client.get(
        f"/api/v1/namespaces/{ns}/events",
        params={"fieldSelector": "involvedObject.kind=MalleusJob"},
    )
    return [(e["type"], e["reason"]) for e in got.json()["items"]]


def _pods(server: AdminApi, ns: str, selector: str) -> list[dict[str, Any]]:
    got = server.client.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})
    return list(got.json()["items"])


def test_on_create_makes_the_pod_group_before_the_pods(
    admin_api: AdminApi, cluster_ctx: Context, namespace: str, make_job: Any
) -> None:
    server, ns = admin_api, namespace
    server.apply_crd(CRDS["scheduling.x-k8s.io"])
    body = _create_job(server, make_job, ns, create="scheduler-plugins")
    job = _on_create(cluster_ctx, body)

    url = f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{ns}/podgroups/demo-gang"
    pg = server.client.get(url).json()
    assert pg["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 600}  # nothing pruned
    (owner,) = pg["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("MalleusJob", body["metadata"]["uid"])
    cond = _condition(job)
    assert (cond["status"], cond["reason"]) == ("True", "Created"), cond
    assert "minMember 2" in cond["message"]
    assert job["status"]["phase"] == "Pending"
    pods = _pods(server, ns, f"{scheduling.POD_GROUP_LABEL}=demo-gang")
    assert sorted(p["metadata"]["name"] for p in pods) == ["demo-node-0", "demo-node-1"]
    assert ("Normal", "PodGroupCreated") in _events(server, ns)

    # kopf's retry, or a second replica after a takeover: the same PodGroup, no new event.
    again = asyncio.run(
        admission.ensure_pod_group(
            cluster_ctx, jobs.resolve(body).spec, JobRef.from_body(body),
            job["status"]["conditions"], status.now(),
        )
    )  # fmt: skip
    assert again is not None and _events(server, ns).count(("Normal", "PodGroupCreated")) == 1
    assert server.client.get(url).json()["metadata"]["uid"] == pg["metadata"]["uid"]


def test_without_the_crd_the_job_says_so_and_the_timer_makes_it_later(
    admin_api: AdminApi, cluster_ctx: Context, namespace: str, make_job: Any
) -> None:
    server, ns = admin_api, namespace
    crd_url = (
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/podgroups.scheduling.volcano.sh"
    )
    if server.client.get(crd_url).status_code != 404:
        pytest.skip("the Volcano PodGroup CRD is already installed in this session")
    body = _create_job(server, make_job, ns, create="volcano", queue="research")
    job = _on_create(cluster_ctx, body)
    cond = _condition(job)
    assert (cond["status"], cond["reason"]) == ("False", "CRDMissing"), cond
    assert "podgroups.scheduling.volcano.sh/v1beta1 is not served" in cond["message"]
    assert "install Volcano" in cond["message"]
    pods = _pods(server, ns, "malleus.io/job=demo")
    assert {"demo-node-0", "demo-node-1"} <= {p["metadata"]["name"] for p in pods}  # not held
    assert _events(server, ns).count(("Warning", "PodGroupFailed")) == 1

    # The timer retries while the job is Pending: one warning per reason, not one per tick.
    asyncio.run(admission.tick(cluster_ctx, job, status.now()))
    assert _events(server, ns).count(("Warning", "PodGroupFailed")) == 1
    server.apply_crd(CRDS["scheduling.volcano.sh"])
    asyncio.run(admission.tick(cluster_ctx, job, status.now()))
    job = asyncio.run(cluster_ctx.cluster.get_job(ns, "demo"))
    assert job is not None
    cond = _condition(job)
    assert (cond["status"], cond["reason"]) == ("True", "Created"), cond
    url = f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{ns}/podgroups/demo-gang"
    assert server.client.get(url).json()["spec"] == {"minMember": 2, "queue": "research"}
    assert ("Normal", "PodGroupCreated") in _events(server, ns)


@pytest.mark.parametrize(
    ("pod_group", "message"),
    [
        ({"create": "kube-batch"}, "Unsupported value"),
        ({"queue": "research"}, "queue is Volcano's"),
        ({"create": "scheduler-plugins", "queue": "research"}, "queue is Volcano's"),
    ],
)
def test_the_crd_refuses_what_the_operator_cannot_make(
    admin_api: AdminApi,
    job_namespace: str,
    make_job: Any,
    pod_group: dict[str, Any],
    message: str,
) -> None:
    body = make_job(namespace=job_namespace, scheduling={"podGroup": {"name": "g", **pod_group}})
    body["metadata"] = {"name": "demo", "namespace": job_namespace}
    url = f"/apis/malleus.io/v1alpha1/namespaces/{job_namespace}/malleusjobs"
    got = admin_api.client.post(url, json=body)
    assert got.status_code == 422 and message in got.text, got.text


def test_a_planted_pod_group_is_left_alone_and_named(
    admin_api: AdminApi, cluster_ctx: Context, namespace: str, make_job: Any
) -> None:
    """A PodGroup of the job's group name that the job does not control is neither used nor
    changed (its minMember could hold the gang back, or admit half of it)."""
    server, ns = admin_api, namespace
    server.apply_crd(CRDS["scheduling.x-k8s.io"])
    planted = {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": {"name": "demo-gang", "namespace": ns},
        "spec": {"minMember": 1},
    }
    url = f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{ns}/podgroups"
    assert server.client.post(url, json=planted).status_code == 201
    body = _create_job(server, make_job, ns, create="scheduler-plugins")
    merged = asyncio.run(
        admission.ensure_pod_group(
            cluster_ctx, jobs.resolve(body).spec, JobRef.from_body(body), [], status.now()
        )
    )
    assert merged is not None
    (cond,) = [c.model_dump(by_alias=True) for c in merged]
    assert (cond["status"], cond["reason"]) == ("False", "NameConflict"), cond
    assert "no controller owner" in cond["message"]
    assert server.client.get(f"{url}/demo-gang").json()["spec"] == {"minMember": 1}
    assert ("Warning", "PodGroupFailed") in _events(server, ns)
