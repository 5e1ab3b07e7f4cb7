"""Shared fixtures: a small job (1 node x 4 GPUs, tp 2, 4 layers, 4 micro-batches), plans, and a
one-rank world in the test's own process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from malleus.planner.problem import PlanningProblem
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.world.world import World


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


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A world of one in this process (gloo, its store on loopback), torn down after the test."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    monkeypatch.setenv("MALLEUS_EXTERNAL_STORE", "1")
    world = World(1)  # holds the store's client while the process group lives
    init_distributed(DistEnv(0, 1, 0, "127.0.0.1", store.port), world, init_timeout_s=10)
    yield world
    dist.destroy_process_group()
