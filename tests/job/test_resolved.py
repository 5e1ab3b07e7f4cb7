"""ResolvedJob: the one derived view of a job that every entry point reads."""

from __future__ import annotations

import math
from typing import Any

import pytest

from malleus.errors import BadInput
from malleus.job import INITIAL_GENERATION, MAX_RATE, PRESETS, ResolvedJob, clean_rates
from malleus.job.memory import layer_parameters, memory_model, model_parameters
from malleus.planner import check_plan
from tests.job.cases import REPO, base_manifest


def resolved(**spec: Any) -> ResolvedJob:
    """examples/tiny-cpu.yaml with `spec` fields replaced, through the schema and CEL rules."""
    manifest = base_manifest()
    for key, value in spec.items():
        manifest["spec"][key] = value
    return ResolvedJob.load(manifest)


def unchecked(**spec: Any) -> ResolvedJob:
    """The same job with `spec` sections replaced behind the schema's back: what the operator
    sees from an API server whose CRD is older than the operator (many of these faults are
    also CEL rules, which `resolved` would reject first)."""
    job = resolved().job
    sections = {
        key: type(getattr(job.spec, key)).model_validate(value) for key, value in spec.items()
    }
    new_spec = job.spec.model_copy(update=sections)
    return ResolvedJob.of(job.model_copy(update={"spec": new_spec}))


def test_sizes_and_counts_of_the_tiny_example() -> None:
    job = ResolvedJob.load(REPO / "examples" / "tiny-cpu.yaml")
    assert job.model == PRESETS["tiny"]
    assert (job.nodes, job.gpus_per_node, job.world, job.tp) == (2, 4, 8, 2)
    training = job.spec.training
    assert job.micro_batches == training.global_batch_size // training.micro_batch_size
    assert job.tokens_per_step == training.global_batch_size * PRESETS["tiny"].sequence
    assert job.parameters == model_parameters(job.model)
    assert job.faults() == []


def test_every_semantic_fault_at_once_with_its_path() -> None:
    job = unchecked(parallelism={"tp": 4, "dp": 9}, model={"preset": "tiny", "heads": 2})
    job = ResolvedJob.of(
        job.job.model_copy(update={"spec": job.spec.model_copy(update={"gpus_per_node": 6})})
    )
    text = [str(f) for f in job.faults()]
    assert any(
        t.startswith("spec.parallelism.tp: tp(4) does not divide gpusPerNode(6)") for t in text
    )
    assert any(
        t.startswith("spec.parallelism.tp: heads(2) is not divisible by tp(4)") for t in text
    )
    assert any(t.startswith("spec.parallelism.dp: dp(9) * tp(4) = 36 exceeds") for t in text)
    assert any(t.startswith("spec.parallelism.dp: dp(9) exceeds the micro-batches") for t in text)
    with pytest.raises(BadInput) as caught:
        job.check()
    assert len(caught.value.faults) == len(text)


def test_tp_not_a_power_of_two() -> None:
    job = unchecked(parallelism={"tp": 3})
    assert "spec.parallelism.tp: 3 is not a power of two" in [str(f) for f in job.faults()]


def test_odd_head_size_is_refused_for_rotary_positions() -> None:
    job = unchecked(parallelism={"tp": 1}, model={"preset": "tiny", "hidden": 60, "heads": 4})
    assert any("head size hidden/heads = 15 must be even" in str(f) for f in job.faults())


def test_problem_carries_the_job_and_cleans_rates() -> None:
    job = resolved()
    problem = job.problem({3: 2.5, 5: 0.9, 99: 3.0, 6: float("nan"), 7: 1e307})
    assert (problem.nodes, problem.gpus_per_node, problem.tp) == (2, 4, 2)
    assert problem.layers == job.model.layers and problem.micro_batches == job.micro_batches
    assert problem.memory == job.memory
    assert problem.rate(3) == 2.5 and problem.rate(5) == 1.0  # faster than reference = healthy
    assert problem.rate(6) is None  # not finite -> unusable
    assert problem.rate(7) == MAX_RATE  # capped: 1e307 would overflow the cost model
    assert 99 not in problem.rates


def test_clean_rates_bounds() -> None:
    assert clean_rates({0: math.inf, 1: -3.0, 2: 5.0, 8: 2.0}, world=8) == {0: None, 2: 5.0}


def test_initial_plan_is_valid_and_generation_one() -> None:
    job = resolved()
    plan = job.initial_plan(time_limit=10)
    assert plan.generation == INITIAL_GENERATION == 1
    check_plan(job.problem(), plan)


def test_initial_plan_refuses_a_job_that_fits_no_memory() -> None:
    job = resolved(resources={"gpuMemoryMiB": 1})
    with pytest.raises(BadInput, match="no parallel layout of this job fits its GPUs") as caught:
        job.initial_plan(time_limit=10)
    assert caught.value.paths == ["spec.resources.gpuMemoryMiB"]


def test_initial_plan_refuses_semantic_faults_before_planning() -> None:
    job = unchecked(parallelism={"tp": 2, "dp": 100})
    calls = []

    def planner(problem: Any, *, time_limit: float | None = None) -> Any:
        calls.append(problem)
        raise AssertionError("must not be called")

    with pytest.raises(BadInput, match=r"dp\(100\)"):
        job.initial_plan(planner=planner)
    assert calls == []


def test_memory_model_of_the_tiny_preset_by_hand() -> None:
    cfg = PRESETS["tiny"]
    h, f = cfg.hidden, cfg.ffn
    assert layer_parameters(cfg) == 4 * h * h + 4 * h + 3 * h * f + f + h + 4 * h
    mem = memory_model(cfg, tp=2, micro_batch_size=1, capacity_mib=1000)
    assert mem.layer_mb == pytest.approx(layer_parameters(cfg) * 16 / 2 / 2**20)
    assert mem.activation_mb == pytest.approx(cfg.sequence * h * 34 / 2 / 2**20)
    assert mem.embedding_mb == pytest.approx(cfg.vocab * h * 16 / 2 / 2**20)
    assert mem.capacity_mb == 1000


def test_memory_model_of_llama_70b_is_in_the_designs_range() -> None:
    """examples/problems/70b.json (tp 8): layer 1470 MB, activations 178 MB. GQA is not modelled, so
    the layer state comes out higher (safe side)."""
    mem = memory_model(PRESETS["llama-70b"], tp=8, micro_batch_size=1, capacity_mib=81559)
    assert 1400 < mem.layer_mb < 2000
    assert 100 < mem.activation_mb < 200
