"""Pure status computations: conditions, phases, plan summaries, stragglers, pod outcomes.

Everything here maps plain data (a job's status dict, pod dicts, a Plan, rates) to a status
*patch* (a dict merged into ``.status``) and the events to post, so the handlers and the daemon
stay thin and every transition is unit-tested without a cluster.

Conditions follow ``metav1.Condition``: one per type, ``lastTransitionTime`` kept unless the
status flips, ``observedGeneration`` set to the spec generation the operator acted on. Types:

- ``Ready``: True while every worker runs (reason ``Running``); False with ``InvalidSpec``,
  ``PodsPending``, ``PodFailed`` or ``Completed``.
- ``Straggling``: True when some GPU's rate is at or above the policy threshold.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from malleus.planner.plan import Plan

__all__ = [
    "ACTIVE_PHASES",
    "TERMINAL_PHASES",
    "Event",
    "PodOutcome",
    "Transition",
    "condition",
    "created_status",
    "invalid_spec_status",
    "merge_conditions",
    "now",
    "phase_of",
    "plan_from_status",
    "plan_status",
    "pod_outcome",
    "pods_transition",
    "replan_status",
    "rfc3339",
    "straggler_status",
    "straggling_condition",
]

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
ACTIVE_PHASES = frozenset({"Pending", "Planning", "Running", "Replanning"})
READY = "Ready"
STRAGGLING = "Straggling"


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def rfc3339(t: dt.datetime) -> str:
    """Seconds-precision UTC timestamp, as metav1.Time serialises."""
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the job."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Transition:
    """What to do about a job: merge ``status`` into ``.status`` and post ``events``."""

    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.status or self.events)


# ---- conditions -----------------------------------------------------------------------------


def condition(
    type_: str,
    status: bool | str,
    reason: str,
    message: str,
    generation: int,
    at: dt.datetime,
) -> dict[str, Any]:
    """A ``metav1.Condition`` dict."""
    if isinstance(status, bool):
        status = "True" if status else "False"
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "observedGeneration": generation,
        "lastTransitionTime": rfc3339(at),
    }


def merge_conditions(
    existing: Iterable[Mapping[str, Any]] | None, *updates: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Replace conditions by type, keeping ``lastTransitionTime`` when the status is unchanged.

    The whole list is returned because a merge patch replaces lists wholesale.
    """
    result = [dict(c) for c in (existing or [])]
    for new in updates:
        new = dict(new)
        for i, old in enumerate(result):
            if old.get("type") == new["type"]:
                if old.get("status") == new["status"] and old.get("lastTransitionTime"):
                    new["lastTransitionTime"] = old["lastTransitionTime"]
                result[i] = new
                break
        else:
            result.append(new)
    return result


def phase_of(status: Mapping[str, Any] | None) -> str | None:
    return (status or {}).get("phase")


# ---- plan and stragglers --------------------------------------------------------------------


def plan_status(plan: Plan) -> dict[str, Any]:
    """The plan as shown in ``.status.plan`` (camelCase; estimate folded into two numbers)."""
    out: dict[str, Any] = {
        "generation": plan.generation,
        "tp": plan.tp,
        "pipelines": [
            {
                "microBatches": p.micro_batches,
                "stages": [{"ranks": list(s.ranks), "layers": list(s.layers)} for s in p.stages],
            }
            for p in plan.pipelines
        ],
        "excluded": sorted(plan.excluded),
    }
    est = plan.estimate
    if est is not None:
        out["predictedStepTime"] = round(est.step_time, 4)
        if est.uniform_step_time is not None and est.step_time > 0:
            uniform = est.uniform_step_time
            if math.isfinite(uniform):
                out["predictedSpeedup"] = round(uniform / est.step_time, 4)
    return out


def straggler_status(
    rates: Mapping[int, float | None], threshold: float, gpus_per_node: int
) -> dict[str, Any]:
    """``stragglers`` (rate >= threshold, or unusable) and the short ``stragglerSummary``.

    Worst first, so the printer column shows what matters: ``"2 (r1 3.0x, r6 2.0x)"``.
    """

    def badness(item: tuple[int, float | None]) -> tuple[float, int]:
        rank, rate = item
        return (-(math.inf if rate is None else rate), rank)

    slow = sorted(((r, v) for r, v in rates.items() if v is None or v >= threshold), key=badness)
    stragglers: list[dict[str, Any]] = []
    for rank, rate in slow:
        entry: dict[str, Any] = {"rank": rank, "node": rank // gpus_per_node}
        if rate is not None:
            entry["rate"] = round(rate, 3)
        stragglers.append(entry)
    if not slow:
        summary = "0"
    else:
        shown = ", ".join(f"r{r} {'down' if v is None else f'{v:.1f}x'}" for r, v in slow[:4])
        more = ", ..." if len(slow) > 4 else ""
        summary = f"{len(slow)} ({shown}{more})"
    return {"stragglers": stragglers, "stragglerSummary": summary}


def straggling_condition(
    rates: Mapping[int, float | None], threshold: float, generation: int, at: dt.datetime
) -> dict[str, Any]:
    slow = sorted(r for r, v in rates.items() if v is None or v >= threshold)
    if slow:
        return condition(
            STRAGGLING,
            True,
            "StragglersDetected",
            f"{len(slow)} GPU(s) at or above rate {threshold}: ranks {slow}",
            generation,
            at,
        )
    return condition(STRAGGLING, False, "NoStragglers", "every GPU is healthy", generation, at)


# ---- create / invalid ------------------------------------------------------------------------


def invalid_spec_status(
    message: str, generation: int, at: dt.datetime, existing: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """``Failed`` with ``Ready=False/InvalidSpec``: nothing was created."""
    return {
        "phase": "Failed",
        "observedGeneration": generation,
        "message": message,
        "conditions": merge_conditions(
            existing, condition(READY, False, "InvalidSpec", message, generation, at)
        ),
    }


def created_status(
    plan: Plan,
    pods: Sequence[str],
    gpus: int,
    generation: int,
    at: dt.datetime,
    existing: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """``Pending`` right after the children were created, with the initial plan."""
    return {
        "phase": "Pending",
        "observedGeneration": generation,
        "plan": plan_status(plan),
        "pods": list(pods),
        "gpus": gpus,
        "step": 0,
        "stragglers": [],
        "stragglerSummary": "0",
        "message": f"created {len(pods)} worker pod(s); waiting for them to run",
        "conditions": merge_conditions(
            existing,
            condition(READY, False, "PodsPending", "worker pods are starting", generation, at),
        ),
    }


def replan_status(
    plan: Plan,
    *,
    reason: str,
    at: dt.datetime,
    planning_seconds: float | None,
    migration_seconds: float | None,
    migration_bytes: int | None,
) -> dict[str, Any]:
    """``plan`` and ``lastReplan`` after a plan was applied by the trainers."""
    last: dict[str, Any] = {"time": rfc3339(at), "reason": reason, "generation": plan.generation}
    if planning_seconds is not None:
        last["planningSeconds"] = round(planning_seconds, 4)
    if migration_seconds is not None:
        last["migrationSeconds"] = round(migration_seconds, 4)
    if migration_bytes is not None:
        last["migrationBytes"] = int(migration_bytes)
    return {"plan": plan_status(plan), "lastReplan": last}


# ---- pods -----------------------------------------------------------------------------------

_STUCK_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)


@dataclass(frozen=True)
class PodOutcome:
    """One worker pod's state as the job sees it: running, pending, succeeded or failed."""

    name: str
    state: str  # Pending | Running | Succeeded | Failed
    detail: str = ""


def pod_outcome(pod: Mapping[str, Any]) -> PodOutcome:
    """Classify a pod: Failed on phase Failed or any container terminated non-zero.

    A container that exited non-zero fails the pod even before the kubelet moves the phase,
    because with torchrun one dead rank means the others will block in a collective.
    """
    name = pod.get("metadata", {}).get("name", "?")
    st = pod.get("status") or {}
    phase = st.get("phase") or "Pending"
    for cs in st.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and int(term.get("exitCode", 0)) != 0:
            why = term.get("reason") or "Error"
            msg = term.get("message")
            detail = f"container {cs.get('name')} exited with code {term['exitCode']} ({why})"
            return PodOutcome(name, "Failed", detail + (f": {msg}" if msg else ""))
    if phase == "Failed":
        reason = st.get("reason") or "Failed"
        return PodOutcome(
            name, "Failed", f"pod failed ({reason}): {st.get('message', '')}".rstrip(": ")
        )
    if phase in ("Running", "Succeeded"):
        return PodOutcome(name, phase)
    for cs in st.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") in _STUCK_WAITING:
            return PodOutcome(name, "Pending", f"{waiting['reason']}: {waiting.get('message', '')}")
    return PodOutcome(name, "Pending")


def pods_transition(
    job_status: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    expected: Sequence[str],
    generation: int,
    at: dt.datetime,
    *,
    deleted: Sequence[str] = (),
) -> Transition:
    """The job's phase from its workers' states; empty when nothing changes.

    - any worker failed (or was deleted under a live job) -> ``Failed``/``PodFailed``: the job
      has no restart policy (a worker cannot rejoin a running process group); the other pods are
      kept for their logs and the user decides (delete the job, or re-create it from a
      checkpoint);
    - every worker succeeded -> ``Succeeded``;
    - every worker running -> ``Running`` (from ``Pending``);
    - terminal phases never change.
    """
    status = job_status or {}
    phase = status.get("phase")
    if phase in TERMINAL_PHASES or phase is None:
        return Transition()
    by_name = {p.get("metadata", {}).get("name"): pod_outcome(p) for p in pods}
    conds = status.get("conditions") or []
    failed = [o for n, o in by_name.items() if n in expected and o.state == "Failed"]
    failed += [PodOutcome(n, "Failed", "pod was deleted") for n in deleted if n in expected]
    if failed:
        first = failed[0]
        message = "; ".join(f"{o.name}: {o.detail}" for o in failed)
        return Transition(
            status={
                "phase": "Failed",
                "message": message,
                "conditions": merge_conditions(
                    conds, condition(READY, False, "PodFailed", message, generation, at)
                ),
            },
            events=[Event("Warning", "PodFailed", f"{first.name}: {first.detail}")]
            + [Event("Warning", "PodFailed", f"{o.name}: {o.detail}") for o in failed[1:]],
        )
    states = [by_name[n].state if n in by_name else "Missing" for n in expected]
    if expected and all(s == "Succeeded" for s in states):
        msg = f"all {len(expected)} worker pod(s) completed"
        return Transition(
            status={
                "phase": "Succeeded",
                "message": msg,
                "conditions": merge_conditions(
                    conds, condition(READY, False, "Completed", msg, generation, at)
                ),
            },
            events=[Event("Normal", "Succeeded", msg)],
        )
    if expected and all(s in ("Running", "Succeeded") for s in states):
        if phase == "Pending":
            msg = f"all {len(expected)} worker pod(s) running"
            return Transition(
                status={
                    "phase": "Running",
                    "message": msg,
                    "conditions": merge_conditions(
                        conds, condition(READY, True, "Running", msg, generation, at)
                    ),
                },
                events=[Event("Normal", "Running", msg)],
            )
        return Transition()
    # Some worker still pending: surface why (image pull, config errors) in the condition.
    stuck = [by_name[n] for n in expected if n in by_name and by_name[n].detail]
    running = sum(s == "Running" for s in states)
    msg = f"{running}/{len(expected)} worker pod(s) running"
    if stuck:
        msg += "; " + "; ".join(f"{o.name}: {o.detail}" for o in stuck)
    old = next((c for c in conds if c.get("type") == READY), None)
    if old is not None and old.get("message") == msg and old.get("reason") == "PodsPending":
        return Transition()
    if phase not in ("Pending",):
        return Transition()  # a running job with a pod not yet "Running" again: wait for failure
    return Transition(
        status={
            "conditions": merge_conditions(
                conds, condition(READY, False, "PodsPending", msg, generation, at)
            )
        }
    )


def plan_from_status(plan: Mapping[str, Any] | None) -> Plan | None:
    """The Plan shown in ``.status.plan`` (the inverse of `plan_status`, estimate aside)."""
    if not plan or not plan.get("pipelines"):
        return None
    try:
        return Plan.model_validate(
            {
                "generation": int(plan.get("generation") or 0),
                "tp": int(plan["tp"]),
                "pipelines": [
                    {
                        "micro_batches": p["microBatches"],
                        "stages": [
                            {"ranks": s["ranks"], "layers": tuple(s["layers"])}
                            for s in p.get("stages", [])
                        ],
                    }
                    for p in plan["pipelines"]
                ],
                "excluded": list(plan.get("excluded") or []),
            }
        )
    except (KeyError, TypeError, ValueError):
        return None
