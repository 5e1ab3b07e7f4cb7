"""Pure status builders: conditions, plan summaries, stragglers, as the typed status dumps them."""

from __future__ import annotations

import datetime as dt
from typing import Any

from malleus.errors import Fault
from malleus.job import LastReplan, MalleusJobStatus, StragglerPolicy
from malleus.operator import status
from malleus.planner.plan import Estimate, Pipeline, Plan, Stage

T0 = dt.datetime(2025, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)
PODS = ["demo-node-0", "demo-node-1"]
POLICY = StragglerPolicy(threshold=1.2)


def shown(s: MalleusJobStatus) -> dict[str, Any]:
    return status.dump(s)


def cond(c: Any) -> dict[str, Any]:
    return c.model_dump(mode="json", by_alias=True, exclude_none=True)


# ---- conditions -----------------------------------------------------------------------------


def test_condition_has_the_metav1_shape() -> None:
    c = cond(status.condition("Ready", True, "Running", "ok", 3, T0))
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
    assert same[0].last_transition_time == T0
    assert same[0].message == "b"
    flipped = status.merge_conditions(same, status.condition("Ready", True, "Running", "c", 1, T1))
    assert flipped[0].last_transition_time == T1
    both = status.merge_conditions(
        flipped, status.condition("Straggling", False, "NoStragglers", "", 1, T1)
    )
    assert [c.type for c in both] == ["Ready", "Straggling"]


def test_merge_reads_stored_conditions_and_drops_foreign_entries() -> None:
    stored = [cond(status.condition("Ready", True, "Running", "a", 1, T0)), {"bogus": 1}]
    merged = status.merge_conditions(stored, status.condition("Ready", True, "Running", "b", 2, T1))
    assert [cond(c) for c in merged] == [
        cond(status.condition("Ready", True, "Running", "b", 2, T0))
    ]


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


def test_plan_status_is_a_summary_with_predictions() -> None:
    s = status.plan_status(PLAN).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert s == {
        "generation": 4,
        "summary": "2 pipelines [2,1 stages] tp 2/1, 1 GPU out, 2.50x vs static",
        "tp": 2,
        "dp": 2,
        "excluded": [5],
        "predictedSpeedup": 2.5,
        "predictedStepTime": 50.0,
    }


def _stages(*counts: int, width: int = 8) -> Plan:
    """A plan of pipelines with ``counts`` stages each, ``width`` ranks per stage."""
    rank = 0
    pipelines = []
    for n in counts:
        stages = []
        for j in range(n):
            stages.append(Stage(ranks=list(range(rank, rank + width)), layers=(j, j + 1)))
            rank += width
        pipelines.append(Pipeline(micro_batches=1, stages=stages))
    return Plan(generation=1, tp=width, pipelines=pipelines)


def test_plan_summary_reads_like_the_issue() -> None:
    plan = _stages(4, 4, 3)
    narrow = plan.pipelines[2].stages[0].model_copy(update={"ranks": [0, 1, 2, 3]})
    plan.pipelines[2].stages[0] = narrow
    plan = plan.model_copy(
        update={
            "excluded": [88, 89],
            "estimate": Estimate(step_time=10.0, uniform_step_time=18.4),
        }
    )
    assert (
        status.plan_summary(plan)
        == "3 pipelines [4,4,3 stages] tp 8/4, 2 GPUs out, 1.84x vs static"
    )
    assert status.plan_summary(_stages(1, width=2)) == "1 pipeline [1 stage] tp 2"


def test_plan_summary_of_a_70b_job_stays_one_short_line() -> None:
    """64 pipelines: run-length counts, not one entry per pipeline (nor per stage)."""
    plan = _stages(*([8] * 60 + [7] * 4), width=1)
    text = status.plan_summary(plan)
    assert text == "64 pipelines [8x60,7x4 stages] tp 1"
    ragged = status.plan_summary(_stages(*range(64, 0, -1), width=1))
    assert ragged.startswith("64 pipelines [64,63,62,") and len(ragged) <= 256


def test_infinite_uniform_time_gives_no_speedup() -> None:
    plan = PLAN.model_copy(
        update={"estimate": Estimate(step_time=50.0, uniform_step_time=float("inf"))}
    )
    assert status.plan_status(plan).predicted_speedup is None


# ---- stragglers -----------------------------------------------------------------------------


def test_stragglers_worst_first_with_a_short_summary() -> None:
    rates = {0: 1.0, 1: 3.04, 5: 1.19, 6: 2.0, 7: None}
    s = shown(status.stragglers(rates, POLICY, gpus_per_node=4))
    assert s["stragglers"] == [
        {"rank": 7, "node": 1},
        {"rank": 1, "node": 0, "rate": 3.04},
        {"rank": 6, "node": 1, "rate": 2.0},
    ]
    assert s["stragglerSummary"] == "3 (r7 down, r1 3.0x, r6 2.0x)"
    assert shown(status.stragglers({0: 1.0}, POLICY, 4)) == {
        "stragglers": [],
        "stragglerSummary": "0",
    }
    many = {r: 2.0 for r in range(6)}
    assert status.stragglers(many, POLICY, 4).straggler_summary.endswith(", ...)")


def test_straggling_condition() -> None:
    yes = status.straggling_condition({3: 2.0, 4: None}, POLICY, 1, T0)
    assert (yes.status, yes.reason) == ("True", "StragglersDetected")
    assert "ranks [3, 4]" in yes.message
    no = status.straggling_condition({3: 1.0}, POLICY, 1, T0)
    assert (no.status, no.reason) == ("False", "NoStragglers")


# ---- created / invalid ----------------------------------------------------------------------


def test_invalid_spec_fails_with_a_ready_false_condition() -> None:
    faults = [
        Fault("spec.parallelism.tp", "heads(4) is not divisible by tp(8)"),
        Fault("spec.parallelism.dp", "dp(9) exceeds the GPU count 8"),
    ]
    s = shown(status.invalid_spec_status(faults, 2, T0))
    assert s["phase"] == "Failed"
    assert s["observedGeneration"] == 2
    c, failed = s["conditions"]
    assert (c["type"], c["status"], c["reason"]) == ("Ready", "False", "InvalidSpec")
    assert (failed["type"], failed["status"], failed["reason"]) == ("Failed", "True", "InvalidSpec")
    assert s["completionTime"] == "2025-05-01T12:00:00Z"
    assert c["observedGeneration"] == 2
    assert (
        c["message"]
        == s["message"]
        == (
            "invalid spec: spec.parallelism.tp: heads(4) is not divisible by tp(8); "
            "spec.parallelism.dp: dp(9) exceeds the GPU count 8"
        )
    )


def test_created_status_is_pending_with_the_plan() -> None:
    s = shown(status.created_status(PLAN, PODS, 8, 1, T0))
    assert s["phase"] == "Pending"
    assert s["plan"]["generation"] == 4
    assert s["pods"] == PODS and s["gpus"] == 8 and s["step"] == 0
    assert s["conditions"][0]["reason"] == "PodsPending"
    assert s["stragglers"] == [] and s["stragglerSummary"] == "0"
    assert "lastReplan" not in s  # a merge patch carries only what it sets


def test_replan_status_records_the_last_replan() -> None:
    last = LastReplan(
        time=T0,
        reason="rank 6 slowed",
        generation=4,
        planning_seconds=0.1235,
        migration_seconds=2.5,
        migration_bytes=1024,
    )
    s = shown(status.replan_status(PLAN, last))
    assert s["lastReplan"] == {
        "time": "2025-05-01T12:00:00Z",
        "reason": "rank 6 slowed",
        "generation": 4,
        "planningSeconds": 0.1235,
        "migrationSeconds": 2.5,
        "migrationBytes": 1024,
    }
    assert s["plan"]["generation"] == 4
    assert set(s) == {"plan", "lastReplan"}
