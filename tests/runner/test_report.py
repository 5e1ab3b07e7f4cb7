"""Report and summary as pure functions, fed by the real controller driving a simulated job.

The simulated job times every step with the cost model itself, so the measured speedup of each
re-plan must equal the predicted one: the report's arithmetic is checked against a known answer.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from typing import Any

import pytest

from malleus.controller import Controller, DecisionEvent, ManualClock, SimulatedJob
from malleus.job import ResolvedJob
from malleus.job.report import generation_segments
from malleus.runner.prepare import true_rates
from malleus.runner.record import PlanSwitch
from malleus.runner.report import RunFacts, build_report, summary_text

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
    windows = [ln.split() for ln in lines if ln.strip().startswith(("0-", "6-", "18-"))]
    assert [w[1] for w in windows] == ["1", "1->2", "2->3"]  # a window per re-plan
    assert any("rank 1 slowed" in ln for ln in lines)
    assert any("rank 1 recovered" in ln for ln in lines)


def test_a_failed_run_says_why_in_the_summary() -> None:
    report = build_report(
        facts(exit_code=1, exit_reason="trainer rank 2 killed by SIGKILL"), [], [], []
    )
    assert report["steps"] == 0 and report["training_seconds"] is None
    assert "stopped: trainer rank 2 killed by SIGKILL" in summary_text(report)


def full_report(simulated: Any, calibration: dict[str, Any] | None = None, **over: Any) -> dict:
    """The report as `malleus run` builds it: with the first plan and the job's problems."""
    events, switches, rows = simulated
    job = ResolvedJob.load(manifest(policy={"windowSteps": 3, "cooldownSeconds": 2}))
    return build_report(
        facts(**over),
        rows,
        switches,
        events,
        initial_plan=json.loads(job.initial_plan().to_json()),
        problem_of=job.problem,
        calibration=calibration,
    )


def test_every_replan_says_what_it_changed(simulated: Any) -> None:
    report = full_report(simulated)
    first, second = report["plan_changes"]
    # rank 1 4x: left out, its partner runs both shards; healed: back in.
    assert first["changed"]["excluded"] == [1] and first["changed"]["tp_regrouped"]
    assert second["changed"]["readmitted"] == [1]
    for c in (first, second):
        assert c["changed"]["text"].endswith("2.0 KiB migrated")  # the switch's 2048 bytes
        assert c["changed"]["labels"]
    text = summary_text(report)
    assert f"changed: {first['changed']['text']}" in text
    assert "rank 1 excluded" in text and "rank 1 re-admitted" in text


def test_a_plan_the_trainers_made_themselves_is_the_one_the_next_replan_changes(
    simulated: Any,
) -> None:
    # Drop the controller's Replanned of generation 2, keep its Migrated: generation 2 is now a
    # plan adopted from the trainers (a recovery's), not a re-plan of this controller.
    from malleus.controller.events import Replanned

    events, switches, rows = simulated
    gen2 = [e for e in events if isinstance(e.data, Replanned) and e.data.generation == 2]
    kept = [e for e in events if e not in gen2]
    assert gen2 and len(kept) == len(events) - 1
    whole, adopted = full_report(simulated), full_report((kept, switches, rows))
    (change,) = adopted["plan_changes"]
    assert change["generation"] == 3
    # against generation 2's plan (re-admits rank 1), not the first plan (which had it)
    assert change["changed"] == whole["plan_changes"][1]["changed"]
    assert change["changed"]["readmitted"] == [1]
    start, recovery, replan = adopted["windows"]
    # the adopted plan's own window: from its first step, nothing before it to compare with
    assert recovery["reason"] == "(recovery: plan generation 2)"
    assert recovery["generation"] == 2 and recovery["old_generation"] is None
    assert recovery["gain"] is None and recovery["after_steps"] >= 3
    assert start["last_step"] + 1 == recovery["first_step"] == change_step(whole, 2)
    assert replan["old_generation"] == 2 and replan["gain"] > 1.0
    assert "(recovery: plan generation 2)" in summary_text(adopted)


def change_step(report: dict, generation: int) -> int:
    return next(c["step_applied"] for c in report["plan_changes"] if c["generation"] == generation)


def test_static_baseline_is_predicted_from_the_runs_own_steps(simulated: Any) -> None:
    report = full_report(simulated)
    base = report["static_baseline"]
    # The simulation times every step as SPU x cost-model units: the fit finds exactly that.
    assert base["seconds_per_unit"] == pytest.approx(SPU)
    assert base["intercept_seconds"] == pytest.approx(0.0, abs=1e-9)
    job = ResolvedJob.load(manifest())
    first = job.initial_plan()
    from malleus.planner.cost import plan_step_time

    known: dict[int, float | None] = {}
    expected = 0.0
    warm = {0} | {c["step_applied"] for c in report["plan_changes"]}
    for r in simulated[2]:
        if r["step"] not in warm:  # a warm-up's rates are not carried on
            known.update({int(k): v for k, v in r["rates"].items()})
        if r["step"] > 0:  # every step after the first, switch steps included
            expected += SPU * plan_step_time(job.problem(known), first)
    assert base["predicted_seconds"] == pytest.approx(expected)
    # Measured: the run's time after its first step (switches count against it).
    first_seconds = simulated[2][0]["seconds"]
    assert base["measured_is_elapsed"]
    assert base["measured_seconds"] == pytest.approx(report["training_seconds"] - first_seconds)
    assert base["gain"] == pytest.approx(expected / base["measured_seconds"])
    assert base["gain"] > 1.2  # the stretch at 4x costs the first plan dearly
    assert len(base["per_step"]) == base["steps"]
    assert "predicted" in base["label"]


def test_windows_compare_each_replan_with_the_plan_it_replaced(simulated: Any) -> None:
    report = full_report(simulated)
    windows = report["windows"]
    assert len(windows) == 1 + len(report["plan_changes"])
    assert windows[0]["reason"] == "(start)" and windows[0]["gain"] is None
    assert [w["first_step"] for w in windows[1:]] == [6, 18]  # the schedule's onsets
    for w in windows[1:]:
        assert w["before_steps"] >= 1 and w["after_steps"] >= 3
        assert w["gain"] > 1.0  # a re-plan, read in its window, is never a loss
        assert w["old_generation"] == w["generation"] - 1


def test_summary_names_every_speedup_and_writes_it_as_x(simulated: Any) -> None:
    text = summary_text(full_report(simulated))
    assert "%" not in text  # no time saved in the summary: speedups only, as `x`
    assert " gain" not in text
    assert "static baseline (predicted" in text and "-> speedup " in text
    assert "per re-plan window" in text and " speedup  shift" in text
    assert "speedup: pred   meas" in text
    assert "ideal" not in text or "x the training time" in text


def test_static_baseline_without_an_emulated_clock_is_fitted(simulated: Any) -> None:
    from malleus.runner.report import static_baseline_of

    emulated = full_report(simulated)
    real = full_report(simulated, unit_seconds=None)  # real GPUs: no unit to lean on
    base = real["static_baseline"]
    assert base["fit"].startswith("least squares")
    assert emulated["static_baseline"]["fit"].startswith("emulated unit")
    assert base["seconds_per_unit"] == pytest.approx(SPU)  # the simulation is exactly affine
    assert base["predicted_seconds"] == pytest.approx(
        emulated["static_baseline"]["predicted_seconds"]
    )
    # A saved report gets the same baseline again (how bench/e2e.py re-renders old reports).
    saved = json.loads(json.dumps(emulated))
    job = ResolvedJob.load(manifest(policy={"windowSteps": 3, "cooldownSeconds": 2}))
    assert static_baseline_of(saved, job.problem) == emulated["static_baseline"]


TERMS = {  # as the trainers publish them (JSON: string keys)
    "layer_seconds": 0.15,
    "embedding": 0.03,
    "head": 0.07,
    "tp_comm": {"2": 0.08},
    "p2p": 0.01,
    "grad_sync_intra": 0.5,
    "grad_sync_inter": 3.0,
    "optimizer": 0.2,
    "fixed": 0.6,
}


def test_static_baseline_uses_the_calibration_measured_under_the_first_plan(
    simulated: Any,
) -> None:
    """The run measured the cost model's terms under the first plan: the baseline is that
    plan's calibrated time at each step's rates, anchored to the first plan's own steps (what
    the calibration left out on this host). Here the first plan ran 2 steps at 4x, too few for
    a level of their own: the calibration's unit plus the median residual of its steps."""
    from malleus.controller.decision import calibrated
    from malleus.planner.cost import plan_step_time
    from malleus.runner.report import static_baseline_of

    job = ResolvedJob.load(manifest(policy={"windowSteps": 3, "cooldownSeconds": 2}))
    first = job.initial_plan()
    measured = {"generation": first.generation, "calibration": TERMS, "link_rates": {"0": 1.5}}
    report = full_report(simulated, calibration=measured)
    base = report["static_baseline"]
    assert base["calibrated"] and "calibrated cost model" in base["label"]
    assert base["fit"].startswith("the terms measured under plan generation")
    known: dict[int, float | None] = {}
    model: list[float] = []
    residuals: list[float] = []
    warm = {0} | {c["step_applied"] for c in report["plan_changes"]}
    for r in simulated[2]:
        if r["step"] not in warm:
            known.update({int(k): v for k, v in r["rates"].items()})
        if r["step"] > 0:
            problem = calibrated(job.problem(known), TERMS, {0: 1.5})
            model.append(0.15 * plan_step_time(problem, first))
            if r["generation"] == first.generation and r["step"] not in warm:
                residuals.append(r["seconds"] - model[-1])
    residual = statistics.median(residuals)
    assert len(residuals) >= 5 and base["intercept_seconds"] == pytest.approx(residual)
    assert base["seconds_per_unit"] == 0.15
    assert f"its median residual on its {len(residuals)} steps" in base["fit"]
    assert base["predicted_seconds"] == pytest.approx(sum(model) + residual * len(model))
    plain = full_report(simulated)["static_baseline"]
    assert not plain["calibrated"] and base["predicted_seconds"] != pytest.approx(
        plain["predicted_seconds"]
    )
    text = summary_text(report)
    assert "static baseline (predicted, calibrated): " in text
    assert "calibrated cost model at the measured rates" in text
    saved = json.loads(json.dumps(report))  # a saved report gets the same baseline again
    assert static_baseline_of(saved, job.problem) == base


def test_a_calibration_of_another_plan_is_not_the_static_baseline(simulated: Any) -> None:
    """Terms measured under a later plan do not describe the first one: the fallback fit."""
    job = ResolvedJob.load(manifest(policy={"windowSteps": 3, "cooldownSeconds": 2}))
    later = {"generation": job.initial_plan().generation + 1, "calibration": TERMS}
    base = full_report(simulated, calibration=later)["static_baseline"]
    assert not base["calibrated"] and base["fit"].startswith("emulated unit")
    assert "(predicted): " in summary_text(full_report(simulated, calibration=later))


# ---- the summary's baseline in every scenario: it means what it says, or it is not printed ----


def _plans(report: dict) -> dict[int, Any]:
    from malleus.planner.plan import Plan

    plans = {report["initial_plan"]["generation"]: Plan.model_validate(report["initial_plan"])}
    for c in report["plan_changes"]:
        plans[c["generation"]] = Plan.model_validate({"tp": 2, **c["plan"]})
    return plans


def test_the_calibrated_baseline_is_the_measured_time_in_the_healthy_phases(
    simulated: Any,
) -> None:
    """The quickstart's baseline ran ~9% above the measured line where both are the first plan
    at the same rates (the calibration left the host's overhead out), and copied a one-step
    host-jitter dip. Steps timed as the calibrated model + 0.05 s of overhead, with a
    one-sample jitter of two GPUs at step 3: the baseline is each healthy step's own time."""
    from malleus.controller.decision import calibrated
    from malleus.planner.cost import plan_step_time

    job = ResolvedJob.load(manifest(policy={"windowSteps": 3, "cooldownSeconds": 2}))
    events, switches, rows = simulated
    plans = _plans(full_report(simulated))
    timed = []
    for r in rows:
        rates = {int(k): v for k, v in r["rates"].items()}
        problem = calibrated(job.problem(rates), TERMS, {0: 1.5})
        seconds = 0.15 * plan_step_time(problem, plans[r["generation"]]) + 0.05
        timed.append(r | {"seconds": seconds, "tokens_per_second": TOKENS / seconds})
    healthy = timed[1]["seconds"]
    timed[3] = timed[3] | {"rates": {**timed[3]["rates"], "0": 1.3, "2": 1.4}}  # host jitter
    measured = {"generation": 1, "calibration": TERMS, "link_rates": {"0": 1.5}}
    report = full_report((events, switches, timed), calibration=measured)
    base = report["static_baseline"]
    assert base["intercept_seconds"] == pytest.approx(0.05)
    predicted = {p["step"]: p["predicted_seconds"] for p in base["per_step"]}
    assert [predicted[s] for s in range(1, 6)] == pytest.approx([healthy] * 5)  # no dip at 3
    assert predicted[6] > 2 * healthy  # the straggler's onset shows from its first step
    last = max(predicted)  # rank 1 healed: the first plan back at its healthy time
    assert predicted[last] == pytest.approx(healthy)
    assert base["smoothing_samples"] == 5


@pytest.mark.parametrize("mode", ["live", "restart"])
def test_a_failed_gpu_leaves_no_static_baseline_in_summary_or_plot(
    simulated: Any, mode: str
) -> None:
    """failure-demo printed `static baseline: 4.3 s ... on 7 steps; measured 24.9 s ... -> gain
    0.17x` (a prediction over the steps before the failure against the time of all of them),
    restart mode 0.54x: a prediction without the failure against a run that paid for one. No
    comparison, in either mode, and the summary says why."""
    from malleus.runner.failures import summary_lines
    from malleus.runner.report import judge_baseline

    report = full_report(simulated, mode=mode)
    assert report["static_baseline"] is not None
    report["failures"] = [
        {"rank": 3, "why": "killed by SIGKILL", "step": 8, "action": "replace in 2 s"}
    ]
    judge_baseline(report)  # as `malleus run` does once the failures are in
    assert report["static_baseline"] is None
    why = report["static_baseline_skipped"]
    assert why.startswith("rank 3 killed by SIGKILL at step 8: the first plan held all run")
    text = "\n".join([summary_text(report), *summary_lines(report)])
    assert f"static baseline: none ({why})" in text
    assert "-> speedup" not in text and "tok/s on" not in text


def test_the_baseline_predicts_every_step_whatever_plan_ran(simulated: Any) -> None:
    """A plan the report does not hold (a recovery's) is predicted for like any other step,
    not dropped: the prediction and the measured time cover the same steps."""
    events, switches, rows = simulated
    whole = full_report(simulated)["static_baseline"]
    renamed = [r | {"generation": 7} if r["step"] >= 12 else r for r in rows]
    base = full_report((events, switches, renamed))["static_baseline"]
    assert base["steps"] == whole["steps"] == len(rows) - 1
    assert base["measured_seconds"] == pytest.approx(whole["measured_seconds"])


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"mode": "static"}, "static mode"),
        ({"mode": "restart"}, None),  # its restarts count against it in the measured time
        ({"exit_code": 130, "exit_reason": "interrupted: trainers stopped"}, None),
    ],
)
def test_the_baseline_applies_by_mode(simulated: Any, over: dict, why: str | None) -> None:
    report = full_report(simulated, **over)
    text = summary_text(report)
    if why is None:
        assert report["static_baseline"]["measured_is_elapsed"]
        assert report["static_baseline_skipped"] is None and "-> speedup" in text
    else:
        assert report["static_baseline"] is None
        assert report["static_baseline_skipped"].startswith(why)
        assert f"static baseline: none ({why}" in text and "-> speedup" not in text


def test_an_interrupted_run_before_any_replan_compares_nothing(simulated: Any) -> None:
    """An interrupted quickstart printed 0.94x: the first plan against itself, off by the
    model's error. Before a re-plan the run is its own static baseline: nothing to print."""
    events, switches, rows = simulated
    first_switch = min(s.step for s in switches if s.step > 0)
    early = [r for r in rows if r["step"] < first_switch]
    report = full_report(
        (events, switches, early), exit_code=130, exit_reason="interrupted: trainers stopped"
    )
    assert report["static_baseline"] is None
    assert report["static_baseline_skipped"].startswith("no re-plan was applied")
    assert "-> speedup" not in summary_text(report)
    # interrupted after the first re-plan: the steps done are compared, with the re-plan's cost
    later = [r for r in rows if r["step"] < first_switch + 4]
    cut = full_report((events, switches, later), exit_code=130, exit_reason="interrupted")
    assert cut["static_baseline"]["steps"] == len(later) - 1
    assert cut["static_baseline"]["gain"] > 1.0


def test_the_calibrated_baseline_runs_through_each_rate_level_of_the_first_plan() -> None:
    """The quickstart's first plan ran 39 healthy steps and 4 at 4x before its re-plan; the
    calibration missed ~0.1 s per healthy step but ~0.01 s at 4x. The baseline is a line over
    the calibrated units through both levels' medians: what the first plan did at each."""
    from malleus.controller.decision import calibrated
    from malleus.planner.cost import plan_step_time
    from malleus.runner.report import static_baseline

    job = ResolvedJob.load(manifest())
    first = job.initial_plan()
    measured = {"generation": first.generation, "calibration": TERMS, "link_rates": {"0": 1.5}}
    rows = []
    for step in range(20):
        rates = {"0": 1.0, "1": 4.0 if step >= 10 else 1.0, "2": 1.0, "3": 1.0}
        units = plan_step_time(
            calibrated(job.problem({int(k): v for k, v in rates.items()}), TERMS, {0: 1.5}), first
        )
        seconds = 0.10 + 0.9 * 0.15 * units  # not the calibration's own 0.15 s per unit
        rows.append({"step": step, "seconds": seconds, "generation": 1, "rates": rates})
    base = static_baseline(
        rows, {1: first}, first, job.problem, tokens_per_step=TOKENS, calibration=measured
    )
    assert base is not None
    assert "2 levels of 9, 10 steps" in base["fit"]
    assert base["intercept_seconds"] == pytest.approx(0.10)
    assert base["seconds_per_unit"] == pytest.approx(0.135)
    predicted = {p["step"]: p["predicted_seconds"] for p in base["per_step"]}
    for r in rows[1:]:
        assert predicted[r["step"]] == pytest.approx(r["seconds"])
