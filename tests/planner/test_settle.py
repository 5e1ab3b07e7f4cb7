"""settle.py: trades of groups into a plan's slowest pipeline under the true rates.

It must only ever return valid plans on the same GPUs, lower the step time of a plan that
puts slow groups together, stop as soon as its `stop()` says so (counted calls, not time), and
leave calibrated problems alone (there its split's time is not the cost model's).
"""

from __future__ import annotations

import random

from malleus.planner import PlanningProblem
from malleus.planner.cost import plan_step_time, uniform_plan
from malleus.planner.plan import Plan
from malleus.planner.search.driver import true_cls
from malleus.planner.search.settle import settle
from malleus.planner.validate import validate_plan
from tests.planner.setting_70b import problem_70b


def _problem(world: int, seed: int, calibrated: bool = False) -> PlanningProblem:
    rng = random.Random(seed)
    # the slow GPUs fill whole nodes at the front: the uniform plan's first pipelines get them
    rates = {r: round(rng.uniform(1.2, 3.0), 2) for r in range(world // 4)}
    calibration = {"layer_seconds": 0.01, "fixed": 1.0} if calibrated else None
    return problem_70b(world, rates=rates, calibration=calibration)


def _ranks(plan: Plan) -> list[int]:
    return sorted(r for p in plan.pipelines for s in p.stages for r in s.ranks)


def _counted(limit: int | None) -> tuple[list[int], object]:
    calls = [0]

    def stop() -> bool:
        calls[0] += 1
        return limit is not None and calls[0] > limit

    return calls, stop


def test_settle_lowers_a_plan_that_keeps_slow_groups_together() -> None:
    for seed in range(3):
        problem = _problem(256, seed)
        start = uniform_plan(problem)
        assert start is not None and not validate_plan(problem, start)
        _, stop = _counted(None)
        out = settle(problem, start, lambda r, p=problem: true_cls(p, r), stop)
        assert out is not None
        assert validate_plan(problem, out) == []
        assert _ranks(out) == _ranks(start)
        assert sum(p.micro_batches for p in out.pipelines) == problem.micro_batches
        assert plan_step_time(problem, out) < plan_step_time(problem, start) * 0.99


def test_settle_stops_at_the_first_true_stop() -> None:
    problem = _problem(256, 0)
    start = uniform_plan(problem)
    assert start is not None
    for limit in (1, 3, 10):
        calls, stop = _counted(limit)
        out = settle(problem, start, lambda r: true_cls(problem, r), stop)
        assert calls[0] == limit + 1  # asked once more, answered True, never asked again
        assert out is not None and validate_plan(problem, out) == []
        assert plan_step_time(problem, out) <= plan_step_time(problem, start) + 1e-9
    calls, stop = _counted(0)
    assert settle(problem, start, lambda r: true_cls(problem, r), stop) is None
    assert calls[0] == 1


def test_settle_leaves_calibrated_problems_alone() -> None:
    problem = _problem(256, 0, calibrated=True)
    start = uniform_plan(problem)
    assert start is not None
    calls, stop = _counted(None)
    assert settle(problem, start, lambda r: true_cls(problem, r), stop) is None
    assert calls[0] == 0
