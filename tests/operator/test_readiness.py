"""`readiness`: Ready=True is the trainers' word (every rank trains), and a store pod that
cannot run shows in Ready with its reason and one Warning event (pure functions; the real
control plane proves it end to end in tests/e2e)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from malleus.control import ControlStatus
from malleus.operator import failures, lifecycle, readiness

T0 = dt.datetime(2025, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
PODS = ["demo-node-0", "demo-node-1"]


def answer(step: int, rates: dict[int, float | None], **extra: Any) -> ControlStatus:
    fields: dict[str, Any] = {
        "job": "demo", "world": 4, "generation": 1, "pending_generation": None,
        "step": step, "steps": 100, "done": False, "stopping": False, "rates": rates,
        "step_seconds": 0.5 if step else None, "tokens_per_second": None,
        "last_migration": None, "last_failure": None,
    }  # fmt: skip
    return ControlStatus(**{**fields, **extra})


def test_ready_only_once_every_rank_trains() -> None:
    starting = [{"type": "Ready", "status": "False", "reason": readiness.STARTING}]
    assert readiness.ready_when_training(starting, answer(0, {}), 4, 1, T0) is None
    some = answer(3, {0: 1.0, 1: 1.0, 2: None, 3: 1.0})  # rank 2 has no figure yet
    assert readiness.ready_when_training(starting, some, 4, 1, T0) is None
    every = answer(3, {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.9})
    ready = readiness.ready_when_training(starting, every, 4, 1, T0)
    assert ready is not None and (ready.status, ready.reason) == ("True", readiness.TRAINING)
    assert ready.message == "every rank (4) is training: step 3"
    # a GPU out of the job is not waited for; an already-true Ready is left alone
    out = answer(3, {0: 1.0, 1: 1.0, 2: None, 3: None}, out={2: "killed", 3: "killed"})
    assert readiness.ready_when_training(starting, out, 4, 1, T0) is not None
    true = [{"type": "Ready", "status": "True", "reason": readiness.TRAINING}]
    assert readiness.ready_when_training(true, every, 4, 1, T0) is None


def unschedulable(name: str) -> dict[str, Any]:
    message = "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False",
                            "reason": "Unschedulable", "message": message}],
        },
    }  # fmt: skip


def running(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Running"}}


def test_a_store_that_cannot_be_scheduled_is_in_ready_and_one_warning() -> None:
    pods = [running(n) for n in PODS] + [unschedulable("demo-store")]
    t = lifecycle.pods_transition({"phase": "Pending", "conditions": []}, pods, PODS, 1, T0)
    assert t.status is not None and t.status.phase == "Running"
    ready = next(c for c in t.status.conditions or [] if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "Unschedulable"), ready
    assert "demo-store: Unschedulable: 0/2 nodes are available" in (ready.message or "")
    assert [(e.type, e.reason) for e in t.events] == [
        ("Normal", "Running"),
        ("Warning", "Unschedulable"),
    ]
    # the same state again: nothing to write, no second event
    stored = {"phase": "Running", "conditions": [ready.model_dump(mode="json", by_alias=True)]}
    again = lifecycle.pods_transition(stored, pods, PODS, 1, T0)
    assert again.status is None and not again.events
    # a running job whose (new) store cannot be scheduled says so, once
    stored = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True",
                                                   "reason": readiness.TRAINING}]}  # fmt: skip
    t = lifecycle.pods_transition(stored, pods, PODS, 1, T0)
    assert [(e.type, e.reason) for e in t.events] == [("Warning", "Unschedulable")]


def test_a_pending_job_names_its_unschedulable_store_beside_its_workers() -> None:
    pods = [unschedulable(n) for n in [*PODS, "demo-store"]]
    t = lifecycle.pods_transition({"phase": "Pending", "conditions": []}, pods, PODS, 1, T0)
    assert t.status is not None
    ready = next(c for c in t.status.conditions or [] if c.type == "Ready")
    assert ready.reason == "Unschedulable" and "demo-store: Unschedulable" in (ready.message or "")
    assert [e.reason for e in t.events].count("Unschedulable") == 3  # one per pod


def test_a_pod_terminating_long_past_its_grace_period_is_stuck() -> None:
    pod = {"metadata": {"deletionTimestamp": "2025-05-01T12:00:00Z"}}
    late = T0 + dt.timedelta(seconds=failures.STUCK_TERMINATING_SECONDS)
    assert not failures.stuck_terminating(pod, T0 + dt.timedelta(seconds=5))
    assert failures.stuck_terminating(pod, late)
    assert not failures.stuck_terminating({"metadata": {}}, late)
