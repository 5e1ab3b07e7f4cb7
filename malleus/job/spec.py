"""The MalleusJob spec as typed models: snake_case attributes, camelCase aliases as in the manifest.

`malleus.job.schema` judges a manifest against the CRD; these models are what the rest of
Malleus reads once it passed (a test keeps every field here equal to the schema's). Defaults live
in the CRD alone: the loader fills them in before the models see the manifest, so a default
written here too would be one concept declared twice. The models' own defaults below only
matter for objects built in code (tests), and a test keeps them equal to the CRD's.

Layout: this module holds the training, model, control-loop and emulation sections and
`MalleusJobSpec` itself; the cluster sections (pod template, run policy, scheduling) are
`malleus.job.spec_cluster`'s and the models' base `malleus.job.spec_base`'s. Every name of
those is importable from here too.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from .presets import GPU_PROFILES, GpuProfile, Preset
from .spec_base import StrictModel
from .spec_cluster import (
    GPU_RESOURCE,
    Capabilities,
    ContainerOverride,
    ContainerResources,
    ContainerSecurity,
    EnvVar,
    ExtraContainer,
    LocalObjectReference,
    PodGroupApi,
    PodGroupSpec,
    PodSpecOverride,
    PodTemplate,
    PodTemplateMetadata,
    ResourceClaimRef,
    ResourceOverride,
    RunPolicy,
    SchedulingSpec,
    VolumeMount,
)

__all__ = [
    "DEFAULT_FAILURE_RULES",
    "FAILURE_CAUSES",
    "GPU_RESOURCE",
    "Capabilities",
    "CheckpointSpec",
    "ContainerOverride",
    "ContainerResources",
    "ContainerSecurity",
    "DataFormat",
    "DataSpec",
    "Dataset",
    "DcgmSpec",
    "EmulationSpec",
    "EnvVar",
    "ExitCodes",
    "ExtraContainer",
    "FailKind",
    "FailureAction",
    "FailureCause",
    "FailurePolicy",
    "FailureRule",
    "JobMetadata",
    "LocalObjectReference",
    "MalleusJobSpec",
    "MetricsSource",
    "MetricsSpec",
    "ModelSpec",
    "ParallelismSpec",
    "PodGroupApi",
    "PodGroupSpec",
    "PodSpecOverride",
    "PodTemplate",
    "PodTemplateMetadata",
    "Precision",
    "PrometheusSpec",
    "ResourceClaimRef",
    "ResourceOverride",
    "ResourcesSpec",
    "RunPolicy",
    "ScheduleEntry",
    "SchedulingSpec",
    "StragglerPolicy",
    "TokenDtype",
    "TrainingSpec",
    "VolumeMount",
]

Dataset = Literal["tiny-corpus", "synthetic"]
DataFormat = Literal["tokens", "hf-dataset", "text"]
TokenDtype = Literal["uint16", "uint32"]
MetricsSource = Literal["trainer", "prometheus"]
Precision = Literal["fp32", "bf16"]


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


class ModelSpec(StrictModel):
    """A preset, explicit sizes, or a Hugging Face folder (`path`); explicit sizes override the
    preset's, and beside `path` they must agree with its config.json."""

    preset: Preset | None = None
    """Named sizes (`malleus.job.PRESETS`)."""
    path: str | None = None
    """A Hugging Face model folder (config.json, *.safetensors, optional index) on the trainers'
    volume. The operator cannot read it, so a cluster job states the sizes beside it; where the
    folder is readable (`malleus check`, the trainers) they are checked against config.json."""
    layers: int | None = None
    """Transformer blocks; the planner splits them into pipeline stages."""
    hidden: int | None = None
    """Model (embedding) width."""
    heads: int | None = None
    """Attention (query) heads."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); unset: as many as `heads`."""
    head_dim: int | None = None
    """Width of one head; unset: hidden / heads."""
    ffn: int | None = None
    """Width of the MLP's inner layer."""
    vocab: int | None = None
    """Vocabulary size."""
    sequence: int | None = None
    """Training sequence length in tokens (with `path`: at most max_position_embeddings)."""
    tied_embeddings: bool = False
    """Share the input embedding with the output head (with `path`: config.json decides)."""


class DataSpec(StrictModel):
    """The user's own data (docs/data.md); the files are read by the trainers, never the operator."""

    format: DataFormat
    """tokens: one flat file of token ids; hf-dataset: a `save_to_disk` folder; text: .txt/.jsonl."""
    path: str
    """The token file, the dataset folder, or a text file or folder of them."""
    dtype: TokenDtype = "uint16"
    """tokens: width of one little-endian token id."""
    column: str = "input_ids"
    """hf-dataset: the column of token-id lists, packed into one stream in row order."""
    tokenizer: str | None = None
    """text: a folder holding tokenizer.json."""


class TrainingSpec(StrictModel):
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
    data: DataSpec | None = None
    """The user's own data; when given it replaces `dataset`."""
    precision: Precision = "fp32"
    """fp32, or bf16: bf16 parameters and activations in the layers, with float32 master
    weights, gradient reduction and Adam state (docs/guide/trainer.md, "Precision and memory")."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them: less memory
    for one more forward per layer; the same math."""
    compile: bool = False
    """Compile the layers' math between their collectives (RMSNorm, attention, SwiGLU) with
    `torch.compile`: fused elementwise kernels and fewer launches on a GPU, for a compilation in
    the first steps (once per shape: every layer of a stage shares it). The same math to
    rounding (the fused kernels round in their own order)."""


class ParallelismSpec(StrictModel):
    """Nominal tensor-parallel degree; optional pinned pipelines (dp) and stages (pp)."""

    tp: int
    dp: int | None = None
    pp: int | None = None


class StragglerPolicy(StrictModel):
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
    """Steps over which the predicted gain must repay the migration (planning is not weighed:
    it is spent by the time the plan is judged, and the trainers trained meanwhile)."""
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


FailureCause = Literal[
    "Preempted", "Evicted", "NodeLost", "OOMKilled", "Error", "Deleted", "Failed"
]
"""Why a worker pod failed, as the operator tells it from the pod (`malleus.operator.failures`):
``Preempted`` (Kueue stopped the workload, or the scheduler preempted the pod for a higher
priority one), ``Evicted`` (the Eviction API: a node drain; or the kubelet: node pressure, a
node shutdown), ``NodeLost`` (its node stopped answering: the taint manager or the pod garbage
collector deleted it), ``OOMKilled`` (a container ran out of memory), ``Error`` (a container
exited non-zero), ``Deleted`` (deleted by someone, with no reason given), ``Failed`` (the pod
failed otherwise, its kubelet refused it, say)."""
FAILURE_CAUSES: tuple[str, ...] = get_args(FailureCause)
FailureAction = Literal["FailJob", "RestartWorker", "Ignore"]
"""What a failure does: fail the job; replace the pod and count the failure against
``maxRestarts`` (and the rule's own); replace the pod without counting it."""


class ExitCodes(StrictModel):
    """Container exit codes a rule matches: ``In`` the values, or ``NotIn`` them."""

    operator: Literal["In", "NotIn"] = "In"
    values: list[int] = Field(min_length=1)

    def match(self, code: int | None) -> bool:
        """Whether ``code`` (None: the pod failed without an exit code) matches."""
        if code is None:
            return False
        return (code in self.values) == (self.operator == "In")


class FailureRule(StrictModel):
    """One rule of ``spec.failurePolicy.rules``: the failures it matches and what they do.

    The first rule that matches a failure decides it; a failure no rule matches is decided by
    the built-in rules (`DEFAULT_FAILURE_RULES`), then counted as ``RestartWorker``.
    """

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """Named in the failure's record (``status.failures[*].rule``) and its event."""
    action: FailureAction
    on_causes: list[FailureCause] = Field(default_factory=list)
    """The causes it matches (empty: every cause)."""
    on_exit_codes: ExitCodes | None = None
    """The container exit codes it matches (unset: any; set: only failures with a code)."""
    max_restarts: int | None = None
    """``RestartWorker`` only: how many of the failures this rule counts one node may have
    (beside ``maxRestarts``, which counts them all); past it the node is ``Out``."""

    @model_validator(mode="after")
    def _budget_of_restarts_only(self) -> FailureRule:
        if self.max_restarts is not None and self.action != "RestartWorker":
            raise ValueError("maxRestarts is for action RestartWorker only")
        return self

    def matches(self, cause: str, exit_code: int | None) -> bool:
        """Whether a failure of ``cause`` (and ``exit_code``) is this rule's."""
        if self.on_causes and cause not in self.on_causes:
            return False
        return self.on_exit_codes is None or self.on_exit_codes.match(exit_code)


DEFAULT_FAILURE_RULES = (
    FailureRule(name="preemption", action="Ignore", on_causes=["Preempted"]),
    FailureRule(name="eviction", action="Ignore", on_causes=["Evicted"]),
)
"""Applied after the job's own rules: a pod Kueue or the scheduler preempted, or a drain
evicted, is replaced without counting against ``maxRestarts`` (its node did nothing wrong).
A job's rule for the same cause comes first, so ``{onCauses: [Evicted], action:
RestartWorker}`` counts evictions again."""


class FailurePolicy(StrictModel):
    """What happens when a GPU, rank or pod dies or hangs: the survivors re-plan and go on."""

    hang_timeout_seconds: int | None = None
    """A rank that makes no progress for this long counts as failed (every collective is bounded
    by it). Unset: sized from the measured step time (10 steps, at least 30 s, at most 600 s)."""
    max_restarts: int = 3
    """Times the operator (or ``malleus run``) replaces one failed rank's pod (or process); a
    rank that failed more often stays out of the job and is planned around."""
    restart_backoff_seconds: int = 10
    """Wait before replacing a failed pod or process; doubled after each failure of the same
    rank, capped at 300 s."""
    grace_period_seconds: int = 60
    """Time a trainer told to stop (SIGTERM, Ctrl-C, pod deletion) has to checkpoint and exit;
    the operator sets it as the pods' ``terminationGracePeriodSeconds``."""
    rules: list[FailureRule] = Field(default_factory=list)
    """The operator's rules for worker pod failures, by cause and exit code, first match wins
    (`FailureRule`; then `DEFAULT_FAILURE_RULES`; then ``RestartWorker``). ``malleus run``
    has no pods and counts every failure of a rank."""
    reset_after_seconds: int | None = 3600
    """A node whose replacement has run this long without failing starts again from zero:
    its counted failures (``maxRestarts``, each rule's) are forgotten at its next failure.
    Unset: never forgotten."""

    def decide(self, cause: str, exit_code: int | None) -> FailureRule | None:
        """The rule that decides a failure of ``cause``: the job's first match, else the
        built-in one, else None (``RestartWorker``, counted)."""
        for rule in (*self.rules, *DEFAULT_FAILURE_RULES):
            if rule.matches(cause, exit_code):
                return rule
        return None


class DcgmSpec(StrictModel):
    """Names of the DCGM exporter metrics."""

    sm_clock_metric: str = "DCGM_FI_DEV_SM_CLOCK"
    clock_event_reasons_metric: str = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"


class KeyRef(StrictModel):
    """One key of a Secret or ConfigMap in the job's namespace (read by the operator by name)."""

    name: str
    key: str


class PrometheusTLSSpec(StrictModel):
    """The CA bundle (PEM) that verifies an https Prometheus URL, from a Secret or a ConfigMap
    (not both); without one the operator's system trust store is used."""

    ca_secret: KeyRef | None = None
    ca_config_map: KeyRef | None = None


class PrometheusSpec(StrictModel):
    """The Prometheus server to query, and how to authenticate to it."""

    url: str | None = None
    bearer_token_secret: KeyRef | None = None
    """Sent as `Authorization: Bearer` (Thanos, OpenShift, managed Prometheus)."""
    tls: PrometheusTLSSpec | None = None
    dcgm: DcgmSpec = Field(default_factory=DcgmSpec)


class MetricsSpec(StrictModel):
    """Where straggling rates come from."""

    source: MetricsSource = "trainer"
    scrape_interval_seconds: int = 5
    prometheus: PrometheusSpec | None = None


class CheckpointSpec(StrictModel):
    """Periodic checkpoints; ``interval_steps == 0`` turns them off."""

    claim_name: str | None = None
    path: str = "/checkpoints"
    interval_steps: int = 0
    keep: int = 3
    """Checkpoints kept on disk, the newest; an older one is deleted only once a newer one is
    complete (and finite), so a crash or a diverged run never leaves the job without one to
    resume. More than one: the newest can be refused on load (corrupt), and a human then needs
    an older one."""


class ResourcesSpec(StrictModel):
    """Per-pod requests; ``gpu_memory_mib`` is the planner's memory capacity per GPU."""

    cpu: int | str | None = None
    memory: int | str | None = None
    gpu_memory_mib: int = Field(default=81559, alias="gpuMemoryMiB")


FailKind = Literal["kill", "hang"]


class ScheduleEntry(StrictModel):
    """One emulated event at ``step`` (emulation only); exactly one of three kinds:

    - ``{step, rank, factor}``: from ``step`` on, GPU ``rank`` computes ``factor`` times slower
      (1.0 heals it);
    - ``{step, rank, fail}``: GPU ``rank``'s trainer fails during ``step``: ``kill`` (the
      process dies, SIGKILL) or ``hang`` (it stops making progress, SIGSTOP);
    - ``{step, node, link}``: from ``step`` on, node ``node``'s links are ``link`` times slower:
      every collective whose group crosses that node (TP inside it, pipeline transfers and
      gradient sync leaving it) is charged ``link`` times its time (1.0 heals it).
    """

    step: int
    rank: int | None = None
    factor: float | None = None
    fail: FailKind | None = None
    node: int | None = None
    link: float | None = None

    @property
    def kind(self) -> Literal["slowdown", "fail", "link"]:
        """Which of the three events this entry is (the schema guarantees exactly one)."""
        if self.fail is not None:
            return "fail"
        if self.link is not None:
            return "link"
        return "slowdown"


class EmulationSpec(StrictModel):
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


class MalleusJobSpec(StrictModel):
    """``spec`` of a MalleusJob."""

    image: str
    nodes: int
    gpus_per_node: int
    model: ModelSpec
    training: TrainingSpec
    parallelism: ParallelismSpec
    straggler_policy: StragglerPolicy = Field(default_factory=StragglerPolicy)
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    control_port: int = 8040
    emulation: EmulationSpec = Field(default_factory=EmulationSpec)
    pod_template: PodTemplate | None = None
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    suspend: bool = False
    """No pods while true (Kueue's admission flips it); suspending a running job checkpoints
    and stops it, resuming recreates its pods from the checkpoint."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
