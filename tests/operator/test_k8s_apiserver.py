"""`k8s.Cluster` against the real API server (``tests/cluster``): every status the operator
writes passes the CRD schema, and the job's children are created, read, patched and deleted.

The pure status functions are unit-tested elsewhere; here their output goes through the real
``/status`` subresource (validation, pruning, CEL) and is read back unchanged, so a field the
CRD does not declare (which the server would silently prune) or a malformed condition fails a
test instead of vanishing in a cluster. Skips without ``MALLEUS_K8S_ASSETS``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from malleus.errors import Fault
from malleus.job import LastReplan, MalleusJobStatus, Phase, StragglerPolicy
from malleus.operator import children, jobs, lifecycle, resources, status, workers
from malleus.operator.context import Context
from malleus.operator.k8s import Cluster
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.resources import JobRef
from malleus.operator.settings import Settings
from malleus.planner.plan import Estimate
from tests.jobs import manifest

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi


@pytest.fixture
def real_k8s(admin_api: AdminApi) -> Iterator[Cluster]:
    """A `Cluster` on the test API server (as admin)."""
    cluster = Cluster.connect(str(admin_api.kubeconfig))
    yield cluster
    cluster.close()


def _round_trip(
    cluster: Cluster, namespace: str, name: str, patch: dict[str, Any]
) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        await cluster.patch_job_status(namespace, name, patch)
        job = await cluster.get_job(namespace, name)
        assert job is not None
        got: dict[str, Any] = job["status"]
        return got

    return asyncio.run(go())


def test_every_status_shape_is_accepted_and_kept(
    real_k8s: Cluster, admin_api: AdminApi, job_namespace: str, make_job: Any
) -> None:
    body = manifest(make_job(namespace=job_namespace))
    url = f"/apis/malleus.io/v1alpha1/namespaces/{job_namespace}/malleusjobs"
    assert admin_api.client.post(url, json=body).status_code == 201
    stored = asyncio.run(real_k8s.get_job(job_namespace, "demo"))
    assert stored is not None
    ref = JobRef.from_body(stored)
    plan, _ = asyncio.run(jobs.initial_plan(jobs.resolve(stored)))
    plan = plan.model_copy(update={"estimate": Estimate(step_time=40.0, uniform_step_time=90.0)})
    t = status.now()
    pods = ["demo-node-0", "demo-node-1"]
    policy = StragglerPolicy()
    running = lifecycle.pods_transition(
        {"phase": "Pending"},
        [{"metadata": {"name": n}, "status": {"phase": "Running"}} for n in pods],
        pods,
        ref.generation,
        t,
    ).status
    assert running is not None
    observed = status.stragglers({3: 2.5, 5: None}, policy, 4)
    observed.step = 5
    observed.tokens_per_second = 100.5
    observed.conditions = status.merge_conditions(
        running.conditions,
        status.straggling_condition({3: 2.5, 5: None}, policy, ref.generation, t),
    )
    last = LastReplan(
        time=t,
        reason="rank 3 slowed (1.00 -> 2.50)",
        generation=2,
        planning_seconds=0.0123,
        migration_seconds=1.5,
        migration_bytes=123456789,
    )
    typed = [
        status.created_status(plan, pods, 8, ref.generation, t),
        running,
        observed,
        MalleusJobStatus(phase=Phase.REPLANNING, message="published plan generation 2"),
        status.replan_status(plan.model_copy(update={"generation": 2}), last),
        status.invalid_spec_status(
            [Fault("spec.parallelism.tp", "heads(4) is not divisible by tp(8)")], 1, t
        ),
    ]
    for patch in map(status.dump, typed):
        got = _round_trip(real_k8s, job_namespace, "demo", patch)
        for key, value in patch.items():
            assert got.get(key) == value, f"{key}: sent {value!r}, stored {got.get(key)!r}"


def test_a_missing_job_reads_as_none_and_its_status_patch_is_ignored(
    real_k8s: Cluster, job_namespace: str
) -> None:
    async def go() -> None:
        assert await real_k8s.get_job(job_namespace, "absent") is None
        await real_k8s.patch_job_status(job_namespace, "absent", {"phase": "Running"})  # ignored

    asyncio.run(go())


def test_core_objects_through_a_cluster(admin_api: AdminApi, namespace: str, make_job: Any) -> None:
    """The children of a job, created, found, patched and deleted through a `Cluster`."""
    k8s = Cluster.connect(str(admin_api.kubeconfig))
    ns = namespace
    body = make_job(namespace=ns)
    job = jobs.resolve(body)
    # The job exists on the server, so the garbage collector keeps its children.
    body["metadata"] = {"name": "demo", "namespace": ns}
    stored = admin_api.client.post(
        f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs", json=body
    )
    assert stored.status_code == 201, stored.text
    ref = JobRef(namespace=ns, name="demo", uid=stored.json()["metadata"]["uid"], generation=1)

    async def go() -> None:
        plan, _ = await jobs.initial_plan(job)
        children = workers.build_children(job, ref, plan, "tok-1")
        for obj in children:
            if obj["kind"] == "Pod":  # no node may run them (the session's kubelets would)
                obj["spec"]["nodeSelector"] = {"malleus.io/test": "nowhere"}
            _, created = await k8s.create(obj)
            assert created
        again, created = await k8s.create(resources.build_secret(ref, "tok-2"))
        assert not created and again["metadata"]["name"] == "demo-control"
        assert await k8s.read_secret_value(ns, "demo-control", "token") == "tok-1"
        pods = await k8s.list_children("Pod", ns, "demo")
        assert [p["metadata"]["name"] for p in pods] == ["demo-node-0", "demo-node-1", "demo-store"]
        assert pods[0]["metadata"]["uid"]  # stamped by the server, not ours
        await k8s.patch("ConfigMap", ns, "demo-config", {"data": {"pending-plan.json": "{}"}})
        await k8s.patch("ConfigMap", ns, "demo-config", {"data": {"pending-plan.json": None}})
        cm = await k8s.read("ConfigMap", ns, "demo-config")
        assert cm is not None and sorted(cm["data"]) == ["job.json", "plan.json"]
        await k8s.post_event(ref, "Warning", "PodFailed", "demo-node-1: exit 1")
        assert await k8s.delete("Pod", ns, "demo-node-1")
        assert not await k8s.delete("Pod", ns, "demo-node-1")
        assert await k8s.read("Pod", ns, "demo-node-1") is None

    try:
        asyncio.run(go())
    finally:
        k8s.close()
    events = admin_api.client.get(
        f"/api/v1/namespaces/{ns}/events", params={"fieldSelector": "involvedObject.name=demo"}
    ).json()["items"]
    assert [(e["reason"], e["involvedObject"]["kind"]) for e in events] == [
        ("PodFailed", "MalleusJob")
    ]


def test_two_pod_events_at_once_make_one_transition_and_one_event(
    admin_api: AdminApi, namespace: str, make_job: Any
) -> None:
    """kopf handles the events of two pods at once: both read the job Pending and both would
    move it to Running (the real control plane showed two ``Running`` events); the status is
    written only onto the version read (`k8s.StaleRead`), so the second computes again."""
    ns = namespace
    body = make_job(namespace=ns)
    body["metadata"] = {"name": "demo", "namespace": ns}
    made = admin_api.client.post(
        f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs", json=body
    )
    assert made.status_code == 201, made.text
    uid = made.json()["metadata"]["uid"]
    owner = {"apiVersion": "malleus.io/v1alpha1", "kind": "MalleusJob", "name": "demo",
             "uid": uid, "controller": True}  # fmt: skip
    for i in range(2):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"demo-node-{i}",
                "labels": {**resources.job_labels("demo"), "app.kubernetes.io/component": "worker"},
                "ownerReferences": [owner],
            },
            "spec": {
                "nodeSelector": {"malleus.io/test": "nowhere"},  # no kubelet runs it
                "containers": [{"name": "trainer", "image": "malleus:test"}],
            },
        }
        got = admin_api.client.post(f"/api/v1/namespaces/{ns}/pods", json=pod)
        assert got.status_code == 201, got.text
        admin_api.set_pod_phase(ns, f"demo-node-{i}", "Running")
    k8s = Cluster.connect(str(admin_api.kubeconfig))
    ctx = Context(k8s, Settings(metrics_port=0), OperatorMetrics())

    async def go() -> None:
        await k8s.patch_job_status(ns, "demo", {"phase": "Pending"})
        await asyncio.gather(*(children.sync_pods(ctx, ns, "demo") for _ in range(3)))

    try:
        asyncio.run(go())
    finally:
        k8s.close()
    job = admin_api.client.get(f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs/demo")
    assert job.json()["status"]["phase"] == "Running"
    reasons = [
        e["reason"] for e in admin_api.list("events", ns, field_selector="involvedObject.name=demo")
    ]
    assert reasons.count("Running") == 1, reasons
