"""The planner on cases small enough to work out by hand (the comments show the arithmetic)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from malleus.planner import Plan, PlanningProblem, plan, validate_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "problems"


def problem(**over: Any) -> PlanningProblem:
    data: dict[str, Any] = {
        "nodes": 2,
        "gpus_per_node": 4,
        "model": {"layers": 8, "tp": 2},
        "micro_batches": 16,
    }
    data.update(over)
    return PlanningProblem.load(data)


def stage_of(result: Plan, rank: int) -> list[int] | None:
    for _, _, s in result.stages():
        if rank in s.ranks:
            return s.ranks
    return None


def test_severe_straggler_is_cut_off_from_its_healthy_partner() -> None:
    # Rank 1 at 8x. Three healthy full groups run alone at 8 per micro-batch: 5 micro-batches
    # each by T = 40 (15). The 16th needs rank 0 without its partner: alone (alpha 2) it takes
    # 16 per micro-batch. Paired with rank 1 it would take 64 > 40. Nothing beats 40: at T < 40
    # the healthy groups do 12 and rank 0 at most 2.
    p = problem(rates={1: 8.0})
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None
    assert result.estimate.step_time == 40.0
    # static: 4 pipelines of m=4; [0,1] at 8x takes 8 layers x 8 = 64 per micro-batch
    assert result.estimate.uniform_step_time == 4 * 64
    assert stage_of(result, 1) in (None, [1])  # never paired with a healthy GPU
    # the three healthy GPUs of node 0 all work: one full group and one alone
    assert sorted(len(stage_of(result, r) or []) for r in (0, 2, 3)) == [1, 2, 2]


def test_slow_gpus_are_grouped_together() -> None:
    # One node, tp 2, ranks 0 and 2 at 3x. Uniform pairs [0,1] and [2,3]: both run at 3x,
    # 2 micro-batches each of 12 -> 24. Regrouped: [1,3] healthy (4 per micro-batch) does 3
    # and [0,2] (12 per micro-batch) does 1 by T = 12; no split of 4 micro-batches does better.
    p = PlanningProblem.load(
        {
            "nodes": 1,
            "gpus_per_node": 4,
            "rates": {"0": 3.0, "2": 3.0},
            "model": {"layers": 4, "tp": 2},
            "micro_batches": 4,
        }
    )
    result = plan(p)
    assert result.estimate is not None
    assert result.estimate.uniform_step_time == 24.0
    assert result.estimate.step_time == 12.0
    assert sorted(stage_of(result, 1) or []) == [1, 3]


def test_a_gpu_that_only_slows_things_down_is_left_out() -> None:
    # 4 single-GPU groups, rank 3 at 100x: three healthy pipelines split 4 micro-batches
    # 2/1/1 -> T = 8; rank 3 could only add a 400-long micro-batch.
    p = PlanningProblem.load(
        {
            "nodes": 1,
            "gpus_per_node": 4,
            "rates": {"3": 100.0},
            "model": {"layers": 4, "tp": 1},
            "micro_batches": 4,
        }
    )
    result = plan(p)
    assert result.estimate is not None and result.estimate.step_time == 8.0
    assert result.excluded == [3]


def test_healthy_70b_beats_the_static_layout_by_hand() -> None:
    # Static: pp=2 does not fit (40 layers at stage 0: 40*(1470+2*178)+600+4700 > 77156), so
    # pp=4, dp=2, m=32: 31*20 + 80 = 700. Two stages fit split 39/41 (39*1826+600+4700 = 76514,
    # 41*1648+600+4700 = 72868): dp=4, m=16 -> 15*41 + 80 = 695.
    data = json.loads((EXAMPLES / "70b.json").read_text())
    data["rates"] = {}
    p = PlanningProblem.load(data)
    result = plan(p)
    assert result.estimate is not None
    assert result.estimate.uniform_step_time == 700.0
    assert result.estimate.step_time == 695.0
    assert result.dp == 4
    assert {s.layers for _, _, s in result.stages()} == {(0, 39), (39, 80)}


def test_failed_gpu_plans_without_it_and_uniform_cannot_run() -> None:
    p = problem(rates={5: None}, micro_batches=8)
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None and result.estimate.uniform_step_time is None
    assert 5 not in result.active_ranks() and 5 not in result.excluded
    # node 1's three usable GPUs all work: one full group and one GPU alone
    assert sorted(len(stage_of(result, r) or []) for r in (4, 6, 7)) == [1, 2, 2]


def test_pinned_dp_is_honoured() -> None:
    for dp in (1, 2, 3):
        p = problem(rates={1: 3.0}, dp=dp)
        result = plan(p)
        assert result.dp == dp
        assert validate_plan(p, result) == []


def test_generation_follows_the_previous_plan() -> None:
    p = problem(rates={1: 3.0})
    first = plan(p)
    assert first.generation == 0
    first.generation = 6
    second = plan(problem(rates={1: 3.0}, previous_plan=json.loads(first.to_json())))
    assert second.generation == 7


def test_recovered_gpus_are_readmitted() -> None:
    # nothing is sticky: with every rate back to 1.0, all 4 groups work again (T = 4*8 = 32)
    before = plan(problem(rates={1: 8.0}))
    after = plan(problem(previous_plan=json.loads(before.to_json())))
    assert after.excluded == []
    assert sorted(after.active_ranks()) == list(range(8))
    assert after.estimate is not None and after.estimate.step_time == 32.0


def test_time_limit_bounds_a_large_search() -> None:
    rates = {r: 1.5 + (r % 7) for r in range(0, 1024, 37)}
    p = PlanningProblem.load(
        {
            "nodes": 128,
            "gpus_per_node": 8,
            "rates": {str(r): v for r, v in rates.items()},
            "model": {"layers": 80, "tp": 8},
            "micro_batches": 1024,
        }
    )
    t0 = time.perf_counter()
    result = plan(p, time_limit=0.5)
    assert time.perf_counter() - t0 < 6.0
    assert validate_plan(p, result) == []
    assert result.estimate is not None and result.estimate.uniform_step_time is not None
    assert result.estimate.step_time < result.estimate.uniform_step_time


@pytest.mark.parametrize("name", ["small", "32b", "70b"])
def test_examples_plan_and_beat_uniform(name: str) -> None:
    p = PlanningProblem.load((EXAMPLES / f"{name}.json").read_text())
    result = plan(p)
    assert validate_plan(p, result) == []
    e = result.estimate
    assert e is not None and e.uniform_step_time is not None
    assert e.step_time <= e.uniform_step_time
    assert e.reference_step_time is not None and e.ideal_step_time is not None
    assert e.ideal_step_time <= e.step_time


def test_70b_beats_the_authors_planner() -> None:
    # the authors' planner scores recovery 0.89 on this setting
    p = PlanningProblem.load((EXAMPLES / "70b.json").read_text())
    e = plan(p).estimate
    assert e is not None and e.reference_step_time is not None
    assert e.reference_step_time / e.step_time > 0.92


def test_slow_gpus_become_last_stages_behind_healthy_groups_within_the_budget() -> None:
    """24 GPUs in nodes of 8, the 70B model (tp 8, 80 layers, no memory model), GPUs 11 and 12
    at 1.6x, 24 micro-batches. Node 1 split into single GPUs: each slow one a 2-layer last
    stage behind a full healthy group (9 micro-batches each: 78 + 2 * 1.6 * 7.22 = 101.1 per
    micro-batch, 702 in all), the six healthy singles pipelines of their own (1 micro-batch,
    80 * 7.22 = 577.6). The same search given 4 CPU seconds finds 702; under its default budget
    it used to stop at 720 (full groups alone, node 1 in singles beside them): its templates
    were each scored at exact per-m times, and the budget ran out before this grouping's.
    Templates are now scored by lines and refined best-first by a floor, so the search reaches
    them well within its budget (bench/planner_held.py, `random 127`)."""
    alpha = [1.0, 1.9, 3.66, 7.22]
    p = PlanningProblem.load(
        {
            "nodes": 3,
            "gpus_per_node": 8,
            "model": {"layers": 80, "tp": 8, "alpha": alpha},
            "micro_batches": 24,
            "rates": {"11": 1.6, "12": 1.6},
        }
    )
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None
    assert result.estimate.step_time <= 702.0 * 1.001
