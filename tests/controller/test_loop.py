"""The whole decision loop over a simulated job (real objects, a manual clock, no mocks).

SimulatedJob runs each step of the plan in force under the step's true rates and charges the
cost model's step time to the clock (1 s per layer-time unit: a healthy step is 16 s), so
cooldowns, horizons and migrations play out as they would, in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from malleus.controller import (
    Controller,
    DecisionEvent,
    EventKind,
    ManualClock,
    Observation,
    SimulatedJob,
    default_planner,
)
from malleus.controller.events import (
    Migrated,
    Planned,
    ReplanFailed,
    StragglerDetected,
)
from malleus.job import StragglerPolicy
from malleus.planner import Plan, PlanningProblem

from .conftest import TWO_STAGE, greedy_planner

K = EventKind


def controller(
    sim: SimulatedJob,
    builder: Any,
    clock: ManualClock,
    policy: StragglerPolicy,
    planner: Callable[..., Plan] = greedy_planner,
    **kw: Any,
) -> tuple[Controller, list[DecisionEvent]]:
    events: list[DecisionEvent] = []
    kw.setdefault("on_event", events.append)
    c = Controller(
        sim,
        sim,
        initial_plan=sim.plan,
        problem_builder=builder,
        policy=policy,
        planner=planner,
        clock=clock,
        planner_grace_seconds=0.0,
        **kw,
    )
    return c, events


def kinds(events: list[DecisionEvent]) -> list[EventKind]:
    return [e.kind for e in events]


def slow(schedule: dict[int, tuple[int, int | None, float | None]]) -> Callable[[int], dict]:
    """rank -> (from step, to step or None, rate)."""

    def rates_at(step: int) -> dict[int, float | None]:
        return {
            r: rate
            for r, (start, end, rate) in schedule.items()
            if start <= step and (end is None or step < end)
        }

    return rates_at


def test_a_one_step_spike_causes_no_replan(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({3: (20, 21, 6.0)}), steps=60)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    assert events == [] and sim.published == []
    assert c.last_step == 59


def test_a_lasting_slowdown_replans_within_the_window(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({3: (20, None, 4.0)}), steps=60)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    assert kinds(events) == [K.STRAGGLER_DETECTED, K.PLANNED, K.REPLANNED, K.MIGRATED]
    assert 20 <= events[0].step < 20 + policy.window_steps
    assert isinstance(events[0].data, StragglerDetected)
    assert events[0].data.shift.causes == {3: "slowed"}
    assert [e.step for e in events] == [events[0].step] * 4
    # the slow group is left out: 3 pipelines take the 8 micro-batches (3+3+2) -> 24 s steps
    assert c.plan.generation == 1 and sim.plan.generation == 1
    assert c.plan.excluded == [2, 3]
    planned = events[1].data
    assert isinstance(planned, Planned) and planned.plan.excluded == [2, 3]
    assert (planned.decision.old_seconds, planned.decision.new_seconds) == (64.0, 24.0)
    assert c.plan.estimate is not None and c.plan.estimate.step_time == 24.0


def test_a_recovered_gpu_is_readmitted(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({3: (10, 40, 4.0)}), steps=80)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    detected = [e for e in events if e.kind is K.STRAGGLER_DETECTED]
    causes = [e.data.shift.causes for e in detected if isinstance(e.data, StragglerDetected)]
    assert causes == [{3: "slowed"}, {3: "recovered"}]
    assert 40 <= detected[1].step < 40 + policy.window_steps
    assert len(sim.published) == 2
    assert 3 in c.plan.active_ranks() and c.plan.excluded == []
    assert c.plan.generation == 2


def test_rates_flapping_around_the_threshold_cause_no_churn(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    pattern = [1.05, 1.3, 1.1, 1.35, 1.15, 1.25, 1.1, 1.3, 1.0, 1.32]
    calls: list[int] = []

    def counting(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        calls.append(1)
        return greedy_planner(problem, time_limit=time_limit)

    sim = make_sim(lambda s: {3: pattern[s % len(pattern)]}, steps=200)
    c, _ = controller(sim, builder, clock, policy, planner=counting)
    asyncio.run(c.run())
    assert len(sim.published) <= 1
    assert len(calls) <= 2


def test_a_straggler_wobbling_inside_the_hysteresis_is_planned_for_once(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(lambda s: {3: 3.0 + (0.2 if s % 3 == 0 else -0.2)}, steps=200)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    assert len(sim.published) == 1
    assert kinds(events).count(K.STRAGGLER_DETECTED) == 1


def test_cooldown_is_respected(make_sim: Any, builder: Any, clock: Any) -> None:
    policy = StragglerPolicy(cooldown_seconds=1000)  # ~10 steps after the first switch
    sim = make_sim(slow({3: (10, None, 4.0), 5: (15, None, 4.0)}), steps=60)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    skipped = [e for e in events if e.kind is K.REPLAN_SKIPPED]
    assert len(skipped) == 1 and skipped[0].message.startswith("cooldown:")
    migrated = [e for e in events if e.kind is K.MIGRATED]
    replanned = [e for e in events if e.kind is K.REPLANNED]
    assert len(replanned) == 2
    assert replanned[1].time - migrated[0].time >= 1000
    assert skipped[0].step < replanned[1].step
    assert len(sim.published) == 2


def test_a_failed_rank_replans_at_once_even_in_cooldown(
    make_sim: Any, builder: Any, clock: Any
) -> None:
    policy = StragglerPolicy(cooldown_seconds=1e6)
    sim = make_sim(slow({3: (10, None, 4.0), 6: (20, None, None)}), steps=30)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    replanned = [e for e in events if e.kind is K.REPLANNED]
    assert len(replanned) == 2
    assert replanned[1].step == 20
    failed = [e for e in events if e.kind is K.STRAGGLER_DETECTED][1]
    assert isinstance(failed.data, StragglerDetected)
    assert failed.data.shift.causes == {6: "failed"} and failed.data.shift.urgent
    assert failed.data.rates[6] is None
    assert failed.type == "Warning"
    assert 6 not in c.plan.active_ranks() + c.plan.excluded
    assert 7 in c.plan.excluded
    assert "cannot run" in replanned[1].message


def test_a_planner_timeout_is_reported_and_the_loop_continues(
    make_sim: Any, builder: Any, clock: Any
) -> None:
    policy = StragglerPolicy(cooldown_seconds=0, planning_timeout_seconds=1)  # whole seconds
    release = threading.Event()
    calls: list[int] = []

    def stuck_once(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        calls.append(1)
        if len(calls) == 1:
            release.wait(10)  # ignores its time limit, as a buggy planner would
        return greedy_planner(problem, time_limit=time_limit)

    sim = make_sim(slow({3: (5, None, 4.0)}), steps=20)
    c, events = controller(sim, builder, clock, policy, planner=stuck_once)
    try:
        asyncio.run(c.run())
    finally:
        release.set()
    assert kinds(events) == [
        K.STRAGGLER_DETECTED,
        K.REPLAN_FAILED,
        K.STRAGGLER_DETECTED,
        K.PLANNED,
        K.REPLANNED,
        K.MIGRATED,
    ]
    assert "did not answer within 1 s" in events[1].message
    assert events[2].step == events[1].step + 1
    assert c.last_step == 19


def test_planner_errors_and_invalid_plans_are_reported(
    make_sim: Any, builder: Any, clock: Any
) -> None:
    policy = StragglerPolicy(cooldown_seconds=0)

    def broken(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        raise ValueError("no layout found")

    def invalid(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        plan = greedy_planner(problem, time_limit=time_limit)
        plan.pipelines[0].micro_batches += 1
        return plan

    for planner, expected in ((broken, "planner failed: no layout found"), (invalid, "invalid")):
        sim = make_sim(slow({3: (5, None, 4.0)}), steps=8)
        c, events = controller(sim, builder, clock, policy, planner=planner)
        asyncio.run(c.run())
        failures = [e for e in events if e.kind is K.REPLAN_FAILED]
        assert failures and all(expected in e.message for e in failures)
        assert sim.published == [] and c.plan.generation == 0
    assert isinstance(failures[0].data, ReplanFailed)
    assert any("pipelines sum to 9" in v for v in failures[0].data.violations)


def test_a_lost_acknowledgement_is_reported_then_adopted_when_seen(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({3: (5, None, 4.0)}), steps=20, acknowledge="late")
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    assert kinds(events) == [
        K.STRAGGLER_DETECTED,
        K.PLANNED,
        K.REPLANNED,
        K.REPLAN_FAILED,
        K.MIGRATED,
    ]
    assert "not acknowledged" in events[3].message
    assert events[4].step == events[3].step + 1
    assert c.plan.generation == 1 and len(sim.published) == 1


def test_allow_exclusion_false_refuses_a_plan_that_idles_gpus(
    make_sim: Any, builder: Any, clock: Any
) -> None:
    policy = StragglerPolicy(allow_exclusion=False)
    sim = make_sim(slow({3: (5, None, 4.0)}), steps=40)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    assert kinds(events) == [K.STRAGGLER_DETECTED, K.PLANNED, K.REPLAN_SKIPPED]
    assert "allowExclusion is false" in events[2].message
    assert sim.published == []


def test_migration_bandwidth_is_learned_from_acknowledged_switches(
    builder: Any, clock: ManualClock, policy: Any
) -> None:
    sim = SimulatedJob(
        builder,
        TWO_STAGE,
        slow({3: (5, None, 4.0)}),
        clock=clock,
        steps=20,
        seconds_per_unit=1.0,
        bandwidth_bytes_per_s=2e8,
    )
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    migrated = [e for e in events if e.kind is K.MIGRATED]
    assert len(migrated) == 1
    done = migrated[0].data
    assert isinstance(done, Migrated) and done.bytes is not None and done.bytes > 0
    assert (done.generation, done.plan, done.step) == (1, c.plan, sim.applied[0][0])
    assert "rank 3 slowed" in done.reason and done.planning_seconds >= 0
    assert c.migration.samples == 1
    assert c.migration.bandwidth == pytest.approx(2e8)


def test_history_is_json_and_the_callback_may_be_async(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    seen: list[str] = []

    async def record(event: DecisionEvent) -> None:
        await asyncio.sleep(0)
        seen.append(event.kind.value)

    sim = make_sim(slow({3: (10, 40, 4.0), 6: (60, None, None)}), steps=70)
    c, _ = controller(sim, builder, clock, policy, on_event=record)
    asyncio.run(c.run())
    history = json.loads(json.dumps([e.to_dict() for e in c.history], allow_nan=False))
    assert [h["kind"] for h in history] == seen
    assert seen == ["StragglerDetected", "Planned", "Replanned", "Migrated"] * 3
    first = history[0]
    assert set(first) == {"kind", "type", "step", "time", "message", "data"}
    assert first["type"] == "Warning" and history[3]["type"] == "Normal"
    assert [h["time"] for h in history] == sorted(h["time"] for h in history)
    assert history[-4]["data"]["causes"] == {"6": "failed"}
    assert history[-4]["data"]["rates"]["6"] is None
    assert history[-2]["data"]["plan"]["generation"] == 3 == c.plan.generation


def test_a_failing_callback_does_not_stop_the_loop(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    def boom(event: DecisionEvent) -> None:
        raise RuntimeError("status patch failed")

    sim = make_sim(slow({3: (5, None, 4.0)}), steps=20)
    c, _ = controller(sim, builder, clock, policy, on_event=boom)
    asyncio.run(c.run())
    assert c.plan.generation == 1 and len(c.history) == 4


def test_run_returns_when_stopped(make_sim: Any, builder: Any, clock: Any, policy: Any) -> None:
    async def main() -> tuple[Controller, SimulatedJob]:
        stop = asyncio.Event()
        sim = make_sim(slow({3: (5, None, 4.0)}), steps=10_000)
        c, _ = controller(
            sim, builder, clock, policy, on_event=lambda e: e.kind is K.MIGRATED and stop.set()
        )
        await c.run(stop)
        return c, sim

    c, sim = asyncio.run(main())
    assert c.plan.generation == 1 and sim.step < 20


def test_step_reads_one_observation_and_repeated_steps_are_ignored(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    async def main() -> None:
        sim = make_sim(lambda s: {}, steps=2)
        c, _ = controller(sim, builder, clock, policy)
        obs = await c.step()
        assert obs is not None and obs.step == 0 and c.last_step == 0
        await c.observe(Observation(0, 16.0, {3: None}, 0))  # same step again: ignored
        assert c.detector.smoothed() == {}
        assert await c.step() is not None
        assert await c.step() is None

    asyncio.run(main())


def test_outside_evidence_is_attached_to_the_detection(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    async def main() -> list[DecisionEvent]:
        sim = make_sim(lambda s: {}, steps=100)
        c, events = controller(sim, builder, clock, policy)
        for step in range(5):
            rates = {r: (4.0 if r == 3 and step >= 2 else 1.0) for r in range(8)}
            await c.observe(Observation(step, 16.0, rates, 0, {3: "throttled: sw_power_cap"}))
        return events

    events = asyncio.run(main())
    assert events[0].kind is K.STRAGGLER_DETECTED
    assert isinstance(events[0].data, StragglerDetected)
    assert events[0].data.evidence == {3: "throttled: sw_power_cap"}


def test_with_the_real_planner_search(make_sim: Any, builder: Any, clock: Any, policy: Any) -> None:
    """The default planner (the search, when installed) behind the same loop."""
    sim = make_sim(slow({3: (10, 40, 4.0)}), steps=70)
    c, events = controller(sim, builder, clock, policy, planner=default_planner)
    asyncio.run(c.run())
    assert kinds(events)[:4] == [K.STRAGGLER_DETECTED, K.PLANNED, K.REPLANNED, K.MIGRATED]
    first = next(e.data for e in events if isinstance(e.data, Planned)).decision
    assert first.new_units < first.old_units
    assert 3 in c.plan.active_ranks() or c.plan.generation == 1


@pytest.mark.parametrize(("warmup", "detected"), [(2, False), (0, True)])
def test_the_first_steps_under_a_plan_are_not_news(
    make_sim: Any, builder: Any, clock: Any, policy: Any, warmup: int, detected: bool
) -> None:
    """A launch's first steps look slow (allocations, new groups); the loop drops them itself,
    so the operator and the local runner see the same input."""

    async def main() -> list[DecisionEvent]:
        sim = make_sim(lambda s: {}, steps=100)
        c, events = controller(sim, builder, clock, policy, warmup_steps=warmup)
        for step in range(8):
            rates = {r: (4.0 if r == 3 and step < 3 else 1.0) for r in range(8)}
            await c.observe(Observation(step, 16.0, rates, 0))
        assert c.last_step == 7  # dropped steps still count as seen
        return events

    events = asyncio.run(main())
    assert (K.STRAGGLER_DETECTED in kinds(events)) is detected


def test_the_rates_shown_are_the_windows_decided_on_and_come_before_the_decision(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    """`on_rates` gets the detector's smoothed rates after every observation it judges, never
    a warm-up one, and before any decision on them: a status fed from it shows the straggler
    a re-plan is about before the re-plan. The warm-up here is healthy and the slowdown comes
    right after it, where a second smoothing that counted the warm-up steps (a median over
    [1, 1, 4]) would still say healthy while the loop (over [1, 4]) decides."""
    log: list[tuple[str, Any]] = []

    async def rates(step: int, smoothed: dict[int, float | None]) -> None:
        await asyncio.sleep(0)
        log.append(("rates", (step, dict(smoothed))))

    async def main() -> None:
        sim = make_sim(lambda s: {}, steps=100)
        c, _ = controller(
            sim,
            builder,
            clock,
            policy,
            on_event=lambda e: log.append(("event", e.kind)),
            on_rates=rates,
        )
        for step in range(5):
            ranks = {r: (4.0 if r == 3 and step >= 3 else 1.0) for r in range(8)}
            await c.observe(Observation(step, 16.0, ranks, 0))
            if log and log[-1][0] == "event":
                return

    asyncio.run(main())
    shown = [v for kind, v in log if kind == "rates"]
    assert next(step for step, _ in shown) == 2  # steps 0 and 1: the warm-up, not judged
    first_event = next(i for i, (kind, _) in enumerate(log) if kind == "event")
    assert log[first_event][1] is K.STRAGGLER_DETECTED
    before = [v for kind, v in log[:first_event] if kind == "rates"]
    assert before[-1][1][3] is not None and policy.is_straggler(before[-1][1][3])


def test_a_failing_rates_callback_does_not_stop_the_loop(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    def boom(step: int, smoothed: dict[int, float | None]) -> None:
        raise RuntimeError("status patch failed")

    sim = make_sim(slow({3: (5, None, 4.0)}), steps=20)
    c, _ = controller(sim, builder, clock, policy, on_rates=boom)
    asyncio.run(c.run())
    assert len(c.history) == 4  # detected, planned, replanned, migrated all the same
