"""The 1F1B makespan of `cost.pipeline_time` against a discrete-event simulation (sim1f1b.py)."""

from __future__ import annotations

import random

import pytest

from malleus.planner.cost import EXACT_MICRO_BATCHES, pipeline_time
from tests.planner.sim1f1b import simulate


def bound(m: int, costs: list[float]) -> float:
    """The formula before: steady state at the bottleneck plus fill/drain of every stage."""
    return (m - 1) * max(costs) + sum(costs)


@pytest.mark.parametrize("seed", range(6))
def test_equals_the_simulation_for_random_stages(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        S = rng.randint(1, 7)
        m = rng.randint(1, 16)
        if seed % 2:
            costs = [rng.uniform(0.2, 6.0) for _ in range(S)]
        else:  # ties and whole numbers: several stages share the bottleneck
            costs = [float(rng.choice([1, 2, 3, 3, 5])) for _ in range(S)]
        t = pipeline_time(m, costs)
        assert t == pytest.approx(simulate(costs, m), rel=1e-12, abs=1e-12), (costs, m)
        assert t <= bound(m, costs) + 1e-9


def test_every_m_from_1_to_16() -> None:
    costs = [4.0, 1.5, 3.0, 0.5, 2.0]
    for m in range(1, 17):
        assert pipeline_time(m, costs) == pytest.approx(simulate(costs, m), rel=1e-12)


def test_the_bound_is_exact_with_the_bottleneck_last_and_uniform_stages() -> None:
    for m in range(1, 12):
        assert pipeline_time(m, [1.0, 2.0, 3.0]) == bound(m, [1.0, 2.0, 3.0])
        assert pipeline_time(m, [2.0] * 4) == pytest.approx((m + 3) * 2.0)
        assert pipeline_time(m, [5.0, 1.0]) == pytest.approx(simulate([5.0, 1.0], m))
    assert pipeline_time(1, [3.0, 1.0, 2.0]) == 6.0  # one micro-batch: no overlap at all


def test_the_old_formula_over_counts_an_early_bottleneck() -> None:
    # Stage 0 is the bottleneck: the last stages run under its backward passes.
    costs, m = [6.0, 1.0, 1.0, 1.0], 8
    exact = pipeline_time(m, costs)
    assert exact == pytest.approx(simulate(costs, m))
    assert exact < bound(m, costs) - 1.0
    # ... and a bottleneck-first order beats the same stages with the bottleneck last
    assert exact < pipeline_time(m, costs[::-1])


def test_beyond_the_exact_range_it_grows_at_the_bottleneck() -> None:
    costs = [3.0, 1.0, 2.0]
    m = EXACT_MICRO_BATCHES + 100
    base = pipeline_time(EXACT_MICRO_BATCHES, costs)
    assert pipeline_time(m, costs) == pytest.approx(base + 100 * 3.0)
    assert pipeline_time(m, costs) <= bound(m, costs)


def test_degenerate_inputs() -> None:
    assert pipeline_time(4, []) == float("inf")
    assert pipeline_time(4, [1.0, float("inf")]) == float("inf")
    assert pipeline_time(5, [2.0]) == 10.0
