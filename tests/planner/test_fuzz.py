"""Hostile and careless input, generated: a clear error or a valid result, never an exception
of another kind, never a hang.

Hypothesis builds planning problems and MalleusJob manifests from plausible values mixed with
garbage (huge counts, 1e307, NaN, wrong types, negative ranks); every one must either be refused
with `BadInput` (field path + message) or give a plan that `validate_plan` accepts, within a
bound. The control endpoint's bodies are fuzzed in tests/trainer/endpoint.
"""

from __future__ import annotations

import math
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from malleus.errors import BadInput
from malleus.job import ResolvedJob
from malleus.planner import PlanningProblem, plan, validate_plan
from tests.job.cases import base_manifest

SECONDS = 5.0
"""Bound on refusing or planning one generated input (the search itself is given 1 s)."""

garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**18), max_value=10**18),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
counts = st.one_of(
    st.integers(min_value=-2, max_value=70), st.sampled_from([10**6, 10**15]), garbage
)
rates = st.dictionaries(
    st.one_of(st.integers(min_value=-3, max_value=80).map(str), st.text(max_size=3)),
    st.one_of(
        st.none(),
        st.floats(min_value=0.5, max_value=20),
        st.sampled_from([1e307, math.inf, math.nan, -1.0, 1e3, 1e3 + 1]),
        garbage,
    ),
    max_size=6,
)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = {
        "nodes": draw(st.one_of(st.integers(min_value=1, max_value=8), counts)),
        "gpus_per_node": draw(st.one_of(st.sampled_from([1, 2, 4, 8]), counts)),
        "rates": draw(st.one_of(rates, garbage)),
        "model": {
            "layers": draw(st.one_of(st.integers(min_value=1, max_value=48), counts)),
            "tp": draw(st.one_of(st.sampled_from([1, 2, 4]), counts)),
        },
        "micro_batches": draw(st.one_of(st.integers(min_value=1, max_value=64), counts)),
    }
    if draw(st.booleans()):
        data["dp"] = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=4), counts))
    if draw(st.booleans()):
        data["memory"] = {
            "capacity_mb": draw(st.one_of(st.floats(0, 1e6), garbage)),
            "layer_mb": draw(st.one_of(st.floats(0, 2000), garbage)),
        }
    if draw(st.booleans()):
        data[draw(st.text(min_size=1, max_size=4))] = draw(garbage)
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_a_problem_is_refused_clearly_or_planned_validly(data: dict[str, Any]) -> None:
    started = time.monotonic()
    try:
        problem = PlanningProblem.load(data)
        result = plan(problem, time_limit=1.0)
    except BadInput as error:
        assert error.faults and all(f.message for f in error.faults)
    else:
        assert validate_plan(problem, result) == []
    assert time.monotonic() - started < SECONDS


paths = st.sampled_from(
    [
        ("nodes",),
        ("gpusPerNode",),
        ("model", "layers"),
        ("model", "hidden"),
        ("model", "heads"),
        ("model", "preset"),
        ("training", "globalBatchSize"),
        ("training", "microBatchSize"),
        ("training", "learningRate"),
        ("training", "steps"),
        ("parallelism", "tp"),
        ("parallelism", "dp"),
        ("parallelism", "pp"),
        ("stragglerPolicy", "threshold"),
        ("resources", "gpuMemoryMiB"),
        ("emulation", "layerForwardMs"),
        ("emulation", "schedule"),
        ("metrics", "source"),
        ("checkpoint", "intervalSteps"),
    ]
)
values = st.one_of(
    garbage,
    st.integers(min_value=0, max_value=64),
    st.sampled_from([10**15, 1e307, 1e12, -1, 0, 3, 6, "tiny", "llama-70b", "prometheus"]),
    st.lists(
        st.fixed_dictionaries(
            {"step": st.integers(-1, 50), "rank": st.integers(-1, 20), "factor": st.floats(0, 1e13)}
        ),
        max_size=2,
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(paths, values), min_size=1, max_size=4))
def test_a_manifest_is_refused_clearly_or_planned_validly(
    edits: list[tuple[tuple[str, ...], Any]],
) -> None:
    manifest = base_manifest()
    for path, value in edits:
        node = manifest["spec"]
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[path[-1]] = value
    started = time.monotonic()
    try:
        job = ResolvedJob.load(manifest)
        result = job.initial_plan(time_limit=1.0)
    except BadInput as error:
        assert error.faults and all(f.message for f in error.faults)
    else:
        assert validate_plan(job.problem(), result) == []
        assert result.generation == 1
    assert time.monotonic() - started < SECONDS
