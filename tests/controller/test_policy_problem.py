"""StragglerPolicy from a MalleusJob, and build_problem: the job, the rates, the memory model."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from malleus.controller import MIB, StragglerPolicy, build_problem, memory_model
from malleus.controller.problem import layer_parameters
from malleus.jobspec import PRESETS, load_job
from malleus.planner import Plan

from .conftest import manifest


def test_policy_defaults_are_the_crds() -> None:
    p = StragglerPolicy.from_job(load_job(manifest()))
    assert p == StragglerPolicy()
    assert (p.threshold, p.hysteresis, p.window_steps, p.cooldown_seconds) == (1.2, 0.3, 5, 30)
    assert (p.min_gain, p.horizon_steps, p.allow_exclusion) == (0.05, 100, True)
    assert p.planning_timeout_seconds == 30


def test_policy_from_job_reads_every_field() -> None:
    job = load_job(
        manifest(
            threshold=1.5,
            hysteresis=0.2,
            windowSteps=3,
            cooldownSeconds=60,
            minGain=0.1,
            horizonSteps=500,
            allowExclusion=False,
            planningTimeoutSeconds=5,
        )
    )
    assert StragglerPolicy.from_job(job).to_dict() == {
        "threshold": 1.5,
        "hysteresis": 0.2,
        "window_steps": 3,
        "cooldown_seconds": 60,
        "min_gain": 0.1,
        "horizon_steps": 500,
        "allow_exclusion": False,
        "planning_timeout_seconds": 5,
    }
    assert StragglerPolicy.from_spec({"threshold": 2.0}).threshold == 2.0
    assert StragglerPolicy.from_spec(None) == StragglerPolicy()


def test_policy_refuses_nonsense_naming_each_field() -> None:
    with pytest.raises(ValueError, match=r"threshold: 0.5.*window_steps: 0"):
        StragglerPolicy(threshold=0.5, window_steps=0)


def test_build_problem_maps_the_job(job: Any, initial_plan: Plan) -> None:
    p = build_problem(job, {3: 2.5, 6: None}, initial_plan)
    assert (p.nodes, p.gpus_per_node, p.tp, p.layers, p.micro_batches) == (2, 4, 2, 8, 8)
    assert p.rates == {3: 2.5, 6: None}
    assert p.dp is None
    assert p.previous_plan == initial_plan
    assert p.memory is not None and p.memory.capacity_mb == 81559


def test_build_problem_cleans_rates(job: Any) -> None:
    p = build_problem(job, {0: 0.97, 1: 1.0, 2: math.nan, 3: math.inf, 4: 1.5, 99: 3.0}, None)
    # faster than the reference is healthy; non-finite is unusable; out-of-range ranks dropped
    assert p.rates == {2: None, 3: None, 4: 1.5}


def test_build_problem_passes_a_pinned_dp() -> None:
    m = manifest()
    m["spec"]["parallelism"]["dp"] = 2
    assert build_problem(load_job(m), {}, None).dp == 2


def test_memory_model_of_the_tiny_preset_by_hand() -> None:
    cfg = PRESETS["tiny"]  # hidden 64, ffn 128, vocab 256, sequence 64
    h, f = 64, 128
    params = (4 * h * h + 4 * h) + (3 * h * f + f + h) + 4 * h
    assert layer_parameters(cfg) == params
    mem = memory_model(cfg, tp=2, micro_batch_size=2, capacity_mib=1000)
    assert mem.layer_mb == pytest.approx(params * 16 / 2 / MIB)
    assert mem.activation_mb == pytest.approx(2 * 64 * 64 * 34 / 2 / MIB)
    assert mem.embedding_mb == pytest.approx(256 * 64 * 16 / 2 / MIB)
    assert (mem.fixed_mb, mem.capacity_mb) == (2000.0, 1000.0)


def test_memory_model_of_llama_70b_is_in_the_designs_range() -> None:
    # DESIGN §4.1's example (tp 8): layer 1470 MB, activations 178 MB. GQA is not modelled, so
    # the layer state comes out higher (safe side).
    mem = memory_model(PRESETS["llama-70b"], tp=8, micro_batch_size=1, capacity_mib=81559)
    assert 1400 < mem.layer_mb < 2000
    assert 100 < mem.activation_mb < 200


def test_build_problem_takes_a_duck_typed_job() -> None:
    spec = SimpleNamespace(
        nodes=1,
        gpus_per_node=4,
        model=PRESETS["tiny"],  # already resolved sizes
        training=SimpleNamespace(global_batch_size=8, micro_batch_size=1),
        parallelism=SimpleNamespace(tp=4, dp=None),
        resources=None,
    )
    p = build_problem(SimpleNamespace(spec=spec), {2: 1.5}, None)
    assert (p.world, p.tp, p.layers, p.micro_batches) == (4, 4, 8, 8)
    assert p.memory is None  # no capacity given: unbounded
