"""The job as the controller sees it: its straggler policy and its planning problem."""

from __future__ import annotations

import math

import pytest

from malleus.job import ResolvedJob, StragglerPolicy, load_job
from malleus.planner import Plan

from .conftest import manifest


def resolved(**policy: object) -> ResolvedJob:
    return ResolvedJob.of(load_job(manifest(**policy)))


def test_policy_defaults_are_the_crds() -> None:
    p = resolved().policy
    assert p == StragglerPolicy()
    assert (p.threshold, p.hysteresis, p.window_steps, p.cooldown_seconds) == (1.2, 0.3, 5, 30)
    assert (p.min_gain, p.horizon_steps, p.allow_exclusion) == (0.05, 100, True)
    assert (p.planning_timeout_seconds, p.max_exclusion_share) == (30, 0.25)


def test_policy_reads_every_field_of_the_manifest() -> None:
    p = resolved(
        threshold=1.5,
        hysteresis=0.2,
        windowSteps=3,
        cooldownSeconds=60,
        minGain=0.1,
        horizonSteps=500,
        allowExclusion=False,
        planningTimeoutSeconds=5,
        maxExclusionShare=0.5,
    ).policy
    assert p.model_dump() == {
        "threshold": 1.5,
        "hysteresis": 0.2,
        "window_steps": 3,
        "cooldown_seconds": 60,
        "min_gain": 0.1,
        "horizon_steps": 500,
        "allow_exclusion": False,
        "planning_timeout_seconds": 5,
        "max_exclusion_share": 0.5,
    }


@pytest.mark.parametrize(
    ("rate", "straggler"), [(None, True), (1.0, False), (1.49, False), (1.5, True), (9.0, True)]
)
def test_a_straggler_is_failed_or_at_the_threshold(rate: float | None, straggler: bool) -> None:
    assert StragglerPolicy(threshold=1.5).is_straggler(rate) is straggler


def test_problem_maps_the_job(initial_plan: Plan) -> None:
    p = resolved().problem({3: 2.5, 6: None}, initial_plan)
    assert (p.nodes, p.gpus_per_node, p.tp, p.layers, p.micro_batches) == (2, 4, 2, 8, 8)
    assert p.rates == {3: 2.5, 6: None}
    assert p.dp is None
    assert p.previous_plan == initial_plan
    assert p.memory is not None and p.memory.capacity_mb == 81559


def test_problem_cleans_rates() -> None:
    p = resolved().problem({0: 0.97, 1: 1.0, 2: math.nan, 3: math.inf, 4: 1.5, 99: 3.0})
    # faster than the reference is healthy; non-finite is unusable; out-of-range ranks dropped
    assert p.rates == {2: None, 3: None, 4: 1.5}


def test_problem_passes_a_pinned_dp() -> None:
    m = manifest()
    m["spec"]["parallelism"]["dp"] = 2
    assert ResolvedJob.of(load_job(m)).problem().dp == 2
