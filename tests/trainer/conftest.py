"""Shared fixtures: a small job (1 node x 4 GPUs, tp 2, 4 layers, 4 micro-batches) and plans."""

from __future__ import annotations

from typing import Any

import pytest

from malleus.planner.problem import PlanningProblem


@pytest.fixture
def problem() -> PlanningProblem:
    return PlanningProblem.load(
        {"nodes": 1, "gpus_per_node": 4, "model": {"layers": 4, "tp": 2}, "micro_batches": 4}
    )


def make_plan(generation: int, **overrides: Any) -> dict[str, Any]:
    """Two pipelines of one full TP group each, 2 micro-batches apiece."""
    plan: dict[str, Any] = {
        "generation": generation,
        "tp": 2,
        "pipelines": [
            {"micro_batches": 2, "stages": [{"ranks": [0, 1], "layers": [0, 4]}]},
            {"micro_batches": 2, "stages": [{"ranks": [2, 3], "layers": [0, 4]}]},
        ],
        "excluded": [],
    }
    plan.update(overrides)
    return plan


@pytest.fixture
def plan_factory():
    return make_plan
