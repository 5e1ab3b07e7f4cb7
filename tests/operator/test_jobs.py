"""Semantic checks the schema cannot express, and the initial plan for healthy GPUs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from malleus.operator import jobs
from malleus.planner.validate import validate_plan


def _faults(make_job: Any, **spec: Any) -> list[str]:
    return jobs.semantic_faults(jobs.parse_job(make_job(**spec)))


def test_a_good_job_has_no_faults_and_a_valid_initial_plan(make_job: Any) -> None:
    job = jobs.parse_job(make_job())
    assert jobs.semantic_faults(job) == []
    plan, seconds = asyncio.run(jobs.initial_plan(job))
    assert plan.generation == jobs.INITIAL_GENERATION
    assert seconds >= 0
    assert validate_plan(jobs.problem_of(job), plan) == []
    assert plan.tp == 2


def test_schema_and_cel_faults_are_invalid_spec(make_job: Any) -> None:
    """The operator re-checks the CRD's rules (an older CRD may have let them through)."""
    with pytest.raises(jobs.InvalidSpec) as e:
        jobs.parse_job(make_job(parallelism={"tp": 8}))  # 8 does not divide 4 GPUs/node
    assert any("spec.parallelism.tp" in f for f in e.value.faults)


def test_heads_not_divisible_by_tp(make_job: Any) -> None:
    # explicit sizes: heads 6 with tp 4 (the CRD's CEL rule would also refuse this)
    model = {"layers": 4, "hidden": 48, "heads": 6, "ffn": 96, "vocab": 256, "sequence": 16}
    job = jobs.parse_job(make_job(model={"preset": "tiny"}, parallelism={"tp": 4}))
    job = job.model_copy(
        update={
            "spec": job.spec.model_copy(update={"model": job.spec.model.model_copy(update=model)})
        }
    )
    faults = jobs.semantic_faults(job)
    assert any("heads(6) is not divisible by tp(4)" in f for f in faults)


def test_pinned_dp_pp_tp_must_match_the_gpus(make_job: Any) -> None:
    faults = _faults(make_job, parallelism={"tp": 2, "dp": 1, "pp": 2})
    assert faults == [
        "spec.parallelism: dp(1) * pp(2) * tp(2) = 4 does not match the GPU count "
        "nodes(2) * gpusPerNode(4) = 8"
    ]
    assert _faults(make_job, parallelism={"tp": 2, "dp": 2, "pp": 2}) == []


def test_pp_beyond_the_layers(make_job: Any) -> None:
    faults = _faults(make_job, nodes=4, gpusPerNode=4, parallelism={"tp": 1, "pp": 16})
    assert any("pp(16) exceeds the model's layers(8)" in f for f in faults)


def test_a_model_that_fits_no_layout_is_invalid(make_job: Any) -> None:
    job = jobs.parse_job(
        make_job(nodes=1, gpusPerNode=1, model={"preset": "llama-70b"}, parallelism={"tp": 1})
    )
    with pytest.raises(jobs.InvalidSpec) as e:
        asyncio.run(jobs.initial_plan(job))
    assert "fits" in str(e.value)


def test_initial_plan_runs_the_semantic_checks_first(make_job: Any) -> None:
    job = jobs.parse_job(make_job(parallelism={"tp": 2, "dp": 1, "pp": 2}))

    def planner(problem: Any, limit: float | None) -> Any:  # pragma: no cover - never called
        raise AssertionError("the planner must not run for an invalid spec")

    with pytest.raises(jobs.InvalidSpec):
        asyncio.run(jobs.initial_plan(job, planner))


def test_parse_ignores_status_and_managed_fields(make_job: Any) -> None:
    body = make_job(status={"phase": "Running", "whatever": 1})
    body["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    assert jobs.parse_job(body).metadata.name == "demo"
