"""The planner's input contract (DESIGN §4.1): a cluster, its per-GPU straggling rates, a model.

Every fault in a problem is reported at once, each naming the field and what is allowed, because
a problem usually comes from a person or a metrics pipeline and one round trip per fault is slow.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["MemorySpec", "ModelSpec", "PlanningProblem", "ProblemError", "validation_faults"]


class ProblemError(ValueError):
    """A planning problem that cannot be planned; `faults` holds one message per fault."""

    def __init__(self, faults: list[str]) -> None:
        self.faults = list(faults)
        super().__init__("invalid planning problem:\n" + "\n".join(f"  - {f}" for f in faults))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """What the planner needs to know of the model: depth, nominal TP degree, group slowdowns."""

    layers: int = Field(description="Number of transformer layers to split across stages.")
    tp: int = Field(
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
    """Per-GPU memory model in MB (DESIGN §4.3); every term is per logical shard."""

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
    """A cluster with per-GPU straggling rates and a model to lay out (DESIGN §4.1)."""

    nodes: int = Field(description="Number of nodes.")
    gpus_per_node: int = Field(
        description="GPUs in each node; rank = node * gpus_per_node + local."
    )
    rates: dict[int, float | None] = Field(
        default_factory=dict,
        description="Straggling rate per global rank (absent = 1.0 healthy; null = unusable).",
    )
    model: ModelSpec
    micro_batches: int = Field(description="Global batch / micro-batch size: one step's work.")
    memory: MemorySpec | None = Field(default=None, description="Memory bound; none = unbounded.")
    dp: int | None = Field(default=None, description="Pin the number of pipelines; null = choose.")
    previous_plan: Any | None = Field(
        default=None, description="The plan in force (a Plan), to prefer layouts that move less."
    )

    @model_validator(mode="after")
    def _check(self) -> PlanningProblem:
        faults = problem_faults(self)
        if faults:
            raise ProblemError(faults)
        if self.previous_plan is not None and not hasattr(self.previous_plan, "pipelines"):
            from .plan import Plan

            object.__setattr__(self, "previous_plan", Plan.model_validate(self.previous_plan))
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
    tp = p.model.tp
    if tp < 1 or tp & (tp - 1):
        faults.append(f"model.tp: {tp} is not a power of two (allowed: 1, 2, 4, 8, ...)")
    elif p.gpus_per_node >= 1 and p.gpus_per_node % tp:
        faults.append(
            f"model.tp: {tp} does not divide gpus_per_node ({p.gpus_per_node}); "
            "a TP group must fit in one node"
        )
    if p.model.layers < 1:
        faults.append(f"model.layers: {p.model.layers} is not allowed; need at least 1")
    if p.model.alpha is not None:
        for k, a in enumerate(p.model.alpha):
            if not (math.isfinite(a) and a > 0):
                faults.append(f"model.alpha[{k}]: {a} is not allowed; need a finite number > 0")
    if p.micro_batches < 1:
        faults.append(f"micro_batches: {p.micro_batches} is not allowed; need at least 1")
    world = p.nodes * p.gpus_per_node
    for rank, rate in sorted(p.rates.items()):
        if not 0 <= rank < world:
            faults.append(
                f"rates[{rank}]: rank {rank} is out of range; ranks are 0..{world - 1} "
                f"({p.nodes} nodes x {p.gpus_per_node} GPUs)"
            )
        if rate is not None and not (math.isfinite(rate) and rate >= 1.0):
            faults.append(
                f"rates[{rank}]: {rate} is not allowed; a straggling rate is a finite number "
                ">= 1.0 (1.0 = healthy), or null for an unusable GPU"
            )
    if p.dp is not None and p.dp < 1:
        faults.append(f"dp: {p.dp} is not allowed; need at least 1 pipeline (or null to choose)")
    if p.memory is not None:
        for name in ("capacity_mb", "layer_mb", "activation_mb", "embedding_mb", "fixed_mb"):
            v = getattr(p.memory, name)
            if not (math.isfinite(v) and v >= 0):
                faults.append(f"memory.{name}: {v} is not allowed; need a finite number >= 0")
    if not faults and all(p.rates.get(r, 1.0) is None for r in range(world)):
        faults.append("rates: every GPU is unusable (null); at least one must be usable")
    return faults


def validation_faults(e: ValidationError) -> list[str]:
    """Flatten a pydantic error into 'field.path: message' lines (semantic faults pass through)."""
    faults: list[str] = []
    for err in e.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ProblemError):
            faults.extend(inner.faults)
            continue
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        faults.append(f"{loc}: {err['msg']}")
    return faults
