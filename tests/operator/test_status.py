"""Pure status computations: conditions, plan summaries, stragglers, pod outcomes, phases."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from malleus.operator import status
from malleus.planner.plan import Estimate, Pipeline, Plan, Stage

T0 = dt.datetime(2025, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)
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


# ---- conditions -----------------------------------------------------------------------------


def test_condition_has_the_metav1_shape() -> None:
    c = status.condition("Ready", True, "Running", "ok", 3, T0)
    assert c == {
        "type": "Ready",
        "status": "True",
        "reason": "Running",
        "message": "ok",
        "observedGeneration": 3,
        "lastTransitionTime": "2025-05-01T12:00:00Z",
    }


def test_merge_keeps_transition_time_unless_the_status_flips() -> None:
    first = status.merge_conditions([], status.condition("Ready", False, "PodsPending", "a", 1, T0))
    same = status.merge_conditions(
        first, status.condition("Ready", False, "PodsPending", "b", 1, T1)
    )
    assert same[0]["lastTransitionTime"] == "2025-05-01T12:00:00Z"
    assert same[0]["message"] == "b"
    flipped = status.merge_conditions(same, status.condition("Ready", True, "Running", "c", 1, T1))
    assert flipped[0]["lastTransitionTime"] == "2025-05-01T12:05:00Z"
    both = status.merge_conditions(
        flipped, status.condition("Straggling", False, "NoStragglers", "", 1, T1)
    )
    assert [c["type"] for c in both] == ["Ready", "Straggling"]


# ---- plan -----------------------------------------------------------------------------------

PLAN = Plan(
    generation=4,
    tp=2,
    pipelines=[
        Pipeline(
            micro_batches=5,
            stages=[Stage(ranks=[1, 0], layers=(0, 3)), Stage(ranks=[2, 3], layers=(3, 8))],
        ),
        Pipeline(micro_batches=3, stages=[Stage(ranks=[4], layers=(0, 8))]),
    ],
    excluded=[5],
    estimate=Estimate(step_time=50.0, uniform_step_time=125.0),
)


def test_plan_status_is_camel_case_with_predictions() -> None:
    s = status.plan_status(PLAN)
    assert s["generation"] == 4 and s["tp"] == 2
    assert s["pipelines"][0] == {
        "microBatches": 5,
        "stages": [{"ranks": [1, 0], "layers": [0, 3]}, {"ranks": [2, 3], "layers": [3, 8]}],
    }
    assert s["excluded"] == [5]
    assert s["predictedSpeedup"] == 2.5
    assert s["predictedStepTime"] == 50.0


def test_plan_round_trips_through_the_status() -> None:
    back = status.plan_from_status(status.plan_status(PLAN))
    assert back == PLAN.model_copy(update={"estimate": None})
    assert status.plan_from_status(None) is None
    assert status.plan_from_status({"generation": 1}) is None
    assert status.plan_from_status({"pipelines": [{"bad": 1}], "tp": 2}) is None


def test_infinite_uniform_time_gives_no_speedup() -> None:
    plan = PLAN.model_copy(
        update={"estimate": Estimate(step_time=50.0, uniform_step_time=float("inf"))}
    )
    assert "predictedSpeedup" not in status.plan_status(plan)


# ---- stragglers -----------------------------------------------------------------------------


def test_stragglers_worst_first_with_a_short_summary() -> None:
    rates = {0: 1.0, 1: 3.04, 5: 1.19, 6: 2.0, 7: None}
    s = status.straggler_status(rates, threshold=1.2, gpus_per_node=4)
    assert s["stragglers"] == [
        {"rank": 7, "node": 1},
        {"rank": 1, "node": 0, "rate": 3.04},
        {"rank": 6, "node": 1, "rate": 2.0},
    ]
    assert s["stragglerSummary"] == "3 (r7 down, r1 3.0x, r6 2.0x)"
    assert status.straggler_status({0: 1.0}, 1.2, 4)["stragglerSummary"] == "0"
    many = {r: 2.0 for r in range(6)}
    assert status.straggler_status(many, 1.2, 4)["stragglerSummary"].endswith(", ...)")


def test_straggling_condition() -> None:
    yes = status.straggling_condition({3: 2.0}, 1.2, 1, T0)
    assert (yes["status"], yes["reason"]) == ("True", "StragglersDetected")
    assert "[3]" in yes["message"]
    no = status.straggling_condition({3: 1.0}, 1.2, 1, T0)
    assert (no["status"], no["reason"]) == ("False", "NoStragglers")


# ---- created / invalid ----------------------------------------------------------------------


def test_invalid_spec_fails_with_a_ready_false_condition() -> None:
    s = status.invalid_spec_status("heads(4) is not divisible by tp(8)", 2, T0)
    assert s["phase"] == "Failed"
    assert s["observedGeneration"] == 2
    (c,) = s["conditions"]
    assert (c["type"], c["status"], c["reason"]) == ("Ready", "False", "InvalidSpec")
    assert c["observedGeneration"] == 2
    assert "tp(8)" in c["message"]


def test_created_status_is_pending_with_the_plan() -> None:
    s = status.created_status(PLAN, PODS, 8, 1, T0)
    assert s["phase"] == "Pending"
    assert s["plan"]["generation"] == 4
    assert s["pods"] == PODS and s["gpus"] == 8 and s["step"] == 0
    assert s["conditions"][0]["reason"] == "PodsPending"


def test_replan_status_records_the_last_replan() -> None:
    s = status.replan_status(
        PLAN,
        reason="rank 6 slowed",
        at=T0,
        planning_seconds=0.12345,
        migration_seconds=2.5,
        migration_bytes=1024,
    )
    assert s["lastReplan"] == {
        "time": "2025-05-01T12:00:00Z",
        "reason": "rank 6 slowed",
        "generation": 4,
        "planningSeconds": 0.1235,
        "migrationSeconds": 2.5,
        "migrationBytes": 1024,
    }
    assert s["plan"]["generation"] == 4


# ---- pods -----------------------------------------------------------------------------------


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
    assert status.pod_outcome(p).state == state


def test_pod_outcome_explains_failures_and_stuck_pulls() -> None:
    assert "Evicted" in status.pod_outcome(pod("a", "Failed", reason="Evicted")).detail
    assert "code 137" in status.pod_outcome(terminated("a", 137)).detail
    stuck = pod(
        "a",
        "Pending",
        containerStatuses=[{"name": "t", "state": {"waiting": {"reason": "ImagePullBackOff"}}}],
    )
    assert status.pod_outcome(stuck).detail.startswith("ImagePullBackOff")


def test_all_running_moves_pending_to_running() -> None:
    st = {"phase": "Pending", "conditions": []}
    t = status.pods_transition(st, [pod(n) for n in PODS], PODS, 1, T0)
    assert t.status["phase"] == "Running"
    assert t.status["conditions"][0]["status"] == "True"
    assert [e.reason for e in t.events] == ["Running"]
    # once Running, the same pods change nothing
    assert not status.pods_transition({"phase": "Running"}, [pod(n) for n in PODS], PODS, 1, T0)


def test_some_pending_says_why_once() -> None:
    st: dict[str, Any] = {"phase": "Pending", "conditions": []}
    stuck = pod(
        PODS[1],
        "Pending",
        containerStatuses=[{"name": "t", "state": {"waiting": {"reason": "ErrImagePull"}}}],
    )
    t = status.pods_transition(st, [pod(PODS[0]), stuck], PODS, 1, T0)
    assert "phase" not in t.status
    (cond,) = t.status["conditions"]
    assert cond["reason"] == "PodsPending"
    assert "1/2" in cond["message"] and "ErrImagePull" in cond["message"]
    st["conditions"] = t.status["conditions"]
    assert not status.pods_transition(st, [pod(PODS[0]), stuck], PODS, 1, T0)


def test_a_failed_pod_fails_the_job_with_an_event() -> None:
    t = status.pods_transition(
        {"phase": "Running"}, [pod(PODS[0]), terminated(PODS[1], 1)], PODS, 1, T0
    )
    assert t.status["phase"] == "Failed"
    assert t.status["conditions"][0]["reason"] == "PodFailed"
    assert [(e.type, e.reason) for e in t.events] == [("Warning", "PodFailed")]
    assert PODS[1] in t.events[0].message


def test_a_deleted_pod_fails_a_live_job() -> None:
    t = status.pods_transition({"phase": "Running"}, [pod(PODS[0])], PODS, 1, T0, deleted=[PODS[1]])
    assert t.status["phase"] == "Failed"
    assert "deleted" in t.status["message"]


def test_all_succeeded_completes_the_job() -> None:
    t = status.pods_transition(
        {"phase": "Running"}, [pod(n, "Succeeded") for n in PODS], PODS, 1, T0
    )
    assert t.status["phase"] == "Succeeded"
    assert t.status["conditions"][0]["reason"] == "Completed"


@pytest.mark.parametrize("phase", ["Failed", "Succeeded", None])
def test_terminal_or_unstarted_jobs_never_change(phase: str | None) -> None:
    st = {"phase": phase} if phase else {}
    assert not status.pods_transition(st, [terminated(PODS[0], 1)], PODS, 1, T0)


def test_pods_of_other_names_are_ignored() -> None:
    t = status.pods_transition(
        {"phase": "Running"}, [pod(n) for n in PODS] + [terminated("x", 1)], PODS, 1, T0
    )
    assert not t
