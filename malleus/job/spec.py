"""The MalleusJob spec as typed models: snake_case attributes, camelCase aliases as in the manifest.

`malleus.job.schema` judges a manifest against the CRD; these models are what the rest of
Malleus reads once it passed (a test keeps every field here equal to the schema's). Defaults live
in the CRD alone: the loader fills them in before the models see the manifest, so a default
written here too would be one concept declared twice. The models' own defaults below only
matter for objects built in code (tests), and a test keeps them equal to the CRD's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from .presets import GPU_PROFILES, GpuProfile, Preset

__all__ = [
    "CheckpointSpec",
    "Dataset",
    "DcgmSpec",
    "EmulationSpec",
    "JobMetadata",
    "MalleusJobSpec",
    "MetricsSource",
    "MetricsSpec",
    "ModelSpec",
    "ParallelismSpec",
    "PrometheusSpec",
    "ResourcesSpec",
    "ScheduleEntry",
    "StragglerPolicy",
    "TrainingSpec",
]

Dataset = Literal["tiny-corpus", "synthetic"]
MetricsSource = Literal["trainer", "prometheus"]


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
    """A GPU whose smoothed straggling rate reaches this is a straggler (1.0 = healthy)."""
    hysteresis: float = 0.3
    """A straggler's rate must move by more than this since the plan in force to count again."""
    window_steps: int = 5
    """Samples per rank the median is taken over: a spike shorter than half of it is ignored."""
    cooldown_seconds: int = 30
    """No new plan this soon after the last applied one (or failed attempt), unless a rank died."""
    min_gain: float = 0.05
    """Minimum predicted relative step-time gain for a new plan to be adopted."""
    horizon_steps: int = 100
    """Steps over which the predicted gain must repay the migration and the planning."""
    allow_exclusion: bool = True
    """Whether a plan may leave usable GPUs idle."""
    max_exclusion_share: float = 0.25
    """Largest share of the GPUs (at least one) that one re-plan may newly count as straggling
    or failed; more only once the signal has persisted for three windows. Reported rates steer
    the job, so a burst of implausible reports (most GPUs slow at once) must not shrink it."""
    planning_timeout_seconds: int = 30
    """Time budget of one planner run."""

    def is_straggler(self, rate: float | None) -> bool:
        """A failed GPU (None) or one whose rate reaches the threshold: the one definition."""
        return rate is None or rate >= self.threshold


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
    gpu_profile: GpuProfile | None = None
    layer_forward_ms: float = 10.0
    layer_backward_ms: float = 20.0
    schedule: list[ScheduleEntry] = Field(default_factory=list)

    def layer_seconds(self) -> tuple[float, float]:
        """(forward, backward) seconds of one layer-shard: the named profile's, else the ms fields.

        The one place both the trainer's clock and `malleus run`'s predictions read them from.
        """
        if self.gpu_profile:
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
