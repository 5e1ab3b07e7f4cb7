"""The planner's output contract: the layout every trainer executes.

A Plan is plain data: which ranks form each stage (a TP group, ordered: GPU i holds logical
shards [i*2^k, (i+1)*2^k)), which half-open layer range each stage holds, how many
micro-batches each pipeline runs, and who sits out. It is shown in the CR status, posted to the
trainers, and checked by `validate_plan` wherever it crosses a boundary.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Estimate", "Pipeline", "Plan", "Stage"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Stage(StrictModel):
    """One pipeline stage: a TP group of one node holding a contiguous range of layers."""

    ranks: list[int] = Field(description="Global ranks of the TP group, in shard order.")
    layers: tuple[int, int] = Field(description="Half-open layer range [start, end).")

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def shards_per_gpu(self, tp: int) -> int:
        """2^k: logical shards of every layer that each GPU of this group holds."""
        return tp // len(self.ranks) if self.ranks else 0

    def shards_of(self, index: int, tp: int) -> range:
        """Logical shards held by the index-th GPU of the group."""
        n = self.shards_per_gpu(tp)
        return range(index * n, (index + 1) * n)


class Pipeline(StrictModel):
    """A data-parallel replica: stages in order, and its share of the step's micro-batches."""

    micro_batches: int = Field(description="Micro-batches this pipeline processes per step.")
    stages: list[Stage]


class Estimate(StrictModel):
    """Cost-model figures, in layer-time units (docs/architecture.md, "Cost model"); MB for migration."""

    step_time: float
    uniform_step_time: float | None = Field(
        default=None,
        description="The static (Megatron-style) layout's step time; null = none runs.",
    )
    ideal_step_time: float | None = None
    reference_step_time: float | None = Field(
        default=None, description="Healthy uniform step time scaled by the capacity lost."
    )
    migration_mb: float = 0.0
    planning_seconds: float | None = None
    terms: dict[str, float] | None = Field(
        default=None,
        description="Calibrated problems: each term of step_time (cost.StepTerms.as_dict), in "
        "layer-time units; null without a calibration (step_time is then the pipeline term).",
    )
    step_seconds: float | None = Field(
        default=None,
        description="step_time in seconds (calibration.layer_seconds known); else null.",
    )


class Plan(StrictModel):
    """A complete layout of the job."""

    generation: int = Field(default=0, description="Increases by one with every applied plan.")
    tp: int = Field(description="Nominal TP degree: logical shards per layer.")
    pipelines: list[Pipeline]
    excluded: list[int] = Field(default_factory=list, description="Usable ranks left idle.")
    failed: list[int] = Field(
        default_factory=list,
        description="Ranks the problem marks unusable (rate null: failed GPUs), in no stage; "
        "the planner lists them all, a plan written by hand may leave them out.",
    )
    estimate: Estimate | None = None

    def stages(self) -> Iterator[tuple[int, int, Stage]]:
        """(pipeline index, stage index, stage) for every stage."""
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                yield i, j, s

    def active_ranks(self) -> list[int]:
        return sorted(r for _, _, s in self.stages() for r in s.ranks)

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        return cls.model_validate_json(text)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)
