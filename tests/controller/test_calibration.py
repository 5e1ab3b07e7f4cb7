"""The trainers' calibration reaches the controller's problem, its decision and its events.

The trainers publish the cost model's measured terms and per-node link rates on /metrics
(trainer/endpoint/metrics.py); `observation_from_metrics` reads them back into the planner's shape, and
the controller plans, decides and reports on the calibrated problem (`decision.calibrated`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest

from malleus.controller import Controller, EventKind, Observation, SimulatedJob
from malleus.controller.decision import calibrated
from malleus.controller.events import Planned, Replanned
from malleus.controller.sources import calibration_from_metrics, observation_from_metrics
from malleus.planner import Plan, PlanningProblem, plan_step_time
from malleus.trainer.endpoint.metrics import TrainerMetrics

from .conftest import greedy_planner

CAL = {
    "layer_seconds": 0.15,
    "embedding": 0.02,
    "head": 0.05,
    "tp_comm": {1: 0.0, 2: 0.08},
    "embedding_comm": {2: 0.004},
    "head_comm": {2: 0.03, 4: 0.05},
    "p2p": 0.01,
    "grad_sync_intra": 0.5,
    "grad_sync_inter": 2.0,
    "grad_sync_call_intra": 0.003,
    "grad_sync_call_inter": 0.02,
    "optimizer": 0.1,
    "fixed": 0.4,
}
LINKS = {0: 1.0, 1: 2.5}


def test_metrics_round_trip_in_seconds() -> None:
    m = TrainerMetrics("job-a", 0, 0)
    m.observe_step(7, 1.5, 100.0, 1.0, 0.5)
    m.observe_calibration(CAL, LINKS)
    text = m.render().decode()
    assert 'malleus_cost_seconds{group_size="2",malleus_job="job-a",term="tp_comm"} 0.012' in text
    assert 'malleus_link_rate{malleus_job="job-a",node_rank="1"} 2.5' in text
    assert "malleus_layer_seconds" in text and "malleus_cost_seconds_per_mebibyte" in text
    cal, links = calibration_from_metrics(text, "job-a")
    assert cal is not None and links == LINKS
    assert 'group_size="4",malleus_job="job-a",term="head_comm"} 0.0075' in text
    assert cal.keys() == CAL.keys()
    for term, value in CAL.items():
        assert cal[term] == pytest.approx(value), term
    obs = observation_from_metrics(text, "job-a", world=8, gpus_per_node=4)
    assert obs is not None and obs.calibration == cal and obs.link_rates == LINKS
    assert calibration_from_metrics(text, "other-job") == (None, {})


def test_the_host_sharing_round_trips_and_leaves_when_gone() -> None:
    m = TrainerMetrics("job-a", 0, 0)
    m.observe_calibration({**CAL, "shared_cpus": 2, "measured_active": 6}, LINKS)
    text = m.render().decode()
    assert 'malleus_calibration_host{malleus_job="job-a",term="shared_cpus"} 2.0' in text
    cal, _ = calibration_from_metrics(text, "job-a")
    assert cal is not None and (cal["shared_cpus"], cal["measured_active"]) == (2, 6)
    problem = calibrated(PlanningProblem.load(_PROBLEM), cal)
    assert problem.calibration is not None and problem.calibration.shared_cpus == 2
    m.observe_calibration({**CAL, "shared_cpus": None, "measured_active": None}, LINKS)
    cal, _ = calibration_from_metrics(m.render().decode(), "job-a")
    assert cal is not None and "shared_cpus" not in cal and "measured_active" not in cal


_PROBLEM = {"nodes": 2, "gpus_per_node": 4, "model": {"layers": 8, "tp": 2}, "micro_batches": 8}


def test_a_page_without_calibration_carries_none() -> None:
    m = TrainerMetrics("job-a", 0, 0)
    m.observe_step(3, 1.0, 10.0, 1.0, 0.5)
    obs = observation_from_metrics(m.render().decode(), "job-a")
    assert obs is not None and obs.calibration is None and obs.link_rates == {}


def test_resolved_problem_and_calibrated_agree(builder: Any) -> None:
    a = builder({3: 2.0}, None, calibration=CAL, link_rates={1: 2.5, 9: 3.0, 0: 0.5})
    b = calibrated(builder({3: 2.0}, None), CAL, {1: 2.5, 9: 3.0, 0: 0.5})
    assert a == b
    assert a.calibration is not None and a.calibration.tp_comm == {1: 0.0, 2: 0.08}
    assert a.link_rates == {0: 1.0, 1: 2.5}  # node 9 is not the job's; below 1.0 is healthy
    assert calibrated(builder({}, None), None) == builder({}, None)


class Calibrated:
    """A SimulatedJob whose trainers report CAL and LINKS with every step."""

    def __init__(self, sim: SimulatedJob) -> None:
        self.sim = sim

    async def read(self) -> Observation | None:
        obs = await self.sim.read()
        return obs and dataclasses.replace(obs, calibration=CAL, link_rates=LINKS)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sim, name)


def test_the_controller_plans_and_decides_on_the_calibrated_problem(
    make_sim: Any, builder: Any, clock: Any, policy: Any
) -> None:
    sim = make_sim(lambda step: {3: 4.0} if step >= 10 else {}, steps=40)
    seen: list[PlanningProblem] = []

    def planner(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        seen.append(problem)
        return greedy_planner(problem, time_limit=time_limit)

    src = Calibrated(sim)
    events: list[Any] = []
    c = Controller(
        src,
        sim,
        initial_plan=sim.plan,
        problem_builder=builder,
        policy=policy,
        planner=planner,
        clock=clock,
        planner_grace_seconds=0.0,
        on_event=events.append,
    )
    asyncio.run(c.run())
    assert seen, "no re-plan"
    problem = seen[0]
    assert problem.calibration is not None and problem.calibration.fixed == CAL["fixed"]
    assert problem.link_rates == {0: 1.0, 1: 2.5}
    planned = next(e.data for e in events if e.kind is EventKind.PLANNED)
    assert isinstance(planned, Planned)
    new = planned.plan
    assert planned.decision.new_units == pytest.approx(plan_step_time(problem, new))
    plain = plan_step_time(builder(problem.rates, None), new)
    assert not math.isclose(planned.decision.new_units, plain)  # the calibrated figure
    replanned = next(e.data for e in events if e.kind is EventKind.REPLANNED)
    assert isinstance(replanned, Replanned)
    assert replanned.decision.new_units == planned.decision.new_units
    assert replanned.plan.estimate is not None
    assert replanned.plan.estimate.step_time == pytest.approx(plan_step_time(problem, new))


def test_prometheus_mode_reads_the_same_terms() -> None:
    """PromQL answers (labels with `__name__`) give the calibration a scrape gives."""
    from malleus.controller.prometheus import default_queries, observation_from_results

    m = TrainerMetrics("job-a", 0, 0)
    m.observe_step(7, 1.5, 100.0, 1.0, 0.5)
    m.observe_calibration(CAL, LINKS)
    from prometheus_client.parser import text_string_to_metric_families

    answer = [
        ({"__name__": s.name, **s.labels}, s.value)
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
        if s.name.startswith(("malleus_cost", "malleus_layer_seconds", "malleus_link_rate"))
    ]
    obs = observation_from_results([], [({}, 7.0)], [({}, 1.5)], [({}, 1.0)], calibration=answer)
    assert obs is not None
    assert obs.calibration == calibration_from_metrics(m.render().decode())[0]
    assert obs.link_rates == LINKS
    query = default_queries("job-a", coordinator_pod="job-a-node-0").calibration
    assert query is not None and 'pod="job-a-node-0"' in query and "malleus_link_rate" in query


def test_an_unusable_calibration_is_left_out(builder: Any) -> None:
    bad = dict(CAL, fixed=1e9)  # beyond the planner's bound on a term
    problem = calibrated(builder({}, None), bad, {1: 2.0})
    assert problem == builder({}, None)
