"""Pure status computations: conditions, plan summaries, stragglers, and the status patches.

Every status the operator writes is a `malleus.job.MalleusJobStatus` (typed, kept equal to the
CRD's status schema by a test) holding only the fields it changes, dumped by `dump` into the
merge patch sent to the status subresource. The handlers and the daemon stay thin and every
builder is unit-tested without a cluster.

Conditions follow ``metav1.Condition``: one per type, ``lastTransitionTime`` kept unless the
status flips, ``observedGeneration`` set to the spec generation the operator acted on. Types:

- ``Ready``: True while every worker runs (reason ``Running``); False with ``InvalidSpec``,
  ``NameConflict`` (an object of a child's name is someone else's), ``PodsPending``,
  ``PodFailed`` or ``Completed``.
- ``Straggling``: True when some GPU is a straggler by the job's policy.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from malleus.errors import Fault
from malleus.job import (
    Condition,
    LastReplan,
    MalleusJobStatus,
    Phase,
    PipelineStatus,
    PlanStatus,
    StageStatus,
    StragglerPolicy,
    StragglerStatus,
)
from malleus.planner.plan import Plan

__all__ = [
    "ACTIVE_PHASES",
    "READY",
    "STRAGGLING",
    "TERMINAL_PHASES",
    "condition",
    "created_status",
    "dump",
    "invalid_spec_message",
    "invalid_spec_status",
    "merge_conditions",
    "name_conflict_status",
    "now",
    "phase_of",
    "plan_from_status",
    "plan_status",
    "replan_status",
    "stragglers",
    "straggling_condition",
]

TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})
ACTIVE_PHASES = frozenset({Phase.PENDING, Phase.RUNNING, Phase.REPLANNING})
READY = "Ready"
STRAGGLING = "Straggling"
_MESSAGE_LIMIT = 32768
"""metav1.Condition's message limit."""


def now() -> dt.datetime:
    """UTC now, to the second: what metav1.Time keeps (so equal times compare equal)."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def dump(status: MalleusJobStatus) -> dict[str, Any]:
    """The merge patch of ``status``: only the fields it sets, camelCase, JSON-ready."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=True)


def phase_of(status: Mapping[str, Any] | None) -> Phase | None:
    """The phase of a stored status (None before the operator wrote one)."""
    raw = (status or {}).get("phase")
    return Phase(raw) if raw else None


# ---- conditions -----------------------------------------------------------------------------


def condition(
    type_: str, status: bool, reason: str, message: str, generation: int, at: dt.datetime
) -> Condition:
    """A ``metav1.Condition``."""
    return Condition(
        type=type_,
        status="True" if status else "False",
        reason=reason,
        message=message[:_MESSAGE_LIMIT],
        observed_generation=generation,
        last_transition_time=at,
    )


def merge_conditions(
    existing: Iterable[Mapping[str, Any] | Condition] | None, *updates: Condition
) -> list[Condition]:
    """Replace conditions by type, keeping ``lastTransitionTime`` when the status is unchanged.

    The whole list is returned because a merge patch replaces lists wholesale. Stored entries
    that are not conditions (written by someone else) are dropped rather than failing the job.
    """
    result: list[Condition] = []
    for old in existing or []:
        try:
            result.append(old if isinstance(old, Condition) else Condition.model_validate(old))
        except ValidationError:
            continue
    for new in updates:
        for i, old in enumerate(result):
            if old.type == new.type:
                if old.status == new.status:
                    new = new.model_copy(update={"last_transition_time": old.last_transition_time})
                result[i] = new
                break
        else:
            result.append(new)
    return result


# ---- plan and stragglers --------------------------------------------------------------------


def plan_status(plan: Plan) -> PlanStatus:
    """The plan as shown in ``.status.plan`` (its estimate folded into two numbers)."""
    status = PlanStatus(
        generation=plan.generation,
        tp=plan.tp,
        pipelines=[
            PipelineStatus(
                micro_batches=p.micro_batches,
                stages=[StageStatus(ranks=list(s.ranks), layers=s.layers) for s in p.stages],
            )
            for p in plan.pipelines
        ],
        excluded=sorted(plan.excluded),
    )
    est = plan.estimate
    if est is not None:
        status.predicted_step_time = round(est.step_time, 4)
        uniform = est.uniform_step_time
        if uniform is not None and est.step_time > 0 and math.isfinite(uniform):
            status.predicted_speedup = round(uniform / est.step_time, 4)
    return status


def plan_from_status(plan: Mapping[str, Any] | None) -> Plan | None:
    """The Plan shown in ``.status.plan`` (the inverse of `plan_status`, estimate aside)."""
    if not plan:
        return None
    try:
        shown = PlanStatus.model_validate(plan)
    except ValidationError:
        return None
    if not shown.pipelines or shown.tp is None:
        return None
    return Plan.model_validate(
        {
            "generation": shown.generation or 0,
            "tp": shown.tp,
            "pipelines": [
                {
                    "micro_batches": p.micro_batches,
                    "stages": [{"ranks": s.ranks, "layers": s.layers} for s in p.stages],
                }
                for p in shown.pipelines
            ],
            "excluded": shown.excluded,
        }
    )


def _slow(
    rates: Mapping[int, float | None], policy: StragglerPolicy
) -> list[tuple[int, float | None]]:
    """The stragglers among ``rates``, worst first (failed ones before any rate)."""

    def badness(item: tuple[int, float | None]) -> tuple[float, int]:
        rank, rate = item
        return (-(math.inf if rate is None else rate), rank)

    return sorted(((r, v) for r, v in rates.items() if policy.is_straggler(v)), key=badness)


def stragglers(
    rates: Mapping[int, float | None], policy: StragglerPolicy, gpus_per_node: int
) -> MalleusJobStatus:
    """``stragglers`` and the short ``stragglerSummary`` (``"2 (r1 3.0x, r6 down)"``).

    Worst first, so the printer column shows what matters.
    """
    slow = _slow(rates, policy)
    entries = [
        StragglerStatus(
            rank=rank, node=rank // gpus_per_node, rate=None if rate is None else round(rate, 3)
        )
        for rank, rate in slow
    ]
    if not slow:
        summary = "0"
    else:
        shown = ", ".join(f"r{r} {'down' if v is None else f'{v:.1f}x'}" for r, v in slow[:4])
        more = ", ..." if len(slow) > 4 else ""
        summary = f"{len(slow)} ({shown}{more})"
    return MalleusJobStatus(stragglers=entries, straggler_summary=summary)


def straggling_condition(
    rates: Mapping[int, float | None], policy: StragglerPolicy, generation: int, at: dt.datetime
) -> Condition:
    slow = sorted(r for r, _ in _slow(rates, policy))
    if slow:
        return condition(
            STRAGGLING,
            True,
            "StragglersDetected",
            f"{len(slow)} GPU(s) at or above rate {policy.threshold}: ranks {slow}",
            generation,
            at,
        )
    return condition(STRAGGLING, False, "NoStragglers", "every GPU is healthy", generation, at)


# ---- create / invalid / re-plan -------------------------------------------------------------


def invalid_spec_message(faults: Sequence[Fault]) -> str:
    """One line per fault, ``path: message``: the condition's, the event's and the status's."""
    return "invalid spec: " + "; ".join(str(f) for f in faults)


def invalid_spec_status(
    faults: Sequence[Fault],
    generation: int,
    at: dt.datetime,
    existing: Sequence[Mapping[str, Any]] = (),
) -> MalleusJobStatus:
    """``Failed`` with ``Ready=False/InvalidSpec``: nothing was created."""
    message = invalid_spec_message(faults)
    return MalleusJobStatus(
        phase=Phase.FAILED,
        observed_generation=generation,
        message=message,
        conditions=merge_conditions(
            existing, condition(READY, False, "InvalidSpec", message, generation, at)
        ),
    )


def name_conflict_status(
    message: str,
    generation: int,
    at: dt.datetime,
    existing: Sequence[Mapping[str, Any]] = (),
) -> MalleusJobStatus:
    """``Ready=False/NameConflict``: a child's name is taken by an object the job does not own.

    No phase: the job is not started (no daemon, no pod watching) until the name is free.
    """
    return MalleusJobStatus(
        observed_generation=generation,
        message=message,
        conditions=merge_conditions(
            existing, condition(READY, False, "NameConflict", message, generation, at)
        ),
    )


def created_status(
    plan: Plan,
    pods: Sequence[str],
    gpus: int,
    generation: int,
    at: dt.datetime,
    existing: Sequence[Mapping[str, Any]] = (),
) -> MalleusJobStatus:
    """``Pending`` right after the children were created, with the initial plan."""
    return MalleusJobStatus(
        phase=Phase.PENDING,
        observed_generation=generation,
        plan=plan_status(plan),
        pods=list(pods),
        gpus=gpus,
        step=0,
        stragglers=[],
        straggler_summary="0",
        message=f"created {len(pods)} worker pod(s); waiting for them to run",
        conditions=merge_conditions(
            existing,
            condition(READY, False, "PodsPending", "worker pods are starting", generation, at),
        ),
    )


def replan_status(plan: Plan, last: LastReplan) -> MalleusJobStatus:
    """``plan`` and ``lastReplan`` after a plan was applied by the trainers."""
    return MalleusJobStatus(plan=plan_status(plan), last_replan=last)
