"""``spec.runPolicy``, terminal conditions and the PodDisruptionBudget.

The timer's decision (`lifecycle.run_policy_due`) is pure and `run_policy.enforce` takes the
time as an argument, so every test sets the clock where it wants it: no sleeping, no waiting for
a real 10-second timer.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import kopf
import pytest

from malleus.job.spec import RunPolicy
from malleus.operator import handlers, jobs, lifecycle, run_policy, workers
from malleus.operator.context import Context
from malleus.operator.resources import JobRef
from malleus.planner.plan import Pipeline, Plan, Stage
from tests.operator.kube import Kube

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
SECOND = dt.timedelta(seconds=1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _stamp(at: dt.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the pure decision ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "stamps", "policy", "at", "expected"),
    [
        ("Running", {"startTime": T0}, {"activeDeadlineSeconds": 60}, T0 + 59 * SECOND, (None, 1)),
        (
            "Running",
            {"startTime": T0},
            {"activeDeadlineSeconds": 60},
            T0 + 60 * SECOND,
            ("deadline", None),
        ),
        ("Replanning", {}, {"activeDeadlineSeconds": 60}, T0 + 61 * SECOND, ("deadline", None)),
        (
            "Succeeded",
            {"startTime": T0},
            {"activeDeadlineSeconds": 60},
            T0 + 999 * SECOND,
            (None, None),
        ),
        (
            "Succeeded",
            {"completionTime": T0},
            {"ttlSecondsAfterFinished": 30},
            T0 + 10 * SECOND,
            (None, 20),
        ),
        ("Failed", {"completionTime": T0}, {"ttlSecondsAfterFinished": 0}, T0, ("expire", None)),
        ("Failed", {}, {"ttlSecondsAfterFinished": 0}, T0, (None, None)),
        ("Running", {"completionTime": T0}, {"ttlSecondsAfterFinished": 0}, T0, (None, None)),
        ("Running", {"startTime": T0}, {}, T0 + 10**6 * SECOND, (None, None)),
    ],
)
def test_run_policy_due(
    phase: str,
    stamps: dict[str, dt.datetime],
    policy: dict[str, int],
    at: dt.datetime,
    expected: Any,
) -> None:
    stored = {"phase": phase, **{k: _stamp(v) for k, v in stamps.items()}}
    due = lifecycle.run_policy_due(stored, RunPolicy.model_validate(policy), T0, at)
    assert (due.action, due.wait) == expected


# ---- the operator's reactions (kmock) --------------------------------------------------------


def _start(kube: Kube, memo: kopf.Memo, body: dict[str, Any]) -> dict[str, Any]:
    """on_create, then every worker running: the job as the API server holds it."""
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    run(handlers.sync_pods(Context.of(memo), "ml", "demo"))
    job = kube.job("ml", "demo")
    assert job["status"]["phase"] == "Running"
    return job


def _started(job: dict[str, Any]) -> dt.datetime:
    started = lifecycle.parse_time(job["status"]["startTime"])
    assert started is not None
    return started


def test_a_job_past_its_deadline_fails_and_loses_its_pods(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    job = _start(kube, memo, make_job(runPolicy={"activeDeadlineSeconds": 600}))
    start = _started(job)
    assert run(run_policy.enforce(ctx, job, start + 599 * SECOND)) is None
    assert len(kube.of_kind("Pod")) == 3 and kube.job("ml", "demo")["status"]["phase"] == "Running"

    assert run(run_policy.enforce(ctx, job, start + 600 * SECOND)) == "deadline"
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    conditions = {c["type"]: c for c in st["conditions"]}
    assert (conditions["Failed"]["status"], conditions["Failed"]["reason"]) == (
        "True",
        "DeadlineExceeded",
    )
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == (
        "False",
        "DeadlineExceeded",
    )
    assert "Succeeded" not in conditions
    assert st["completionTime"] == _stamp(start + 600 * SECOND)
    assert kube.of_kind("Pod") == []  # the GPUs are given back
    assert {k for k, _ in kube.names()} >= {"Service", "ConfigMap", "Secret"}  # for the TTL
    assert kube.reasons()[-1] == "DeadlineExceeded"
    # The pods' deletion reaches the pod watcher afterwards: the job stays DeadlineExceeded.
    run(handlers.sync_pods(ctx, "ml", "demo", deleted=["demo-node-0", "demo-node-1"]))
    assert kube.job("ml", "demo")["status"]["conditions"] == st["conditions"]
    assert "PodFailed" not in kube.reasons()


def test_a_job_that_completed_meanwhile_is_not_failed_by_its_deadline(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """The timer's body may be stale: the job is read again before it is failed."""
    job = _start(kube, memo, make_job(runPolicy={"activeDeadlineSeconds": 60}))
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Succeeded")
    run(handlers.sync_pods(ctx, "ml", "demo"))
    assert run(run_policy.enforce(ctx, job, _started(job) + 3600 * SECOND)) is None
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Succeeded"
    succeeded = next(c for c in st["conditions"] if c["type"] == "Succeeded")
    assert (succeeded["status"], succeeded["reason"]) == ("True", "Completed")


def test_a_finished_job_loses_its_children_after_the_ttl_and_keeps_its_record(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    job = _start(kube, memo, make_job(runPolicy={"ttlSecondsAfterFinished": 300}))
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Succeeded")
    run(handlers.sync_pods(ctx, "ml", "demo"))
    job = kube.job("ml", "demo")
    done = next(c for c in job["status"]["conditions"] if c["type"] == "Succeeded")
    assert (done["status"], done["reason"]) == ("True", "Completed")
    ended = lifecycle.parse_time(job["status"]["completionTime"])
    assert ended is not None
    owned_before = kube.names()
    # 2 pods, Service, ConfigMap, Secret, NetworkPolicy, PDB, the store's Pod and Service
    assert len(owned_before) == 9

    assert run(run_policy.enforce(ctx, job, ended + 299 * SECOND)) is None
    assert kube.names() == owned_before
    assert run(run_policy.enforce(ctx, job, ended + 300 * SECOND)) == "expire"
    assert kube.names() == []
    assert kube.job("ml", "demo")["status"]["phase"] == "Succeeded"  # the record stays
    assert kube.reasons()[-1] == "Expired"
    assert "Pod/demo-node-0" in kube.events[-1]["message"]
    # A later tick (or a restarted operator) finds nothing left and says nothing more.
    events = len(kube.events)
    assert run(run_policy.enforce(ctx, job, ended + 900 * SECOND)) is None
    assert len(kube.events) == events


def test_the_ttl_spares_objects_the_job_does_not_control(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    job = _start(kube, memo, make_job(runPolicy={"ttlSecondsAfterFinished": 0}))
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Succeeded")
    run(handlers.sync_pods(ctx, "ml", "demo"))
    kube.remove("PodDisruptionBudget", "ml", "demo-workers")
    impostor = {"metadata": {"name": "demo-workers", "namespace": "ml"}, "spec": {}}
    kube.put(
        "PodDisruptionBudget",
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", **impostor},
    )
    job = kube.job("ml", "demo")
    ended = lifecycle.parse_time(job["status"]["completionTime"])
    assert ended is not None
    assert run(run_policy.enforce(ctx, job, ended)) == "expire"
    assert kube.names() == [("PodDisruptionBudget", "demo-workers")]


def test_the_timer_runs_only_for_jobs_with_a_run_policy() -> None:
    assert handlers._has_run_policy({"runPolicy": {"ttlSecondsAfterFinished": 5}})
    assert not handlers._has_run_policy({"nodes": 2})


# ---- the PodDisruptionBudget -----------------------------------------------------------------


def test_the_disruption_budget_keeps_every_worker(make_job: Any) -> None:
    job = jobs.resolve(
        make_job(
            nodes=3,
            training={
                "globalBatchSize": 24,
                "microBatchSize": 2,
                "steps": 10,
                "learningRate": 0.001,
            },
        )
    )
    ref = JobRef(namespace="ml", name="demo", uid="uid-1234")
    pods = [workers.build_pod(job, ref, i) for i in range(3)]
    (budget,) = [
        c
        for c in workers.build_children(job, ref, _plan(), "t")
        if c["kind"] == "PodDisruptionBudget"
    ]
    assert budget["metadata"]["name"] == "demo-workers"
    assert budget["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    assert budget["spec"]["minAvailable"] == 3
    selector = budget["spec"]["selector"]["matchLabels"]
    assert all(selector.items() <= p["metadata"]["labels"].items() for p in pods)
    assert not any(
        c["kind"] == "PodDisruptionBudget"
        for c in workers.build_children(job, ref, _plan(), "t", disruption_budget=False)
    )
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(budget, kv.latest_version(), strict=True)


def _plan() -> Plan:
    return Plan(
        generation=1,
        tp=2,
        pipelines=[Pipeline(micro_batches=12, stages=[Stage(ranks=[0, 1], layers=(0, 8))])],
        excluded=[2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    )


def test_run_policy_edits_apply_live_pod_template_edits_do_not(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    body = make_job(generation=2, status={"phase": "Running"})
    kube.add_job(body)
    diff = [("add", ("runPolicy", "activeDeadlineSeconds"), None, 60)]
    run(handlers.on_update(body=body, diff=diff, patch=kopf.Patch(), memo=memo))
    assert kube.reasons() == ["PolicyUpdated"]
    diff = [("add", ("podTemplate", "spec", "nodeSelector"), None, {"pool": "a"})]
    run(handlers.on_update(body=body, diff=diff, patch=kopf.Patch(), memo=memo))
    assert kube.reasons()[-1] == "SpecChangeIgnored"
    assert "podTemplate.spec.nodeSelector" in kube.events[-1]["message"]
