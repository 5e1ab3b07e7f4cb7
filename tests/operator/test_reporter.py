"""The reporter (observations and typed decision events -> status, events, metrics) and the plan
ConfigMap around the controller's sink, over HTTP against kmock."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from malleus.controller.decision import Decision
from malleus.controller.detector import Shift
from malleus.controller.events import (
    DecisionEvent,
    Migrated,
    Planned,
    ReplanFailed,
    Replanned,
    ReplanSkipped,
    StragglerDetected,
)
from malleus.controller.ports import Ack, Observation
from malleus.operator import handlers, jobs, planstore, resources
from malleus.operator.context import Context
from malleus.operator.reporter import JobReporter
from malleus.planner.plan import Estimate, Pipeline, Plan, Stage
from tests.operator.kube import Kube
from tests.statuses import control_status

REF = resources.JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)
T = 1_700_000_000.0


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def created(
    kube: Kube, memo: kopf.Memo, body: dict[str, Any], phase: str = "Running"
) -> dict[str, Any]:
    """A job after on_create in ``phase``; returns kopf's live view of it."""
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", {**patch["status"], "phase": phase})
    return kube.job("ml", "demo")


def reporter(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any, **spec: Any
) -> tuple[JobReporter, dict[str, Any]]:
    body = created(kube, memo, make_job(**spec))
    return JobReporter(ctx, REF, jobs.resolve(body), body), body


def obs(step: int, rates: dict[int, float | None], seconds: float | None = 0.5) -> Observation:
    return Observation(step=step, step_seconds=seconds, rates=rates, generation=1)


DECISION = Decision(
    apply=True,
    reason="worth it",
    old_units=30.0,
    new_units=20.0,
    old_seconds=None,
    new_seconds=None,
    relative_gain=0.33,
    gain_seconds=None,
    migration_mb=1.0,
    migration_seconds=0.1,
    planning_seconds=0.2,
)
NEW = Plan(
    generation=2,
    tp=2,
    pipelines=[Pipeline(micro_batches=8, stages=[Stage(ranks=[0, 1], layers=(0, 8))])],
    excluded=[2, 3, 4, 5, 6, 7],
    estimate=Estimate(step_time=20.0, uniform_step_time=30.0),
)
SHIFT = Shift(step=7, time=T, reason="rank 3 slowed (1.00 -> 3.00)", ranks={3: (1.0, 3.0)})


def event(data: Any, message: str = "m") -> DecisionEvent:
    return DecisionEvent(step=7, time=T, message=message, data=data)


EVERY_KIND = [
    StragglerDetected(SHIFT, {3: 3.0}),
    Planned(NEW, DECISION),
    ReplanSkipped("cooldown", shift=SHIFT),
    Replanned(2, NEW, DECISION),
    Migrated(2, 9, 1.5, 4096.0, NEW, SHIFT.reason, 0.01),
    ReplanFailed("planner failed"),
]


def test_observations_update_step_and_tokens_and_the_controllers_rates_the_stragglers(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    rep, _ = reporter(kube, memo, ctx, make_job)
    run(rep.on_observation(obs(12, {3: 2.5, 4: 1.0})))
    st = kube.job("ml", "demo")["status"]
    assert st["step"] == 12
    # tiny preset: sequence 64, global batch 16 -> 1024 tokens per step, 0.5 s per step
    assert st["tokensPerSecond"] == 2048.0
    assert st["stragglers"] == []  # a raw observation is not what the controller judged
    run(rep.on_rates(12, {3: 2.5, 4: 1.0}))
    st = kube.job("ml", "demo")["status"]
    assert st["stragglers"] == [{"rank": 3, "node": 0, "rate": 2.5}]
    assert st["stragglerSummary"] == "1 (r3 2.5x)"
    cond = next(c for c in st["conditions"] if c["type"] == "Straggling")
    assert cond["status"] == "True"
    assert next(c for c in st["conditions"] if c["type"] == "Ready")  # merged, not replaced
    # nothing changed: no second patch
    patches = kube.requests("update", "MalleusJob")
    run(rep.on_observation(obs(12, {3: 2.5, 4: 1.0})))
    run(rep.on_rates(12, {3: 2.5, 4: 1.0}))
    assert kube.requests("update", "MalleusJob") == patches


def test_rates_without_a_quorum_leave_the_stragglers_shown(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """A restarted daemon's controller has no window yet (empty smoothed rates): the status
    keeps the stragglers it showed, which that controller believes, until it knows better."""
    rep, _ = reporter(kube, memo, ctx, make_job)
    run(rep.on_rates(7, {3: 4.0, 4: 1.0}))
    restarted = JobReporter(ctx, REF, rep.job, kube.job("ml", "demo"))
    run(restarted.on_rates(9, {}))
    assert kube.job("ml", "demo")["status"]["stragglers"] == [{"rank": 3, "node": 0, "rate": 4.0}]
    run(restarted.on_rates(10, {3: 1.0, 4: 1.0}))
    assert kube.job("ml", "demo")["status"]["stragglers"] == []
    cond = next(
        c for c in kube.job("ml", "demo")["status"]["conditions"] if c["type"] == "Straggling"
    )
    assert cond["status"] == "False"


def test_decision_events_become_kubernetes_events(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    rep, _ = reporter(kube, memo, ctx, make_job)
    for data in EVERY_KIND:
        run(rep.on_event(event(data, f"about {data.kind.value}")))
    posted = [(e["type"], e["reason"], e["message"]) for e in kube.events[1:]]  # after Created
    assert posted == [
        ("Warning", "StragglerDetected", "about StragglerDetected"),
        ("Normal", "ReplanSkipped", "about ReplanSkipped"),
        ("Normal", "Replanned", "about Replanned"),
        ("Normal", "Migrated", "about Migrated"),
        ("Warning", "ReplanFailed", "about ReplanFailed"),
    ]  # Planned is not an event: it is in the status and the metrics


def test_replanned_then_migrated_updates_phase_plan_and_last_replan(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    rep, body = reporter(kube, memo, ctx, make_job)
    replans = ctx.metrics.replans.labels(namespace="ml", job="demo")
    run(rep.on_event(event(Replanned(2, NEW, DECISION), "published plan generation 2")))
    assert kube.job("ml", "demo")["status"]["phase"] == "Replanning"
    body["status"]["phase"] = "Replanning"  # kopf's live view follows the stored status
    migrated = Migrated(2, 9, 1.5, 4096.0, NEW, SHIFT.reason, 0.01)
    run(rep.on_event(event(migrated, "trainers run generation 2")))
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    assert st["message"] == "trainers run generation 2"
    assert st["plan"]["generation"] == 2
    assert st["plan"]["excluded"] == [2, 3, 4, 5, 6, 7]
    assert st["plan"]["predictedSpeedup"] == 1.5  # the plan's estimate, from the event
    assert st["lastReplan"] == {
        "time": "2023-11-14T22:13:20Z",
        "reason": "rank 3 slowed (1.00 -> 3.00)",
        "generation": 2,
        "planningSeconds": 0.01,
        "migrationSeconds": 1.5,
        "migrationBytes": 4096,
    }
    assert replans._value.get() == 1


def test_the_daemon_never_overrides_a_terminal_phase(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    rep, body = reporter(kube, memo, ctx, make_job)
    kube.merge_status("ml", "demo", {"phase": "Failed"})
    body["status"]["phase"] = "Failed"
    run(rep.on_event(event(Replanned(2, NEW, DECISION))))
    run(rep.on_event(event(ReplanFailed("planner failed"))))
    assert kube.job("ml", "demo")["status"]["phase"] == "Failed"
    assert ctx.metrics.replan_failures.labels(namespace="ml", job="demo")._value.get() == 1


def test_planned_events_feed_the_planning_histogram(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    rep, _ = reporter(kube, memo, ctx, make_job)

    def count() -> float:
        for family in ctx.metrics.registry.collect():
            if family.name == "malleus_operator_planning_seconds":
                for s in family.samples:
                    if s.name.endswith("_count"):
                        return s.value
        return 0.0

    before = count()  # the initial plan's
    run(rep.on_event(event(Planned(NEW, DECISION))))
    assert count() == before + 1


# ---- the plan ConfigMap around the controller's sink ------------------------------------------


class InnerSink:
    def __init__(self) -> None:
        self.published: list[Plan] = []

    async def publish(self, plan: Plan) -> int:
        self.published.append(plan)
        return plan.generation

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        return Ack(generation=generation, step=9, migration_seconds=0.5, migration_bytes=10.0)


def cm(kube: Kube) -> dict[str, str]:
    found = kube.get("ConfigMap", "ml", "demo-config")
    assert found is not None
    data: dict[str, str] = found["data"]
    return data


def test_sink_records_pending_then_in_force(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    created(kube, memo, make_job())
    new = Plan.from_json(cm(kube)["plan.json"]).model_copy(update={"generation": 2})
    sink = planstore.ConfigMapPlanSink(ctx.cluster, REF, InnerSink())

    async def go() -> None:
        assert await sink.publish(new) == 2
        assert Plan.from_json(cm(kube)[planstore.PENDING_KEY]).generation == 2
        assert Plan.from_json(cm(kube)[resources.PLAN_KEY]).generation == 1
        ack = await sink.wait_applied(2, 1.0)
        assert ack.migration_seconds == 0.5

    run(go())
    assert planstore.PENDING_KEY not in cm(kube)
    assert Plan.from_json(cm(kube)[resources.PLAN_KEY]).generation == 2


@pytest.mark.parametrize(
    ("running", "trainers_pending", "expected", "kept"),
    [(2, None, 2, False), (1, 2, 1, True), (1, None, 1, False), (None, None, 1, True)],
)
def test_resume_promotes_a_pending_plan_only_if_it_runs(
    kube: Kube,
    memo: kopf.Memo,
    ctx: Context,
    make_job: Any,
    running: int | None,
    trainers_pending: int | None,
    expected: int,
    kept: bool,
) -> None:
    created(kube, memo, make_job())
    stored = kube.get("ConfigMap", "ml", "demo-config")
    assert stored is not None
    pending = Plan.from_json(stored["data"]["plan.json"]).model_copy(update={"generation": 2})
    stored["data"][planstore.PENDING_KEY] = pending.to_json()
    kube.put("ConfigMap", stored)
    answer = None
    if running is not None:
        answer = control_status(
            world=8, generation=running, pending_generation=trainers_pending, step=5, steps=100
        )
    plan, still = run(planstore.resume_plan(ctx.cluster, REF, answer))
    assert plan is not None and plan.generation == expected
    assert (still is not None) == kept and (planstore.PENDING_KEY in cm(kube)) == kept
    assert Plan.from_json(cm(kube)[resources.PLAN_KEY]).generation == expected
