"""kopf handlers called directly with ``patch=kopf.Patch()``, over HTTP against kmock."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from malleus.job import Phase
from malleus.operator import handlers, jobs, resources, workers
from malleus.operator.context import Context
from malleus.planner.plan import Plan
from tests.operator.kube import KINDS, Kube


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def create(kube: Kube, memo: kopf.Memo, body: dict[str, Any]) -> tuple[kopf.Patch, list[str]]:
    """Run on_create as kopf would; returns the patch and the names of the objects created."""
    kube.add_job(body)
    before = set(kube.names())
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    result = sorted(f"{k}/{n}" for k, n in set(kube.names()) - before)
    kube.merge_status("ml", body["metadata"]["name"], patch.get("status", {}))
    return patch, result


def test_create_makes_service_configmap_secret_and_pods(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    training = {"globalBatchSize": 24, "microBatchSize": 2, "steps": 10, "learningRate": 0.001}
    patch, result = create(kube, memo, make_job(nodes=3, training=training))
    assert [o["metadata"]["name"] for o in kube.of_kind("Pod")] == [
        "demo-node-0",
        "demo-node-1",
        "demo-node-2",
        "demo-store",  # the rendezvous store, hosted by no worker
    ]
    assert [o["metadata"]["name"] for o in kube.of_kind("Service")] == ["demo", "demo-store"]
    assert len(kube.of_kind("ConfigMap")) == 1
    assert len(kube.of_kind("Secret")) == 1
    assert len(kube.of_kind("NetworkPolicy")) == 1
    (budget,) = kube.of_kind("PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 3  # every worker: a drain must not evict one
    for kind in ("Pod", "Service", "ConfigMap", "Secret", "NetworkPolicy", "PodDisruptionBudget"):
        for obj in kube.of_kind(kind):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    st = patch["status"]
    assert st["phase"] == "Pending"
    assert st["plan"]["generation"] == 1
    assert st["pods"] == ["demo-node-0", "demo-node-1", "demo-node-2"]
    assert st["gpus"] == 12
    assert st["conditions"][0]["reason"] == "PodsPending"
    assert kube.reasons() == ["Created"]
    assert len(result) == 10
    # the ConfigMap holds the same plan the status shows
    cm = kube.of_kind("ConfigMap")[0]
    assert Plan.from_json(cm["data"]["plan.json"]).generation == st["plan"]["generation"]
    assert ctx.metrics.phases.counts()[Phase.PENDING] == 1


def test_create_is_idempotent_and_keeps_the_token(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    create(kube, memo, make_job())
    token = kube.of_kind("Secret")[0]["data"]["token"]
    creates = kube.requests("create")
    _, result = create(kube, memo, make_job())  # a retried handler, or a restart
    assert result == []
    assert kube.of_kind("Secret")[0]["data"]["token"] == token
    assert len(kube.of_kind("Pod")) == 3  # two workers and the store
    # every child attempted again (a no-op), plus one more Created event
    assert kube.requests("create") == 2 * creates


def test_a_retried_create_shows_the_plan_the_pods_got(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    create(kube, memo, make_job())
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None
    cm["data"]["plan.json"] = cm["data"]["plan.json"].replace('"generation": 1', '"generation": 5')
    kube.put("ConfigMap", cm)
    patch, _ = create(kube, memo, make_job())
    assert patch["status"]["plan"]["generation"] == 5


def test_each_job_gets_its_own_random_token(kube: Kube, memo: kopf.Memo, make_job: Any) -> None:
    create(kube, memo, make_job(name="a", uid="u-a"))
    create(kube, memo, make_job(name="b", uid="u-b"))
    a, b = (s["data"]["token"] for s in kube.of_kind("Secret"))
    assert a != b and len(a) >= 40


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (
            {"parallelism": {"tp": 2, "dp": 1, "pp": 2}},
            "spec.parallelism dp * pp * tp must equal the GPU count",
        ),
        (
            {
                "nodes": 1,
                "gpusPerNode": 1,
                "model": {"preset": "llama-70b"},
                "parallelism": {"tp": 1},
            },
            "no parallel layout of this job fits its GPUs",
        ),
        (
            {"parallelism": {"tp": 8}},
            "spec.parallelism.tp: spec.parallelism.tp must divide spec.gpusPerNode",
        ),
    ],
)
def test_invalid_spec_fails_and_creates_nothing(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any, spec: dict[str, Any], needle: str
) -> None:
    body = make_job(generation=3, **spec)
    kube.add_job(body)
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="invalid spec"):
        run(handlers.on_create(body=body, patch=patch, memo=memo))
    st = patch["status"]
    assert st["phase"] == "Failed"
    assert st["observedGeneration"] == 3
    cond, failed = st["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "False", "InvalidSpec")
    assert (failed["type"], failed["status"], failed["reason"]) == ("Failed", "True", "InvalidSpec")
    assert cond["observedGeneration"] == 3
    assert needle in cond["message"]
    assert kube.names() == []
    assert kube.reasons() == ["InvalidSpec"]
    assert kube.events[0]["type"] == "Warning"
    assert needle in kube.events[0]["message"]
    assert ctx.metrics.phases.counts()[Phase.FAILED] == 1


def test_a_slow_initial_planner_times_out_into_a_retry(
    kube: Kube, memo: kopf.Memo, make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first plan runs off the event loop under the policy's budget: a planner that
    overruns it makes kopf retry later instead of freezing the operator."""
    import threading

    from malleus.operator import jobs

    release, returned = threading.Event(), threading.Event()

    def slow(problem: Any, *, time_limit: float | None = None) -> Plan:
        release.wait(120)  # overruns its budget until the test lets it go
        returned.set()
        raise AssertionError("too late to matter")

    original = jobs.initial_plan
    monkeypatch.setattr(jobs, "initial_plan", lambda job, *_: original(job, planner=slow))
    body = make_job(stragglerPolicy={"planningTimeoutSeconds": 1})
    kube.add_job(body)
    try:
        with pytest.raises(kopf.TemporaryError, match="timed out"):
            run(handlers.on_create(body=body, patch=kopf.Patch(), memo=memo))
        assert not returned.is_set()  # it gave up at budget + grace, with the planner running
    finally:
        release.set()
    assert kube.names() == []


# ---- pods -----------------------------------------------------------------------------------


def pod_event(kube: Kube, memo: kopf.Memo, name: str, type_: str = "MODIFIED") -> None:
    body = kube.get("Pod", "ml", name) or {"metadata": {"name": name}}
    labels = body.get("metadata", {}).get("labels") or {resources.JOB_LABEL: "demo"}
    run(
        handlers.on_pod_event(
            event={"type": type_, "object": body},
            body=body,
            namespace="ml",
            labels=labels,
            memo=memo,
        )
    )


def test_running_pods_make_the_job_running(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    create(kube, memo, make_job())
    kube.set_pod_phase("ml", "demo-node-0", "Running")
    pod_event(kube, memo, "demo-node-0")
    assert kube.job("ml", "demo")["status"]["phase"] == "Pending"
    kube.set_pod_phase("ml", "demo-node-1", "Running")
    pod_event(kube, memo, "demo-node-1")
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "TrainersStarting")  # trainers: not yet
    assert kube.reasons() == ["Created", "Running"]
    assert ctx.metrics.phases.counts()[Phase.RUNNING] == 1


def test_a_failed_pod_is_recovered_from_not_the_end_of_the_job(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    create(kube, memo, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    pod_event(kube, memo, "demo-node-1")
    failures = ctx.metrics.pod_failures.labels(namespace="ml", job="demo")
    assert failures._value.get() == 0
    kube.set_pod_phase(
        "ml",
        "demo-node-1",
        "Running",
        containerStatuses=[
            {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}
        ],
    )
    pod_event(kube, memo, "demo-node-1")
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PodFailed")
    assert [f["node"] for f in st["failures"]] == [1]
    assert [o["gpu"] for o in st["gpusOut"]] == [4, 5, 6, 7]
    assert kube.reasons()[-1] == "PodFailed"
    assert failures._value.get() == 1
    # the same failed pod seen again is not a second failure
    n = len(kube.events)
    pod_event(kube, memo, "demo-node-1")
    assert len(kube.events) == n
    assert kube.job("ml", "demo")["status"]["failures"][0]["failures"] == 1


def test_a_deleted_worker_is_a_failure_of_a_running_job(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    create(kube, memo, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    pod_event(kube, memo, "demo-node-1")
    gone = kube.get("Pod", "ml", "demo-node-0")
    assert gone is not None
    kube.remove("Pod", "ml", "demo-node-0")
    run(
        handlers.on_pod_event(
            event={"type": "DELETED"},
            body=gone,
            namespace="ml",
            labels=gone["metadata"]["labels"],
            memo=memo,
        )
    )
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    assert (st["failures"][0]["node"], st["failures"][0]["reason"]) == (0, "Deleted")


def test_pod_events_of_a_deleting_job_are_ignored(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    create(kube, memo, make_job())
    job = kube.job("ml", "demo")
    job["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    kube.put("MalleusJob", job)
    kube.set_pod_phase("ml", "demo-node-0", "Failed")
    pod_event(kube, memo, "demo-node-0")
    assert kube.job("ml", "demo")["status"]["phase"] == "Pending"


def test_completed_pods_complete_the_job(kube: Kube, memo: kopf.Memo, make_job: Any) -> None:
    create(kube, memo, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    pod_event(kube, memo, "demo-node-0")
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Succeeded")
    pod_event(kube, memo, "demo-node-1")
    assert kube.job("ml", "demo")["status"]["phase"] == "Succeeded"
    assert kube.reasons()[-1] == "Succeeded"


# ---- delete ---------------------------------------------------------------------------------


def test_delete_removes_every_child_and_nothing_else(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    create(kube, memo, make_job())
    create(kube, memo, make_job(name="other", uid="u-other"))
    stranger = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-config-backup", "namespace": "ml"},
    }
    run(ctx.cluster.create(stranger))
    deletes = len(list(kube.emulator))
    run(handlers.on_delete(body=kube.job("ml", "demo"), memo=memo))
    assert kube.names() == [
        ("ConfigMap", "demo-config-backup"),
        ("ConfigMap", "other-config"),
        ("NetworkPolicy", "other-network"),
        ("Pod", "other-node-0"),
        ("Pod", "other-node-1"),
        ("Pod", "other-store"),
        ("PodDisruptionBudget", "other-workers"),
        ("Secret", "other-control"),
        ("Service", "other"),
        ("Service", "other-store"),
    ]
    deleted = [r for r in list(kube.emulator)[deletes:] if r.action == "DELETE"]
    assert deleted[0].resource == KINDS["Pod"]  # workers first
    assert len(deleted) == 9


def test_delete_of_an_invalid_job_spares_same_named_objects(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = make_job(parallelism={"tp": 2, "dp": 1, "pp": 2})
    kube.add_job(body)
    with pytest.raises(kopf.PermanentError):
        run(handlers.on_create(body=body, patch=kopf.Patch(), memo=memo))
    users_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo", "namespace": "ml"},
    }
    run(ctx.cluster.create(users_service))
    run(handlers.on_delete(body=body, memo=memo))
    assert kube.get("Service", "ml", "demo") is not None


# ---- resume ---------------------------------------------------------------------------------


def test_resume_of_a_running_job_recreates_nothing(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    create(kube, memo, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    pod_event(kube, memo, "demo-node-0")
    creates = kube.requests("create")
    run(handlers.on_resume(body=kube.job("ml", "demo"), patch=kopf.Patch(), memo=memo))
    assert kube.requests("create") == creates
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"
    assert ctx.metrics.phases.counts()[Phase.RUNNING] == 1


def test_resume_records_a_worker_lost_while_away(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    create(kube, memo, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    pod_event(kube, memo, "demo-node-0")
    kube.remove("Pod", "ml", "demo-node-1")
    run(handlers.on_resume(body=kube.job("ml", "demo"), patch=kopf.Patch(), memo=memo))
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    assert st["failures"][0]["pod"] == "demo-node-1"
    assert st["failures"][0]["state"] == "Waiting"  # the replacement timer takes it from here
    assert kube.get("Pod", "ml", "demo-node-1") is None  # not re-created by resume itself
    # a second restart before the replacement: the same loss is not counted twice
    run(handlers.on_resume(body=kube.job("ml", "demo"), patch=kopf.Patch(), memo=memo))
    assert kube.job("ml", "demo")["status"]["failures"][0]["failures"] == 1


def test_resume_of_a_pending_job_completes_its_children(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    create(kube, memo, make_job())
    token = kube.of_kind("Secret")[0]["data"]["token"]
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None
    cm["data"]["plan.json"] = cm["data"]["plan.json"].replace('"generation": 1', '"generation": 7')
    kube.put("ConfigMap", cm)
    kube.remove("Pod", "ml", "demo-node-1")
    run(handlers.on_resume(body=kube.job("ml", "demo"), patch=kopf.Patch(), memo=memo))
    assert kube.get("Pod", "ml", "demo-node-1") is not None
    assert kube.of_kind("Secret")[0]["data"]["token"] == token
    # the ConfigMap (with its newer plan) was left alone
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None
    assert Plan.from_json(cm["data"]["plan.json"]).generation == 7
    assert kube.reasons()[-1] == "Resumed"


def test_resume_of_a_finished_job_does_nothing(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = make_job(status={"phase": "Succeeded"})
    kube.add_job(body)
    run(handlers.on_resume(body=body, patch=kopf.Patch(), memo=memo))
    assert list(kube.emulator) == []
    assert ctx.metrics.phases.counts()[Phase.SUCCEEDED] == 1


# ---- update ---------------------------------------------------------------------------------


def test_policy_changes_apply_structural_ones_are_refused(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    body = make_job(generation=2, status={"phase": "Running"})
    kube.add_job(body)
    patch = kopf.Patch()
    diff = [("change", ("stragglerPolicy", "threshold"), 1.2, 1.5)]
    run(handlers.on_update(body=body, diff=diff, patch=patch, memo=memo))
    assert patch["status"]["observedGeneration"] == 2
    assert kube.reasons() == ["PolicyUpdated"]
    diff = [("change", ("nodes",), 2, 4)]
    run(handlers.on_update(body=body, diff=diff, patch=kopf.Patch(), memo=memo))
    assert kube.reasons()[-1] == "SpecChangeIgnored"
    assert kube.events[-1]["type"] == "Warning"


def test_daemon_runs_only_for_active_jobs() -> None:
    assert handlers._active(body={"status": {"phase": "Running"}})
    assert handlers._active(body={"status": {"phase": "Pending"}})
    assert not handlers._active(body={"status": {"phase": "Failed"}})
    assert not handlers._active(body={"status": {}})


def test_the_job_daemon_resyncs_the_pods_of_a_pending_job(
    kube: Kube, memo: kopf.Memo, make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """job_daemon hands run_job a resync that re-derives the phase from the pods."""
    create(kube, memo, make_job())
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")  # before the job had a phase: no-op event
    stored = kube.job("ml", "demo")
    assert stored["status"]["phase"] == "Pending"
    seen: dict[str, Any] = {}

    async def run_job(ctx: Any, body: Any, stopped: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        await kwargs["resync"]()

    monkeypatch.setattr(handlers.daemon, "run_job", run_job)
    run(handlers.job_daemon(body=stored, stopped=None, memo=memo))
    assert seen["resync"] is not None
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"
    assert kube.reasons()[-1] == "Running"


def test_startup_puts_a_context_in_the_memo(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Settings from the memo (as ``python -m malleus.operator`` passes them), a cluster from
    their kubeconfig, fresh metrics; kopf's settings as the CRD's status schema needs them."""
    from malleus.operator.context import MEMO_KEY
    from malleus.operator.settings import Settings

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
        "clusters: [{name: t, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        "contexts: [{name: t, context: {cluster: t, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    memo = kopf.Memo(settings=Settings(metrics_port=0, kubeconfig=str(kubeconfig)))
    kopf_settings = kopf.OperatorSettings()
    run(handlers.configure(settings=kopf_settings, memo=memo))
    ctx = Context.of(memo)
    assert ctx.settings.kubeconfig == str(kubeconfig)
    assert ctx.cluster.api.configuration.host == "http://127.0.0.1:1"
    assert kopf_settings.persistence.finalizer == handlers.FINALIZER
    # the pod watch is filtered by the API server: the operator's pods only, not the cluster's
    pods = kopf.Resource("", "v1", "pods", namespaced=True)
    jobs_ = kopf.Resource("malleus.io", "v1alpha1", "malleusjobs", namespaced=True)
    assert list(kopf_settings.watching.label_selectors.collect(pods)) == [handlers.POD_SELECTOR]
    assert list(kopf_settings.watching.label_selectors.collect(jobs_)) == []
    assert isinstance(memo[MEMO_KEY], Context)
    run(handlers.close(memo=memo))
    with pytest.raises(RuntimeError, match="startup handler has not run"):
        Context.of(kopf.Memo())


def test_the_pod_watch_selector_takes_every_pod_the_operator_makes(make_job: Any) -> None:
    """Worker and store pods alike carry the labels the watch selects on (a pod the selector
    missed would never be seen failing)."""
    job = jobs.resolve(make_job())
    ref = resources.JobRef(namespace="ml", name="demo", uid="u", generation=1)
    built = workers.build_children(job, ref, job.initial_plan(), "token")
    pods = [o for o in built if o["kind"] == "Pod"]
    assert len(pods) == job.nodes + 1  # the workers and the store
    wanted = [term.partition("=") for term in handlers.POD_SELECTOR.split(",")]
    for pod in pods:
        labels = pod["metadata"]["labels"]
        for key, eq, value in wanted:
            assert key in labels and (not eq or labels[key] == value), (pod, key)
