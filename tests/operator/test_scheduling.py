"""Pending reasons, the schedule timeout and the gang schedulers' labels.

`scheduling` and `lifecycle.schedule_timeout_transition` are pure; `admission.tick` takes the
time, so the timeout is crossed by moving the clock. Reactions run against kmock.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import kopf

from malleus.job import ResolvedJob
from malleus.operator import admission, handlers, kueue, lifecycle, scheduling, workers
from malleus.operator.context import Context
from malleus.operator.resources import JobRef
from tests.operator.kube import Kube

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
SECOND = dt.timedelta(seconds=1)
PODS = ["demo-node-0", "demo-node-1"]
NO_NODES = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def unschedulable(name: str) -> dict[str, Any]:
    cond = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": NO_NODES,
    }
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "conditions": [cond]}}


def pulling(name: str, reason: str = "ErrImagePull") -> dict[str, Any]:
    waiting = {"reason": reason, "message": "manifest unknown"}
    statuses = [{"name": "trainer", "state": {"waiting": waiting}}]
    return {
        "metadata": {"name": name},
        "status": {"phase": "Pending", "containerStatuses": statuses},
    }


def running(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Running"}}


def test_pending_reasons_name_the_pod_and_quote_the_scheduler() -> None:
    reasons = scheduling.pending_reasons([pulling(PODS[0]), unschedulable(PODS[1])], PODS)
    assert [(r.pod, r.reason) for r in reasons] == [
        (PODS[1], "Unschedulable"),  # first: an unplaced pod never pulls
        (PODS[0], "ImagePullBackOff"),
    ]
    assert str(reasons[0]) == f"{PODS[1]}: Unschedulable: {NO_NODES}"
    assert "container trainer: ErrImagePull: manifest unknown" in reasons[1].message
    assert scheduling.pending_reasons([running(PODS[0]), unschedulable("other")], PODS) == []


def test_an_unschedulable_pod_shows_in_ready_and_in_one_event() -> None:
    st: dict[str, Any] = {"phase": "Pending", "conditions": []}
    t = lifecycle.pods_transition(st, [running(PODS[0]), unschedulable(PODS[1])], PODS, 1, T0)
    (cond,) = t.status.model_dump(by_alias=True, mode="json")["conditions"] if t.status else []
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "False", "Unschedulable")
    assert cond["message"] == f"1/2 worker pod(s) running; {PODS[1]}: Unschedulable: {NO_NODES}"
    assert [(e.type, e.reason) for e in t.events] == [("Warning", "Unschedulable")]
    assert PODS[1] in t.events[0].message and NO_NODES in t.events[0].message
    st["conditions"] = [cond]
    assert not lifecycle.pods_transition(
        st, [running(PODS[0]), unschedulable(PODS[1])], PODS, 1, T0
    )
    # The scheduler tries again and words it anew: the condition follows, no second event.
    retried = unschedulable(PODS[1])
    retried["status"]["conditions"][0]["message"] = "0/161 nodes are available: 161 Insufficient"
    again = lifecycle.pods_transition(st, [running(PODS[0]), retried], PODS, 1, T0)
    assert again.status is not None and again.events == []
    # Another pod stuck is another occurrence.
    both = lifecycle.pods_transition(st, [unschedulable(PODS[0]), retried], PODS, 1, T0)
    assert [(e.reason, e.message.split(":")[0]) for e in both.events] == [
        ("Unschedulable", PODS[0])
    ]


def test_the_schedule_timeout_is_a_pure_decision() -> None:
    ready = {"type": "Ready", "status": "False", "reason": "Unschedulable", "message": "why"}
    ready |= {"lastTransitionTime": "2026-03-01T12:00:00Z"}
    st = {"phase": "Pending", "startTime": "2026-03-01T12:00:00Z", "conditions": [ready]}
    assert not lifecycle.schedule_timeout_transition(st, 600, 1, T0 + 599 * SECOND)
    t = lifecycle.schedule_timeout_transition(st, 600, 1, T0 + 600 * SECOND)
    assert t.status is not None and t.status.phase == "Failed"
    failed = next(c for c in t.status.conditions or [] if c.type == "Failed")
    assert (failed.status, failed.reason) == ("True", "ScheduleTimeout")
    assert "600 s" in failed.message and "why" in failed.message
    assert not lifecycle.schedule_timeout_transition(
        {**st, "phase": "Running"}, 1, 1, T0 + 999 * SECOND
    )
    assert not lifecycle.schedule_timeout_transition({"phase": "Pending"}, 1, 1, T0)


def test_a_job_whose_pods_never_schedule_fails_and_gives_its_gpus_back(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = make_job(scheduling={"scheduleTimeoutSeconds": 120})
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    kube.set_pod_phase("ml", PODS[0], "Running")
    pod = kube.get("Pod", "ml", PODS[1])
    assert pod is not None
    kube.put("Pod", {**pod, "status": unschedulable(PODS[1])["status"]})
    run(handlers.sync_pods(ctx, "ml", "demo"))
    ready = next(c for c in kube.job("ml", "demo")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "Unschedulable" and NO_NODES in ready["message"]
    assert kube.reasons()[-1] == "Unschedulable"

    job = kube.job("ml", "demo")
    started = lifecycle.parse_time(job["status"]["startTime"])
    assert started is not None
    assert run(admission.tick(ctx, job, started + 119 * SECOND)) is None
    assert run(admission.tick(ctx, job, started + 120 * SECOND)) == "timeout"
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    assert {c["type"]: c["reason"] for c in st["conditions"]}["Failed"] == "ScheduleTimeout"
    assert [k for k, _ in kube.names() if k == "Pod"] == []
    assert kube.reasons()[-1] == "ScheduleTimeout"
    run(handlers.sync_pods(ctx, "ml", "demo", deleted=PODS))
    assert "PodFailed" not in kube.reasons()


def test_a_gang_queued_by_kueue_is_not_timed_out_while_it_waits(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """Kueue gates the pods until the queue admits them all: the timeout starts after that."""
    body = make_job(scheduling={"scheduleTimeoutSeconds": 120})
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    gate = [{"name": "kueue.x-k8s.io/admission"}]
    for name in PODS:
        pod = kube.get("Pod", "ml", name)
        assert pod is not None
        kube.put("Pod", {**pod, "spec": {**pod["spec"], "schedulingGates": gate}})
    job = kube.job("ml", "demo")
    queued_until = T0 + 3600 * SECOND
    assert run(admission.tick(ctx, job, queued_until)) == "queued"
    assert kube.job("ml", "demo")["status"]["startTime"] == "2026-03-01T13:00:00Z"
    for name in PODS:  # admitted: the gates are gone, the scheduler cannot place them
        pod = kube.get("Pod", "ml", name)
        assert pod is not None
        kube.put("Pod", {**pod, "spec": {**pod["spec"], "schedulingGates": []}})
    assert run(admission.tick(ctx, job, queued_until + 119 * SECOND)) is None
    assert run(admission.tick(ctx, job, queued_until + 120 * SECOND)) == "timeout"


def _pod(make_job: Any, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    body = make_job(**spec)
    body["metadata"]["labels"] = labels
    job = ResolvedJob.load(body)
    return workers.build_pod(job, JobRef.from_body(body), 1)


def test_workers_carry_no_kueue_label_when_the_job_is_queued(make_job: Any) -> None:
    """Kueue admits the job's Workload (operator/kueue.py); a pod with a queue name would be
    gated again by Kueue's pod webhook, so nothing of Kueue's reaches the pods."""
    pod = _pod(make_job, {kueue.QUEUE_LABEL: "team-a"})
    meta = pod["metadata"]
    assert not [k for k in meta["labels"] if k.startswith("kueue.x-k8s.io/")], meta
    assert not [k for k in meta.get("annotations") or {} if k.startswith("kueue.x-k8s.io/")]
    assert pod["spec"].get("schedulingGates") is None


def test_workers_carry_a_coschedulers_pod_group(make_job: Any) -> None:
    pod = _pod(make_job, {}, scheduling={"podGroup": {"name": "demo-gang"}})
    assert pod["metadata"]["labels"][scheduling.POD_GROUP_LABEL] == "demo-gang"
    assert pod["metadata"]["annotations"][scheduling.POD_GROUP_ANNOTATION] == "demo-gang"
