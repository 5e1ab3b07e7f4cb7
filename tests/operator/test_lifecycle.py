"""A job's phase from its pods: outcomes per pod, transitions of the job, the events to post."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from malleus.operator import lifecycle, readiness, status

T0 = dt.datetime(2025, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
PODS = ["demo-node-0", "demo-node-1"]


def pod(name: str, phase: str = "Running", **status_: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": phase, **status_}}


def terminated(name: str, code: int, phase: str = "Running") -> dict[str, Any]:
    return pod(
        name,
        phase,
        containerStatuses=[
            {"name": "trainer", "state": {"terminated": {"exitCode": code, "reason": "Error"}}}
        ],
    )


def shown(t: lifecycle.Transition) -> dict[str, Any]:
    assert t.status is not None
    return status.dump(t.status)


@pytest.mark.parametrize(
    ("p", "state"),
    [
        (pod("a", "Pending"), "Pending"),
        (pod("a", "Running"), "Running"),
        (pod("a", "Succeeded"), "Succeeded"),
        (pod("a", "Failed", reason="Evicted", message="node pressure"), "Failed"),
        (terminated("a", 1), "Failed"),  # a dead rank: fail before the kubelet moves the phase
        (terminated("a", 0, phase="Succeeded"), "Succeeded"),
        ({"metadata": {"name": "a"}}, "Pending"),
    ],
)
def test_pod_outcome(p: dict[str, Any], state: str) -> None:
    assert lifecycle.pod_outcome(p).state == state


def test_pod_outcome_explains_failures_and_stuck_pulls() -> None:
    assert "Evicted" in lifecycle.pod_outcome(pod("a", "Failed", reason="Evicted")).detail
    assert "code 137" in lifecycle.pod_outcome(terminated("a", 137)).detail
    stuck = pod(
        "a",
        "Pending",
        containerStatuses=[{"name": "t", "state": {"waiting": {"reason": "ImagePullBackOff"}}}],
    )
    assert lifecycle.pod_outcome(stuck).detail.startswith("ImagePullBackOff")


def test_all_running_moves_pending_to_running() -> None:
    st = {"phase": "Pending", "conditions": []}
    t = lifecycle.pods_transition(st, [pod(n) for n in PODS], PODS, 1, T0)
    assert shown(t)["phase"] == "Running"
    # pods running is not the job ready: that is the trainers' word (`readiness`)
    ready = shown(t)["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", readiness.STARTING), ready
    assert [e.reason for e in t.events] == ["Running"]
    # once Running, the same pods change nothing
    assert not lifecycle.pods_transition({"phase": "Running"}, [pod(n) for n in PODS], PODS, 1, T0)


def test_some_pending_says_why_once() -> None:
    st: dict[str, Any] = {"phase": "Pending", "conditions": []}
    stuck = pod(
        PODS[1],
        "Pending",
        containerStatuses=[{"name": "t", "state": {"waiting": {"reason": "ErrImagePull"}}}],
    )
    t = lifecycle.pods_transition(st, [pod(PODS[0]), stuck], PODS, 1, T0)
    assert "phase" not in shown(t)
    (cond,) = shown(t)["conditions"]
    assert cond["reason"] == "ImagePullBackOff"
    assert "1/2" in cond["message"] and "ErrImagePull" in cond["message"]
    assert [(e.type, e.reason) for e in t.events] == [("Warning", "ImagePullBackOff")]
    st["conditions"] = shown(t)["conditions"]
    assert not lifecycle.pods_transition(st, [pod(PODS[0]), stuck], PODS, 1, T0)


def test_a_failed_pod_is_recorded_not_the_end_of_the_job() -> None:
    t = lifecycle.pods_transition(
        {"phase": "Running"}, [pod(PODS[0]), terminated(PODS[1], 1)], PODS, 1, T0
    )
    st = shown(t)
    assert "phase" not in st  # still Running: the others recover, the pod is replaced
    (record,) = st["failures"]
    assert (record["node"], record["state"], record["failures"]) == (1, "Waiting", 1)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PodFailed")
    assert [(e.type, e.reason) for e in t.events] == [("Warning", "PodFailed")]
    assert PODS[1] in t.events[0].message and "replacement in 10 s" in t.events[0].message
    assert [o["gpu"] for o in st["gpusOut"]] == [1]  # gpusPerNode 1 here


def test_a_deleted_pod_is_a_failure_of_a_live_job() -> None:
    t = lifecycle.pods_transition(
        {"phase": "Running"}, [pod(PODS[0])], PODS, 1, T0, deleted=[PODS[1]]
    )
    st = shown(t)
    assert "phase" not in st
    assert st["failures"][0]["reason"] == "Deleted"


def test_all_succeeded_completes_the_job() -> None:
    t = lifecycle.pods_transition(
        {"phase": "Running"}, [pod(n, "Succeeded") for n in PODS], PODS, 1, T0
    )
    assert shown(t)["phase"] == "Succeeded"
    assert shown(t)["conditions"][0]["reason"] == "Completed"


@pytest.mark.parametrize("phase", ["Failed", "Succeeded", None])
def test_terminal_or_unstarted_jobs_never_change(phase: str | None) -> None:
    st = {"phase": phase} if phase else {}
    assert not lifecycle.pods_transition(st, [terminated(PODS[0], 1)], PODS, 1, T0)


def test_pods_of_other_names_are_ignored() -> None:
    t = lifecycle.pods_transition(
        {"phase": "Running"}, [pod(n) for n in PODS] + [terminated("x", 1)], PODS, 1, T0
    )
    assert not t
