"""decide(): the gain over the horizon against migration + planning, both ways; MigrationModel."""

from __future__ import annotations

from typing import Any

import pytest

from malleus.controller import MIB, MigrationModel, decide
from malleus.job import StragglerPolicy
from malleus.planner import Plan, plan_step_time

from .conftest import TWO_STAGE, greedy_planner

POLICY = StragglerPolicy()


def _slow(builder: Any, rates: dict[int, float | None]) -> tuple[Any, Plan]:
    problem = builder(rates, None)
    return problem, greedy_planner(problem)


def test_a_plan_that_pays_for_its_migration_is_applied(builder: Any) -> None:
    problem, new = _slow(builder, {3: 3.0})
    d = decide(
        problem,
        TWO_STAGE,
        new,
        policy=POLICY,
        seconds_per_unit=1.0,
        planning_seconds=0.5,
        migration=MigrationModel(5e9),
    )
    assert d.apply, d.reason
    # 1F1B: (4 - 1) x 12 + (4 + 12), the slow stage (rate 3 x 4 layers) as the bottleneck
    assert d.old_units == plan_step_time(problem, TWO_STAGE) == 52.0
    assert d.new_units < d.old_units
    assert d.old_seconds == 52.0 and d.new_seconds == d.new_units  # 1 s per unit
    assert d.gain_seconds == pytest.approx((d.old_seconds - d.new_seconds) * 100)
    assert d.migration_mb > 0
    assert d.migration_seconds == pytest.approx(d.migration_mb * MIB / 5e9)
    assert "saves" in d.reason


def test_a_plan_whose_migration_costs_more_than_it_saves_is_skipped(builder: Any) -> None:
    problem, new = _slow(builder, {3: 3.0})
    slow_network = MigrationModel(bandwidth_bytes_per_s=100.0)
    d = decide(
        problem,
        TWO_STAGE,
        new,
        policy=POLICY,
        seconds_per_unit=1.0,
        planning_seconds=0.0,
        migration=slow_network,
    )
    assert not d.apply
    assert d.gain_seconds is not None and d.gain_seconds < d.migration_seconds
    assert "less than the migration" in d.reason


def test_planning_time_is_spent_and_not_weighed(builder: Any, initial_plan: Plan) -> None:
    # Planning is over when the decision is taken, and the trainers trained meanwhile: a plan
    # worth its migration is applied however long its planner queued on a busy operator.
    problem, new = _slow(builder, {3: 3.0})
    kw: dict[str, Any] = {"policy": POLICY, "seconds_per_unit": 1.0, "migration": MigrationModel()}
    quick = decide(problem, initial_plan, new, planning_seconds=0.0, **kw)
    assert quick.apply and quick.gain_seconds is not None
    slow = decide(problem, initial_plan, new, planning_seconds=quick.gain_seconds + 1, **kw)
    assert slow.apply and slow.gain_seconds == quick.gain_seconds
    assert f"(planned in {quick.gain_seconds + 1:.1f} s)" in slow.reason


def test_a_gain_below_min_gain_is_skipped(builder: Any, initial_plan: Plan) -> None:
    problem, new = _slow(builder, {3: 3.0})
    d = decide(
        problem,
        initial_plan,
        new,
        policy=StragglerPolicy(min_gain=0.9),
        seconds_per_unit=1.0,
        planning_seconds=0.0,
        migration=MigrationModel(),
    )
    assert not d.apply and "below minGain 90.0%" in d.reason


def test_the_same_layout_is_skipped(builder: Any, initial_plan: Plan) -> None:
    problem = builder({}, None)
    same = initial_plan.model_copy(update={"generation": 7})
    d = decide(
        problem,
        initial_plan,
        same,
        policy=POLICY,
        seconds_per_unit=1.0,
        planning_seconds=0.0,
        migration=MigrationModel(),
    )
    assert not d.apply and d.reason == "the planner chose the layout in force"


def test_a_plan_in_force_that_cannot_run_is_always_replaced(
    builder: Any, initial_plan: Plan
) -> None:
    problem, new = _slow(builder, {5: None})
    d = decide(
        problem,
        initial_plan,
        new,
        policy=POLICY,
        seconds_per_unit=None,
        planning_seconds=1e6,
        migration=MigrationModel(1.0),
    )
    assert d.apply and "cannot run" in d.reason
    assert d.to_dict()["old_units"] is None  # infinity is not JSON


def test_without_a_measured_step_the_relative_gain_decides(
    builder: Any, initial_plan: Plan
) -> None:
    problem, new = _slow(builder, {3: 3.0})
    d = decide(
        problem,
        initial_plan,
        new,
        policy=POLICY,
        seconds_per_unit=None,
        planning_seconds=0.0,
        migration=MigrationModel(),
    )
    assert d.apply and d.gain_seconds is None and "no step time measured" in d.reason


def test_migration_model_learns_an_ewma_of_bandwidth() -> None:
    m = MigrationModel(bandwidth_bytes_per_s=5e9, smoothing=0.5)
    assert m.predict_seconds(5e9 / MIB) == pytest.approx(1.0)
    m.observe(1e9, 1.0)  # the first real sample replaces the configured guess
    assert m.bandwidth == 1e9
    m.observe(3e9, 1.0)
    assert m.bandwidth == 2e9
    m.observe(0, 1.0)  # nothing moved: nothing learned
    m.observe(1e9, None)
    assert m.bandwidth == 2e9 and m.samples == 2
    with pytest.raises(ValueError):
        MigrationModel(0)
