"""The step's figures (`StepReport`, `world_vector`) and what the step's helpers read of a Trainer
(`TrainerView`).

The Trainer (trainer/engine/trainer.py) runs the step; the calibration window
(trainer/engine/calibrator.py) and the step's figures (trainer/engine/figures.py) read its
layout, groups, pieces, meters and services. They name what they read through `TrainerView`, a
structural type the Trainer satisfies, so that neither imports the Trainer and the Trainer
imports both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    from malleus.trainer.parallel.timing import CommMeter, LayerTimer
    from malleus.trainer.world.world import World

    from .services import Services

__all__ = ["OWN_WORDS", "StepReport", "TrainerView", "world_vector"]

OWN_WORDS = 4
"""A rank's row of the step's world gather: [its owned grad^2, its loss part, its seconds per
unit (0: no units), its compute seconds], then the control words (meaningful in the
coordinator's row only, trainer/switching/protocol.py)."""


def world_vector(rows: Mapping[int, Sequence[float]], size: int, coordinator: int) -> list[float]:
    """The step's world vector from every rank's own row (GPU id -> row): [grad^2 summed, loss
    summed, seconds per unit of GPUs 0..size-1, compute seconds of GPUs 0..size-1, control
    words] — the format the commit, the boundary and a recovery read (`Trainer.commit`,
    `Trainer.close_interrupted_step`; JSON in the store, trainer/recovery/protocol.py).

    A row speaks only for its own GPU: slot r comes from GPU r's row and nowhere else, and the
    control words (the stop included) from the coordinator's row alone, so a rank cannot
    change another's figures or stop the job. The sums run over the rows in GPU order, so every
    rank gets the same bits (a non-finite row makes them non-finite, as a sum did; nothing
    raises). A GPU without a row (out of the process group) has 0 in its slots, as no rank
    wrote them."""
    gpus = sorted(rows)
    per_unit, compute = [0.0] * size, [0.0] * size
    for g in gpus:
        if 0 <= g < size:
            per_unit[g], compute[g] = float(rows[g][2]), float(rows[g][3])
    width = max((len(r) for r in rows.values()), default=OWN_WORDS) - OWN_WORDS
    lead = rows.get(coordinator)
    control = [float(w) for w in lead[OWN_WORDS:]] if lead is not None else [0.0] * width
    return [
        sum((float(rows[g][0]) for g in gpus), 0.0),
        sum((float(rows[g][1]) for g in gpus), 0.0),
        *per_unit,
        *compute,
        *control,
    ]


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
