"""Generations converge: the trainers own the counter and the decision loop follows it.

Reproduced before the fix: once the trainers knew a generation newer than the controller's
(a manual POST /plan, a --switch, a controller restarted between a publish and its
acknowledgement), every later plan was refused with 409 and nothing was ever applied again.
SimulatedJob answers like the trainers' inbox (the next generation only) and remembers its plans.
"""

from __future__ import annotations

import asyncio
from typing import Any

from malleus.controller import Controller, EventKind, Observation, SimulatedJob
from malleus.controller.events import Migrated, ReplanFailed
from malleus.controller.ports import Ack, GenerationConflict
from malleus.planner import Pipeline, Plan, Stage

from .conftest import greedy_planner
from .test_loop import controller, kinds, slow

K = EventKind


def other_layout(generation: int) -> Plan:
    """A layout nobody in the loop planned: two 2-stage pipelines over the TP groups."""
    return Plan(
        generation=generation,
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=4,
                stages=[Stage(ranks=[0, 1], layers=(0, 4)), Stage(ranks=[4, 5], layers=(4, 8))],
            ),
            Pipeline(
                micro_batches=4,
                stages=[Stage(ranks=[2, 3], layers=(0, 4)), Stage(ranks=[6, 7], layers=(4, 8))],
            ),
        ],
    )


def test_a_409_with_a_newer_generation_is_adopted_and_the_next_replan_succeeds(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({3: (10, None, 4.0)}), steps=40)
    # someone posted generation 1 (the controller's next) and the trainers hold it pending
    assert asyncio.run(sim.publish(other_layout(1))) == 1
    c, events = controller(sim, builder, clock, policy)
    asyncio.run(c.run())
    failed = [e for e in events if e.kind is K.REPLAN_FAILED]
    assert len(failed) == 1 and isinstance(failed[0].data, ReplanFailed)
    assert "trainers run 0 and know 1" in failed[0].message
    # the very next step re-planned with generation 2, which the trainers took
    assert kinds(events)[-4:] == [K.STRAGGLER_DETECTED, K.PLANNED, K.REPLANNED, K.MIGRATED]
    assert events[-1].step == failed[0].step + 1
    assert [p.generation for p in sim.published] == [1, 2]
    assert c.plan.generation == sim.plan.generation == 2 and c.plan.excluded == [2, 3]


def test_a_plan_posted_by_someone_else_is_caught_up_with_from_the_records(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({3: (20, None, 4.0)}), steps=50)
    c, events = controller(sim, builder, clock, policy)

    async def main() -> None:
        for _ in range(5):
            await c.step()
        await sim.post(other_layout(1))  # a person's POST /plan: in force from the next step
        while await c.step() is not None:
            pass

    asyncio.run(main())
    caught = events[0]
    assert isinstance(caught.data, Migrated) and caught.data.generation == 1
    assert caught.data.plan.pipelines == other_layout(1).pipelines  # the real layout
    assert "not published by this controller" in caught.data.reason
    assert K.REPLAN_FAILED not in kinds(events)
    assert [p.generation for p in sim.published] == [1, 2]
    assert c.plan.generation == sim.plan.generation == 2 and c.plan.excluded == [2, 3]


class NoRecords:
    """The simulated trainers behind a sink that keeps no plans (as HttpPlanSink alone)."""

    def __init__(self, sim: SimulatedJob) -> None:
        self.sim = sim

    async def read(self) -> Observation | None:
        return await self.sim.read()

    async def publish(self, plan: Plan) -> int:
        return await self.sim.publish(plan)

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        return await self.sim.wait_applied(generation, timeout)


def test_a_generation_without_a_record_still_converges(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(slow({3: (20, None, 4.0)}), steps=50)
    ends = NoRecords(sim)
    c = Controller(
        ends,
        ends,
        initial_plan=sim.plan,
        problem_builder=builder,
        policy=policy,
        planner=greedy_planner,
        clock=clock,
        planner_grace_seconds=0.0,
    )

    async def main() -> None:
        await c.step()
        await sim.post(other_layout(1))
        while await c.step() is not None:
            pass

    asyncio.run(main())
    assert [p.generation for p in sim.published] == [1, 2]
    assert sim.plan.generation == c.plan.generation == 2 and sim.plan.excluded == [2, 3]
    assert not [e for e in c.history if e.kind is K.REPLAN_FAILED]


def test_a_controller_restarted_between_publish_and_ack_converges(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    # the trainers take the plan at their next step, but the answer never reaches controller A
    sim = make_sim(slow({3: (10, None, 4.0), 5: (40, None, 4.0)}), steps=80, acknowledge="late")
    first, a_events = controller(sim, builder, clock, policy, ack_timeout_seconds=1.0)

    async def until_published() -> None:
        while not sim.published:
            await first.step()

    asyncio.run(until_published())
    assert a_events[-1].kind is K.REPLAN_FAILED and "not acknowledged" in a_events[-1].message
    first.close()  # A dies; B starts from the last acknowledged plan and no record of gen 1
    start = sim.plan.model_copy()
    second, events = controller(sim, builder, clock, policy)
    assert second.plan == start and start.generation == 0

    async def restarted() -> None:
        await second.step()  # the trainers switch to generation 1 at this step
        sim.acknowledge = "now"
        await second.run()

    asyncio.run(restarted())
    caught = events[0]
    assert isinstance(caught.data, Migrated) and caught.data.generation == 1
    assert caught.data.plan.excluded == [2, 3]
    # rank 5 slows later: B's own plan gets the next generation, and it is applied
    assert [p.generation for p in sim.published] == [1, 2]
    assert kinds(events)[-1] is K.MIGRATED and sim.plan.generation == second.plan.generation == 2
    assert sim.plan == second.plan and sim.plan.excluded == [4, 5]  # a tie gives 2-3 one
    assert K.REPLAN_FAILED not in kinds(events)


def test_the_trainers_word_wins_also_when_they_know_less(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    """A controller that believes generation 7 exists (a pending plan the trainers lost) takes
    the 409's newest and publishes what they expect."""
    sim = make_sim(slow({3: (10, None, 4.0)}), steps=40)
    lost = sim.plan.model_copy(update={"generation": 7})
    c, events = controller(sim, builder, clock, policy, pending_plan=lost)
    asyncio.run(c.run())
    assert [e.message for e in events if e.kind is K.REPLAN_FAILED] == [
        "generation 8 refused: the trainers run 0 and know 0; re-planning from there"
    ]
    assert [p.generation for p in sim.published] == [1]
    assert sim.plan.generation == c.plan.generation == 1


def test_the_simulated_trainers_refuse_all_but_the_next_generation(
    make_sim: Any,
) -> None:
    sim = make_sim(lambda s: {}, steps=1)

    async def main() -> None:
        for generation in (0, 2, 10**30):
            try:
                await sim.publish(other_layout(generation))
            except GenerationConflict as e:
                assert (e.status, e.generation, e.newest) == (409, 0, 0)
            else:
                raise AssertionError(f"generation {generation} accepted")
        assert await sim.publish(other_layout(1)) == 1

    asyncio.run(main())
