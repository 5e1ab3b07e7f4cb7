"""The MalleusJob status as typed models: what the operator writes, built from these alone.

A test keeps every field equal to the CRD's status schema, so a status built here is one the API
server stores as written (nothing pruned).
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from .schema import API_VERSION, KIND
from .spec import FailureAction, FailureCause, JobMetadata, MalleusJobSpec, StrictModel

__all__ = [
    "Condition",
    "ConditionStatus",
    "FailureState",
    "GpuOut",
    "LastRecovery",
    "LastReplan",
    "MalleusJob",
    "MalleusJobStatus",
    "NodeFailure",
    "Phase",
    "PlanStatus",
    "StragglerStatus",
]

ConditionStatus = Literal["True", "False", "Unknown"]


class Phase(StrEnum):
    """``status.phase``: where a job is in its life (the CRD's enum; a test keeps them equal)."""

    PENDING = "Pending"
    """Accepted; the first plan is being computed and the pods are being created."""
    RUNNING = "Running"
    """Training under the plan in force."""
    REPLANNING = "Replanning"
    """A new plan was published; the trainers have not yet acknowledged the switch."""
    SUSPENDED = "Suspended"
    """``spec.suspend`` is true: no pods (the Service, ConfigMap and Secret stay)."""
    SUCCEEDED = "Succeeded"
    """Every step trained."""
    FAILED = "Failed"
    """Stopped for good: an invalid spec, no valid plan on the GPUs left, no worker left, a
    deadline (the conditions say which). A failed pod alone is a recovery, not this."""


class Condition(StrictModel):
    """``metav1.Condition``."""

    type: str
    status: ConditionStatus
    observed_generation: int | None = None
    last_transition_time: dt.datetime
    reason: str
    message: str


class PlanStatus(StrictModel):
    """The plan in force, in brief: the whole plan is ``plan.json`` in the job's ConfigMap
    (hundreds of stages would make ``kubectl describe`` hundreds of lines)."""

    generation: int | None = None
    summary: str | None = None
    """The plan in one line (``kubectl get mj -o wide``); the whole plan is in the ConfigMap."""
    tp: int | None = None
    dp: int | None = None
    excluded: list[int] = Field(default_factory=list)
    predicted_speedup: float | None = None
    predicted_step_time: float | None = None


class StragglerStatus(StrictModel):
    """A straggling GPU."""

    rank: int
    node: int | None = None
    rate: float | None = None


class LastReplan(StrictModel):
    """The most recent re-plan and its migration."""

    time: dt.datetime | None = None
    reason: str | None = None
    planning_seconds: float | None = None
    migration_seconds: float | None = None
    migration_bytes: int | None = None
    generation: int | None = None


FailureState = Literal["Waiting", "Replaced", "Out"]
"""A failed node's state: ``Waiting`` out its backoff for a replacement pod, ``Replaced`` (the
replacement was created), ``Out`` (past ``spec.failurePolicy.maxRestarts``: not replaced)."""


class NodeFailure(StrictModel):
    """A node whose worker pod failed, and what the operator did about it (one per node)."""

    node: int
    pod: str
    failures: int
    """Failures of this node's pod so far (each pod counted once, by its uid)."""
    restarts: int = 0
    """Replacement pods created for this node so far."""
    state: FailureState
    reason: str
    """Why the last pod failed: ``Error``, ``OOMKilled``, ``Evicted``, ``Deleted``, ``LeftOut``..."""
    message: str = ""
    time: dt.datetime
    """When the last failure was seen."""
    pod_uid: str | None = None
    """The uid of the pod whose failure is recorded (a pod fails once, however often it is seen)."""
    replace_at: dt.datetime | None = None
    """When the replacement is due (state ``Waiting``)."""
    cause: FailureCause | None = None
    """The last failure's cause (`malleus.job.spec.FailureCause`)."""
    rule: str | None = None
    """The ``spec.failurePolicy.rules`` entry (or built-in rule) that decided the last failure;
    unset: none matched (counted, ``RestartWorker``)."""
    action: FailureAction | None = None
    """What the last failure did (``FailJob`` fails the job)."""
    counted: int = 0
    """Failures counted against ``maxRestarts`` since the node's counters were last reset
    (``Ignore``-d ones are not)."""
    causes: dict[str, int] = Field(default_factory=dict)
    """Failures by cause since the last reset, counted or not."""
    rule_counts: dict[str, int] = Field(default_factory=dict)
    """Failures each ``RestartWorker`` rule counted since the last reset (its ``maxRestarts``)."""
    replaced_at: dt.datetime | None = None
    """When the node's latest replacement pod was created: its healthy time runs from here
    (``resetAfterSeconds``)."""

    @model_validator(mode="before")
    @classmethod
    def _counted_before_rules(cls, value: Any) -> Any:
        # A record written before failures were counted by cause counted every one of them.
        if isinstance(value, dict) and "counted" not in value and "failures" in value:
            return {**value, "counted": value["failures"]}
        return value


class GpuOut(StrictModel):
    """A GPU out of the job, and why."""

    gpu: int
    node: int | None = None
    reason: str
    source: Literal["trainers", "pod"] = "trainers"
    """Who says so: the trainers' coordinator (``/status`` ``out``), or the operator from a
    failed pod not yet back."""


class LastRecovery(StrictModel):
    """The latest recovery from failed GPUs, as the trainers' coordinator measured it."""

    epoch: int
    time: dt.datetime | None = None
    failed: list[int] = Field(default_factory=list)
    step: int | None = None
    steps_lost: int | None = None
    seconds: float | None = None
    bytes_restored: int | None = None
    mode: Literal["replicas", "checkpoint"] | None = None
    generation: int | None = None


class MalleusJobStatus(StrictModel):
    """``status`` of a MalleusJob, written by the operator."""

    phase: Phase | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    plan: PlanStatus | None = None
    stragglers: list[StragglerStatus] = Field(default_factory=list)
    straggler_summary: str | None = None
    gpus: int | None = None
    step: int | None = None
    tokens_per_second: float | None = None
    last_replan: LastReplan | None = None
    failures: list[NodeFailure] | None = None
    """Nodes whose pod failed: restarts, the last reason, the replacement's state."""
    gpus_out: list[GpuOut] | None = None
    """GPUs out of the job, and why (the trainers' word and the failed pods not yet back)."""
    last_recovery: LastRecovery | None = None
    pods: list[str] = Field(default_factory=list)
    start_time: dt.datetime | None = None
    """When the pods were created: ``spec.runPolicy.activeDeadlineSeconds`` counts from it."""
    completion_time: dt.datetime | None = None
    """When the job Succeeded or Failed: ``ttlSecondsAfterFinished`` counts from it."""
    message: str | None = None


class MalleusJob(StrictModel):
    """A whole MalleusJob custom resource."""

    api_version: Literal["malleus.io/v1alpha1"] = API_VERSION
    kind: Literal["MalleusJob"] = KIND
    metadata: JobMetadata
    spec: MalleusJobSpec
    status: MalleusJobStatus | None = None
