"""Pure status computations: conditions, plan summaries, stragglers, and the status patches.

Every status the operator writes is a `malleus.job.MalleusJobStatus` (typed, kept equal to the
CRD's status schema by a test) holding only the fields it changes, dumped by `dump` into the
merge patch sent to the status subresource. The handlers and the daemon stay thin and every
builder is unit-tested without a cluster.

Conditions follow ``metav1.Condition``: one per type, ``lastTransitionTime`` kept unless the
status flips, ``observedGeneration`` set to the spec generation the operator acted on. Types:

- ``Ready``: True while every worker runs (reason ``Running``); False with ``InvalidSpec``,
  ``PolicyViolation`` (the pod template breaks the admin's policy: no pods),
  ``NameConflict`` (an object of a child's name is someone else's), ``PodsPending``,
  ``PodFailed`` or ``Completed``.
- ``Straggling``: True when some GPU is a straggler by the job's policy.
- ``Degraded``: True while a failed worker waits for its replacement or stays out, or the
  trainers leave GPUs out (`failures.degraded_condition`); False (``AllGpusIn``) otherwise.
- ``Succeeded`` / ``Failed``: set True, once, when the job ends (``kubectl wait
  --for=condition=Succeeded mj/NAME``), with the reason (``Completed``; ``InvalidSpec``,
  ``PolicyViolation``, ``BadInput`` (a trainer refused the job's files), ``NoValidPlan``,
  ``NoWorkersLeft``, ``DeadlineExceeded``); ``completionTime`` is set with them.
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
    PlanStatus,
    StragglerPolicy,
    StragglerStatus,
)
from malleus.planner.plan import Plan

__all__ = [
    "ACTIVE_PHASES",
    "FAILED",
    "POLICY_VIOLATION",
    "READY",
    "STRAGGLING",
    "SUCCEEDED",
    "TERMINAL_PHASES",
    "condition",
    "created_status",
    "dump",
    "finished_status",
    "invalid_spec_message",
    "invalid_spec_status",
    "merge_conditions",
    "name_conflict_status",
    "now",
    "phase_of",
    "plan_status",
    "plan_summary",
    "policy_violation_message",
    "policy_violation_status",
    "replan_status",
    "stragglers",
    "straggling_condition",
]

TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})
ACTIVE_PHASES = frozenset({Phase.PENDING, Phase.RUNNING, Phase.REPLANNING})
READY = "Ready"
STRAGGLING = "Straggling"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
"""The terminal condition types, named like the phases they end in."""
POLICY_VIOLATION = "PolicyViolation"
"""The reason (``Ready=False``, and ``Failed`` at creation) and the Warning event of a job whose
``spec.podTemplate`` breaks the operator's pod template policy: no pod is created."""
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


def _counts(values: Sequence[int], unit: str) -> str:
    """``4,4,3 stages``, or run-length ``8x60,7x4 stages`` past six values (a 70B job's 64
    pipelines must still fit on one line)."""
    if max(values, default=0) <= 1:
        unit = unit.removesuffix("s")
    if len(values) <= 6:
        return f"{','.join(map(str, values))} {unit}"
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return ",".join(f"{v}x{n}" if n > 1 else str(v) for v, n in runs) + f" {unit}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def plan_summary(plan: Plan) -> str:
    """The plan in one line: ``3 pipelines [4,4,3 stages] tp 8/4, 2 GPUs out, 1.84x vs static``.

    Pipelines by their stage counts (most first), the tensor-parallel widths of the stages
    (a stage narrower than ``tp`` works around an excluded or slow GPU), the GPUs left idle and
    the predicted speedup over the uniform (static) layout; ``kubectl describe`` shows it
    where the whole plan (``plan.json`` in the ConfigMap) would take lines per stage.
    """
    stages = sorted((len(p.stages) for p in plan.pipelines), reverse=True)
    widths = sorted({len(s.ranks) for p in plan.pipelines for s in p.stages}, reverse=True)
    text = f"{_plural(len(stages), 'pipeline')} [{_counts(stages, 'stages')}]"
    text += f" tp {'/'.join(map(str, widths or [plan.tp]))}"
    if plan.excluded:
        text += f", {_plural(len(plan.excluded), 'GPU')} out"
    speedup = plan_speedup(plan)
    if speedup is not None:
        text += f", {speedup:.2f}x vs static"
    return text[:256]


def plan_speedup(plan: Plan) -> float | None:
    """Predicted step time of the uniform layout over this plan's (None without an estimate)."""
    est = plan.estimate
    if est is None or est.uniform_step_time is None or est.step_time <= 0:
        return None
    uniform = est.uniform_step_time
    return round(uniform / est.step_time, 4) if math.isfinite(uniform) else None


def plan_status(plan: Plan) -> PlanStatus:
    """The plan as shown in ``.status.plan``: generation, summary, degrees, excluded ranks and
    the estimate folded into two numbers. Not the stages: the whole plan is ``plan.json`` in
    the ConfigMap, which a restarted operator reads back (`planstore`)."""
    status = PlanStatus(
        generation=plan.generation,
        summary=plan_summary(plan),
        tp=plan.tp,
        dp=plan.dp,
        excluded=sorted(plan.excluded),
    )
    if plan.estimate is not None:
        status.predicted_step_time = round(plan.estimate.step_time, 4)
        status.predicted_speedup = plan_speedup(plan)
    return status


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
    failed = finished_status(Phase.FAILED, "InvalidSpec", message, generation, at, existing)
    failed.observed_generation = generation
    return failed


def policy_violation_message(faults: Sequence[Fault]) -> str:
    """One line per fault, ``path: message`` (each names the chart value that would allow it)."""
    return "pod template policy: no pods created: " + "; ".join(str(f) for f in faults)


def policy_violation_status(
    faults: Sequence[Fault],
    generation: int,
    at: dt.datetime,
    existing: Iterable[Mapping[str, Any] | Condition] | None = (),
    *,
    fail: bool,
) -> MalleusJobStatus:
    """``Ready=False/PolicyViolation`` naming the faults. ``fail`` (at creation: nothing was
    created): phase ``Failed`` with ``Failed=True`` too, like InvalidSpec; otherwise (a resume
    or a replacement refused, the policy having changed since) the phase stays, the pods are
    not created, and the job waits for its spec or the policy to change."""
    message = policy_violation_message(faults)
    if fail:
        failed = finished_status(Phase.FAILED, POLICY_VIOLATION, message, generation, at, existing)
        failed.observed_generation = generation
        return failed
    return MalleusJobStatus(
        message=message,
        conditions=merge_conditions(
            existing, condition(READY, False, POLICY_VIOLATION, message, generation, at)
        ),
    )


def finished_status(
    phase: Phase,
    reason: str,
    message: str,
    generation: int,
    at: dt.datetime,
    existing: Iterable[Mapping[str, Any] | Condition] | None = (),
) -> MalleusJobStatus:
    """The job ended (``phase`` Succeeded or Failed): ``Ready=False`` and the terminal condition
    of that name True, both with ``reason``, and ``completionTime`` (the TTL counts from it)."""
    terminal = SUCCEEDED if phase == Phase.SUCCEEDED else FAILED
    return MalleusJobStatus(
        phase=phase,
        message=message,
        completion_time=at,
        conditions=merge_conditions(
            existing,
            condition(READY, False, reason, message, generation, at),
            condition(terminal, True, reason, message, generation, at),
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
        start_time=at,
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
