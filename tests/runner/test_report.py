"""Report and summary as pure functions, fed by the real controller driving a simulated job.

The simulated job times every step with the cost model itself, so the measured speedup of each
re-plan must equal the predicted one: the report's arithmetic is checked against a known answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from malleus.controller import Controller, DecisionEvent, ManualClock, SimulatedJob
from malleus.job import ResolvedJob
from malleus.runner.prepare import true_rates
from malleus.runner.record import PlanSwitch
from malleus.runner.report import RunFacts, build_report, generation_segments, summary_text

from .conftest import manifest

SCHEDULE = ((6, 1, 4.0), (18, 1, 1.0))
TOKENS = 256
SPU = 0.12  # seconds per cost-model unit


def simulate(steps: int = 28) -> tuple[list[DecisionEvent], list[PlanSwitch], list[dict]]:
    """(events, switches, per-step rows) of the e2e scenario under the simulated job."""
    job = ResolvedJob.load(manifest(policy={"windowSteps": 3, "cooldownSeconds": 2}))
    plan = job.initial_plan()
    clock = ManualClock()
    sim = SimulatedJob(
        job.problem,
        plan,
        lambda s: true_rates(SCHEDULE, s),
        clock=clock,
        steps=steps,
        seconds_per_unit=SPU,
    )
    rows: list[dict] = []

    class Recording:
        async def read(self) -> Any:
            obs = await sim.read()
            if obs is not None:
                rows.append(
                    {
                        "step": obs.step,  # the simulation counts 0-based, like the record
                        "time": clock() - 1_000_000.0,
                        "seconds": obs.step_seconds,
                        "tokens_per_second": TOKENS / obs.step_seconds,
                        "loss": 5.0 - (obs.step + 1) * 0.1,
                        "rates": {str(r): v for r, v in obs.rates.items()},
                    }
                )
            return obs

    controller = Controller(
        Recording(),
        sim,
        initial_plan=plan,
        problem_builder=job.problem,
        policy=job.policy,
        clock=clock,
    )
    asyncio.run(controller.run())
    switches = [PlanSwitch(plan.generation, 0)] + [
        PlanSwitch(p.generation, s, 0.5, 2048.0) for s, p in sim.applied
    ]
    for row in rows:
        row["generation"] = max(s.generation for s in switches if s.step <= row["step"])
    return controller.history, switches, rows


@pytest.fixture(scope="module")
def simulated() -> tuple[list[DecisionEvent], list[PlanSwitch], list[dict]]:
    return simulate()


def facts(**over: Any) -> RunFacts:
    base = dict(
        job="runner-test",
        mode="live",
        nodes=1,
        gpus_per_node=4,
        tp=2,
        tokens_per_step=TOKENS,
        window_steps=3,
        total_steps=28,
        started="2025-01-01T00:00:00+00:00",
        wall_seconds=60.0,
        exit_code=0,
        exit_reason="completed",
        unit_seconds=SPU,
        schedule=SCHEDULE,
    )
    return RunFacts(**(base | over))


def test_every_replan_is_reported_with_prediction_and_measurement(simulated: Any) -> None:
    events, switches, rows = simulated
    report = build_report(facts(), rows, switches, events, ideal_step_seconds=[0.5] * 28)
    changes = report["plan_changes"]
    assert [c["generation"] for c in changes] == [2, 3]  # the first plan is generation 1
    first, second = changes
    assert "rank 1 slowed" in first["reason"] and "rank 1 recovered" in second["reason"]
    assert 6 < first["step_applied"] <= 6 + 3 + 1  # within the window of the onset
    assert 18 < second["step_applied"] <= 18 + 3 + 1
    for c in changes:
        # The simulation times steps with the cost model: measured == predicted exactly.
        assert c["measured_steps"] >= 3
        assert c["measured_speedup"] == pytest.approx(c["predicted_speedup"])
        assert c["throughput_vs_predicted"] == pytest.approx(1.0)
        assert c["predicted_speedup"] > 1.2
        assert (c["migration_seconds"], c["migration_bytes"]) == (0.5, 2048.0)
        assert c["planning_seconds"] is not None
    assert report["steps"] == 28 and report["final_loss"] == pytest.approx(5.0 - 2.8)
    assert report["ideal_seconds"] == pytest.approx(14.0)
    assert report["ideal_ratio"] == pytest.approx(14.0 / report["training_seconds"])
    assert [e["kind"] for e in report["events"]][:4] == [
        "StragglerDetected",
        "Planned",
        "Replanned",
        "Migrated",
    ]
    assert report["events"][2]["data"]["plan"] == first["plan"]
    json.dumps(report, allow_nan=False)  # strict JSON as it is


def test_generation_segments_average_tokens_over_time() -> None:
    rows = [
        {"step": 0, "generation": 0, "seconds": 1.0},
        {"step": 1, "generation": 0, "seconds": 3.0},
        {"step": 2, "generation": 1, "seconds": 0.5},
    ]
    seg = generation_segments(rows, tokens_per_step=100)
    assert seg[0] | {} == {
        "generation": 0,
        "first_step": 0,
        "last_step": 1,
        "steps": 2,
        "mean_tokens_per_second": 50.0,  # 200 tokens in 4 s, not the mean of 100 and 33
        "median_step_seconds": 2.0,
    }
    assert seg[1]["mean_tokens_per_second"] == 200.0


def test_summary_lists_generations_replans_and_loss(simulated: Any) -> None:
    events, switches, rows = simulated
    text = summary_text(build_report(facts(), rows, switches, events))
    assert "28/28 steps" in text and "final loss 2.2000" in text
    assert "re-plans: 2" in text
    lines = text.splitlines()
    gen_rows = [ln for ln in lines if ln.strip().startswith(("1 ", "2 ", "3 "))]
    assert len(gen_rows) >= 3
    assert any("rank 1 slowed" in ln for ln in lines)
    assert any("rank 1 recovered" in ln for ln in lines)


def test_a_failed_run_says_why_in_the_summary() -> None:
    report = build_report(
        facts(exit_code=1, exit_reason="trainer rank 2 killed by SIGKILL"), [], [], []
    )
    assert report["steps"] == 0 and report["training_seconds"] is None
    assert "stopped: trainer rank 2 killed by SIGKILL" in summary_text(report)
