"""The step's figures (`StepReport`) and what the step's helpers read of a Trainer (`TrainerView`).

The Trainer (trainer/engine/trainer.py) runs the step; the calibration window
(trainer/engine/calibrator.py) and the step's figures (trainer/engine/figures.py) read its
layout, groups, pieces, meters and services. They name what they read through `TrainerView`, a
structural type the Trainer satisfies, so that neither imports the Trainer and the Trainer
imports both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from malleus.job import ModelConfig, ResolvedJob
    from malleus.job.spec import TrainingSpec
    from malleus.planner import Plan
    from malleus.trainer.model.precision import Precision
    from malleus.trainer.parallel.groups import GroupCache
    from malleus.trainer.parallel.layout import Layout
    from malleus.trainer.parallel.pipeline import LayerTimer
    from malleus.trainer.parallel.tensor import CommMeter
    from malleus.trainer.world.world import World

    from .services import Services

__all__ = ["StepReport", "TrainerView"]


@dataclass(frozen=True)
class StepReport:
    """The figures of one completed step (the same on every rank, but `rate` is this rank's)."""

    step: int  # index of the step just run (0-based)
    loss: float  # mean over the step's micro-batches
    grad_norm: float  # before clipping
    lr: float
    seconds: float
    tokens_per_second: float
    compute_seconds: float  # this rank's layer compute, communication excluded
    rates: dict[int, float | None]  # every rank's straggling rate (None: not yet calibrated)


class TrainerView(Protocol):
    """What the calibration and the step's figures read of one rank's Trainer."""

    job: ResolvedJob
    model: ModelConfig
    training: TrainingSpec
    plan: Plan
    layout: Layout
    rank: int
    world: World  # the job's process group (`world.size`: its GPUs)
    step: int
    device: torch.device
    act_shape: tuple[int, int, int]
    precision: Precision
    meter: CommMeter
    timer: LayerTimer
    groups: GroupCache
    params: dict[str, Tensor]
    services: Services
