"""A job's phase from its worker pods: pure, so every transition is unit-tested without a cluster.

The pod watcher (`handlers.on_pod_event`) lists the job's pods and asks `pods_transition` what
changed: a status patch (a `MalleusJobStatus` holding only what changes) and the events to post.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from malleus.job import MalleusJobStatus, Phase

from .status import READY, TERMINAL_PHASES, condition, merge_conditions, phase_of

__all__ = ["Event", "PodOutcome", "Transition", "pod_outcome", "pods_transition"]

PodState = Literal["Pending", "Running", "Succeeded", "Failed"]


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the job."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Transition:
    """What to do about a job: merge ``status`` into ``.status`` and post ``events``."""

    status: MalleusJobStatus | None = None
    events: list[Event] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.status is not None or bool(self.events)


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
    state: PodState
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


def _ended(
    phase: Phase, reason: str, message: str, conds: Any, generation: int, at: dt.datetime
) -> MalleusJobStatus:
    return MalleusJobStatus(
        phase=phase,
        message=message,
        conditions=merge_conditions(
            conds, condition(READY, phase == Phase.RUNNING, reason, message, generation, at)
        ),
    )


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
    stored = job_status or {}
    phase = phase_of(stored)
    if phase is None or phase in TERMINAL_PHASES:
        return Transition()
    by_name = {p.get("metadata", {}).get("name"): pod_outcome(p) for p in pods}
    conds = stored.get("conditions") or []
    failed = [o for n, o in by_name.items() if n in expected and o.state == "Failed"]
    failed += [PodOutcome(n, "Failed", "pod was deleted") for n in deleted if n in expected]
    if failed:
        message = "; ".join(f"{o.name}: {o.detail}" for o in failed)
        return Transition(
            status=_ended(Phase.FAILED, "PodFailed", message, conds, generation, at),
            events=[Event("Warning", "PodFailed", f"{o.name}: {o.detail}") for o in failed],
        )
    states = [by_name[n].state if n in by_name else "Missing" for n in expected]
    if expected and all(s == "Succeeded" for s in states):
        msg = f"all {len(expected)} worker pod(s) completed"
        return Transition(
            status=_ended(Phase.SUCCEEDED, "Completed", msg, conds, generation, at),
            events=[Event("Normal", "Succeeded", msg)],
        )
    if expected and all(s in ("Running", "Succeeded") for s in states):
        if phase != Phase.PENDING:
            return Transition()
        msg = f"all {len(expected)} worker pod(s) running"
        return Transition(
            status=_ended(Phase.RUNNING, "Running", msg, conds, generation, at),
            events=[Event("Normal", "Running", msg)],
        )
    if phase != Phase.PENDING:
        return Transition()  # a running job with a pod not yet "Running" again: wait for failure
    # Some worker still pending: surface why (image pull, config errors) in the condition.
    stuck = [by_name[n] for n in expected if n in by_name and by_name[n].detail]
    running = sum(s == "Running" for s in states)
    msg = f"{running}/{len(expected)} worker pod(s) running"
    if stuck:
        msg += "; " + "; ".join(f"{o.name}: {o.detail}" for o in stuck)
    old = next((c for c in conds if c.get("type") == READY), None)
    if old is not None and old.get("message") == msg and old.get("reason") == "PodsPending":
        return Transition()
    return Transition(
        status=MalleusJobStatus(
            conditions=merge_conditions(
                conds, condition(READY, False, "PodsPending", msg, generation, at)
            )
        )
    )
