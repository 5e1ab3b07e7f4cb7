"""MalleusJob manifests: validation, defaulting and typed models, with no cluster.

``malleus run`` / ``malleus train`` take the same manifest as ``kubectl apply``, so they must accept
and reject exactly what the API server does. There is one schema: the CRD in
``crds/malleusjob.yaml``, shipped as package data (``malleus/data/malleusjob.yaml``, kept
identical by a test). This module reads its ``openAPIV3Schema``, applies its defaults, checks
its types, ranges, enums and patterns, and evaluates its CEL ``x-kubernetes-validations`` with
cel-python, the way the API server does: every fault is collected and reported at once, each
with its field path (``spec.parallelism.tp``) and what is allowed.

No torch, no kubernetes client: the operator image and the planner import this too.
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import celpy
import yaml
from celpy import celtypes
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "CRD_PATH",
    "KIND",
    "PLURAL",
    "PRESETS",
    "RULES_NOT_CHECKED",
    "VERSION",
    "CheckpointSpec",
    "Condition",
    "ConditionStatus",
    "Dataset",
    "DcgmSpec",
    "EmulationSpec",
    "Fault",
    "JobMetadata",
    "JobSpecError",
    "LastReplan",
    "MalleusJob",
    "MalleusJobSpec",
    "MalleusJobStatus",
    "MetricsSource",
    "MetricsSpec",
    "ModelConfig",
    "ModelSpec",
    "ParallelismSpec",
    "Phase",
    "PipelineStatus",
    "PlanStatus",
    "Preset",
    "PrometheusSpec",
    "ResourcesSpec",
    "ScheduleEntry",
    "StageStatus",
    "StragglerPolicy",
    "StragglerStatus",
    "TrainingSpec",
    "crd",
    "dump_job",
    "gpu_count",
    "job_schema",
    "load_job",
    "micro_batches",
    "resolve_model",
    "validate_manifest",
]

API_GROUP = "malleus.io"
VERSION = "v1alpha1"
API_VERSION = f"{API_GROUP}/{VERSION}"
KIND = "MalleusJob"
PLURAL = "malleusjobs"

RULES_NOT_CHECKED = (
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)
"""The API server's words for CEL rules skipped after a blocking fault (type, enum, required,
too long, too many)."""

CRD_PATH = Path(__file__).with_name("data") / "malleusjob.yaml"
"""The CRD shipped as package data: a copy of crds/malleusjob.yaml (a test keeps them equal)."""

# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One thing wrong with a manifest: where (``spec.training.steps``) and what is allowed."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<manifest>'}: {self.message}"


class JobSpecError(ValueError):
    """A manifest the API server would reject; ``faults`` lists every fault found."""

    def __init__(self, faults: Sequence[Fault], source: str | None = None) -> None:
        self.faults: list[Fault] = list(faults)
        self.source = source
        where = f" in {source}" if source else ""
        count = len(self.faults)
        lines = [f"invalid {KIND}{where} ({count} fault{'s' if count != 1 else ''}):"]
        lines += [f"  - {fault}" for fault in self.faults]
        super().__init__("\n".join(lines))

    @property
    def paths(self) -> list[str]:
        """The field paths of the faults, in order."""
        return [fault.path for fault in self.faults]


# --------------------------------------------------------------------------------------------
# The schema (package data, identical to crds/malleusjob.yaml)
# --------------------------------------------------------------------------------------------


@functools.cache
def _crd() -> dict[str, Any]:
    text = CRD_PATH.read_text(encoding="utf-8")
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


@functools.cache
def _schema() -> dict[str, Any]:
    for version in _crd()["spec"]["versions"]:
        if version["name"] == VERSION:
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            return schema
    raise LookupError(f"the packaged CRD has no version {VERSION}")  # pragma: no cover


def crd() -> dict[str, Any]:
    """The MalleusJob CustomResourceDefinition (a fresh copy), as shipped with the package."""
    return copy.deepcopy(_crd())


def job_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``malleus.io/v1alpha1`` MalleusJob (a fresh copy)."""
    return copy.deepcopy(_schema())


# --------------------------------------------------------------------------------------------
# Structural-schema validation and defaulting, as the API server does it
# --------------------------------------------------------------------------------------------

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    for name in ("object", "array", "string", "integer", "number"):
        if isinstance(value, _JSON_TYPES[name]):
            return name
    return "null" if value is None else type(value).__name__


def _has_type(value: Any, schema: Mapping[str, Any]) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    expected = schema.get("type")
    if expected is None:
        return True
    if isinstance(value, bool):
        return expected == "boolean"
    return isinstance(value, _JSON_TYPES[expected])


def _literal(value: Any) -> str:
    """A value as the API server prints it in messages (JSON-like)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class _Validator:
    """One pass over a manifest: prune/default, then check the schema, then the CEL rules."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.faults: list[Fault] = []
        self.blocking = False

    def fault(self, path: str, message: str, *, blocking: bool = False) -> None:
        """Record a fault. ``blocking`` ones stop the CEL rules, as on the API server: a wrong
        type, a value outside an enum, a missing field, and a string or list over its maximum
        (the rules' cost bounds rely on those maxima)."""
        self.faults.append(Fault(path, message))
        self.blocking = self.blocking or blocking

    # -- pruning and defaulting ---------------------------------------------------------------

    def normalize(self, value: Any, schema: Mapping[str, Any], path: str, *, meta: bool) -> Any:
        """Drop nulls and unknown fields (a fault when strict), apply defaults, recursively.

        ``meta`` marks ObjectMeta, whose fields the schema lists only in part.
        """
        if isinstance(value, (dt.datetime, dt.date)):  # YAML reads unquoted timestamps
            return _rfc3339(value)
        if isinstance(value, dict) and _has_type(value, schema):
            properties: Mapping[str, Any] = schema.get("properties", {})
            result: dict[str, Any] = {}
            for key, item in value.items():
                if item is None and not schema.get("nullable"):
                    continue  # the API server prunes nulls of non-nullable fields, then defaults
                if key in properties:
                    result[key] = self.normalize(
                        item, properties[key], _join(path, key), meta=not path and key == "metadata"
                    )
                elif meta or schema.get("x-kubernetes-preserve-unknown-fields"):
                    result[key] = item
                elif self.strict:
                    self.fault(_join(path, str(key)), f'unknown field "{_join(path, str(key))}"')
            for key, sub in properties.items():
                if key not in result and "default" in sub:
                    result[key] = self.normalize(
                        copy.deepcopy(sub["default"]), sub, _join(path, key), meta=False
                    )
            return result
        if isinstance(value, list) and "items" in schema:
            return [
                self.normalize(item, schema["items"], f"{path}[{i}]", meta=False)
                for i, item in enumerate(value)
            ]
        return value

    # -- schema checks ------------------------------------------------------------------------

    def check(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        """Types, enums, ranges, lengths, patterns, required fields, list uniqueness."""
        if not _has_type(value, schema):
            expected = "integer or string" if schema.get("x-kubernetes-int-or-string") else None
            self.fault(
                path,
                f"must be of type {expected or schema.get('type')}, not {_type_of(value)}",
                blocking=True,
            )
            return
        if "enum" in schema and value not in schema["enum"]:
            allowed = ", ".join(_literal(v) for v in schema["enum"])
            self.fault(
                path,
                f"Unsupported value: {_literal(value)}: supported values: {allowed}",
                blocking=True,
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._check_range(value, schema, path)
        if isinstance(value, str):
            self._check_string(value, schema, path)
        if isinstance(value, list):
            self._check_list(value, schema, path)
        if isinstance(value, dict):
            for key in schema.get("required", []):
                if key not in value:
                    self.fault(_join(path, key), "Required value", blocking=True)
            properties: Mapping[str, Any] = schema.get("properties", {})
            for key, item in value.items():
                if key in properties:
                    self.check(item, properties[key], _join(path, key))

    def _check_range(self, value: float, schema: Mapping[str, Any], path: str) -> None:
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None:
            if schema.get("exclusiveMinimum") and not value > low:
                self.fault(path, f"should be greater than {low}")
            elif value < low:
                self.fault(path, f"should be greater than or equal to {low}")
        if high is not None:
            if schema.get("exclusiveMaximum") and not value < high:
                self.fault(path, f"should be less than {high}")
            elif value > high:
                self.fault(path, f"should be less than or equal to {high}")

    def _check_string(self, value: str, schema: Mapping[str, Any], path: str) -> None:
        if "minLength" in schema and len(value) < schema["minLength"]:
            self.fault(path, f"should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            self.fault(
                path, f"Too long: may not be more than {schema['maxLength']} bytes", blocking=True
            )
        if "pattern" in schema and not _pattern(schema["pattern"]).search(value):
            self.fault(path, f"should match '{schema['pattern']}'")
        if schema.get("format") == "date-time" and not _is_rfc3339(value):
            self.fault(path, f"must be an RFC 3339 date-time, not {_literal(value)}")

    def _check_list(self, value: list[Any], schema: Mapping[str, Any], path: str) -> None:
        if "minItems" in schema and len(value) < schema["minItems"]:
            self.fault(path, f"should have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            self.fault(
                path,
                f"Too many: {len(value)}: must have at most {schema['maxItems']} items",
                blocking=True,
            )
        list_type = schema.get("x-kubernetes-list-type")
        seen: set[str] = set()
        for i, item in enumerate(value):
            if list_type == "map" and isinstance(item, dict):
                keys = schema.get("x-kubernetes-list-map-keys", [])
                identity = repr([item.get(k) for k in keys])
            elif list_type == "set":
                identity = repr(item)
            else:
                identity = ""
            if identity:
                if identity in seen:
                    self.fault(f"{path}[{i}]", f"Duplicate value: {identity}")
                seen.add(identity)
            if "items" in schema:
                self.check(item, schema["items"], f"{path}[{i}]")

    # -- CEL rules ----------------------------------------------------------------------------

    def rules(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        """Evaluate every ``x-kubernetes-validations`` rule on the values present."""
        if not _has_type(value, schema):
            return
        for rule in schema.get("x-kubernetes-validations", []):
            self._evaluate(rule, value, schema, path)
        if isinstance(value, dict):
            for key, sub in schema.get("properties", {}).items():
                if key in value:
                    self.rules(value[key], sub, _join(path, key))
        elif isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                self.rules(item, schema["items"], f"{path}[{i}]")

    def _evaluate(
        self, rule: Mapping[str, Any], value: Any, schema: Mapping[str, Any], path: str
    ) -> None:
        message = rule.get("message") or f"failed rule: {rule['rule']}"
        try:
            result = _program(rule["rule"]).evaluate({"self": _to_cel(value, schema)})
            if isinstance(result, celpy.CELEvalError):
                raise result
        except celpy.CELEvalError as error:
            # The API server reports a rule that cannot run at the rule's own node.
            self.fault(path, f"{message} (the rule could not be evaluated: {error.args[0]})")
            return
        if not bool(result):
            self.fault(path + rule.get("fieldPath", ""), message)


@functools.cache
def _pattern(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


@functools.cache
def _cel_environment() -> celpy.Environment:
    return celpy.Environment()


@functools.cache
def _program(rule: str) -> celpy.Runner:
    environment = _cel_environment()
    return environment.program(environment.compile(rule))


def _to_cel(value: Any, schema: Mapping[str, Any]) -> Any:
    """A Python value as CEL sees it, typed by the schema (a ``number`` is always a double)."""
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties", {})
        return celtypes.MapType(
            {
                celtypes.StringType(key): _to_cel(item, properties.get(key, {}))
                for key, item in value.items()
            }
        )
    if isinstance(value, list):
        items = schema.get("items", {})
        return celtypes.ListType([_to_cel(item, items) for item in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, (int, float)) and schema.get("type") == "number":
        return celtypes.DoubleType(float(value))
    return celpy.json_to_cel(value)


def _rfc3339(value: dt.date) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.isoformat().replace("+00:00", "Z")
    return value.isoformat()


def _is_rfc3339(text: str) -> bool:
    if not re.fullmatch(
        r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", text
    ):
        return False
    try:
        dt.datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def validate_manifest(
    manifest: Mapping[str, Any], *, strict: bool = True
) -> tuple[dict[str, Any], list[Fault]]:
    """Default and validate a MalleusJob manifest as the API server would.

    Returns the defaulted manifest (unknown fields pruned) and the faults, empty when valid.
    With ``strict`` (like ``kubectl``'s default field validation) an unknown field is a fault;
    without it, it is silently pruned as the API server does.
    """
    validator = _Validator(strict)
    schema = _schema()
    if not isinstance(manifest, Mapping):
        return {}, [Fault("", f"a manifest must be a mapping, not {_type_of(manifest)}")]
    if manifest.get("apiVersion") != API_VERSION:
        validator.fault("apiVersion", f"must be {_literal(API_VERSION)}")
    if manifest.get("kind") != KIND:
        validator.fault("kind", f"must be {_literal(KIND)}")
    metadata = manifest.get("metadata")
    if not isinstance(metadata, Mapping) or not metadata.get("name"):
        validator.fault("metadata.name", "Required value: the job needs a name")
    defaulted: dict[str, Any] = validator.normalize(dict(manifest), schema, "", meta=False)
    validator.check(defaulted, schema, "")
    if validator.blocking:
        # Like the API server: CEL rules assume types, enums, required fields and maxima hold.
        validator.fault("", RULES_NOT_CHECKED)
    else:
        validator.rules(defaulted, schema, "")
    return defaulted, validator.faults


# --------------------------------------------------------------------------------------------
# Typed models (snake_case attributes, camelCase aliases as in the manifest)
# --------------------------------------------------------------------------------------------

Preset = Literal["tiny", "small", "gpt-125m", "llama-7b", "llama-70b"]
Dataset = Literal["tiny-corpus", "synthetic"]
MetricsSource = Literal["trainer", "prometheus"]
Phase = Literal["Pending", "Planning", "Running", "Replanning", "Succeeded", "Failed"]
ConditionStatus = Literal["True", "False", "Unknown"]


class _Model(BaseModel):
    """Base: camelCase aliases, construction by either name, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class JobMetadata(BaseModel):
    """The part of ObjectMeta Malleus reads; everything else is kept as given."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class ModelSpec(_Model):
    """A preset, or every size explicitly; explicit sizes override the preset's."""

    preset: Preset | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    sequence: int | None = None
    tied_embeddings: bool = False


class TrainingSpec(_Model):
    """The optimisation; unchanged by every plan."""

    global_batch_size: int
    micro_batch_size: int
    steps: int
    learning_rate: float
    warmup_steps: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    dataset: Dataset = "tiny-corpus"


class ParallelismSpec(_Model):
    """Nominal tensor-parallel degree; optional pinned pipelines (dp) and stages (pp)."""

    tp: int
    dp: int | None = None
    pp: int | None = None


class StragglerPolicy(_Model):
    """When a GPU counts as a straggler and when a new plan is worth its migration."""

    threshold: float = 1.2
    hysteresis: float = 0.3
    window_steps: int = 5
    cooldown_seconds: int = 30
    min_gain: float = 0.05
    horizon_steps: int = 100
    allow_exclusion: bool = True
    planning_timeout_seconds: int = 30


class DcgmSpec(_Model):
    """Names of the DCGM exporter metrics."""

    sm_clock_metric: str = "DCGM_FI_DEV_SM_CLOCK"
    clock_event_reasons_metric: str = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"


class PrometheusSpec(_Model):
    """The Prometheus server to query."""

    url: str | None = None
    dcgm: DcgmSpec = Field(default_factory=DcgmSpec)


class MetricsSpec(_Model):
    """Where straggling rates come from."""

    source: MetricsSource = "trainer"
    scrape_interval_seconds: int = 5
    prometheus: PrometheusSpec | None = None


class CheckpointSpec(_Model):
    """Periodic checkpoints; ``interval_steps == 0`` turns them off."""

    claim_name: str | None = None
    path: str = "/checkpoints"
    interval_steps: int = 0


class ResourcesSpec(_Model):
    """Per-pod requests; ``gpu_memory_mib`` is the planner's memory capacity per GPU."""

    cpu: int | str | None = None
    memory: int | str | None = None
    gpu_memory_mib: int = Field(default=81559, alias="gpuMemoryMiB")


class ScheduleEntry(_Model):
    """From ``step`` on, ``rank`` runs ``factor`` times slower (emulation only)."""

    step: int
    rank: int
    factor: float


class EmulationSpec(_Model):
    """Emulated GPU clock for CPU machines."""

    enabled: bool = False
    gpu_profile: (
        Literal["h100-llama-70b-tp8", "h100-llama-13b-tp4", "a100-llama-7b-tp1", "cpu-tiny"] | None
    ) = None
    layer_forward_ms: float = 10.0
    layer_backward_ms: float = 20.0
    schedule: list[ScheduleEntry] = Field(default_factory=list)

    def layer_seconds(self) -> tuple[float, float]:
        """(forward, backward) seconds of one layer-shard: the named profile's, else the ms fields.

        The one place both the trainer's clock and `malleus run`'s predictions read them from.
        """
        if self.gpu_profile:
            from malleus.trainer.emulation import GPU_PROFILES  # stdlib-only module

            return GPU_PROFILES[self.gpu_profile]
        return self.layer_forward_ms / 1000.0, self.layer_backward_ms / 1000.0


class MalleusJobSpec(_Model):
    """``spec`` of a MalleusJob."""

    image: str
    nodes: int
    gpus_per_node: int
    model: ModelSpec
    training: TrainingSpec
    parallelism: ParallelismSpec
    straggler_policy: StragglerPolicy = Field(default_factory=StragglerPolicy)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    control_port: int = 8040
    emulation: EmulationSpec = Field(default_factory=EmulationSpec)


class Condition(_Model):
    """``metav1.Condition``."""

    type: str
    status: ConditionStatus
    observed_generation: int | None = None
    last_transition_time: dt.datetime
    reason: str
    message: str


class StageStatus(_Model):
    """One pipeline stage: its tensor-parallel group and half-open layer range."""

    ranks: list[int]
    layers: tuple[int, int]


class PipelineStatus(_Model):
    """One data-parallel pipeline."""

    micro_batches: int
    stages: list[StageStatus]


class PlanStatus(_Model):
    """The plan in force, as shown in the status."""

    generation: int | None = None
    tp: int | None = None
    pipelines: list[PipelineStatus] = Field(default_factory=list)
    excluded: list[int] = Field(default_factory=list)
    predicted_speedup: float | None = None
    predicted_step_time: float | None = None


class StragglerStatus(_Model):
    """A straggling GPU."""

    rank: int
    node: int | None = None
    rate: float | None = None


class LastReplan(_Model):
    """The most recent re-plan and its migration."""

    time: dt.datetime | None = None
    reason: str | None = None
    planning_seconds: float | None = None
    migration_seconds: float | None = None
    migration_bytes: int | None = None
    generation: int | None = None


class MalleusJobStatus(_Model):
    """``status`` of a MalleusJob, written by the operator."""

    phase: Phase | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    plan: PlanStatus | None = None
    stragglers: list[StragglerStatus] = Field(default_factory=list)
    straggler_summary: str | None = None
    gpus: int | None = None
    step: int | None = None
    tokens_per_second: float | None = None
    last_replan: LastReplan | None = None
    pods: list[str] = Field(default_factory=list)
    message: str | None = None


class MalleusJob(_Model):
    """A whole MalleusJob custom resource."""

    api_version: Literal["malleus.io/v1alpha1"] = API_VERSION
    kind: Literal["MalleusJob"] = KIND
    metadata: JobMetadata
    spec: MalleusJobSpec
    status: MalleusJobStatus | None = None


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_job(
    source: str | os.PathLike[str] | Mapping[str, Any], *, strict: bool = True
) -> MalleusJob:
    """Load, default and validate a MalleusJob from a YAML file path or a manifest mapping.

    A file may hold several YAML documents (a PVC beside the job, say); exactly one must be a
    MalleusJob. Raises ``JobSpecError`` listing every fault; ``strict`` makes unknown fields
    faults (the API server would silently drop them, hiding typos).
    """
    label: str | None = None
    if isinstance(source, Mapping):
        manifest: Any = source
    else:
        label = os.fspath(source)
        manifest = _read_manifest(label)
    defaulted, faults = validate_manifest(manifest, strict=strict)
    if faults:
        raise JobSpecError(faults, label)
    try:
        return MalleusJob.model_validate(defaulted)
    except ValidationError as error:  # the schema and the models disagree: report, do not crash
        raise JobSpecError(
            [
                Fault(".".join(str(part) for part in e["loc"]), e["msg"])
                for e in error.errors(include_url=False)
            ],
            label,
        ) from error


def _read_manifest(path: str) -> Any:
    with open(path, encoding="utf-8") as handle:
        try:
            documents = [d for d in yaml.safe_load_all(handle) if d is not None]
        except yaml.YAMLError as error:
            raise JobSpecError([Fault("", f"not valid YAML: {error}")], path) from error
    jobs = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == KIND]
    if len(jobs) == 1:
        return jobs[0]
    if not jobs and len(documents) == 1:
        return documents[0]  # validation will say what is wrong with it
    raise JobSpecError([Fault("", f"expected one {KIND} document, found {len(jobs)}")], path)


def dump_job(job: MalleusJob) -> dict[str, Any]:
    """The job as a manifest (camelCase, JSON types, unset optional fields left out)."""
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------------------------
# Model sizes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Resolved transformer sizes (vocab 256 = bytes, the tiny corpus's tokenization)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    sequence: int
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


PRESETS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "tiny": ModelConfig(layers=8, hidden=64, heads=4, ffn=128, vocab=256, sequence=64),
        "small": ModelConfig(layers=12, hidden=256, heads=8, ffn=688, vocab=256, sequence=128),
        "gpt-125m": ModelConfig(
            layers=12, hidden=768, heads=12, ffn=3072, vocab=50304, sequence=1024
        ),
        "llama-7b": ModelConfig(
            layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, sequence=4096
        ),
        "llama-70b": ModelConfig(
            layers=80, hidden=8192, heads=64, ffn=28672, vocab=32000, sequence=4096
        ),
    }
)
"""Named model sizes; the CRD's CEL rules carry their heads and hidden (a test keeps them equal)."""

_SIZES = ("layers", "hidden", "heads", "ffn", "vocab", "sequence")


def resolve_model(model: ModelSpec) -> ModelConfig:
    """The sizes of ``spec.model``: the preset's, overridden by any size given explicitly."""
    base = PRESETS[model.preset] if model.preset is not None else None
    sizes: dict[str, int] = {}
    missing: list[Fault] = []
    for name in _SIZES:
        value = getattr(model, name)
        if value is None and base is not None:
            value = getattr(base, name)
        if value is None:
            missing.append(Fault(f"spec.model.{name}", "Required value: no preset gives it"))
        else:
            sizes[name] = value
    if missing:
        raise JobSpecError(missing)
    if sizes["hidden"] % sizes["heads"]:
        raise JobSpecError(
            [
                Fault(
                    "spec.model.hidden",
                    f"hidden ({sizes['hidden']}) must be divisible by heads ({sizes['heads']})",
                )
            ]
        )
    return ModelConfig(**sizes, tied_embeddings=model.tied_embeddings)


def gpu_count(job: MalleusJob) -> int:
    """GPUs the job owns: nodes x gpusPerNode (excluded GPUs included)."""
    return job.spec.nodes * job.spec.gpus_per_node


def micro_batches(job: MalleusJob) -> int:
    """Micro-batches per step (globalBatchSize / microBatchSize): the planner's unit of work."""
    return job.spec.training.global_batch_size // job.spec.training.micro_batch_size
