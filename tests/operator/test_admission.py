"""``spec.suspend``: no pods while true; suspending stops the trainers, resuming recreates pods.

`admission.admission_action` is pure; `admission.reconcile` takes the time as an argument, so the
stop grace is crossed by moving the clock, not by waiting. The operator's reactions run against
kmock (`tests/operator/kube.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from typing import Any

import kopf
import pytest

from malleus.job import Phase
from malleus.operator import admission, handlers
from malleus.operator.context import MEMO_KEY, Context
from malleus.operator.resources import JobRef
from tests.operator.kube import Kube

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
SECOND = dt.timedelta(seconds=1)
PODS = ["demo-node-0", "demo-node-1"]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("suspend", "phase", "live", "since", "at", "expected"),
    [
        (True, Phase.RUNNING, 2, None, T0, "suspend"),
        (True, Phase.PENDING, 0, None, T0, "suspend"),
        (True, Phase.SUSPENDED, 2, T0, T0 + 299 * SECOND, None),
        (True, Phase.SUSPENDED, 2, T0, T0 + 300 * SECOND, "delete-pods"),
        (True, Phase.SUSPENDED, 0, T0, T0 + 999 * SECOND, None),
        (False, Phase.SUSPENDED, 1, T0, T0 + SECOND, None),  # never two sets of workers
        (False, Phase.SUSPENDED, 0, T0, T0 + SECOND, "resume"),
        (True, Phase.SUCCEEDED, 2, None, T0, None),
        (True, None, 0, None, T0, None),
        (False, Phase.RUNNING, 2, None, T0, None),
    ],
)
def test_admission_action(
    suspend: bool,
    phase: Phase | None,
    live: int,
    since: dt.datetime | None,
    at: dt.datetime,
    expected: str | None,
) -> None:
    assert admission.admission_action(suspend, phase, live, since, at) == expected


def _set_suspend(kube: Kube, value: bool) -> dict[str, Any]:
    job = kube.job("ml", "demo")
    job["spec"]["suspend"] = value
    job["metadata"]["generation"] += 1
    return kube.put("MalleusJob", job)


def _workers(kube: Kube) -> list[str]:
    """The job's worker pods (its rendezvous store's pod aside)."""
    return sorted(n for k, n in kube.names() if k == "Pod" and n.startswith("demo-node-"))


def _conditions(kube: Kube) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in kube.job("ml", "demo")["status"]["conditions"]}


def _running(kube: Kube, memo: kopf.Memo, body: dict[str, Any]) -> None:
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    for name in PODS:
        kube.set_pod_phase("ml", name, "Running")
    run(handlers.sync_pods(Context.of(memo), "ml", "demo"))
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"


def test_a_job_created_suspended_has_everything_but_pods(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    body = make_job(suspend=True)
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Suspended" and "startTime" not in st
    conds = _conditions(kube)
    assert (conds["Suspended"]["status"], conds["Ready"]["reason"]) == ("True", "Suspended")
    kinds = {k for k, _ in kube.names()}
    assert "Pod" not in kinds and {"Service", "ConfigMap", "Secret"} <= kinds
    assert Context.of(memo).metrics.phases.counts()[Phase.SUSPENDED] == 1

    # Kueue admits it: spec.suspend false -> the pods, phase Pending, the clock starts.
    job = _set_suspend(kube, False)
    ctx = Context.of(memo)
    assert run(admission.reconcile(ctx, job, T0)) == "resume"
    assert _workers(kube) == PODS
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Pending" and st["startTime"] == "2026-03-01T12:00:00Z"
    assert _conditions(kube)["Suspended"]["reason"] == "Resumed"
    assert kube.reasons()[-1] == "Resumed"
    assert run(admission.reconcile(ctx, job, T0 + SECOND)) is None  # once


def test_suspending_a_running_job_that_cannot_be_asked_deletes_its_pods_at_once(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """No pod IP, so no coordinator to ask: nothing would checkpoint; the pods go now."""
    ctx = dataclasses.replace(
        ctx, settings=ctx.settings.with_(endpoint_template="https://{pod_ip}:{port}")
    )
    memo = kopf.Memo({MEMO_KEY: ctx})
    _running(kube, memo, make_job())
    job = _set_suspend(kube, True)
    assert run(admission.reconcile(ctx, job, T0)) == "suspend"
    assert [k for k, _ in kube.names() if k == "Pod"] == []
    assert {k for k, _ in kube.names()} >= {"Service", "ConfigMap", "Secret"}
    assert kube.job("ml", "demo")["status"]["phase"] == "Suspended"
    assert "Suspended" in kube.reasons()
    # The pods' deletion reaches the pod watcher: a suspended job is not failed by it.
    run(handlers.sync_pods(ctx, "ml", "demo", deleted=PODS))
    assert kube.job("ml", "demo")["status"]["phase"] == "Suspended"
    assert "PodFailed" not in kube.reasons()


def test_suspending_asks_the_trainers_to_checkpoint_and_waits_for_them(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[int, bool, int]] = []

    async def ask_stop(
        _ctx: Context, _ref: JobRef, port: int, checkpoint: bool, gpus_per_node: int
    ) -> bool:
        asked.append((port, checkpoint, gpus_per_node))
        return True

    monkeypatch.setattr(admission, "_ask_stop", ask_stop)
    _running(kube, memo, make_job(checkpoint={"intervalSteps": 10}))
    job = _set_suspend(kube, True)
    assert run(admission.reconcile(ctx, job, T0)) == "suspend"
    assert asked == [(8040, True, 4)]
    assert _workers(kube) == PODS  # checkpointing, not killed
    # node 0 exits after its checkpoint: deleted at the next tick; node 1 hangs.
    kube.set_pod_phase("ml", PODS[0], "Succeeded")
    run(handlers.sync_pods(ctx, "ml", "demo"))
    assert kube.job("ml", "demo")["status"]["phase"] == "Suspended"  # not "Succeeded"
    since = admission._since(kube.job("ml", "demo")["status"])
    assert since is not None
    assert run(admission.reconcile(ctx, job, since + 10 * SECOND)) is None
    assert _workers(kube) == [PODS[1]]
    # Resuming must wait for the last pod: two sets of workers never share a rendezvous.
    job = _set_suspend(kube, False)
    assert run(admission.reconcile(ctx, job, since + 20 * SECOND)) is None
    assert run(admission.reconcile(ctx, job, since + 300 * SECOND)) == "delete-pods"
    assert [k for k, _ in kube.names() if k == "Pod"] == []
    assert run(admission.reconcile(ctx, job, since + 310 * SECOND)) == "resume"
    assert _workers(kube) == PODS


def test_suspend_is_a_live_field_and_the_timer_runs_for_pending_or_suspended_jobs() -> None:
    assert "suspend" in handlers._POLICY_FIELDS
    pending = kopf.Body({"status": {"phase": "Pending"}})
    running = kopf.Body({"status": {"phase": "Running"}})
    assert handlers._pending_or_suspended(spec={}, body=pending)
    assert handlers._pending_or_suspended(spec={"suspend": True}, body=running)
    assert not handlers._pending_or_suspended(spec={}, body=running)
