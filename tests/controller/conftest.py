"""Shared pieces for the controller tests: a real MalleusJob, its problem builder, a planner.

The builder is `ResolvedJob.problem`, the one every caller of the controller hands it.

The planner here is deliberately simple and exact for what it does (one-stage pipelines, one
per healthy TP group, micro-batches dealt greedily to whichever group finishes them soonest),
so the tests depend on the controller's behaviour and not on the real search's tuning.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from malleus.controller import ManualClock, SimulatedJob
from malleus.job import MalleusJob, ResolvedJob, StragglerPolicy, load_job
from malleus.planner import Pipeline, Plan, PlanningProblem, Stage, uniform_plan
from malleus.planner.cost import group_rate


def manifest(**policy: Any) -> dict[str, Any]:
    """2 nodes x 4 GPUs, tp 2 (4 TP groups), tiny model (8 layers), 8 micro-batches per step."""
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "ctl-test"},
        "spec": {
            "image": "malleus:test",
            "nodes": 2,
            "gpusPerNode": 4,
            "model": {"preset": "tiny"},
            "training": {
                "globalBatchSize": 16,
                "microBatchSize": 2,
                "steps": 1000,
                "learningRate": 0.001,
            },
            "parallelism": {"tp": 2},
            "stragglerPolicy": policy,
        },
    }


# Two pipelines of two stages (4 layers each): a switch to single-stage pipelines moves layers.
TWO_STAGE = Plan(
    tp=2,
    pipelines=[
        Pipeline(
            micro_batches=4,
            stages=[Stage(ranks=[0, 1], layers=(0, 4)), Stage(ranks=[2, 3], layers=(4, 8))],
        ),
        Pipeline(
            micro_batches=4,
            stages=[Stage(ranks=[4, 5], layers=(0, 4)), Stage(ranks=[6, 7], layers=(4, 8))],
        ),
    ],
)


def greedy_planner(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
    """One single-stage pipeline per usable full TP group; micro-batches to the group that would
    finish its next one soonest (exact for min-max); groups that get none are excluded."""
    tp, L = problem.tp, problem.layers
    groups: list[list[int]] = []
    excluded: list[int] = []
    for start in range(0, problem.world, tp):
        ranks = list(range(start, start + tp))
        usable = [r for r in ranks if problem.rate(r) is not None]
        if len(usable) == tp:
            groups.append(ranks)
        else:
            excluded += usable
    y = [group_rate(problem, g) * L for g in groups]
    counts = [0] * len(groups)
    heap = [(y[i], i) for i in range(len(groups))]
    heapq.heapify(heap)
    for _ in range(problem.micro_batches):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * y[i], i))
    pipelines = []
    for g, m in zip(groups, counts, strict=True):
        if m == 0:
            excluded += g
        else:
            pipelines.append(Pipeline(micro_batches=m, stages=[Stage(ranks=g, layers=(0, L))]))
    return Plan(tp=tp, pipelines=pipelines, excluded=sorted(excluded))


@pytest.fixture
def job() -> MalleusJob:
    return load_job(manifest())


@pytest.fixture
def builder(
    job: MalleusJob,
) -> Callable[[Mapping[int, float | None], Plan | None], PlanningProblem]:
    return ResolvedJob.of(job).problem


@pytest.fixture
def initial_plan(builder: Any) -> Plan:
    plan = uniform_plan(builder({}, None))
    assert plan is not None
    return plan


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make_sim(builder: Any, initial_plan: Plan, clock: ManualClock) -> Callable[..., SimulatedJob]:
    def make(
        rates_at: Callable[[int], Mapping[int, float | None]], steps: int, **kw: Any
    ) -> SimulatedJob:
        kw.setdefault("seconds_per_unit", 1.0)  # a healthy step (16 layer-units) takes 16 s
        return SimulatedJob(builder, initial_plan, rates_at, clock=clock, steps=steps, **kw)

    return make


@pytest.fixture
def policy() -> StragglerPolicy:
    return StragglerPolicy(cooldown_seconds=30)
