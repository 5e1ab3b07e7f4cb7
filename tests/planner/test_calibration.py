"""The calibrated cost model: terms, old numbers without it, faults, and planning with it."""

from __future__ import annotations

import json
from pathlib import Path
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
    step_time_terms,
    uniform_plan,
    validate_plan,
)
from malleus.planner.cli import summary
from malleus.planner.cost import group_rate, stage_costs
from tests.planner.exhaustive import optimum

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "problems"
ROOMY = {"capacity_mb": 30, "layer_mb": 2, "activation_mb": 1, "embedding_mb": 1, "fixed_mb": 1}


def old_time(problem: PlanningProblem, p: Plan) -> float:
    """The model before calibration: (m-1) * max c + sum c, c = layer compute."""
    worst = 0.0
    for q in p.pipelines:
        cs = [group_rate(problem, s.ranks) * s.num_layers for s in q.stages]
        worst = max(worst, (q.micro_batches - 1) * max(cs) + sum(cs))
    return worst


def bottleneck_last(problem: PlanningProblem, p: Plan) -> bool:
    for q in p.pipelines:
        cs = [group_rate(problem, s.ranks) * s.num_layers for s in q.stages]
        if cs[-1] < max(cs):
            return False
    return True


@pytest.mark.parametrize("name", ["small", "32b", "70b"])
def test_without_calibration_the_numbers_are_the_old_ones(name: str) -> None:
    p = PlanningProblem.load((EXAMPLES / f"{name}.json").read_text())
    assert p.calibration is None and p.link_rates == {}
    uni = uniform_plan(p)
    assert uni is not None
    t = plan_step_time(p, uni)
    assert t <= old_time(p, uni) + 1e-9
    if bottleneck_last(p, uni):
        assert t == old_time(p, uni)
    # a healthy uniform layout has equal stages: the 1F1B fix changes nothing there
    healthy = p.model_copy(update={"rates": {}})
    assert plan_step_time(healthy, uni) == old_time(healthy, uni)
    assert step_time_terms(p, uni).total == t


def test_a_zero_calibration_is_no_calibration() -> None:
    data = json.loads((EXAMPLES / "32b.json").read_text())
    p = PlanningProblem.load(data)
    zero = PlanningProblem.load({**data, "calibration": {"layer_seconds": 0.01}})
    uni = uniform_plan(p)
    assert uni is not None
    assert plan_step_time(zero, uni) == plan_step_time(p, uni)
    terms = step_time_terms(zero, uni)
    assert (terms.grad_sync, terms.optimizer, terms.fixed) == (0.0, 0.0, 0.0)


def _two_stage() -> Plan:
    return Plan(
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=2,
                stages=[Stage(ranks=[0, 1], layers=(0, 2)), Stage(ranks=[2, 3], layers=(2, 4))],
            )
        ],
    )


CAL = {
    "layer_seconds": 0.01,
    "embedding": 1.0,
    "head": 2.0,
    "tp_comm": {"2": 0.5},
    "p2p": 0.25,
    "optimizer": 0.1,
    "fixed": 3.0,
}


def _one_node(**over: Any) -> PlanningProblem:
    data: dict[str, Any] = {
        "nodes": 1,
        "gpus_per_node": 4,
        "model": {"layers": 4, "tp": 2},
        "micro_batches": 2,
        "memory": {"capacity_mb": 1000, "layer_mb": 8, "embedding_mb": 4},
        "calibration": CAL,
    }
    data.update(over)
    return PlanningProblem.load(data)


def test_each_term_by_hand() -> None:
    p, pl = _one_node(), _two_stage()
    t = step_time_terms(p, pl)
    # pace 1 + 0.5 (healthy full group: the ends are not scaled); stage costs 4.25 and 5.0
    assert t.stages == {"layers": 4.0, "tp_comm": 2.0, "embedding": 1.0, "head": 2.0, "p2p": 0.25}
    assert t.pipeline == pytest.approx(5.0 + 9.25)  # bottleneck last: (m-1)*5 + sum
    assert t.grad_sync == 0.0  # one pipeline: nothing to all-reduce
    # each GPU holds 2 layers x 2 MB (layer_mb / 4) + 1 MB of embedding or head
    assert t.optimizer == pytest.approx(0.1 * 5.0)
    assert t.fixed == 3.0
    assert t.total == pytest.approx(17.75) == plan_step_time(p, pl)
    seconds = t.seconds()
    assert seconds is not None and seconds["total"] == pytest.approx(0.1775)
    assert set(t.as_dict()) >= {"pipeline", "grad_sync", "optimizer", "fixed", "total"}


def test_a_slow_link_slows_the_tp_collectives_and_the_transfers_of_its_node() -> None:
    t = step_time_terms(_one_node(link_rates={"0": 2.0}), _two_stage())
    # tp 0.5 x 2 per layer -> pace 2.0; ends scaled by 2.0 / 1.5; p2p at the worse link (2.0)
    assert t.stages["tp_comm"] == pytest.approx(4.0)
    assert t.stages["head"] == pytest.approx(2.0 * 2.0 / 1.5)
    assert t.stages["p2p"] == pytest.approx(0.5)
    c0, c1 = 4.0 + 4.0 / 3.0 + 0.5, 4.0 + 8.0 / 3.0
    assert t.pipeline == pytest.approx(c1 + c0 + c1)


def test_tp_comm_of_an_unlisted_size_scales_from_the_nearest() -> None:
    p = _one_node(calibration={**CAL, "tp_comm": {"4": 0.6}}, model={"layers": 4, "tp": 4})
    assert p.calibration is not None
    assert p.calibration.tp_comm_at(4) == 0.6
    assert p.calibration.tp_comm_at(2) == pytest.approx(0.6 * (1 / 2) / (3 / 4))
    assert p.calibration.tp_comm_at(1) == 0.0


def test_the_ends_collectives_cost_a_group_not_a_single_gpu() -> None:
    """`head_comm` / `embedding_comm` by the end stage's group size: a last stage of one GPU pays
    none, a pair pays its own (not scaled by its pace as the head's compute is), sizes not listed
    as tp_comm's; absent, the old model."""
    base = {"layer_seconds": 1.0, "head": 0.2, "tp_comm": {"2": 0.3}}
    p = _one_node(calibration={**base, "head_comm": {"2": 1.0}, "embedding_comm": {"2": 0.5}})
    cal = p.calibration
    assert cal is not None
    assert (cal.head_comm_at(1), cal.head_comm_at(2)) == (0.0, 1.0)
    assert cal.head_comm_at(4) == pytest.approx(1.0 * (3 / 4) / (1 / 2))
    pair = Plan(
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=2,
                stages=[Stage(ranks=[0, 1], layers=(0, 2)), Stage(ranks=[2, 3], layers=(2, 4))],
            )
        ],
    )
    single = Plan(
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=2,
                stages=[Stage(ranks=[0, 1], layers=(0, 2)), Stage(ranks=[2], layers=(2, 4))],
            )
        ],
        excluded=[3],
    )
    plain = _one_node(calibration=base)
    for plan_ in (pair, single):
        assert validate_plan(p, plan_) == []
    # per micro-batch the pair's last stage adds its head_comm, the single GPU's adds nothing
    first = [
        c - d
        for c, d in zip(
            stage_costs(p, pair.pipelines[0]), stage_costs(plain, pair.pipelines[0]), strict=True
        )
    ]
    assert first == pytest.approx([0.5, 1.0])
    alone = [
        c - d
        for c, d in zip(
            stage_costs(p, single.pipelines[0]),
            stage_costs(plain, single.pipelines[0]),
            strict=True,
        )
    ]
    assert alone == pytest.approx([0.5, 0.0])


def test_head_and_embedding_shrink_the_end_stages() -> None:
    p = PlanningProblem.load(
        {
            "nodes": 1,
            "gpus_per_node": 4,
            "model": {"layers": 12, "tp": 1},
            "micro_batches": 16,
            "dp": 1,
            "calibration": {"layer_seconds": 1.0, "embedding": 1.5, "head": 3.0},
        }
    )
    result = plan(p)
    assert validate_plan(p, result) == []
    layers = [s.num_layers for s in result.pipelines[0].stages]
    assert len(layers) >= 3, layers
    assert layers[-1] < max(layers[1:-1]) and layers[0] < max(layers[1:-1]), layers
    assert layers[-1] <= layers[0], layers  # the head costs more than the embedding
    # without the calibration the same problem splits evenly
    bare = PlanningProblem.load({**json.loads(p.model_dump_json()), "calibration": None})
    even = [s.num_layers for s in plan(bare).pipelines[0].stages]
    assert max(even) - min(even) <= 1, even


def test_the_estimate_reports_each_term_in_seconds() -> None:
    p = _one_node(nodes=2, model={"layers": 4, "tp": 2}, micro_batches=4)
    result = plan(p)
    e = result.estimate
    assert e is not None and e.terms is not None
    assert e.step_time == pytest.approx(plan_step_time(p, result))
    assert e.terms["total"] == pytest.approx(e.step_time)
    assert e.step_seconds == pytest.approx(e.step_time * 0.01)
    text = summary(p, result)
    assert "gradient sync" in text and " s)" in text
    # an uncalibrated plan's estimate has no terms (the plan JSON is as before)
    bare = plan(PlanningProblem.load(json.loads(p.model_dump_json()) | {"calibration": None}))
    assert bare.estimate is not None and bare.estimate.terms is None


CASES: dict[str, dict[str, Any]] = {
    "head, embedding, tp_comm, p2p; one 2x": {
        "nodes": 2,
        "gpus_per_node": 2,
        "rates": {"1": 2.0},
        "model": {"layers": 6, "tp": 2},
        "micro_batches": 4,
        "calibration": {
            "layer_seconds": 1.0,
            "embedding": 0.5,
            "head": 2.0,
            "tp_comm": {"2": 0.3},
            "p2p": 0.2,
            "fixed": 1.0,
        },
    },
    # the ends' own collectives make a pair at either end cost more than a single GPU there
    "the ends' collectives by group size; one 2x": {
        "nodes": 2,
        "gpus_per_node": 2,
        "rates": {"1": 2.0},
        "model": {"layers": 6, "tp": 2},
        "micro_batches": 4,
        "calibration": {
            "layer_seconds": 1.0,
            "embedding": 0.5,
            "head": 2.0,
            "embedding_comm": {"2": 0.4},
            "head_comm": {"2": 1.5},
            "tp_comm": {"2": 0.3},
            "p2p": 0.2,
            "fixed": 1.0,
        },
    },
    "slow link, memory": {
        "nodes": 2,
        "gpus_per_node": 4,
        "model": {"layers": 6, "tp": 2},
        "micro_batches": 6,
        "memory": ROOMY,
        "link_rates": {"1": 3.0},
        "calibration": {"layer_seconds": 1.0, "tp_comm": {"2": 0.4}, "p2p": 0.1, "head": 1.5},
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_calibrated_plans_are_within_one_percent_of_the_optimum(name: str) -> None:
    p = PlanningProblem.load(CASES[name])
    best = optimum(p)
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None
    assert result.estimate.step_time >= best - 1e-9  # the enumerator really is exhaustive
    assert result.estimate.step_time <= best * 1.01, (result.estimate.step_time, best)


def test_a_slow_single_gpu_as_a_short_last_stage_behind_a_single() -> None:
    """With GPU 1 at 2x and cheap ends the optimum is [2,3] alone (2 micro-batches) beside
    [0] > [1] (5 + 1 layers, 2 micro-batches): 22.44. At 2 micro-batches the order matters
    (the bottleneck first hides the short stage after it), and the planner chose the order for
    many micro-batches, [1] > [0], then [2,3] > [1] beside [0]: 24.45 (+9%, found 2026-12-02)."""
    case = CASES["the ends' collectives by group size; one 2x"]
    cal = {**case["calibration"], "embedding": 0.2, "head": 0.3}
    del cal["fixed"]
    p = PlanningProblem.load({**case, "calibration": cal})
    assert plan(p).estimate.step_time <= optimum(p) * 1.02  # type: ignore[union-attr]


def _faults(**over: Any) -> list[str]:
    data: dict[str, Any] = {
        "nodes": 2,
        "gpus_per_node": 4,
        "model": {"layers": 8, "tp": 2},
        "micro_batches": 8,
    }
    data.update(over)
    with pytest.raises(ProblemError) as e:
        PlanningProblem.load(data)
    return [str(f) for f in e.value.faults]


@pytest.mark.parametrize(
    ("over", "expect"),
    [
        ({"calibration": {"layer_seconds": 0}}, "calibration.layer_seconds: 0"),
        ({"calibration": {"layer_seconds": float("nan")}}, "calibration.layer_seconds: nan"),
        ({"calibration": {}}, "calibration.layer_seconds"),
        ({"calibration": {"layer_seconds": 1, "head": -1}}, "calibration.head: -1"),
        ({"calibration": {"layer_seconds": 1, "p2p": float("inf")}}, "calibration.p2p: inf"),
        ({"calibration": {"layer_seconds": 1, "tp_comm": {"3": 0.1}}}, "calibration.tp_comm[3]"),
        ({"calibration": {"layer_seconds": 1, "tp_comm": {"2": -0.1}}}, "calibration.tp_comm[2]"),
        (
            {"calibration": {"layer_seconds": 1, "head_comm": {"3": 0.1}}},
            "calibration.head_comm[3]",
        ),
        (
            {"calibration": {"layer_seconds": 1, "embedding_comm": {"2": float("nan")}}},
            "calibration.embedding_comm[2]",
        ),
        ({"calibration": {"layer_seconds": 1, "bogus": 1}}, "calibration.bogus"),
        ({"link_rates": {"2": 2.0}}, "link_rates[2]: node 2 is out of range"),
        ({"link_rates": {"0": 0.5}}, "link_rates[0]: 0.5 is not allowed"),
        ({"link_rates": {"0": 1e9}}, "link_rates[0]: 1000000000.0 is not allowed"),
        ({"link_rates": {"0": None}}, "link_rates.0"),
    ],
)
def test_bad_calibration_and_links_are_named(over: dict[str, Any], expect: str) -> None:
    faults = _faults(**over)
    assert any(expect in f for f in faults), faults


def test_every_calibration_fault_at_once() -> None:
    faults = _faults(
        calibration={"layer_seconds": -1, "head": -2, "optimizer": float("nan")},
        link_rates={"5": 0.1},
    )
    assert len(faults) == 5, faults  # layer_seconds, head, optimizer, link node, link value
