"""An operator restart between a publish and its acknowledgement converges.

Reproduced before the fix: the restarted daemon dropped the pending plan while the trainers'
inbox still applied it, so the trainers ran generation 2, the status stayed Replanning at
generation 1, and every later plan was refused with 409. Here the daemon is killed (its task
cancelled) right after the POST, while the coordinator holds the plan, and a new daemon is
started; the trainer side is the real control endpoint and plan inbox on 127.0.0.1, the
cluster kmock over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import kopf
import pytest

from malleus.operator import daemon, handlers, jobs
from malleus.operator.context import Context
from malleus.planner.plan import Pipeline, Plan, Stage
from malleus.planner.problem import PlanningProblem
from tests.operator.fake_trainer import Coordinator, Stop
from tests.operator.kube import Kube


def _healthy_groups(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
    """One single-stage pipeline per TP group without a straggler."""
    tp = problem.tp
    groups = [list(range(g * tp, (g + 1) * tp)) for g in range(problem.world // tp)]
    healthy = [g for g in groups if all((problem.rate(r) or 99) < 1.2 for r in g)]
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
        excluded=[r for g in groups if g not in healthy for r in g],
    )


async def until(what: Callable[[], bool], seconds: float = 20.0) -> None:
    """Poll `what` every 50 ms; fail the test after `seconds`."""
    for _ in range(int(seconds / 0.05)):
        if what():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached within {seconds} s: {what.__doc__ or what}")


@pytest.mark.parametrize("taken", ["after the restart", "before the restart"])
def test_a_daemon_restarted_between_publish_and_ack_converges(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any, taken: str
) -> None:
    job_body = make_job(
        stragglerPolicy={"windowSteps": 1, "cooldownSeconds": 0, "minGain": 0.05},
        metrics={"scrapeIntervalSeconds": 1},
    )
    kube.add_job(job_body)
    patch = kopf.Patch()
    asyncio.run(handlers.on_create(body=job_body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", {**patch["status"], "phase": "Running"})
    body = kube.job("ml", "demo")  # kopf's live view, kept current by `follow` below
    token = asyncio.run(ctx.cluster.read_secret_value("ml", "demo-control", "token"))
    # the coordinator: steps, rates, and plans taken at step boundaries unless held
    trainers = Coordinator(jobs.resolve(body), token, slow={3}, hold=True)
    inbox = trainers.inbox
    ours = trainers.context(ctx)

    async def follow(stop: Stop) -> None:
        """kopf refreshes a daemon's body with every change of the object."""
        while not stop:
            body["status"] = kube.job("ml", "demo")["status"]
            await asyncio.sleep(0.02)

    def shown() -> dict[str, Any]:
        return kube.job("ml", "demo")["status"]

    def start(stop: Stop) -> asyncio.Future[str | None]:
        return asyncio.ensure_future(
            daemon.run_job(ours, body, stop, planner=_healthy_groups, poll_seconds=0.1)
        )

    async def scenario() -> None:
        stop = Stop()
        background = [
            asyncio.ensure_future(trainers.train(stop)),
            asyncio.ensure_future(follow(stop)),
        ]
        try:
            first = start(Stop())
            await until(lambda: inbox.pending_generation == 2)
            await until(lambda: shown().get("phase") == "Replanning")
            first.cancel()  # the operator dies after the POST, before the acknowledgement
            with contextlib.suppress(asyncio.CancelledError):
                await first
            cm = kube.get("ConfigMap", "ml", "demo-config")
            assert (
                cm is not None and Plan.from_json(cm["data"]["pending-plan.json"]).generation == 2
            )
            if taken == "before the restart":
                trainers.hold = False
                await until(lambda: inbox.current_generation == 2)
            second_stop = Stop()
            second = start(second_stop)
            if taken == "after the restart":
                await asyncio.sleep(0.5)  # the new daemon resumes while the plan is pending
                assert shown()["plan"]["generation"] == 1 and inbox.pending_generation == 2
                trainers.hold = False
            await until(lambda: shown()["plan"]["generation"] == 2, seconds=5)
            await until(lambda: shown()["phase"] == "Running", seconds=5)
            cm = kube.get("ConfigMap", "ml", "demo-config")  # recorded before the status
            assert cm is not None and "pending-plan.json" not in cm["data"]
            assert Plan.from_json(cm["data"]["plan.json"]).generation == 2
            trainers.slow = {3, 5}  # a later re-plan: the next generation, applied
            await until(lambda: inbox.current_generation == 3)
            await until(lambda: shown()["plan"]["generation"] == 3)
            body["status"]["phase"] = "Succeeded"  # the pod watcher says the job is over
            kube.merge_status("ml", "demo", {"phase": "Succeeded"})
            assert await asyncio.wait_for(second, 15) is None
            second_stop.event.set()
        finally:
            stop.event.set()
            for task in background:
                await task

    try:
        asyncio.run(scenario())
    finally:
        trainers.server.stop()
    assert "ReplanFailed" not in kube.reasons()
    st = kube.job("ml", "demo")["status"]
    assert st["plan"]["excluded"] == [2, 3, 4, 5]
    assert st["lastReplan"]["generation"] == 3
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None and "pending-plan.json" not in cm["data"]
    assert Plan.from_json(cm["data"]["plan.json"]).generation == 3
