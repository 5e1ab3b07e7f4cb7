"""The planner's input contract: a cluster, its per-GPU straggling rates, a model.

Every fault in a problem is reported at once, each naming the field and what is allowed, because
a problem usually comes from a person or a metrics pipeline and one round trip per fault is slow.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from malleus.errors import BadInput, Fault

from .calibration import Calibration, calibration_faults

__all__ = [
    "MAX_GPUS",
    "MAX_LAYERS",
    "MAX_MICRO_BATCHES",
    "MAX_RATE",
    "Calibration",
    "MemorySpec",
    "ModelSpec",
    "PlanningProblem",
    "ProblemError",
    "as_fault",
    "validation_faults",
]

MAX_RATE = 1000.0
"""Largest straggling rate the planner takes: a GPU 1000x slower than healthy does no useful
work (give null for unusable), and unbounded figures (1e307) overflow the cost model.
`malleus.job.ResolvedJob.problem` clips measured rates to it; a problem written by hand that
exceeds it is refused."""
MAX_GPUS = 65536
"""Largest cluster (nodes x gpus_per_node) planned: bounds the search's time and memory."""
MAX_LAYERS = 4096
"""Most layers a model may have (the largest public models have ~200)."""
MAX_MICRO_BATCHES = 1_000_000
"""Most micro-batches per step: the micro-batch solver's work grows with it."""


def as_fault(text: str) -> Fault:
    """`"rates.3: must be >= 1"` -> Fault("rates.3", "must be >= 1"); no path -> Fault("", text)."""
    path, sep, message = text.partition(": ")
    if sep and path and " " not in path:
        return Fault(path, message)
    return Fault("", text)


class ProblemError(BadInput):
    """A planning problem that cannot be planned; one fault per problem (`BadInput`)."""

    def __init__(self, faults: list[str], source: str | None = None) -> None:
        super().__init__([as_fault(f) for f in faults], source, what="PlanningProblem")


Count = Annotated[int, Strict()]
"""An integer that is one: `true` or `8.0` in a problem file is a mistake, not a count."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """What the planner needs to know of the model: depth, nominal TP degree, group slowdowns."""

    layers: Count = Field(description="Number of transformer layers to split across stages.")
    tp: Count = Field(
        description="Nominal tensor-parallel degree: a power of two dividing gpus_per_node."
    )
    alpha: list[float] | None = Field(
        default=None,
        description="alpha[k]: slowdown of a TP group of tp/2^k GPUs relative to a full group "
        "(default 2^k). Length log2(tp)+1.",
    )

    def alpha_at(self, k: int) -> float:
        """Slowdown of a group holding 2^k shards per GPU."""
        if self.alpha is not None and k < len(self.alpha):
            return float(self.alpha[k])
        return float(2**k)


class MemorySpec(_Strict):
    """Per-GPU memory model in MB; every term is per logical shard."""

    capacity_mb: float = Field(description="Usable memory of one GPU.")
    layer_mb: float = Field(
        description="Parameters, gradients and optimizer state of one logical shard of one layer."
    )
    activation_mb: float = Field(
        default=0.0,
        description="Activations kept for one layer-shard and one in-flight micro-batch.",
    )
    embedding_mb: float = Field(
        default=0.0, description="Embedding (first stage) or head (last stage) state of one shard."
    )
    fixed_mb: float = Field(default=0.0, description="Per-GPU overhead (CUDA context, buffers).")


class PlanningProblem(_Strict):
    """A cluster with per-GPU straggling rates and a model to lay out."""

    nodes: Count = Field(description="Number of nodes.")
    gpus_per_node: Count = Field(
        description="GPUs in each node; rank = node * gpus_per_node + local."
    )
    rates: dict[int, float | None] = Field(
        default_factory=dict,
        description="Straggling rate per global rank (absent = 1.0 healthy; null = unusable).",
    )
    model: ModelSpec
    micro_batches: Count = Field(description="Global batch / micro-batch size: one step's work.")
    memory: MemorySpec | None = Field(default=None, description="Memory bound; none = unbounded.")
    dp: Count | None = Field(
        default=None, description="Pin the number of pipelines; null = choose."
    )
    previous_plan: Any | None = Field(
        default=None, description="The plan in force (a Plan), to prefer layouts that move less."
    )
    calibration: Calibration | None = Field(
        default=None,
        description="Measured cost terms beyond layer compute (embedding, head, TP and pipeline "
        "transfers, gradient sync, optimizer, fixed); null = layer compute only.",
    )
    link_rates: dict[int, float] = Field(
        default_factory=dict,
        description="Link slowdown per node (absent = 1.0 healthy; 1.0 to MAX_RATE): a "
        "collective whose group touches a node with link rate L takes L times as long.",
    )

    @model_validator(mode="after")
    def _check(self) -> PlanningProblem:
        faults = problem_faults(self)
        if faults:
            raise ProblemError(faults)
        if self.previous_plan is not None and not hasattr(self.previous_plan, "pipelines"):
            from .plan import Plan

            object.__setattr__(self, "previous_plan", Plan.model_validate(self.previous_plan))
        if self.previous_plan is not None:
            faults = previous_plan_faults(self)
            if faults:
                raise ProblemError(faults)
        return self

    # ---- derived views -------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tp(self) -> int:
        return self.model.tp

    @property
    def layers(self) -> int:
        return self.model.layers

    def rate(self, rank: int) -> float | None:
        """Straggling rate of a rank: 1.0 when unreported, None when unusable."""
        return self.rates.get(rank, 1.0)

    def usable_ranks(self) -> list[int]:
        return [r for r in range(self.world) if self.rate(r) is not None]

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link_rate(self, node: int) -> float:
        """Link slowdown of a node: 1.0 when unreported."""
        return float(self.link_rates.get(node, 1.0))

    @classmethod
    def load(cls, data: str | bytes | dict[str, Any]) -> PlanningProblem:
        """Parse JSON text or a dict; every fault (types and semantics) in one ProblemError."""
        try:
            if isinstance(data, (str, bytes)):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as e:
            raise ProblemError(validation_faults(e)) from None

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude_none=False)


def problem_faults(p: PlanningProblem) -> list[str]:
    """Every fault of a problem, one message each naming the field and what is allowed."""
    faults: list[str] = []
    if p.nodes < 1:
        faults.append(f"nodes: {p.nodes} is not allowed; need at least 1")
    if p.gpus_per_node < 1:
        faults.append(f"gpus_per_node: {p.gpus_per_node} is not allowed; need at least 1")
    if p.nodes * p.gpus_per_node > MAX_GPUS:
        faults.append(
            f"nodes: {p.nodes} x gpus_per_node {p.gpus_per_node} = {p.nodes * p.gpus_per_node} "
            f"GPUs; at most {MAX_GPUS} are planned"
        )
    tp = p.model.tp
    if tp < 1 or tp & (tp - 1):
        faults.append(f"model.tp: {tp} is not a power of two (allowed: 1, 2, 4, 8, ...)")
    elif p.gpus_per_node >= 1 and p.gpus_per_node % tp:
        faults.append(
            f"model.tp: {tp} does not divide gpus_per_node ({p.gpus_per_node}); "
            "a TP group must fit in one node"
        )
    if not 1 <= p.model.layers <= MAX_LAYERS:
        faults.append(f"model.layers: {p.model.layers} is not allowed; need 1..{MAX_LAYERS}")
    if p.model.alpha is not None:
        for k, a in enumerate(p.model.alpha):
            if not (math.isfinite(a) and a > 0):
                faults.append(f"model.alpha[{k}]: {a} is not allowed; need a finite number > 0")
    if not 1 <= p.micro_batches <= MAX_MICRO_BATCHES:
        faults.append(
            f"micro_batches: {p.micro_batches} is not allowed; need 1..{MAX_MICRO_BATCHES}"
        )
    world = p.nodes * p.gpus_per_node
    if world > MAX_GPUS:
        return faults  # the per-rank checks below would walk every rank
    for rank, rate in sorted(p.rates.items()):
        if not 0 <= rank < world:
            faults.append(
                f"rates[{rank}]: rank {rank} is out of range; ranks are 0..{world - 1} "
                f"({p.nodes} nodes x {p.gpus_per_node} GPUs)"
            )
        if rate is not None and not (math.isfinite(rate) and 1.0 <= rate <= MAX_RATE):
            faults.append(
                f"rates[{rank}]: {rate} is not allowed; a straggling rate is a number from 1.0 "
                f"(healthy) to {MAX_RATE:g}, or null for an unusable GPU"
            )
    if p.dp is not None and not 1 <= p.dp <= max(world, 1):
        faults.append(f"dp: {p.dp} is not allowed; need 1..{world} pipelines (or null to choose)")
    if p.memory is not None:
        for name in ("capacity_mb", "layer_mb", "activation_mb", "embedding_mb", "fixed_mb"):
            v = getattr(p.memory, name)
            if not (math.isfinite(v) and v >= 0):
                faults.append(f"memory.{name}: {v} is not allowed; need a finite number >= 0")
    for node, rate in sorted(p.link_rates.items()):
        if not 0 <= node < p.nodes:
            faults.append(
                f"link_rates[{node}]: node {node} is out of range; nodes are 0..{p.nodes - 1}"
            )
        if not (math.isfinite(rate) and 1.0 <= rate <= MAX_RATE):
            faults.append(
                f"link_rates[{node}]: {rate} is not allowed; a link rate is a number from 1.0 "
                f"(healthy) to {MAX_RATE:g}"
            )
    if p.calibration is not None:
        faults.extend(calibration_faults(p.calibration))
    if not faults and all(p.rates.get(r, 1.0) is None for r in range(world)):
        faults.append("rates: every GPU is unusable (null); at least one must be usable")
    return faults


def previous_plan_faults(p: PlanningProblem) -> list[str]:
    """A plan in force that cannot be this cluster's: another tp, or ranks outside the world
    (the planner would prefer layouts that "move little" from GPUs that do not exist)."""
    plan = p.previous_plan
    faults: list[str] = []
    if plan.tp != p.tp:
        faults.append(f"previous_plan.tp: {plan.tp} is not the problem's tp ({p.tp})")
    where = f"ranks are 0..{p.world - 1} ({p.nodes} nodes x {p.gpus_per_node} GPUs)"
    for i, pipeline in enumerate(plan.pipelines):
        for j, stage in enumerate(pipeline.stages):
            outside = [r for r in stage.ranks if not 0 <= r < p.world]
            if outside:
                faults.append(
                    f"previous_plan.pipelines[{i}].stages[{j}].ranks: {outside} outside; {where}"
                )
            if stage.layers[1] > p.layers:
                faults.append(
                    f"previous_plan.pipelines[{i}].stages[{j}].layers: {list(stage.layers)} "
                    f"beyond the model's {p.layers} layers"
                )
    outside = [r for r in plan.excluded if not 0 <= r < p.world]
    if outside:
        faults.append(f"previous_plan.excluded: {outside} outside; {where}")
    return faults


def validation_faults(e: ValidationError) -> list[str]:
    """Flatten a pydantic error into 'field.path: message' lines (semantic faults pass through)."""
    faults: list[str] = []
    for err in e.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ProblemError):
            faults.extend(f"{f.path}: {f.message}" if f.path else f.message for f in inner.faults)
            continue
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        faults.append(f"{loc}: {err['msg']}")
    return faults
