"""The trainers' control API's typed body: `ControlStatus` (``GET /status``) and its records.

What a trainer's control endpoint serves and its readers parse: the status of the run
(`ControlStatus`) and the records it carries of the latest live switch (`MigrationRecord`),
plan that failed to apply (`PlanFailure`) and recovery from failed ranks (`RecoveryRecord`).
Pure models, frozen and NaN-free; the clients that fetch them and the exceptions they raise are
`malleus.control.client`'s. Import either from `malleus.control`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from malleus.planner.calibration import Calibration

__all__ = ["ControlStatus", "MigrationRecord", "PlanFailure", "RecoveryRecord"]


class StrictModel(BaseModel):
    # NaN is not JSON: the server must say None for "no figure", and a reader must never see NaN.
    model_config = ConfigDict(frozen=True, allow_inf_nan=False)


class MigrationRecord(StrictModel):
    """One completed live switch, as the coordinator measured it."""

    generation: int
    """The plan generation switched to."""
    step: int
    """The first step that ran under that plan (the switch happened just before it)."""
    seconds: float
    """Wall seconds of the switch on the slowest rank."""
    bytes: int
    """Bytes moved over the wire, summed over ranks."""


class PlanFailure(StrictModel):
    """A plan accepted by ``POST /plan`` that could not be applied; the old plan stays."""

    generation: int
    reason: str


class RecoveryRecord(StrictModel):
    """One completed recovery from failed ranks, as the new coordinator measured it."""

    epoch: int
    """Recoveries so far in this run (1 = the first); the process group's incarnation."""
    failed: dict[int, str]
    """The GPUs that left the job in this recovery, with why (``killed``, ``hung``, ...)."""
    step: int
    """The first step trained after the recovery."""
    steps_lost: int
    """Committed steps undone (0 when every shard had a surviving holder; a rollback to the
    last checkpoint loses the steps since it)."""
    seconds: float
    """Wall seconds from the failure's detection to the first committed step after it."""
    bytes_restored: int
    """Bytes copied from surviving holders (or read from the checkpoint) to the new layout."""
    mode: Literal["replicas", "checkpoint"]
    """Where the lost shards came from: surviving data-parallel replicas, or the checkpoint."""
    generation: int
    """The plan generation the survivors went on with."""


class ControlStatus(StrictModel):
    """The ``GET /status`` body served by a trainer's control endpoint (rank 0 speaks for all)."""

    job: str
    world: int
    generation: int
    """The plan generation in force."""
    pending_generation: int | None
    """Accepted by ``POST /plan``, not yet applied (taken at the next step boundary)."""
    step: int
    """Steps completed."""
    steps: int
    """Steps the run will train."""
    done: bool
    """Every step trained (``step >= steps``); the processes exit next."""
    stopping: bool
    """``POST /stop`` was accepted: the run ends at the next step boundary."""
    rates: dict[int, float | None]
    """Straggling rate per global rank (1.0 = healthy); None = no figure yet, or failed."""
    step_seconds: float | None
    """Wall seconds of the last step; None before the first."""
    tokens_per_second: float | None
    last_migration: MigrationRecord | None
    """The latest live switch; None while the first plan is still in force."""
    last_failure: PlanFailure | None
    """The latest plan that failed to apply, cleared when a later plan is applied."""
    out: dict[int, str] = {}
    """GPUs out of the job because they failed, with why (``killed``, ``hung``, ``left``);
    a replacement that joined removes its GPU from here."""
    last_recovery: RecoveryRecord | None = None
    """The latest recovery from failed ranks; None while none has failed."""
    calibration: Calibration | None = None
    """The cost model's terms as the trainers measured them (the planner's `calibration`:
    ``layer_seconds`` in seconds, the rest in layer-time units); None until measured."""
    link_rates: dict[int, float] = {}
    """Per node: its links' slowdown as measured (1.0 = healthy); empty until measured."""
