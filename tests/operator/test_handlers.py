"""kopf handlers called directly with ``patch=kopf.Patch()`` against the in-memory `k8s`."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from malleus.operator import handlers, metrics, resources
from malleus.planner.plan import Plan


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def create(cluster: Any, body: dict[str, Any]) -> tuple[kopf.Patch, list[str]]:
    """Run on_create as kopf would; returns the patch and the names of the objects created."""
    cluster.add_job(body)
    before = set(cluster.objects)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch))
    result = sorted(f"{k}/{n}" for (k, _, n) in set(cluster.objects) - before)
    # what kopf would do with the patch: merge it into the stored job
    cluster.job("ml", body["metadata"]["name"]).setdefault("status", {}).update(
        patch.get("status", {})
    )
    return patch, result


def test_create_makes_service_configmap_secret_and_pods(cluster: Any, make_job: Any) -> None:
    training = {"globalBatchSize": 24, "microBatchSize": 2, "steps": 10, "learningRate": 0.001}
    patch, result = create(cluster, make_job(nodes=3, training=training))
    assert [o["metadata"]["name"] for o in cluster.of_kind("Pod")] == [
        "demo-node-0",
        "demo-node-1",
        "demo-node-2",
    ]
    assert len(cluster.of_kind("Service")) == 1
    assert len(cluster.of_kind("ConfigMap")) == 1
    assert len(cluster.of_kind("Secret")) == 1
    for obj in cluster.objects.values():
        if obj["kind"] != "MalleusJob":
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    st = patch["status"]
    assert st["phase"] == "Pending"
    assert st["plan"]["generation"] == 1
    assert st["pods"] == ["demo-node-0", "demo-node-1", "demo-node-2"]
    assert st["gpus"] == 12
    assert st["conditions"][0]["reason"] == "PodsPending"
    assert cluster.reasons() == ["Created"]
    assert len(result) == 6
    # the ConfigMap holds the same plan the status shows
    cm = cluster.of_kind("ConfigMap")[0]
    assert Plan.from_json(cm["data"]["plan.json"]).generation == st["plan"]["generation"]
    assert metrics.PHASES.counts()["Pending"] == 1


def test_create_is_idempotent_and_keeps_the_token(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    token = cluster.of_kind("Secret")[0]["data"]["token"]
    creates = sum(1 for c in cluster.calls if c[0] == "create")
    _, result = create(cluster, make_job())  # a retried handler, or a restart
    assert result == []
    assert cluster.of_kind("Secret")[0]["data"]["token"] == token
    assert len(cluster.of_kind("Pod")) == 2
    assert sum(1 for c in cluster.calls if c[0] == "create") == 2 * creates  # attempted, no-op


def test_a_retried_create_shows_the_plan_the_pods_got(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    cm = cluster.objects[("ConfigMap", "ml", "demo-config")]
    cm["data"]["plan.json"] = cm["data"]["plan.json"].replace('"generation": 1', '"generation": 5')
    patch, _ = create(cluster, make_job())
    assert patch["status"]["plan"]["generation"] == 5


def test_each_job_gets_its_own_random_token(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job(name="a", uid="u-a"))
    create(cluster, make_job(name="b", uid="u-b"))
    a, b = (s["data"]["token"] for s in cluster.of_kind("Secret"))
    assert a != b and len(a) >= 40


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"parallelism": {"tp": 2, "dp": 1, "pp": 2}}, "does not match the GPU count"),
        (
            {
                "nodes": 1,
                "gpusPerNode": 1,
                "model": {"preset": "llama-70b"},
                "parallelism": {"tp": 1},
            },
            "fits",
        ),
        ({"parallelism": {"tp": 8}}, "spec.parallelism.tp"),
    ],
)
def test_invalid_spec_fails_and_creates_nothing(
    cluster: Any, make_job: Any, spec: dict[str, Any], needle: str
) -> None:
    body = make_job(generation=3, **spec)
    cluster.add_job(body)
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="invalid spec"):
        run(handlers.on_create(body=body, patch=patch))
    st = patch["status"]
    assert st["phase"] == "Failed"
    assert st["observedGeneration"] == 3
    (cond,) = st["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "False", "InvalidSpec")
    assert cond["observedGeneration"] == 3
    assert needle in cond["message"]
    assert [o for o in cluster.objects.values() if o["kind"] != "MalleusJob"] == []
    assert cluster.reasons() == ["InvalidSpec"]
    assert cluster.events[0]["type"] == "Warning"


# ---- pods -----------------------------------------------------------------------------------


def pod_event(cluster: Any, name: str, type_: str = "MODIFIED") -> None:
    body = cluster.objects.get(("Pod", "ml", name)) or {"metadata": {"name": name}}
    labels = body.get("metadata", {}).get("labels") or {resources.JOB_LABEL: "demo"}
    run(
        handlers.on_pod_event(
            event={"type": type_, "object": body}, body=body, namespace="ml", labels=labels
        )
    )


def test_running_pods_make_the_job_running(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    cluster.set_pod_phase("ml", "demo-node-0", "Running")
    pod_event(cluster, "demo-node-0")
    assert cluster.job("ml", "demo")["status"]["phase"] == "Pending"
    cluster.set_pod_phase("ml", "demo-node-1", "Running")
    pod_event(cluster, "demo-node-1")
    st = cluster.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert cluster.reasons() == ["Created", "Running"]
    assert metrics.PHASES.counts()["Running"] == 1


def test_a_failed_pod_fails_the_job_and_keeps_the_others(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        cluster.set_pod_phase("ml", name, "Running")
    pod_event(cluster, "demo-node-1")
    before = metrics.POD_FAILURES.labels(namespace="ml", job="demo")._value.get()
    cluster.set_pod_phase(
        "ml",
        "demo-node-1",
        "Running",
        containerStatuses=[
            {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}
        ],
    )
    pod_event(cluster, "demo-node-1")
    st = cluster.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PodFailed")
    assert cluster.reasons()[-1] == "PodFailed"
    assert len(cluster.of_kind("Pod")) == 2  # kept for their logs
    assert metrics.POD_FAILURES.labels(namespace="ml", job="demo")._value.get() == before + 1
    # terminal: later events change nothing
    n = len(cluster.events)
    pod_event(cluster, "demo-node-0")
    assert len(cluster.events) == n


def test_a_deleted_worker_fails_a_running_job(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        cluster.set_pod_phase("ml", name, "Running")
    pod_event(cluster, "demo-node-1")
    gone = cluster.objects.pop(("Pod", "ml", "demo-node-0"))
    run(
        handlers.on_pod_event(
            event={"type": "DELETED"},
            body=gone,
            namespace="ml",
            labels=gone["metadata"]["labels"],
        )
    )
    assert cluster.job("ml", "demo")["status"]["phase"] == "Failed"


def test_pod_events_of_a_deleting_job_are_ignored(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    cluster.job("ml", "demo")["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    cluster.set_pod_phase("ml", "demo-node-0", "Failed")
    pod_event(cluster, "demo-node-0")
    assert cluster.job("ml", "demo")["status"]["phase"] == "Pending"


def test_completed_pods_complete_the_job(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        cluster.set_pod_phase("ml", name, "Running")
    pod_event(cluster, "demo-node-0")
    for name in ("demo-node-0", "demo-node-1"):
        cluster.set_pod_phase("ml", name, "Succeeded")
    pod_event(cluster, "demo-node-1")
    assert cluster.job("ml", "demo")["status"]["phase"] == "Succeeded"
    assert cluster.reasons()[-1] == "Succeeded"


# ---- delete ---------------------------------------------------------------------------------


def test_delete_removes_every_child_and_nothing_else(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    create(cluster, make_job(name="other", uid="u-other"))
    stranger = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-config-backup", "namespace": "ml"},
    }
    run(cluster.create(stranger))
    run(handlers.on_delete(body=cluster.job("ml", "demo")))
    left = sorted((k, n) for (k, _, n) in cluster.objects if k != "MalleusJob")
    assert left == [
        ("ConfigMap", "demo-config-backup"),
        ("ConfigMap", "other-config"),
        ("Pod", "other-node-0"),
        ("Pod", "other-node-1"),
        ("Secret", "other-control"),
        ("Service", "other"),
    ]
    deleted = [c[1] for c in cluster.calls if c[0] == "delete"]
    assert deleted[0][0] == "Pod"  # workers first


def test_delete_of_an_invalid_job_spares_same_named_objects(cluster: Any, make_job: Any) -> None:
    body = make_job(parallelism={"tp": 2, "dp": 1, "pp": 2})
    cluster.add_job(body)
    with pytest.raises(kopf.PermanentError):
        run(handlers.on_create(body=body, patch=kopf.Patch()))
    users_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo", "namespace": "ml"},
    }
    run(cluster.create(users_service))
    run(handlers.on_delete(body=body))
    assert ("Service", "ml", "demo") in cluster.objects


# ---- resume ---------------------------------------------------------------------------------


def test_resume_of_a_running_job_recreates_nothing(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        cluster.set_pod_phase("ml", name, "Running")
    pod_event(cluster, "demo-node-0")
    creates = sum(1 for c in cluster.calls if c[0] == "create")
    patch = kopf.Patch()
    run(handlers.on_resume(body=cluster.job("ml", "demo"), patch=patch))
    assert sum(1 for c in cluster.calls if c[0] == "create") == creates
    assert cluster.job("ml", "demo")["status"]["phase"] == "Running"
    assert metrics.PHASES.counts()["Running"] == 1


def test_resume_notices_a_worker_lost_while_away(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        cluster.set_pod_phase("ml", name, "Running")
    pod_event(cluster, "demo-node-0")
    del cluster.objects[("Pod", "ml", "demo-node-1")]
    run(handlers.on_resume(body=cluster.job("ml", "demo"), patch=kopf.Patch()))
    st = cluster.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    assert "demo-node-1" in st["message"]
    assert ("Pod", "ml", "demo-node-1") not in cluster.objects  # not re-created


def test_resume_of_a_pending_job_completes_its_children(cluster: Any, make_job: Any) -> None:
    create(cluster, make_job())
    token = cluster.of_kind("Secret")[0]["data"]["token"]
    cm = cluster.objects[("ConfigMap", "ml", "demo-config")]
    cm["data"]["plan.json"] = cm["data"]["plan.json"].replace('"generation": 1', '"generation": 7')
    del cluster.objects[("Pod", "ml", "demo-node-1")]
    run(handlers.on_resume(body=cluster.job("ml", "demo"), patch=kopf.Patch()))
    assert ("Pod", "ml", "demo-node-1") in cluster.objects
    assert cluster.of_kind("Secret")[0]["data"]["token"] == token
    # the ConfigMap (with its newer plan) was left alone
    plan = Plan.from_json(cluster.objects[("ConfigMap", "ml", "demo-config")]["data"]["plan.json"])
    assert plan.generation == 7
    assert cluster.reasons()[-1] == "Resumed"


def test_resume_of_a_finished_job_does_nothing(cluster: Any, make_job: Any) -> None:
    body = make_job(status={"phase": "Succeeded"})
    cluster.add_job(body)
    run(handlers.on_resume(body=body, patch=kopf.Patch()))
    assert cluster.calls == []
    assert metrics.PHASES.counts()["Succeeded"] == 1


# ---- update ---------------------------------------------------------------------------------


def test_policy_changes_apply_structural_ones_are_refused(cluster: Any, make_job: Any) -> None:
    body = make_job(generation=2, status={"phase": "Running"})
    cluster.add_job(body)
    patch = kopf.Patch()
    diff = [("change", ("stragglerPolicy", "threshold"), 1.2, 1.5)]
    run(handlers.on_update(body=body, diff=diff, patch=patch))
    assert patch["status"]["observedGeneration"] == 2
    assert cluster.reasons() == ["PolicyUpdated"]
    diff = [("change", ("nodes",), 2, 4)]
    run(handlers.on_update(body=body, diff=diff, patch=kopf.Patch()))
    assert cluster.reasons()[-1] == "SpecChangeIgnored"
    assert cluster.events[-1]["type"] == "Warning"


def test_daemon_runs_only_for_active_jobs() -> None:
    assert handlers._active(status={"phase": "Running"})
    assert handlers._active(status={"phase": "Pending"})
    assert not handlers._active(status={"phase": "Failed"})
    assert not handlers._active(status={})


def test_the_job_daemon_resyncs_the_pods_of_a_pending_job(
    cluster: Any, make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """job_daemon hands run_job a resync that re-derives the phase from the pods."""
    create(cluster, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        cluster.set_pod_phase("ml", name, "Running")  # before the job had a phase: no-op event
    stored = cluster.job("ml", "demo")
    assert stored["status"]["phase"] == "Pending"
    seen: dict[str, Any] = {}

    async def run_job(body: Any, stopped: Any, settings: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        await kwargs["resync"]()

    monkeypatch.setattr(handlers.daemon, "run_job", run_job)
    run(handlers.job_daemon(body=stored, stopped=None))
    assert seen["resync"] is not None
    assert stored["status"]["phase"] == "Running"
    assert cluster.reasons()[-1] == "Running"
