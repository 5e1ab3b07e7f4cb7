"""The MalleusJob contract, torch-free: one place every entry point reads a job from.

Rooms:
- `schema`: the CRD (package data) applied as the API server applies it (defaults, pruning,
  structural checks via jsonschema, CEL rules via `cel`);
- `spec`, `status`: the typed models of ``spec`` and ``status``;
- `presets`: named model sizes and GPU profiles;
- `load`: files and mappings -> a validated `MalleusJob`, with one wording for bad files;
- `model`, `hf`: `spec.model` resolved into a `ModelConfig` (preset, explicit sizes, or a
  Hugging Face folder's config.json, judged without torch);
- `data`: `spec.training.data` and its files judged before any trainer starts;
- `contained`: the file names an index or a `state.json` lists, kept inside their folder;
- `rates`: measured straggling rates bounded (job's ranks, finite, capped) before use;
- `memory`: the planner's memory model of a job;
- `resolved`: `ResolvedJob`, the one derived view (sizes, world, faults, problem, first plan);
- `resources`: can this machine run the job (`malleus run` and `malleus train` both ask);
- `report`: the parts of the JSON run report that `malleus run` and `malleus train` share.

Imports: job -> planner (the plan contract), errors; nothing here imports the controller, the
runner, the operator or the trainer.
"""

from malleus.errors import BadInput, Fault

from .load import dump_job, load_job, read_documents, read_text
from .presets import GPU_PROFILES, PRESETS, GpuProfile, ModelConfig, Preset
from .rates import bounded_rates, clean_rates
from .resolved import INITIAL_GENERATION, MAX_RATE, ResolvedJob, resolve_model
from .schema import (
    API_GROUP,
    API_VERSION,
    CRD_PATH,
    KIND,
    PLURAL,
    RULES_NOT_CHECKED,
    VERSION,
    crd,
    job_schema,
    validate_manifest,
)
from .spec import (
    CheckpointSpec,
    DcgmSpec,
    EmulationSpec,
    FailKind,
    FailurePolicy,
    JobMetadata,
    MalleusJobSpec,
    MetricsSpec,
    ModelSpec,
    ParallelismSpec,
    PrometheusSpec,
    ResourcesSpec,
    ScheduleEntry,
    StragglerPolicy,
    TrainingSpec,
)
from .status import (
    Condition,
    LastReplan,
    MalleusJob,
    MalleusJobStatus,
    Phase,
    PlanStatus,
    StragglerStatus,
)

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "CRD_PATH",
    "GPU_PROFILES",
    "INITIAL_GENERATION",
    "KIND",
    "MAX_RATE",
    "PLURAL",
    "PRESETS",
    "RULES_NOT_CHECKED",
    "VERSION",
    "BadInput",
    "CheckpointSpec",
    "Condition",
    "DcgmSpec",
    "EmulationSpec",
    "FailKind",
    "FailurePolicy",
    "Fault",
    "GpuProfile",
    "JobMetadata",
    "LastReplan",
    "MalleusJob",
    "MalleusJobSpec",
    "MalleusJobStatus",
    "MetricsSpec",
    "ModelConfig",
    "ModelSpec",
    "ParallelismSpec",
    "Phase",
    "PlanStatus",
    "Preset",
    "PrometheusSpec",
    "ResolvedJob",
    "ResourcesSpec",
    "ScheduleEntry",
    "StragglerPolicy",
    "StragglerStatus",
    "TrainingSpec",
    "bounded_rates",
    "clean_rates",
    "crd",
    "dump_job",
    "job_schema",
    "load_job",
    "read_documents",
    "read_text",
    "resolve_model",
    "validate_manifest",
]
