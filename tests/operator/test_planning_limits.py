"""The operator's planning limits (issue 25): the model, the setting, the chart, the clamp in
one place, a job over ``maxGpus`` refused unplanned, and planner processes that are killed
when they overrun."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import kopf
import pytest

from malleus.controller.planning import PlanningTimeout
from malleus.controller.processes import PlannerProcesses
from malleus.job import StragglerPolicy
from malleus.job.limits import OverLimit, PlanningLimits
from malleus.operator import handlers, jobs
from malleus.operator.context import MEMO_KEY, Context
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.settings import Settings
from malleus.planner.plan import Plan
from tests.chart import helm, render
from tests.operator.kube import Kube


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- the model ------------------------------------------------------------------------------


def test_a_policy_beyond_the_limits_is_clamped_and_each_change_said() -> None:
    limits = PlanningLimits()
    assert (limits.max_gpus, limits.max_planning_seconds, limits.min_cooldown_seconds) == (
        4096,
        60,
        10,
    )
    hostile = StragglerPolicy(planning_timeout_seconds=3600, cooldown_seconds=0)
    policy, said = limits.limit(hostile, world=8)
    assert (policy.planning_timeout_seconds, policy.cooldown_seconds) == (60, 10)
    assert said == [
        "planningTimeoutSeconds 3600 -> 60 (the operator's planningLimits.maxPlanningSeconds)",
        "cooldownSeconds 0 -> 10 (the operator's planningLimits.minCooldownSeconds)",
    ]
    assert limits.limit(StragglerPolicy(), world=4096) == (StragglerPolicy(), [])  # defaults fit


def test_a_job_larger_than_max_gpus_is_over_limit_naming_the_value_that_raises_it() -> None:
    with pytest.raises(OverLimit) as e:
        PlanningLimits(max_gpus=64).limit(StragglerPolicy(), world=128)
    (fault,) = e.value.faults
    assert "128 GPUs" in fault.message and "planning limit of 64" in fault.message
    assert "planningLimits.maxGpus" in fault.message


# ---- the setting and the chart -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        '{"maxPlanningSeconds": 0}',
        '{"maxPlanningSeconds": 7200}',
        '{"maxGpus": 0}',
        '{"minCooldownSeconds": -1}',
        '{"maxGPUs": 10}',
        "not json",
    ],
)
def test_bad_limits_fail_the_operators_start_naming_the_setting(raw: str) -> None:
    with pytest.raises(ValueError, match="MALLEUS_OPERATOR_PLANNING_LIMITS"):
        Settings.from_env({"MALLEUS_OPERATOR_PLANNING_LIMITS": raw})


def test_bad_planner_processes_fail_the_start() -> None:
    with pytest.raises(ValueError, match="PLANNER_PROCESSES"):
        Settings.from_env({"MALLEUS_OPERATOR_PLANNER_PROCESSES": "-1"})


def test_the_chart_hands_its_limits_to_the_operator() -> None:
    docs = render("planningLimits.maxGpus=64", "plannerProcesses=3")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    settings = Settings.from_env(
        {
            "MALLEUS_OPERATOR_PLANNING_LIMITS": env["MALLEUS_OPERATOR_PLANNING_LIMITS"]["value"],
            "MALLEUS_OPERATOR_PLANNER_PROCESSES": env["MALLEUS_OPERATOR_PLANNER_PROCESSES"][
                "value"
            ],
        }
    )
    assert settings.limits() == PlanningLimits(max_gpus=64)
    assert settings.planner_processes == 3
    (default,) = [d for d in render() if d["kind"] == "Deployment"]
    env = {e["name"]: e for e in default["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert PlanningLimits.from_json_text(env["MALLEUS_OPERATOR_PLANNING_LIMITS"]["value"]) == (
        PlanningLimits()
    )


def test_the_schema_refuses_a_limit_out_of_range() -> None:
    done = helm(
        "template", "x", "helm/malleus-operator", "--set", "planningLimits.maxPlanningSeconds=0",
        check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "maxPlanningSeconds" in done.stderr


# ---- one clamp for the initial plan and the controller --------------------------------------


def test_the_initial_plan_gets_the_clamped_budget(make_job: Any) -> None:
    job = jobs.resolve(make_job(stragglerPolicy={"planningTimeoutSeconds": 3600}))
    limits = PlanningLimits(max_planning_seconds=5)
    seen: list[float | None] = []

    def planner(problem: Any, *, time_limit: float | None = None) -> Plan:
        seen.append(time_limit)
        from malleus.planner.search import plan

        return plan(problem)

    run(jobs.initial_plan(job, planner, limits))
    assert seen == [5.0]
    limited, said = jobs.limited(job, limits)
    assert limited.policy.planning_timeout_seconds == 5 and len(said) == 1
    assert jobs.limited(limited, limits) == (limited, [])  # idempotent
    with pytest.raises(OverLimit):  # never planned
        run(jobs.initial_plan(job, planner, PlanningLimits(max_gpus=4)))
    assert seen == [5.0]


def _memo(kube: Kube, limits: PlanningLimits) -> kopf.Memo:
    settings = Settings(metrics_port=0, planning_limits=limits.model_dump_json(by_alias=True))
    ctx = Context(cluster=kube.cluster, settings=settings, metrics=OperatorMetrics())
    return kopf.Memo({MEMO_KEY: ctx})


def test_a_job_over_max_gpus_fails_unplanned_with_over_limit(
    kube: Kube, make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("an over-limit job was planned")

    monkeypatch.setattr(jobs, "initial_plan", never)
    body = make_job(generation=2)  # 2 nodes x 4 GPUs
    kube.add_job(body)
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match=r"planningLimits\.maxGpus"):
        run(
            handlers.on_create(body=body, patch=patch, memo=_memo(kube, PlanningLimits(max_gpus=4)))
        )
    st = patch["status"]
    assert st["phase"] == "Failed" and st["observedGeneration"] == 2
    ready, failed = st["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "OverLimit")
    assert (failed["type"], failed["status"], failed["reason"]) == ("Failed", "True", "OverLimit")
    assert "8 GPUs" in ready["message"] and "limit of 4" in ready["message"]
    assert kube.names() == []
    assert kube.reasons() == ["OverLimit"]


def test_creation_says_when_a_limit_changed_the_policy(kube: Kube, make_job: Any) -> None:
    body = make_job(stragglerPolicy={"planningTimeoutSeconds": 3600, "cooldownSeconds": 0})
    kube.add_job(body)
    run(handlers.on_create(body=body, patch=kopf.Patch(), memo=_memo(kube, PlanningLimits())))
    assert kube.reasons() == ["Created", "PlanningLimited"]
    limited = kube.events[1]
    assert limited["type"] == "Normal"
    assert limited["message"] == (
        "planningTimeoutSeconds 3600 -> 60 (the operator's planningLimits.maxPlanningSeconds); "
        "cooldownSeconds 0 -> 10 (the operator's planningLimits.minCooldownSeconds)"
    )


# ---- planner processes ----------------------------------------------------------------------


def test_an_overrunning_planner_process_is_killed_and_replaced(make_job: Any) -> None:
    """A planner that ignores its limit is killed at limit + grace (a thread could not be);
    the next plan runs on a fresh process; JSON both ways."""
    problem = jobs.resolve(make_job()).problem()
    pool = PlannerProcesses(1, planner="tests.operator.planners:spin_when_short", kill_grace=0.3)
    try:
        pool.start()
        assert isinstance(pool.plan(problem, time_limit=30), Plan)  # warm, and a plan back
        t0 = time.monotonic()
        with pytest.raises(PlanningTimeout, match="killed"):
            pool.for_job("ml/demo")(problem, time_limit=0.5)
        assert time.monotonic() - t0 < 0.5 + 0.3 + 1.0
        assert pool.killed == 1
        assert pool.for_job("ml/demo") is pool.for_job("ml/demo")  # one lock per job
        plan = pool.for_job("ml/demo")(problem, time_limit=30)
        assert json.loads(plan.to_json())["tp"] == 2
    finally:
        pool.close()
