"""What the ``Ready`` condition of a running job says: the truth about its trainers.

Pods running is not a job ready: a job said ``Ready=True`` with its store Pending and no
trainer answering (issue 31). The pods' side (`lifecycle`) takes a job to phase ``Running``
with ``Ready=False`` (`STARTING`, or why its store cannot run: `store_stuck`); the trainers'
side (`reporter.JobReporter.on_trainers`) makes it ``Ready=True`` (`TRAINING`) once the
coordinator says every rank of the job trains (`every_rank_training`). Pure functions.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from malleus.control import ControlStatus
from malleus.job import Condition

from . import scheduling
from .status import READY, condition

__all__ = [
    "STARTING",
    "TRAINING",
    "every_rank_training",
    "ready_when_training",
    "starting_condition",
    "store_stuck",
]

STARTING = "TrainersStarting"
"""``Ready=False`` reason: every worker pod runs, not every rank has trained yet."""
TRAINING = "Training"
"""``Ready=True`` reason: every rank of the job trains (the coordinator's word)."""


def every_rank_training(answer: ControlStatus, world: int) -> bool:
    """Whether the coordinator's ``/status`` says every rank of a ``world``-rank job (bar
    those out of it) has trained: a step completed since it started (every rank takes part in
    a step) and a rate for each rank."""
    out = {int(r) for r in answer.out}
    if answer.step < 1 or answer.step_seconds is None:
        return False
    return all(answer.rates.get(r) is not None for r in range(world) if r not in out)


def ready_when_training(
    stored: Iterable[Mapping[str, Any] | Condition] | None,
    answer: ControlStatus,
    world: int,
    generation: int,
    at: dt.datetime,
) -> Condition | None:
    """``Ready=True`` (`TRAINING`) when every rank trains and ``Ready`` is not True yet;
    None otherwise (nothing to change)."""
    for c in stored or []:
        c = c.model_dump(by_alias=True) if isinstance(c, Condition) else c
        if c.get("type") == READY and c.get("status") == "True":
            return None
    if not every_rank_training(answer, world):
        return None
    message = f"every rank ({world - len(answer.out)}) is training: step {answer.step}"
    return condition(READY, True, TRAINING, message, generation, at)


def store_stuck(pods: Sequence[Mapping[str, Any]], store: str) -> scheduling.PendingReason | None:
    """Why the job's store pod ``store`` cannot run (unschedulable, an image pull), or None."""
    reasons = scheduling.pending_reasons(pods, [store])
    return reasons[0] if reasons else None


def starting_condition(
    workers: int,
    stuck: scheduling.PendingReason | None,
    generation: int,
    at: dt.datetime,
) -> Condition:
    """``Ready=False`` of a job whose ``workers`` pods all run: the store's trouble if it has
    one (its reason), else `STARTING`."""
    if stuck is not None:
        message = f"all {workers} worker pod(s) running; the store cannot run: {stuck}"
        return condition(READY, False, stuck.reason, message, generation, at)
    message = f"all {workers} worker pod(s) running; waiting for every rank to report training"
    return condition(READY, False, STARTING, message, generation, at)
