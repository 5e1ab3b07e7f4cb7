"""malleus.job: local validation must accept and reject what the API server does.

The server side of the same cases runs in tests/crd; here everything runs without a cluster.
"""

from __future__ import annotations

import copy
import datetime as dt
import enum
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from malleus import job as jobspec
from malleus.job import (
    PRESETS,
    RULES_NOT_CHECKED,
    BadInput,
    MalleusJob,
    ModelConfig,
    ModelSpec,
    ResolvedJob,
    dump_job,
    job_schema,
    load_job,
    resolve_model,
    validate_manifest,
)
from tests.job.cases import EXAMPLES, REPO, BadCase, bad_cases, base_manifest, load_yaml

CASES = bad_cases()


def spec_schema() -> dict[str, Any]:
    return job_schema()["properties"]["spec"]


def test_packaged_crd_is_identical_to_crds_file() -> None:
    """One source of truth: the package data is a byte-for-byte copy of crds/malleusjob.yaml."""
    assert jobspec.CRD_PATH.read_bytes() == (REPO / "crds" / "malleusjob.yaml").read_bytes()


def test_crd_identity() -> None:
    crd = jobspec.crd()
    assert crd["spec"]["group"] == jobspec.API_GROUP
    assert crd["spec"]["names"]["kind"] == jobspec.KIND
    assert crd["spec"]["names"]["plural"] == jobspec.PLURAL
    assert crd["spec"]["names"]["shortNames"] == ["mj"]
    assert [v["name"] for v in crd["spec"]["versions"]] == [jobspec.VERSION]
    version = crd["spec"]["versions"][0]
    assert version["served"] and version["storage"] and version["subresources"] == {"status": {}}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in status and status["properties"]


# -- examples -----------------------------------------------------------------------------------


def test_three_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"tiny-cpu.yaml", "quickstart.yaml", "llama-70b.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_loads(path: Path) -> None:
    job = load_job(path)
    assert job.metadata.name == path.stem
    assert ResolvedJob.of(job).world == job.spec.nodes * job.spec.gpus_per_node
    model = resolve_model(job.spec.model)
    assert model.heads % job.spec.parallelism.tp == 0
    assert job.spec.gpus_per_node % job.spec.parallelism.tp == 0


def test_tiny_cpu_example() -> None:
    job = load_job(REPO / "examples" / "tiny-cpu.yaml")
    spec = job.spec
    assert (spec.nodes, spec.gpus_per_node, spec.parallelism.tp, ResolvedJob.of(job).world) == (
        2,
        4,
        2,
        8,
    )
    assert resolve_model(spec.model) == PRESETS["tiny"]
    assert (spec.training.global_batch_size, spec.training.micro_batch_size) == (8, 1)
    assert ResolvedJob.of(job).micro_batches == 8 and spec.training.steps == 30
    assert spec.emulation.enabled
    assert (spec.emulation.layer_forward_ms, spec.emulation.layer_backward_ms) == (5.0, 10.0)


def test_quickstart_example() -> None:
    job = load_job(REPO / "examples" / "quickstart.yaml")
    spec = job.spec
    assert (spec.nodes, spec.gpus_per_node, spec.parallelism.tp) == (2, 4, 2)
    assert spec.parallelism.dp == 2  # two pipelines of two stages: re-plans move layers
    assert ResolvedJob.of(job).micro_batches == 8 and spec.training.steps == 160
    assert [(e.step, e.rank, e.factor) for e in spec.emulation.schedule] == [
        (40, 1, 4.0),
        (80, 6, 2.0),
        (120, 1, 1.0),
        (120, 6, 1.0),
    ]


def test_llama_70b_example() -> None:
    job = load_job(REPO / "examples" / "llama-70b.yaml")
    spec = job.spec
    assert ResolvedJob.of(job).world == 64 and spec.parallelism.tp == 8
    assert resolve_model(spec.model).layers == 80
    assert not spec.emulation.enabled
    assert spec.metrics.source == "prometheus"
    assert spec.metrics.prometheus is not None and spec.metrics.prometheus.url
    assert spec.metrics.prometheus.dcgm.sm_clock_metric == "DCGM_FI_DEV_SM_CLOCK"


# -- defaults -----------------------------------------------------------------------------------


def minimal_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "minimal"},
        "spec": {
            "image": "malleus:test",
            "nodes": 1,
            "gpusPerNode": 2,
            "model": {"preset": "tiny"},
            "training": {
                "globalBatchSize": 4,
                "microBatchSize": 2,
                "steps": 1,
                "learningRate": 0.01,
            },
            "parallelism": {"tp": 1},
        },
    }


def test_defaults_applied() -> None:
    spec = load_job(minimal_manifest()).spec
    policy = spec.straggler_policy
    assert (policy.threshold, policy.hysteresis, policy.window_steps) == (1.2, 0.3, 5)
    assert (policy.cooldown_seconds, policy.min_gain, policy.horizon_steps) == (30, 0.05, 100)
    assert policy.allow_exclusion is True and policy.planning_timeout_seconds == 30
    training = spec.training
    assert (training.warmup_steps, training.weight_decay, training.grad_clip) == (0, 0.1, 1.0)
    assert (training.seed, training.dataset) == (1234, "tiny-corpus")
    assert spec.metrics.source == "trainer" and spec.metrics.scrape_interval_seconds == 5
    assert spec.metrics.prometheus is None
    assert (spec.checkpoint.path, spec.checkpoint.interval_steps) == ("/checkpoints", 0)
    assert spec.checkpoint.claim_name is None
    assert spec.resources.gpu_memory_mib == 81559 and spec.control_port == 8040
    emulation = spec.emulation
    assert emulation.enabled is False and emulation.schedule == []
    assert (emulation.layer_forward_ms, emulation.layer_backward_ms) == (10, 20)
    assert spec.model.tied_embeddings is False


def test_defaulted_manifest_carries_every_schema_default() -> None:
    """Walk the schema: each default appears in the defaulted manifest where its parent exists."""
    defaulted, faults = validate_manifest(minimal_manifest())
    assert faults == []

    def walk(schema: dict[str, Any], value: Any, path: str) -> int:
        count = 0
        for key, sub in schema.get("properties", {}).items():
            if "default" in sub and sub.get("type") != "object":
                assert key in value, f"{path}.{key} not defaulted"
                assert value[key] == sub["default"], f"{path}.{key}"
                count += 1
            if isinstance(value, dict) and isinstance(value.get(key), dict):
                count += walk(sub, value[key], f"{path}.{key}")
        return count

    assert walk(spec_schema(), defaulted["spec"], "spec") >= 20


def test_dcgm_defaults_when_prometheus_given() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["metrics"] = {"source": "prometheus", "prometheus": {"url": "http://p:9090"}}
    dcgm = load_job(manifest).spec.metrics.prometheus.dcgm  # type: ignore[union-attr]
    assert dcgm.sm_clock_metric == "DCGM_FI_DEV_SM_CLOCK"
    assert dcgm.clock_event_reasons_metric == "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"


def test_null_section_is_defaulted_like_the_server() -> None:
    """`emulation:` with nothing after it is null; the API server prunes it, then defaults it."""
    manifest = minimal_manifest()
    manifest["spec"]["emulation"] = None
    assert load_job(manifest).spec.emulation.layer_forward_ms == 10


def test_explicit_values_are_kept() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["stragglerPolicy"] = {"threshold": 1.5, "allowExclusion": False}
    policy = load_job(manifest).spec.straggler_policy
    assert (policy.threshold, policy.allow_exclusion, policy.hysteresis) == (1.5, False, 0.3)


def test_input_is_not_mutated() -> None:
    manifest = minimal_manifest()
    before = copy.deepcopy(manifest)
    load_job(manifest)
    assert manifest == before


# -- faults -------------------------------------------------------------------------------------


def test_at_least_ten_kinds_of_bad_input() -> None:
    assert len(CASES) >= 10
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_manifest_faults(case: BadCase) -> None:
    with pytest.raises(BadInput) as caught:
        load_job(case.manifest())
    error = caught.value
    assert set(error.paths) == case.fields
    assert any(case.local in f.message for f in error.faults), error.faults
    for fault in error.faults:  # every fault is in the rendered error
        assert str(fault) in str(error)


def test_every_fault_reported_at_once() -> None:
    manifest = base_manifest()
    spec = manifest["spec"]
    spec["nodes"] = 1
    spec["parallelism"]["tp"] = 3
    spec["training"]["microBatchSize"] = 3
    spec["training"]["learningRate"] = 0
    spec["metrics"] = {"source": "prometheus"}
    spec["emulation"]["schedule"] = [{"step": 0, "rank": 4, "factor": 2.0}]
    spec["controlPort"] = 70000
    with pytest.raises(BadInput) as caught:
        load_job(manifest)
    assert set(caught.value.paths) == {
        "spec.parallelism.tp",
        "spec.training.microBatchSize",
        "spec.training.learningRate",
        "spec.metrics.prometheus.url",
        "spec.emulation.schedule",
        "spec.controlPort",
    }
    text = str(caught.value)
    assert text.startswith("invalid MalleusJob (")
    assert "power of two" in text and "must divide spec.gpusPerNode" in text
    assert "spec.controlPort: should be less than or equal to 65535" in text


def test_blocking_fault_skips_rules_like_the_server() -> None:
    manifest = base_manifest()
    manifest["spec"]["training"]["dataset"] = "web"
    manifest["spec"]["parallelism"]["tp"] = 3  # a CEL fault, not checked this time
    _, faults = validate_manifest(manifest)
    assert {f.path for f in faults} == {"spec.training.dataset", ""}
    assert any(f.message == RULES_NOT_CHECKED for f in faults)


def test_unknown_fields_strict_and_lenient() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["gpuPerNode"] = 8  # a typo
    manifest["spec"]["model"]["dropout"] = 0.1
    manifest["metadata"]["labels"] = {"team": "x"}  # ObjectMeta is not pruned
    with pytest.raises(BadInput) as caught:
        load_job(manifest)
    assert set(caught.value.paths) == {"spec.gpuPerNode", "spec.model.dropout"}
    assert 'unknown field "spec.gpuPerNode"' in str(caught.value)
    defaulted, faults = validate_manifest(manifest, strict=False)
    assert faults == []
    assert "gpuPerNode" not in defaulted["spec"] and "dropout" not in defaulted["spec"]["model"]
    job = load_job(manifest, strict=False)
    assert job.spec.gpus_per_node == 2 and job.metadata.labels == {"team": "x"}


def test_header_faults() -> None:
    manifest = minimal_manifest()
    manifest["apiVersion"] = "malleus.io/v1"
    manifest["kind"] = "Job"
    del manifest["metadata"]["name"]
    with pytest.raises(BadInput) as caught:
        load_job(manifest)
    assert set(caught.value.paths) == {"apiVersion", "kind", "metadata.name"}


def test_not_a_mapping() -> None:
    _, faults = validate_manifest(["not", "a", "job"])  # type: ignore[arg-type]
    assert len(faults) == 1 and "mapping" in faults[0].message


@pytest.mark.parametrize(
    ("value", "ok"),
    [("8", True), ("500m", True), (4, True), ("1.5", True), ("2e3", True), ("lots", False)],
)
def test_cpu_quantity(value: Any, ok: bool) -> None:
    manifest = minimal_manifest()
    manifest["spec"]["resources"] = {"cpu": value, "memory": "64Gi"}
    _, faults = validate_manifest(manifest)
    assert (faults == []) is ok


def test_wrong_type_for_int_or_string() -> None:
    manifest = minimal_manifest()
    manifest["spec"]["resources"] = {"memory": 1.5}
    _, faults = validate_manifest(manifest)
    assert faults[0].path == "spec.resources.memory"
    assert "integer or string" in faults[0].message


# -- YAML files ---------------------------------------------------------------------------------


def test_file_with_other_documents(tmp_path: Path) -> None:
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all([pvc, minimal_manifest()]))
    assert load_job(path).metadata.name == "minimal"
    assert load_job(str(path)).metadata.name == "minimal"


def test_file_with_two_jobs(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([minimal_manifest(), minimal_manifest()]))
    with pytest.raises(BadInput, match="found 2"):
        load_job(path)


def test_file_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("spec: [unclosed\n")
    with pytest.raises(BadInput, match="not valid YAML") as caught:
        load_job(path)
    assert caught.value.source == str(path)


def test_bad_file_names_the_file(tmp_path: Path) -> None:
    manifest = minimal_manifest()
    manifest["spec"]["nodes"] = 0
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    with pytest.raises(BadInput, match=f"in {path}"):
        load_job(path)


# -- CEL rules ----------------------------------------------------------------------------------


def all_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, rule) for rule in schema.get("x-kubernetes-validations", [])]
    for key, sub in schema.get("properties", {}).items():
        found += all_rules(sub, f"{path}.{key}" if path else key)
    if "items" in schema:
        found += all_rules(schema["items"], f"{path}[*]")
    return found


def test_every_rule_has_a_message_naming_its_field() -> None:
    rules = all_rules(job_schema())
    assert len(rules) >= 9
    for path, rule in rules:
        target = (path + rule.get("fieldPath", "")).lstrip(".")  # a root rule's `.metadata.name`
        assert rule.get("message"), rule["rule"]
        assert target.split("[")[0] in rule["message"], (target, rule["message"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cel_preset_tables_match_presets(preset: str) -> None:
    """The heads and hidden tables inside the CEL rules agree with PRESETS."""
    config = PRESETS[preset]
    for tp in (1, 2, 4, 8, 16):
        manifest = minimal_manifest()
        manifest["spec"].update(gpusPerNode=16, nodes=1, model={"preset": preset})
        manifest["spec"]["parallelism"]["tp"] = tp
        _, faults = validate_manifest(manifest)
        assert ("spec.parallelism.tp" in {f.path for f in faults}) == bool(config.heads % tp)
    for hidden, heads, divisible in (
        (config.heads * 7 + 1, None, False),  # the table's heads must not divide it
        (config.heads * 5, None, True),
        (None, config.hidden, True),  # the table's hidden must be divisible by it
        (None, config.hidden + 1, False),
    ):
        model: dict[str, Any] = {"preset": preset}
        if hidden is not None:
            model["hidden"] = hidden
        if heads is not None:
            model["heads"] = heads
        manifest = minimal_manifest()
        manifest["spec"]["model"] = model
        _, faults = validate_manifest(manifest)
        assert ("spec.model.hidden" in {f.path for f in faults}) is not divisible, model


@settings(max_examples=150, deadline=None)
@given(
    gpus_per_node=st.integers(1, 16),
    tp=st.integers(1, 16),
    heads=st.integers(1, 64),
    global_batch=st.integers(1, 64),
    micro_batch=st.integers(1, 64),
)
def test_rules_mean_what_they_say(
    gpus_per_node: int, tp: int, heads: int, global_batch: int, micro_batch: int
) -> None:
    """The CEL rules, evaluated by cel-python, match the arithmetic they stand for."""
    manifest = minimal_manifest()
    spec = manifest["spec"]
    spec.update(nodes=16, gpusPerNode=gpus_per_node)
    spec["model"] = {"preset": "tiny", "heads": heads, "hidden": heads * 16}
    spec["parallelism"]["tp"] = tp
    spec["training"].update(globalBatchSize=global_batch, microBatchSize=micro_batch)
    _, faults = validate_manifest(manifest)
    paths = {f.path for f in faults}
    tp_ok = tp & (tp - 1) == 0 and gpus_per_node % tp == 0 and heads % tp == 0
    assert ("spec.parallelism.tp" not in paths) is tp_ok
    assert ("spec.training.microBatchSize" not in paths) is (global_batch % micro_batch == 0)
    assert paths <= {"spec.parallelism.tp", "spec.training.microBatchSize"}


def test_number_fields_are_doubles_in_cel() -> None:
    """An integer written for a `number` field (factor: 3) must not break the rules."""
    manifest = base_manifest()
    manifest["spec"]["emulation"]["schedule"] = [{"step": 1, "rank": 7, "factor": 3}]
    assert load_job(manifest).spec.emulation.schedule[0].factor == 3.0


# -- models -------------------------------------------------------------------------------------


def model_fields_by_alias(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside X, X | None or list[X]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = nested_model(arg)
        if found is not None:
            return found
    return None


def literal_values(annotation: Any) -> set[Any] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {member.value for member in annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (found := literal_values(arg)) is not None:
                return found
    return None


def compare(schema: dict[str, Any], model: type[BaseModel], path: str) -> int:
    """Fields, defaults and enums of a model against its schema node; returns fields compared."""
    fields = model_fields_by_alias(model)
    properties = schema.get("properties", {})
    assert set(fields) == set(properties), f"{path}: {set(fields) ^ set(properties)}"
    count = 0
    for key, sub in properties.items():
        field = fields[key]
        where = f"{path}.{key}"
        assert field.is_required() == (key in schema.get("required", [])), where
        if "default" in sub and sub.get("type") != "object":
            assert field.get_default(call_default_factory=True) == sub["default"], where
        if "enum" in sub:
            assert literal_values(field.annotation) == set(sub["enum"]), where
        node = sub["items"] if sub.get("type") == "array" else sub
        inner = nested_model(field.annotation)
        if inner is not None and node.get("properties"):
            count += compare(node, inner, where)
        count += 1
    return count


def test_spec_models_match_the_schema() -> None:
    assert compare(spec_schema(), jobspec.MalleusJobSpec, "spec") >= 60


def test_status_models_match_the_schema() -> None:
    schema = job_schema()["properties"]["status"]
    assert compare(schema, jobspec.MalleusJobStatus, "status") >= 35


def full_status() -> dict[str, Any]:
    return {
        "phase": "Running",
        "observedGeneration": 1,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "observedGeneration": 1,
                "lastTransitionTime": "2026-01-02T03:04:05Z",
                "reason": "PlanApplied",
                "message": "plan 2 in force",
            }
        ],
        "plan": {
            "generation": 2,
            "summary": "2 pipelines [2,1 stages] tp 2/1, 1 GPU out, 2.50x vs static",
            "tp": 2,
            "dp": 2,
            "excluded": [1],
            "predictedSpeedup": 2.5,
            "predictedStepTime": 40.0,
        },
        "stragglers": [{"rank": 1, "node": 0, "rate": 3.0}],
        "stragglerSummary": "1 (r1 3.0x)",
        "gpus": 8,
        "step": 42,
        "tokensPerSecond": 1234.5,
        "lastReplan": {
            "time": "2026-01-02T03:04:05Z",
            "reason": "rank 1 rate 3.0",
            "planningSeconds": 0.2,
            "migrationSeconds": 1.5,
            "migrationBytes": 1048576,
            "generation": 2,
        },
        "pods": ["tiny-cpu-0", "tiny-cpu-1"],
        "message": "training",
    }


def test_status_round_trip() -> None:
    manifest = base_manifest()
    manifest["status"] = full_status()
    job = load_job(manifest)
    assert job.status is not None and job.status.plan is not None
    assert (job.status.plan.dp, job.status.plan.summary) == (2, full_status()["plan"]["summary"])
    assert job.status.conditions[0].last_transition_time == dt.datetime(
        2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC
    )
    assert dump_job(job)["status"] == full_status()


def test_status_is_validated() -> None:
    manifest = base_manifest()
    manifest["status"] = {"phase": "Exploding", "conditions": [{"type": "Ready"}]}
    with pytest.raises(BadInput) as caught:
        load_job(manifest)
    assert {"status.phase", "status.conditions[0].status"} <= set(caught.value.paths)


def test_unquoted_yaml_timestamps_are_accepted() -> None:
    manifest = base_manifest()
    status = full_status()
    status["lastReplan"]["time"] = dt.datetime(2026, 1, 2, 3, 4, 5)  # what YAML 1.1 gives
    manifest["status"] = status
    assert load_job(manifest).status.last_replan.time.year == 2026  # type: ignore[union-attr]


def test_duplicate_condition_types_rejected() -> None:
    manifest = base_manifest()
    condition = full_status()["conditions"][0]
    manifest["status"] = {"conditions": [condition, dict(condition)]}
    with pytest.raises(BadInput) as caught:
        load_job(manifest)
    assert caught.value.paths == ["status.conditions[1]"]


def test_dump_round_trip() -> None:
    job = load_job(REPO / "examples" / "quickstart.yaml")
    dumped = dump_job(job)
    assert dumped["spec"]["gpusPerNode"] == 4
    assert dumped["spec"]["resources"]["gpuMemoryMiB"] == 81559
    assert load_job(dumped) == job


def test_models_accept_snake_case_names() -> None:
    spec = jobspec.TrainingSpec(global_batch_size=8, micro_batch_size=1, steps=2, learning_rate=0.1)
    assert spec.weight_decay == 0.1
    assert spec.model_dump(by_alias=True)["globalBatchSize"] == 8


# -- model sizes --------------------------------------------------------------------------------


def test_presets() -> None:
    assert PRESETS["tiny"] == ModelConfig(8, 64, 4, 128, 256, 64)
    assert PRESETS["small"] == ModelConfig(12, 256, 8, 688, 256, 128)
    assert PRESETS["gpt-125m"] == ModelConfig(12, 768, 12, 3072, 50304, 1024)
    assert PRESETS["llama-7b"] == ModelConfig(32, 4096, 32, 11008, 32000, 4096)
    assert PRESETS["llama-70b"] == ModelConfig(80, 8192, 64, 28672, 32000, 4096)
    enum = spec_schema()["properties"]["model"]["properties"]["preset"]["enum"]
    assert list(PRESETS) == enum
    for config in PRESETS.values():
        assert config.hidden % config.heads == 0


def test_resolve_model_overrides_preset() -> None:
    config = resolve_model(ModelSpec(preset="small", layers=4, tied_embeddings=True))
    assert config == ModelConfig(4, 256, 8, 688, 256, 128, tied_embeddings=True)
    assert config.head_dim == 32


def test_resolve_explicit_model() -> None:
    spec = ModelSpec(layers=2, hidden=32, heads=2, ffn=64, vocab=256, sequence=16)
    assert resolve_model(spec) == ModelConfig(2, 32, 2, 64, 256, 16)


def test_resolve_model_faults() -> None:
    with pytest.raises(BadInput) as caught:
        resolve_model(ModelSpec(layers=2, hidden=32))
    assert caught.value.paths == [
        "spec.model.heads",
        "spec.model.ffn",
        "spec.model.vocab",
        "spec.model.sequence",
    ]
    manifest = base_manifest()
    manifest["spec"]["model"] = {"preset": "tiny", "hidden": 66}
    with pytest.raises(
        BadInput, match=r"spec\.model\.hidden must be divisible by spec\.model\.heads"
    ):
        ResolvedJob.load(manifest)


def test_example_files_are_plain_manifests() -> None:
    """Examples hold one MalleusJob each (kubectl apply -f works on them as they are)."""
    for path in EXAMPLES:
        manifest = load_yaml(path)
        assert manifest["apiVersion"] == "malleus.io/v1alpha1" and manifest["kind"] == "MalleusJob"
        assert isinstance(MalleusJob.model_validate(validate_manifest(manifest)[0]), MalleusJob)


def test_every_count_and_factor_has_a_maximum() -> None:
    """Unbounded numbers let a typo (1e15 micro-batches, a 1e12 slowdown) hang the planner or the
    emulated clock; every integer and number of the spec is bounded above in the CRD."""

    def unbounded(node: dict[str, Any], path: str) -> list[str]:
        out = []
        if node.get("type") in ("integer", "number") and "maximum" not in node:
            out.append(path)
        for key, sub in node.get("properties", {}).items():
            out += unbounded(sub, f"{path}.{key}")
        if "items" in node:
            out += unbounded(node["items"], f"{path}[]")
        return out

    assert unbounded(spec_schema(), "spec") == []


def test_an_infinite_learning_rate_is_refused() -> None:
    manifest = base_manifest()
    manifest["spec"]["training"]["learningRate"] = float("inf")
    assert "spec.training.learningRate" in {f.path for f in validate_manifest(manifest)[1]}
