"""Host contention in the calibrated cost model: emulated GPUs sharing a host's CPUs.

When one host runs every GPU process and they outnumber its CPUs, the terms that are host work
(collectives, transfers, optimizer, the rest of a step) grow with the GPUs serving, layer
compute (emulated time) does not: `Calibration.contention` scales the host-work terms of a plan
by its serving GPUs per CPU against the measured plan's (docs/architecture.md, "Cost model").
"""

from __future__ import annotations

from typing import Any

import pytest

from malleus.planner import (
    Pipeline,
    Plan,
    PlanningProblem,
    ProblemError,
    Stage,
    plan,
    plan_step_time,
)
from malleus.planner import step_time_terms as terms
from malleus.planner.calibration import HOST_TERMS

CAL: dict[str, Any] = {
    "layer_seconds": 0.01,
    "embedding": 1.0,
    "head": 2.0,
    "tp_comm": {"2": 0.5},
    "head_comm": {"2": 0.2},
    "p2p": 0.25,
    "grad_sync_intra": 0.3,
    "grad_sync_call_intra": 0.05,
    "optimizer": 0.1,
    "fixed": 3.0,
}


def _problem(**cal: Any) -> PlanningProblem:
    return PlanningProblem.load(
        {
            "nodes": 1,
            "gpus_per_node": 4,
            "model": {"layers": 4, "tp": 2},
            "micro_batches": 4,
            "memory": {"capacity_mb": 1000, "layer_mb": 8, "embedding_mb": 4},
            "calibration": {**CAL, **cal},
        }
    )


def _plan(groups: list[list[int]]) -> Plan:
    """One pipeline of `groups` as stages, the layers split evenly."""
    per = 4 // len(groups)
    stages = [Stage(ranks=g, layers=(i * per, (i + 1) * per)) for i, g in enumerate(groups)]
    return Plan(tp=2, pipelines=[Pipeline(micro_batches=4, stages=stages)])


FOUR, TWO = _plan([[0, 1], [2, 3]]), _plan([[0, 1]])


def test_without_sharing_nothing_scales() -> None:
    p = _problem()
    assert p.calibration is not None and p.calibration.contention(2) == 1.0
    assert plan_step_time(p, TWO) == plan_step_time(_problem(), TWO)


@pytest.mark.parametrize(
    ("cpus", "measured", "active", "factor"),
    [
        (2, 4, 4, 1.0),
        (2, 4, 2, 0.5),
        (1, 4, 2, 0.5),
        (2, 2, 4, 2.0),
        (8, 4, 2, 1.0),
        (2, 6, 8, 4 / 3),
    ],
)
def test_the_factor_is_gpus_per_cpu_against_the_measured(
    cpus: int, measured: int, active: int, factor: float
) -> None:
    cal = _problem(shared_cpus=cpus, measured_active=measured).calibration
    assert cal is not None and cal.contention(active) == pytest.approx(factor)


def test_host_terms_scale_and_compute_does_not() -> None:
    shared = _problem(shared_cpus=2, measured_active=4)
    assert plan_step_time(shared, FOUR) == plan_step_time(_problem(), FOUR)  # as measured
    # Two GPUs serving on 2 CPUs, measured with 4: host work at half the measured figure.
    halved = {t: CAL.get(t, 0.0) * 0.5 for t in HOST_TERMS}
    halved.update(tp_comm={"2": 0.25}, head_comm={"2": 0.1})
    by_hand = _problem(**halved)
    got, want = terms(shared, TWO), terms(by_hand, TWO)
    assert got.as_dict() == pytest.approx(want.as_dict())
    assert got.stages is not None and got.stages["layers"] == 4.0  # compute unchanged
    # The head: its compute as measured (2.0), its collectives halved (0.2 -> 0.1).
    assert got.stages["head"] == pytest.approx(2.0 + 0.1)
    assert got.total < terms(_problem(), TWO).total


def test_the_planner_prices_its_choice_at_its_own_contention() -> None:
    """The estimate the planner reports is the plan's contention-priced step time, and a plan
    that leaves GPUs out is priced cheaper host work than the measured figures."""
    shared = _problem(shared_cpus=1, measured_active=4, fixed=30.0)
    chosen = plan(shared, time_limit=5)
    assert chosen.estimate is not None
    assert chosen.estimate.step_time == pytest.approx(plan_step_time(shared, chosen))
    assert plan_step_time(shared, TWO) < plan_step_time(_problem(fixed=30.0), TWO)


@pytest.mark.parametrize(
    ("cal", "expect"),
    [
        ({"shared_cpus": 2}, "calibration.shared_cpus: given without calibration.measured_active"),
        ({"measured_active": 2}, "calibration.measured_active: given without"),
        ({"shared_cpus": 0, "measured_active": 2}, "calibration.shared_cpus: 0 is not allowed"),
        ({"shared_cpus": 2, "measured_active": -1}, "calibration.measured_active: -1"),
    ],
)
def test_bad_sharing_is_named(cal: dict[str, Any], expect: str) -> None:
    with pytest.raises(ProblemError) as err:
        _problem(**cal)
    assert expect in str(err.value)
