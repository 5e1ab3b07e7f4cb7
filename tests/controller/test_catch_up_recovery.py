"""A recovery's plan, made by the trainers and never published by the controller, is adopted
with the GPUs it drops counted as failed: a replacement that joins with a healthy rate is then a
return, which a later plan re-admits (tests/runner/test_faults.py does it end to end)."""

from __future__ import annotations

import asyncio

from malleus.controller.generations import Generations
from malleus.planner import Pipeline, Plan, Stage


def _plan(generation: int, pipelines: list[list[int]], excluded: tuple[int, ...] = ()) -> Plan:
    return Plan(
        generation=generation,
        tp=1,
        pipelines=[
            Pipeline(micro_batches=4 // len(pipelines), stages=[Stage(ranks=r, layers=(0, 2))])
            for r in pipelines
        ],
        excluded=list(excluded),
    )


class _Records:
    """A sink that knows the plan the trainers serve (`GET /plan`): `PlanRecords`."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    async def publish(self, plan: Plan) -> int:
        raise AssertionError("nothing is published here")

    async def wait_applied(self, generation: int, timeout: float) -> object:
        raise AssertionError("nothing is awaited here")

    async def recorded_plan(self, generation: int) -> Plan | None:
        return self.plan if self.plan.generation == generation else None


def test_the_gpus_a_recovery_plan_drops_are_believed_failed() -> None:
    first = _plan(1, [[0], [1], [2]], excluded=[3])
    recovery = _plan(2, [[1], [2]])  # GPU 0 died: the trainers' plan leaves it out altogether
    gens = Generations(first)
    pending = asyncio.run(gens.catch_up(2, _Records(recovery)))  # type: ignore[arg-type]
    assert pending is not None and pending.plan == recovery
    # GPU 0 is gone from the layout: failed; GPU 3 (excluded before) is gone too; 1, 2 stay.
    assert pending.rates == {0: None, 3: None}
