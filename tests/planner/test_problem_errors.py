"""Bad problems are refused with one clear message per fault; impossible memory says how far."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from malleus.errors import Fault
from malleus.planner import PlanningProblem, ProblemError, plan


def base(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "nodes": 2,
        "gpus_per_node": 4,
        "model": {"layers": 8, "tp": 2},
        "micro_batches": 8,
    }
    data.update(over)
    return data


def faults_of(data: dict[str, Any] | str) -> list[str]:
    with pytest.raises(ProblemError) as e:
        PlanningProblem.load(data)
    return [str(f) for f in e.value.faults]


@pytest.mark.parametrize(
    ("over", "expect"),
    [
        ({"model": {"layers": 8, "tp": 3}}, "model.tp: 3 is not a power of two"),
        ({"model": {"layers": 8, "tp": 8}}, "model.tp: 8 does not divide gpus_per_node (4)"),
        ({"rates": {"2": 0.5}}, "rates[2]: 0.5 is not allowed"),
        ({"rates": {"2": float("inf")}}, "rates[2]: inf is not allowed"),
        ({"rates": {"2": float("nan")}}, "rates[2]: nan is not allowed"),
        ({"rates": {"8": 2.0}}, "rates[8]: rank 8 is out of range; ranks are 0..7"),
        ({"rates": {"-1": 2.0}}, "rates[-1]: rank -1 is out of range"),
        ({"micro_batches": 0}, "micro_batches: 0 is not allowed; need 1..1000000"),
        ({"micro_batches": 10**15}, "micro_batches: 1000000000000000 is not allowed"),
        ({"rates": {"2": 1e307}}, "rates[2]: 1e+307 is not allowed; a straggling rate is a number"),
        ({"model": {"layers": 10**6, "tp": 2}}, "model.layers: 1000000 is not allowed"),
        ({"nodes": 10**6}, "at most 65536 are planned"),
        ({"dp": 9}, "dp: 9 is not allowed; need 1..8 pipelines"),
        ({"model": {"layers": 0, "tp": 2}}, "model.layers: 0 is not allowed"),
        ({"dp": 0}, "dp: 0 is not allowed"),
        ({"rates": dict.fromkeys(map(str, range(8)))}, "every GPU is unusable"),
    ],
)
def test_each_fault_is_named(over: dict[str, Any], expect: str) -> None:
    faults = faults_of(base(**over))
    assert any(expect in f for f in faults), faults


def test_every_fault_at_once() -> None:
    faults = faults_of(base(model={"layers": 8, "tp": 3}, micro_batches=0, rates={"9": 0.2}))
    assert len(faults) == 4  # tp, micro_batches, rank range, rate value


def test_type_errors_name_the_field() -> None:
    faults = faults_of(base(micro_batches="many"))
    assert any(f.startswith("micro_batches:") for f in faults)
    faults = faults_of(json.dumps(base(nodes=[2])))
    assert any(f.startswith("nodes:") for f in faults)


def test_no_layout_fits_memory_says_how_far() -> None:
    # 8 layers x 10 MB over at most 4 full groups: the most frugal layout is one pipeline of
    # 4 stages of 2 layers, whose ends need 2 * 10 + 5 (embedding) + 1 fixed = 26 MB > 20 MB.
    p = PlanningProblem.load(
        base(memory={"capacity_mb": 20, "layer_mb": 10, "embedding_mb": 5, "fixed_mb": 1})
    )
    with pytest.raises(ProblemError) as e:
        plan(p)
    (fault,) = [str(f) for f in e.value.faults]
    m = re.search(r"smallest per-GPU need is (\d+) MB with (\d+) stages of (\S+) layers", fault)
    assert m, fault
    assert (int(m.group(1)), int(m.group(2)), m.group(3)) == (26, 4, "2")
    assert "capacity 20 MB" in fault


def test_memory_that_fits_only_deep_pipelines_still_plans() -> None:
    p = PlanningProblem.load(
        base(memory={"capacity_mb": 26, "layer_mb": 10, "embedding_mb": 5, "fixed_mb": 1})
    )
    result = plan(p)
    assert result.dp == 1 and len(result.pipelines[0].stages) == 4


def test_more_pinned_pipelines_than_micro_batches() -> None:
    p = PlanningProblem.load(base(dp=5, micro_batches=3))
    with pytest.raises(ProblemError) as e:
        plan(p)
    assert e.value.faults == [
        Fault("dp", "5 pipelines need at least 5 micro-batches; the step has 3"),
    ]


@pytest.mark.parametrize("field", ["nodes", "gpus_per_node", "micro_batches", "dp"])
def test_a_boolean_or_float_is_not_a_count(field: str) -> None:
    for value in (True, 8.0):
        faults = faults_of(base(**{field: value}))
        assert any(f.startswith(f"{field}:") for f in faults), faults


def test_a_previous_plan_must_fit_the_cluster() -> None:
    good = PlanningProblem.load(base())
    previous = plan(good).model_dump(mode="json")
    previous["pipelines"][0]["stages"][0]["ranks"] = [40, 41]
    previous["excluded"] = [99]
    faults = faults_of(base(previous_plan=previous))
    assert any("previous_plan.pipelines[0].stages[0].ranks: [40, 41] outside" in f for f in faults)
    assert any(f.startswith("previous_plan.excluded: [99] outside") for f in faults), faults
