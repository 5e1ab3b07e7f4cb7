"""A custom resource body -> `ResolvedJob` and its initial plan, judged as `malleus check` judges.

The faults themselves are `ResolvedJob.faults`' (tested with the job package); these tests hold
the operator to using them: the same paths and messages, the planner run off the event loop
under the policy's budget, and the first generation `INITIAL_GENERATION`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from malleus.errors import BadInput
from malleus.job import INITIAL_GENERATION, ResolvedJob
from malleus.operator import jobs
from malleus.planner.validate import validate_plan


def test_a_good_job_gets_a_valid_initial_plan(make_job: Any) -> None:
    job = jobs.resolve(make_job())
    assert job.faults() == []
    plan, seconds = asyncio.run(jobs.initial_plan(job))
    assert plan.generation == INITIAL_GENERATION
    assert seconds >= 0
    assert validate_plan(job.problem(), plan) == []
    assert plan.tp == 2


def test_schema_and_cel_faults_are_bad_input(make_job: Any) -> None:
    """The operator re-checks the CRD's rules (an older CRD may have let them through)."""
    with pytest.raises(BadInput) as e:
        jobs.resolve(make_job(parallelism={"tp": 8}))  # 8 does not divide 4 GPUs/node
    assert "spec.parallelism.tp" in e.value.paths


def test_the_operator_reports_what_the_resolved_job_reports(make_job: Any) -> None:
    body = make_job(nodes=4, parallelism={"tp": 1, "pp": 16})  # the CRD's rules pass
    with pytest.raises(BadInput) as e:
        asyncio.run(jobs.initial_plan(jobs.resolve(body)))
    assert e.value.faults == ResolvedJob.load(body, strict=False).faults()
    assert [str(f) for f in e.value.faults] == [
        "spec.parallelism.pp: pp(16) exceeds the model's layers(8); every stage needs a layer"
    ]


def test_a_model_that_fits_no_layout_is_bad_input(make_job: Any) -> None:
    job = jobs.resolve(
        make_job(nodes=1, gpusPerNode=1, model={"preset": "llama-70b"}, parallelism={"tp": 1})
    )
    with pytest.raises(BadInput) as e:
        asyncio.run(jobs.initial_plan(job))
    assert "no parallel layout of this job fits its GPUs" in str(e.value)


def test_initial_plan_runs_the_semantic_checks_first(make_job: Any) -> None:
    job = jobs.resolve(make_job(nodes=4, parallelism={"tp": 1, "pp": 16}))

    def planner(problem: Any, *, time_limit: float | None = None) -> Any:  # pragma: no cover
        raise AssertionError("the planner must not run for an invalid spec")

    with pytest.raises(BadInput):
        asyncio.run(jobs.initial_plan(job, planner))


def test_resolve_ignores_status_and_managed_fields(make_job: Any) -> None:
    body = make_job(status={"phase": "Running", "whatever": 1})
    body["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    body["spec"]["unknownField"] = 1  # pruned, as the API server prunes it
    assert jobs.resolve(body).name == "demo"
