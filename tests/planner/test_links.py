"""Slow links: collectives of the groups that touch a slow-link node take longer, and the planner
plans around them (its TP, its gradient sync, its exclusion)."""

from __future__ import annotations

from typing import Any

import pytest

from malleus.planner import (
    Pipeline,
    Plan,
    PlanningProblem,
    Stage,
    plan,
    plan_step_time,
    step_time_terms,
    uniform_plan,
    validate_plan,
)

CAL: dict[str, Any] = {
    "layer_seconds": 0.01,
    "tp_comm": {"4": 0.3, "2": 0.2},
    "p2p": 0.1,
    "grad_sync_inter": 0.05,
    "grad_sync_intra": 0.015,
    "embedding": 0.2,
    "head": 1.0,
    "fixed": 1.0,
}
BASE: dict[str, Any] = {
    "nodes": 4,
    "gpus_per_node": 4,
    "model": {"layers": 16, "tp": 4},
    "micro_batches": 16,
}


def test_the_link_aware_plan_beats_the_compute_only_plan() -> None:
    full = PlanningProblem.load({**BASE, "calibration": CAL, "link_rates": {"1": 4.0}})
    blind = plan(PlanningProblem.load(BASE))  # knows neither the terms nor the link
    aware = plan(full)
    assert validate_plan(full, aware) == []
    uni = uniform_plan(full)
    assert uni is not None
    t_blind, t_aware = plan_step_time(full, blind), plan_step_time(full, aware)
    assert t_aware <= plan_step_time(full, uni) + 1e-9
    assert t_aware < 0.9 * t_blind, (t_aware, t_blind)
    # the slow node no longer runs full TP groups across its slow link
    slow_groups = [s for _, _, s in aware.stages() if s.ranks[0] // 4 == 1]
    assert all(len(s.ranks) < 4 for s in slow_groups), slow_groups
    assert aware.estimate is not None and aware.estimate.terms is not None


def test_without_a_slow_link_the_calibrated_plan_treats_every_node_alike() -> None:
    # No node differs, so none is singled out. Here the TP collectives (0.3 per layer of 1)
    # cost more than a pipeline's gradient sync: every GPU alone, 16 one-stage pipelines,
    # takes 71.9 against 89.8 for full groups (the uniform plan, which the search kept until
    # issue 27 let it split healthy nodes of small clusters).
    full = PlanningProblem.load({**BASE, "calibration": CAL})
    result = plan(full)
    sizes = [
        sorted(len(s.ranks) for _, _, s in result.stages() if s.ranks[0] // 4 == n)
        for n in range(4)
    ]
    assert all(x == sizes[0] for x in sizes), sizes
    uni = uniform_plan(full)
    assert uni is not None
    assert plan_step_time(full, result) <= plan_step_time(full, uni) * 0.81


def _pairs(problem: PlanningProblem, pipelines: list[list[int]]) -> Plan:
    """Two pipelines of two tp-1 stages (layers [0, 1) and [1, 2)) on the given ranks."""
    return Plan(
        tp=1,
        pipelines=[
            Pipeline(
                micro_batches=2,
                stages=[Stage(ranks=[a], layers=(0, 1)), Stage(ranks=[b], layers=(1, 2))],
            )
            for a, b in pipelines
        ],
    )


def _grid(**over: Any) -> PlanningProblem:
    data: dict[str, Any] = {
        "nodes": 2,
        "gpus_per_node": 2,
        "model": {"layers": 2, "tp": 1},
        "micro_batches": 4,
        "memory": {"capacity_mb": 100, "layer_mb": 4},  # 1 MB of gradient per layer shard
        "calibration": {
            "layer_seconds": 1.0,
            "grad_sync_intra": 0.5,
            "grad_sync_inter": 2.0,
            "p2p": 0.25,
        },
        "link_rates": {"1": 3.0},
    }
    data.update(over)
    return PlanningProblem.load(data)


def test_gradient_sync_by_shard_group_intra_or_inter_node_at_the_slowest_link() -> None:
    p = _grid()
    # pipelines side by side: each layer's replicas sit in different nodes (inter, link 3)
    across = step_time_terms(p, _pairs(p, [[0, 1], [2, 3]]))
    assert across.grad_sync == pytest.approx(1.0 * 2.0 * 3.0)
    # each layer's replicas in one node: node 0's pair is intra at link 1, node 1's at link 3
    inside = step_time_terms(p, _pairs(p, [[0, 2], [1, 3]]))
    assert inside.grad_sync == pytest.approx(1.0 * 0.5 * 3.0)
    # ... but every stage boundary now touches the slow node: p2p at the worse link
    assert inside.stages["p2p"] == pytest.approx(0.25 * 3.0)
    assert across.stages["p2p"] == pytest.approx(0.25 * 3.0)  # node 1 holds the slower one
    # one pipeline: nothing to synchronise
    solo = Plan(
        tp=1,
        pipelines=[Pipeline(micro_batches=4, stages=[Stage(ranks=[0], layers=(0, 2))])],
        excluded=[1, 2, 3],
    )
    assert step_time_terms(p, solo).grad_sync == 0.0


def test_the_reference_and_ideal_ignore_slow_links() -> None:
    slow, healthy = _grid(), _grid(link_rates={})
    from malleus.planner import ideal_step_time, reference_step_time

    assert reference_step_time(slow) == reference_step_time(healthy)
    assert ideal_step_time(slow) == ideal_step_time(healthy)
