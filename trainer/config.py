"""`TrainConfig`: everything a rank needs from a MalleusJob, in one flat frozen object.

The worker reads only this, so manifest details (field names, presets, defaults) stay in
malleus.jobspec; `from_job` is the one place that translates. It also states the planning
problem of the job (`problem`), including the memory model the plan is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from malleus.planner import MemorySpec, ModelSpec, PlanningProblem

from .model import GPTConfig

__all__ = ["EmulationConfig", "TrainConfig", "from_job", "load_config"]


@dataclass(frozen=True)
class EmulationConfig:
    """Emulated GPU clock: seconds per layer-shard and micro-batch, and scheduled slowdowns."""

    forward_s: float = 0.010
    backward_s: float = 0.020
    schedule: tuple[tuple[int, int, float], ...] = ()  # (step, rank, factor)


@dataclass(frozen=True)
class TrainConfig:
    """One training job as the trainer sees it (the same on every rank)."""

    name: str
    nodes: int
    gpus_per_node: int
    model: GPTConfig  # carries tp, the number of logical shards per layer
    global_batch: int
    micro_batch: int
    steps: int
    learning_rate: float
    warmup_steps: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    dataset: str = "tiny-corpus"  # or "synthetic"
    dp: int | None = None
    gpu_memory_mb: float | None = None  # None: no memory bound
    control_port: int = 8040
    emulation: EmulationConfig | None = None
    checkpoint_dir: str | None = None  # spec.checkpoint.path, when intervalSteps > 0
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global batch ({self.global_batch}) is not a multiple of the micro-batch "
                f"({self.micro_batch})"
            )

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tp(self) -> int:
        return self.model.tp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step: every plan splits exactly these across its pipelines."""
        return self.global_batch // self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.sequence

    def with_steps(self, steps: int) -> TrainConfig:
        return replace(self, steps=steps)

    def memory(self) -> MemorySpec | None:
        """The per-shard memory model the controller plans with (malleus.controller.problem),
        so that the trainer accepts exactly the plans the planner may produce."""
        if self.gpu_memory_mb is None:
            return None
        from malleus.controller.problem import memory_model

        return memory_model(
            self.model,
            tp=self.tp,
            micro_batch_size=self.micro_batch,
            capacity_mib=self.gpu_memory_mb,
        )

    def problem(self, rates: dict[int, float | None] | None = None) -> PlanningProblem:
        """The planning problem of this job (healthy GPUs unless `rates` says otherwise)."""
        return PlanningProblem(
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            rates=dict(rates or {}),
            model=ModelSpec(layers=self.model.layers, tp=self.tp),
            micro_batches=self.micro_batches,
            memory=self.memory(),
            dp=self.dp,
        )


def from_job(job: Any) -> TrainConfig:
    """Translate a malleus.jobspec MalleusJob into a TrainConfig."""
    from malleus.jobspec import resolve_model

    spec = job.spec
    shape = resolve_model(spec.model)
    tr = spec.training
    emu = getattr(spec, "emulation", None)
    emulation = None
    if emu is not None and emu.enabled:
        forward_s, backward_s = emu.layer_seconds()
        emulation = EmulationConfig(
            forward_s=forward_s,
            backward_s=backward_s,
            schedule=tuple((e.step, e.rank, e.factor) for e in (emu.schedule or [])),
        )
    ckpt = getattr(spec, "checkpoint", None)
    every = int(getattr(ckpt, "interval_steps", 0) or 0)
    resources = getattr(spec, "resources", None)
    memory = getattr(resources, "gpu_memory_mib", None) if resources is not None else None
    return TrainConfig(
        name=job.metadata.name,
        nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node,
        model=GPTConfig(
            layers=shape.layers,
            hidden=shape.hidden,
            heads=shape.heads,
            ffn=shape.ffn,
            vocab=shape.vocab,
            sequence=shape.sequence,
            tied_embeddings=bool(shape.tied_embeddings),
            tp=spec.parallelism.tp,
        ),
        global_batch=tr.global_batch_size,
        micro_batch=tr.micro_batch_size,
        steps=tr.steps,
        learning_rate=tr.learning_rate,
        warmup_steps=tr.warmup_steps,
        weight_decay=tr.weight_decay,
        grad_clip=tr.grad_clip,
        seed=tr.seed,
        dataset=tr.dataset,
        dp=spec.parallelism.dp,
        gpu_memory_mb=float(memory) if memory else None,
        control_port=spec.control_port,
        emulation=emulation,
        checkpoint_dir=ckpt.path if ckpt is not None and every > 0 else None,
        checkpoint_every=every,
    )


def load_config(path: str) -> TrainConfig:
    """Read and validate a MalleusJob manifest."""
    from malleus.jobspec import load_job

    return from_job(load_job(path))
