"""Rates with limits: bounded before they are smoothed, and no burst can write off the job.

Reproduced before the fix: reporting 7 of 8 ranks at 50x left 1 GPU training, and a rate of
1e307 crashed the planner. The spoofing sources here are real parsers (the Prometheus answer
reader with its ownership check) in front of a SimulatedJob that runs the true rates.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from malleus.controller import EventKind, Observation, SimulatedJob
from malleus.controller.events import Planned, StragglerDetected
from malleus.controller.guard import PERSIST_WINDOWS, ExclusionGuard
from malleus.controller.prometheus import observation_from_results, own_rank_series
from malleus.job import StragglerPolicy
from malleus.job.rates import bounded_rates
from malleus.planner import Plan, PlanningProblem
from malleus.planner.problem import MAX_RATE

from .conftest import greedy_planner
from .test_loop import controller, kinds, slow

K = EventKind


def test_bounded_rates_keep_the_job_s_ranks_and_finite_capped_figures() -> None:
    rates = {0: 1e307, 1: math.nan, 2: math.inf, 3: -1.0, 4: 0.9, 5: None, 6: 0.0, 99: 2.0}
    assert bounded_rates(rates, 8) == {0: MAX_RATE, 1: None, 2: None, 4: 0.9, 5: None}


def test_the_guard_holds_a_burst_beyond_the_share_until_it_persists() -> None:
    policy = StragglerPolicy(window_steps=5)
    guard = ExclusionGuard(policy, world=8)
    assert guard.allowed == 2 and guard.persist_steps == PERSIST_WINDOWS * 5
    burst = {r: (50.0 if r < 7 else 1.0) for r in range(8)}
    guard.track(10, burst)
    rates, held = guard.limit(burst, {}, 10)
    assert held == [0, 1, 2, 3, 4, 5, 6] and all(rates[r] == 1.0 for r in range(8))
    # the plan in force already works around rank 0: it counts, and it is not held
    rates, held = guard.limit(burst, {0: 3.0}, 10)
    assert held == [1, 2, 3, 4, 5, 6] and rates[0] == 50.0
    # two at once are within the share
    two = {0: 50.0, 1: None}
    assert guard.limit(two, {}, 10) == (two, [])
    assert guard.steps_left(held, 10) == 15
    guard.track(25, burst)
    assert guard.limit(burst, {}, 25) == (burst, [])  # persisted: believed
    guard.track(26, {3: 1.0})
    assert not guard.persisted(3, 26) and guard.persisted(4, 26)


def test_a_tiny_job_still_reacts_to_one_straggler_at_once() -> None:
    guard = ExclusionGuard(StragglerPolicy(max_exclusion_share=0.25), world=2)
    assert guard.allowed == 1
    assert guard.limit({1: 4.0}, {}, 0) == ({1: 4.0}, [])


def test_a_huge_rate_reaches_the_planner_capped(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    seen: list[PlanningProblem] = []

    def recording(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        seen.append(problem)
        return greedy_planner(problem, time_limit=time_limit)

    sim = make_sim(slow({3: (10, None, 4.0)}), steps=30)
    spoofed = Spoofing(sim, lambda step, rates: {**rates, 3: 1e307} if step >= 10 else rates)
    c, events = controller(sim, builder, clock, policy, planner=recording)
    c.source = spoofed
    asyncio.run(c.run())
    assert seen and seen[0].rates[3] == MAX_RATE
    assert K.REPLAN_FAILED not in kinds(events)
    assert c.plan.excluded == [2, 3]


class Spoofing:
    """The simulated trainers' observations, rewritten by `lie(step, rates)` on the way."""

    def __init__(self, sim: SimulatedJob, lie: Any) -> None:
        self.sim, self.lie = sim, lie

    async def read(self) -> Observation | None:
        obs = await self.sim.read()
        if obs is None:
            return None
        rates = self.lie(obs.step, dict(obs.rates))
        return Observation(obs.step, obs.step_seconds, rates, obs.generation)


def test_a_burst_of_seven_of_eight_gpus_at_50x_cannot_shrink_the_job(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    burst = range(10, 10 + 3 * policy.window_steps)  # shorter than the persistence asked for
    sim = make_sim(lambda s: {}, steps=60)
    liar = Spoofing(
        sim,
        lambda step, rates: {r: (50.0 if r else 1.0) for r in rates} if step in burst else rates,
    )
    c, events = controller(sim, builder, clock, policy)
    c.source = liar
    asyncio.run(c.run())
    assert sim.published == [] and c.plan.excluded == []
    skipped = [e for e in events if e.kind is K.REPLAN_SKIPPED]
    assert kinds(events) == [K.REPLAN_SKIPPED]
    assert "7 of 8 GPUs report straggling at once" in skipped[0].message
    assert "maxExclusionShare allows (2)" in skipped[0].message


def test_a_real_slowdown_beyond_the_share_is_planned_around_once_it_persists(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({r: (10, None, 4.0) for r in (2, 3, 5)}), steps=60)
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    assert kinds(events)[0] is K.REPLAN_SKIPPED
    replanned = [e for e in events if e.kind is K.REPLANNED]
    assert len(replanned) == 1
    flagged_from = 10 + policy.window_steps // 2  # the median turns at the quorum
    assert replanned[0].step == flagged_from + PERSIST_WINDOWS * policy.window_steps
    detected = next(e.data for e in events if isinstance(e.data, StragglerDetected))
    assert {r: detected.rates[r] for r in (2, 3, 5)} == dict.fromkeys((2, 3, 5), 4.0)
    planned = next(e.data for e in events if isinstance(e.data, Planned))
    assert planned.decision.new_seconds < planned.decision.old_seconds
    assert 5 in c.plan.excluded and sim.plan == c.plan


def test_one_pod_claiming_another_pods_ranks_is_ignored(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    """Prometheus mode: every worker pod publishes every rank; node 1's pod claims that the
    four GPUs of node 0 are 50x slow, for the whole run."""
    keep = own_rank_series(gpus_per_node=4, pattern=r"-node-(\d+)$")

    def series(step: int, rates: dict[int, float | None]) -> dict[int, float | None]:
        samples = []
        for node in (0, 1):
            for rank, rate in rates.items():
                claim = 50.0 if node == 1 and rank < 4 else rate
                labels = {"rank": str(rank), "pod": f"ctl-test-node-{node}"}
                samples.append((labels, math.nan if claim is None else claim))
        got = observation_from_results(samples, [({}, step)], [], [({}, 0)], keep=keep)
        assert got is not None
        return dict(got.rates)

    sim = make_sim(slow({6: (10, None, 4.0)}), steps=40)
    c, events = controller(sim, builder, clock, policy)
    c.source = Spoofing(sim, series)
    asyncio.run(c.run())
    assert kinds(events) == [K.STRAGGLER_DETECTED, K.PLANNED, K.REPLANNED, K.MIGRATED]
    assert c.plan.excluded == [6, 7]  # the real straggler, and only it
    unchecked = observation_from_results(
        [({"rank": "0", "pod": "ctl-test-node-1"}, 50.0)], [({}, 1)], [], []
    )
    assert unchecked is not None and unchecked.rates == {0: 50.0}  # what the check refuses
