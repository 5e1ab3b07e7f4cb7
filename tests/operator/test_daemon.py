"""The per-job daemon: waiting for the workers, the job as its pods run it, resuming, and one
whole decision loop against a real (torch-free) trainer control endpoint on 127.0.0.1, with
the cluster served by kmock over HTTP."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kopf
import pytest

from malleus.operator import daemon, handlers, jobs, resources
from malleus.operator.context import Context
from malleus.planner.plan import Pipeline, Plan, Stage
from malleus.planner.problem import PlanningProblem
from tests.operator.fake_trainer import Coordinator, Stop
from tests.operator.kube import Kube

REF = resources.JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def created(
    kube: Kube, memo: kopf.Memo, body: dict[str, Any], phase: str = "Running"
) -> dict[str, Any]:
    """A job after on_create in ``phase``; returns kopf's live view of it."""
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", {**patch["status"], "phase": phase})
    return kube.job("ml", "demo")


def with_settings(ctx: Context, **changes: Any) -> Context:
    return Context(ctx.cluster, ctx.settings.with_(**changes), ctx.metrics)


def test_effective_job_keeps_the_started_layout_and_the_live_policy(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = created(kube, memo, make_job())
    body["spec"]["nodes"] = 4  # a structural edit: the running pods do not change
    body["spec"]["stragglerPolicy"] = {"threshold": 1.7}
    job = run(daemon.effective_job(ctx, REF, body))
    assert job.nodes == 2
    assert job.policy.threshold == 1.7


def test_a_restarted_daemon_believes_the_stragglers_the_status_shows() -> None:
    body = {"status": {"stragglers": [{"rank": 3, "node": 0, "rate": 2.5}, {"rank": 7, "node": 1}]}}
    assert daemon.believed_rates(body) == {3: 2.5, 7: None}
    assert daemon.believed_rates({}) == {}
    assert daemon.believed_rates({"status": {"stragglers": [{"node": 1}]}}) == {}


# ---- a whole loop against a real control endpoint -------------------------------------------


def _exclude_slow_groups(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
    """One single-stage pipeline per TP group without a straggler (enough for the loop)."""
    tp = problem.tp
    groups = [list(range(g * tp, (g + 1) * tp)) for g in range(problem.world // tp)]
    healthy = [g for g in groups if all((problem.rate(r) or 99) < 1.2 for r in g)]
    slow = [r for g in groups if g not in healthy for r in g]
    m, k = divmod(problem.micro_batches, len(healthy))
    return Plan(
        tp=tp,
        pipelines=[
            Pipeline(
                micro_batches=m + (1 if i < k else 0),
                stages=[Stage(ranks=g, layers=(0, problem.layers))],
            )
            for i, g in enumerate(healthy)
        ],
        excluded=slow,
    )


def test_run_job_replans_around_a_straggler_end_to_end(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = created(
        kube,
        memo,
        make_job(
            stragglerPolicy={"windowSteps": 1, "cooldownSeconds": 0, "minGain": 0.05},
            metrics={"scrapeIntervalSeconds": 1},
        ),
    )
    token = run(ctx.cluster.read_secret_value("ml", "demo-control", "token"))
    # the coordinator's side: steps, rates (rank 3 slows at step 3), plan switches
    coordinator = Coordinator(jobs.resolve(body), token, slow={3}, slow_from=3)
    ours = coordinator.context(ctx)

    async def scenario() -> str | None:
        stop = Stop()
        trainer = asyncio.ensure_future(coordinator.train(stop))
        runner = asyncio.ensure_future(
            daemon.run_job(ours, body, stop, planner=_exclude_slow_groups, poll_seconds=0.1)
        )
        try:
            for _ in range(300):  # bounded: 30 s at most
                if "Migrated" in kube.reasons() or runner.done():
                    break
                await asyncio.sleep(0.1)
            body["status"]["phase"] = "Succeeded"  # the pod watcher says the job is over
            return await asyncio.wait_for(runner, 15)
        finally:
            stop.event.set()
            await trainer

    try:
        result = run(scenario())
    finally:
        coordinator.server.stop()
    assert result is None
    reasons = kube.reasons()
    assert (
        reasons.index("StragglerDetected") < reasons.index("Replanned") < reasons.index("Migrated")
    ), reasons
    st = kube.job("ml", "demo")["status"]
    assert st["plan"]["generation"] == 2
    assert st["plan"]["excluded"] == [2, 3]
    assert st["lastReplan"]["generation"] == 2
    assert st["lastReplan"]["migrationBytes"] == 4096
    assert st["step"] > 0 and st["tokensPerSecond"] > 0
    assert st["stragglers"][0]["rank"] == 3
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None
    assert Plan.from_json(cm["data"]["plan.json"]).generation == 2
    assert "pending-plan.json" not in cm["data"]
    # the token from the Secret is what authorised the POST
    assert coordinator.inbox.current_generation == 2
    assert json.loads(cm["data"]["job.json"])["metadata"]["name"] == "demo"


def test_run_job_returns_when_the_job_ends_before_running(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = created(kube, memo, make_job(), phase="Pending")

    async def scenario() -> str | None:
        stop = Stop()
        task = asyncio.ensure_future(daemon.run_job(ctx, body, stop, poll_seconds=0.05))
        await asyncio.sleep(0.2)
        body["status"]["phase"] = "Failed"
        return await asyncio.wait_for(task, 5)

    assert run(scenario()) is None


def test_run_job_stops_when_kopf_stops_it(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = created(kube, memo, make_job(), phase="Pending")

    async def scenario() -> str | None:
        stop = Stop()
        task = asyncio.ensure_future(daemon.run_job(ctx, body, stop, poll_seconds=0.05))
        await asyncio.sleep(0.1)
        stop.event.set()
        return await asyncio.wait_for(task, 5)

    assert run(scenario()) is None


# ---- a pending job whose pods already run ---------------------------------------------------


class Ticks(Stop):
    """A stop flag on a fake clock: each ``wait`` is one poll that returns at once, and the
    flag sets itself at the ``limit``-th poll (the deadline: a loop that never leaves
    Pending ends there instead of hanging)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.polls = 0

    async def wait(self, timeout: float | None = None) -> bool:
        self.polls += 1
        if self.polls >= self.limit:
            self.event.set()
        await asyncio.sleep(0)
        return self.event.is_set()


def pending_with_running_pods(kube: Kube, memo: kopf.Memo, make_job: Any) -> dict[str, Any]:
    """Pods turned Running before the job had its Pending phase: the pod events changed
    nothing, so the job is Pending although every worker runs."""
    body = created(kube, memo, make_job(), phase="Pending")
    for i in range(body["spec"]["nodes"]):
        kube.set_pod_phase("ml", resources.pod_name("demo", i), "Running")
    return body


class Follow:
    """A resync that, like kopf, refreshes the live ``body`` from the stored job afterwards."""

    def __init__(self, kube: Kube, ctx: Context, body: dict[str, Any], fail_first: bool = False):
        self.kube, self.ctx, self.body = kube, ctx, body
        self.fail_first = fail_first
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.fail_first and self.calls == 1:
            raise ConnectionError("API server unreachable")
        await handlers.sync_pods(self.ctx, "ml", "demo")
        self.body["status"] = self.kube.job("ml", "demo")["status"]


def test_wait_running_resyncs_a_pending_job_whose_pods_run(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = pending_with_running_pods(kube, memo, make_job)
    stop = Ticks(limit=10)
    resync = Follow(kube, ctx, body)
    running = run(asyncio.wait_for(daemon._wait_running(body, stop, 2.0, resync), 5))
    assert running is True
    assert not stop  # it got there before the deadline
    # one resync, after the first poll (not before it); the poll after it sees Running
    assert (resync.calls, stop.polls) == (1, 2)
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "TrainersStarting")  # trainers: not yet
    assert "Running" in kube.reasons()


def test_wait_running_keeps_resyncing_after_a_failed_resync(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = pending_with_running_pods(kube, memo, make_job)
    stop = Ticks(limit=10)
    resync = Follow(kube, ctx, body, fail_first=True)
    assert run(asyncio.wait_for(daemon._wait_running(body, stop, 2.0, resync), 5)) is True
    assert (resync.calls, stop.polls) == (2, 3)  # retried at the next poll
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"


def test_wait_running_without_resync_waits_for_a_pod_event(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    body = pending_with_running_pods(kube, memo, make_job)
    before = kube.requests("update", "MalleusJob")
    stop = Ticks(limit=5)
    assert run(asyncio.wait_for(daemon._wait_running(body, stop, 2.0), 5)) is False
    assert stop.polls == 5  # polled until stopped
    assert kube.job("ml", "demo")["status"]["phase"] == "Pending"
    assert kube.requests("update", "MalleusJob") == before


@pytest.mark.parametrize(("resync", "phase"), [(True, "Running"), (False, "Pending")])
def test_run_job_passes_resync_to_the_wait(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any, resync: bool, phase: str
) -> None:
    body = pending_with_running_pods(kube, memo, make_job)
    # The coordinator's address needs the pod's IP, which the emulated pods lack: once Running,
    # run_job waits for it until the stop flag's deadline, with no trainer involved.
    ours = with_settings(ctx, endpoint_template="http://{pod_ip}:{port}")
    stop = Ticks(limit=5)
    follow = Follow(kube, ctx, body) if resync else None
    result = run(asyncio.wait_for(daemon.run_job(ours, body, stop, resync=follow), 5))
    assert result is None
    assert stop.polls == 5
    assert kube.job("ml", "demo")["status"]["phase"] == phase
