"""Properties over random small problems: every plan is valid and never slower than uniform."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from malleus.planner import (
    PlanningProblem,
    ProblemError,
    plan,
    plan_step_time,
    uniform_plan,
    validate_plan,
)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    gpn = draw(st.sampled_from([2, 4, 8]))
    nodes = draw(st.integers(1, 16 // gpn))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if gpn % t == 0]))
    world = nodes * gpn
    slow = draw(st.lists(st.integers(0, world - 1), max_size=4, unique=True))
    rates: dict[str, float | None] = {
        str(r): draw(st.one_of(st.none(), st.floats(1.0, 10.0))) for r in slow
    }
    if all(rates.get(str(r), 1.0) is None for r in range(world)):
        rates.pop(str(slow[0]))
    data: dict[str, Any] = {
        "nodes": nodes,
        "gpus_per_node": gpn,
        "rates": rates,
        "model": {"layers": draw(st.integers(1, 12)), "tp": tp},
        "micro_batches": draw(st.integers(1, 12)),
    }
    if draw(st.booleans()):
        data["memory"] = {
            "capacity_mb": draw(st.sampled_from([8, 12, 20, 40])),
            "layer_mb": draw(st.sampled_from([0.5, 1, 2])),
            "activation_mb": draw(st.sampled_from([0, 0.25, 1])),
            "embedding_mb": draw(st.sampled_from([0, 1])),
            "fixed_mb": 1,
        }
    if draw(st.integers(0, 4)) == 0:
        data["dp"] = draw(st.integers(1, min(3, world)))  # a problem allows 1..world
    return data


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plans_are_valid_and_never_slower_than_uniform(data: dict[str, Any]) -> None:
    p = PlanningProblem.load(data)
    uni = uniform_plan(p)
    uni_ok = uni is not None and not validate_plan(p, uni)
    try:
        result = plan(p, time_limit=2.0)
    except ProblemError:
        # only when nothing fits (or a pinned dp cannot be formed): then neither does uniform
        assert not uni_ok
        return
    assert validate_plan(p, result) == []
    e = result.estimate
    assert e is not None
    assert e.step_time == plan_step_time(p, result)
    if uni_ok:
        assert uni is not None
        assert e.uniform_step_time == plan_step_time(p, uni)
        assert e.step_time <= e.uniform_step_time + 1e-9
    else:
        assert e.uniform_step_time is None
    if p.dp is not None:
        assert result.dp == p.dp
    if p.model.alpha is None:  # with alpha = 2^k no GPU beats its healthy full-group speed
        assert e.ideal_step_time is not None and e.step_time >= e.ideal_step_time - 1e-9
