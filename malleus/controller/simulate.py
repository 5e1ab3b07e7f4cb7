"""A job of emulated GPUs driven by the cost model: a RateSource and PlanSink in one object.

It closes the decision loop without processes: each `read()` runs one step of the plan in force
under the true rates of that step (`rates_at(step)`), advancing a manual clock by the step time
the cost model predicts; `publish` + `wait_applied` switch at the step boundary and charge the
migration the cost model says the layout change needs. Like the trainers' inbox it takes only
the next generation (409 otherwise) and, like them, it remembers the plans it ran, so that a
controller can catch up with them (`PlanRecords`). Tests use it to hold the controller to
its promises (no churn, re-admission, cooldown) over hundreds of steps in milliseconds;
`malleus run` could use it for a dry run of a policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Literal

from malleus.planner.cost import migration_mb, plan_step_time
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem
from malleus.planner.validate import validate_plan

from .decision import MIB
from .ports import Ack, AckTimeout, GenerationConflict, Observation, PlanRejected

__all__ = ["ManualClock", "SimulatedJob"]

RatesAt = Callable[[int], Mapping[int, "float | None"]]


class ManualClock:
    """A clock that moves only when told: `clock()` reads it, `advance(s)` moves it."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.now += seconds


class SimulatedJob:
    """Emulated trainers: true rates by step, step times and migrations from the cost model."""

    def __init__(
        self,
        problem_builder: Callable[[Mapping[int, float | None], Plan | None], PlanningProblem],
        plan: Plan,
        rates_at: RatesAt,
        *,
        clock: ManualClock,
        steps: int,
        seconds_per_unit: float = 0.01,
        bandwidth_bytes_per_s: float = 5e9,
        stalled_step_seconds: float = 10.0,
        acknowledge: Literal["now", "late", "never"] = "now",
    ) -> None:
        self.problem_builder = problem_builder
        self.plan = plan
        self.rates_at = rates_at
        self.clock = clock
        self.steps = steps
        self.seconds_per_unit = seconds_per_unit
        self.bandwidth = bandwidth_bytes_per_s
        self.stalled_step_seconds = stalled_step_seconds
        self.acknowledge = acknowledge
        """now: switch in wait_applied; late: switch at the next step but never acknowledge (a
        lost answer); never: accept plans and ignore them."""
        self.step = 0
        self.published: list[Plan] = []
        self.applied: list[tuple[int, Plan]] = []
        """(first step under it, plan) for every switch."""
        self._pending: Plan | None = None
        self._outside = False  # the pending plan came from `post`: switch at the next step
        self._world = problem_builder({}, None).world

    def _problem(self, step: int) -> PlanningProblem:
        return self.problem_builder(self.rates_at(step), None)

    def _switch(self) -> Ack:
        pending = self._pending
        assert pending is not None
        mb = migration_mb(self._problem(self.step), self.plan, pending)
        seconds = mb * MIB / self.bandwidth
        self.clock.advance(seconds)
        self.plan, self._pending, self._outside = pending, None, False
        self.applied.append((self.step, pending))
        return Ack(pending.generation, self.step, seconds, mb * MIB)

    async def read(self) -> Observation | None:
        if self.step >= self.steps:
            return None
        if self._pending is not None and (self.acknowledge == "late" or self._outside):
            self._switch()
        step = self.step
        problem = self._problem(step)
        units = plan_step_time(problem, self.plan)
        seconds = units * self.seconds_per_unit if math.isfinite(units) else None
        self.clock.advance(seconds if seconds is not None else self.stalled_step_seconds)
        self.step += 1
        true = self.rates_at(step)
        rates = {r: true.get(r, 1.0) for r in range(self._world)}  # excluded ranks measure too
        return Observation(step, seconds, rates, self.plan.generation)

    async def publish(self, plan: Plan) -> int:
        newest = max(self.plan.generation, self._pending.generation if self._pending else -1)
        if plan.generation != newest + 1:
            raise GenerationConflict(
                self.plan.generation, newest, f"generation {plan.generation} is not {newest + 1}"
            )
        violations = validate_plan(self._problem(self.step), plan)
        if violations:
            raise PlanRejected(400, "; ".join(violations))
        self._pending = plan
        self.published.append(plan)
        return plan.generation

    async def post(self, plan: Plan) -> int:
        """A plan from outside the controller (a person's POST /plan, a `--switch`): accepted
        like any other and switched to at the next step."""
        generation = await self.publish(plan)
        self._outside = True
        return generation

    async def recorded_plan(self, generation: int) -> Plan | None:
        """The plan of `generation` if these trainers ran it or hold it pending."""
        known = [self.plan, *(p for _, p in self.applied), *self.published]
        return next((p for p in reversed(known) if p.generation == generation), None)

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        pending = self._pending
        if self.acknowledge != "now" or pending is None or pending.generation != generation:
            raise AckTimeout(f"generation {generation} not acknowledged")
        return self._switch()
