"""validate_plan finds every kind of violation and says where (pipeline, stage, field)."""

from __future__ import annotations

import pytest

from malleus.planner import (
    Pipeline,
    Plan,
    PlanError,
    PlanningProblem,
    Stage,
    check_plan,
    validate_plan,
)


@pytest.fixture
def problem() -> PlanningProblem:
    return PlanningProblem.load(
        {
            "nodes": 2,
            "gpus_per_node": 4,
            "rates": {"6": None},
            "model": {"layers": 8, "tp": 2},
            "micro_batches": 8,
            "memory": {"capacity_mb": 20, "layer_mb": 2, "fixed_mb": 1},
        }
    )


def good() -> Plan:
    return Plan(
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=5,
                stages=[Stage(ranks=[0, 1], layers=(0, 4)), Stage(ranks=[2, 3], layers=(4, 8))],
            ),
            Pipeline(
                micro_batches=3,
                stages=[Stage(ranks=[4, 5], layers=(0, 4)), Stage(ranks=[7], layers=(4, 8))],
            ),
        ],
    )


def only(problem: PlanningProblem, plan: Plan) -> str:
    faults = validate_plan(problem, plan)
    assert len(faults) == 1, faults
    return faults[0]


def test_a_good_plan_passes(problem: PlanningProblem) -> None:
    assert validate_plan(problem, good()) == []
    check_plan(problem, good())


def test_layer_gap_and_overlap(problem: PlanningProblem) -> None:
    plan = good()
    plan.pipelines[0].stages[1].layers = (5, 8)
    assert "pipelines[0].stages[1].layers: starts at 5" in only(problem, plan)
    assert "gap" in only(problem, plan)
    plan.pipelines[0].stages[1].layers = (3, 8)
    assert "overlap" in only(problem, plan)


def test_empty_stage_and_short_coverage(problem: PlanningProblem) -> None:
    plan = good()
    plan.pipelines[1].stages[1].layers = (4, 4)
    faults = validate_plan(problem, plan)
    assert any(f.startswith("pipelines[1].stages[1].layers: [4, 4) is empty") for f in faults)
    assert any(f.startswith("pipelines[1].stages: layers end at 4") for f in faults)


def test_group_size_must_be_tp_over_a_power_of_two() -> None:
    p = PlanningProblem.load(
        {"nodes": 1, "gpus_per_node": 8, "model": {"layers": 4, "tp": 4}, "micro_batches": 2}
    )
    plan = Plan(
        tp=4,
        pipelines=[
            Pipeline(micro_batches=2, stages=[Stage(ranks=[0, 1, 2], layers=(0, 4))]),
        ],
        excluded=[3, 4, 5, 6, 7],
    )
    assert "pipelines[0].stages[0].ranks: a group of 3 GPUs" in only(p, plan)


def test_group_must_sit_in_one_node(problem: PlanningProblem) -> None:
    plan = good()
    plan.pipelines[1].stages[0].ranks = [3, 4]
    faults = validate_plan(problem, plan)
    assert any("pipelines[1].stages[0].ranks: [3, 4] span nodes [0, 1]" in f for f in faults)
    assert any("rank 3 is also in pipelines[0].stages[1]" in f for f in faults)
    assert any("ranks [5] are usable but in no stage" in f for f in faults)


def test_unusable_rank_cannot_serve(problem: PlanningProblem) -> None:
    plan = good()
    plan.pipelines[1].stages[1].ranks = [6]
    faults = validate_plan(problem, plan)
    assert any("pipelines[1].stages[1].ranks: rank 6 is unusable" in f for f in faults)


def test_rank_beyond_the_world(problem: PlanningProblem) -> None:
    plan = good()
    plan.excluded = [9]
    assert "excluded: rank 9 is beyond the world (0..7)" in only(problem, plan)


def test_micro_batches_must_sum_and_be_positive(problem: PlanningProblem) -> None:
    plan = good()
    plan.pipelines[1].micro_batches = 0
    faults = validate_plan(problem, plan)
    assert any(f.startswith("pipelines[1].micro_batches: 0") for f in faults)
    assert any("micro_batches: pipelines sum to 5" in f for f in faults)


def test_memory_bound_names_the_stage(problem: PlanningProblem) -> None:
    plan = good()
    # rank 7 alone holds 2 shards of 4 layers: 2 * 2 * 4 + 1 = 17 MB (fits); 6 layers: 25 MB
    plan.pipelines[1].stages[0].layers = (0, 2)
    plan.pipelines[1].stages[1].layers = (2, 8)
    fault = only(problem, plan)
    assert fault.startswith("pipelines[1].stages[1]: needs 25 MB per GPU")
    assert "capacity of 20 MB" in fault


def test_tp_mismatch_and_no_pipelines(problem: PlanningProblem) -> None:
    plan = Plan(tp=4, pipelines=[])
    faults = validate_plan(problem, plan)
    assert any(f == "tp: plan has 4, problem has 2" for f in faults)
    assert any(f.startswith("pipelines: a plan needs at least one pipeline") for f in faults)


def test_check_plan_raises_with_every_violation(problem: PlanningProblem) -> None:
    plan = good()
    plan.pipelines[0].micro_batches = 4
    plan.excluded = [9]
    with pytest.raises(PlanError) as e:
        check_plan(problem, plan)
    assert len(e.value.violations) == 2
