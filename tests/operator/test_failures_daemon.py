"""The decision loop across faults, against real (torch-free) trainer control endpoints on
127.0.0.1 and 127.0.0.2 with the cluster in kmock: the coordinator is found among the running
pods' ranks and followed when a failure moves it; the trainers' GPUs out and recoveries reach
the status and events (``Recovered`` once per recovery, also across a restart); a restarted
loop adopts the plan generation the trainers made on their own, neither lost nor repeated."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from malleus.control import ControlStatus, RecoveryRecord
from malleus.operator import daemon, handlers, jobs, resources, trainers
from malleus.operator.context import Context
from malleus.planner.plan import Pipeline, Plan, Stage
from tests.operator.fake_trainer import Stop
from tests.operator.kube import Kube

control = pytest.importorskip("malleus.trainer.endpoint.server")
pytestmark = pytest.mark.timeout(120)

REF = resources.JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)
TOKEN = "t0ken"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _port_free_on_both() -> int:
    """A base port whose next four are free on 127.0.0.1 and 127.0.0.2."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 4 > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for host in ("127.0.0.1", "127.0.0.2"):
                    for p in range(base, base + 4):
                        sock = stack.enter_context(socket.socket())
                        sock.bind((host, p))
            return base
        except OSError:
            continue
    pytest.skip("no free port range on 127.0.0.1 and 127.0.0.2")


class Trainers:
    """What a coordinator serves: status, plan in force, GPUs out, the last recovery."""

    def __init__(self, world: int, plan: Plan) -> None:
        self.world = world
        self.plan = plan
        self.out: dict[int, str] = {}
        self.recovery: RecoveryRecord | None = None
        self.step = 5

    def status(self) -> ControlStatus:
        return ControlStatus(
            job="demo",
            world=self.world,
            generation=self.plan.generation,
            pending_generation=None,
            step=self.step,
            steps=100,
            done=False,
            stopping=False,
            rates=dict.fromkeys(range(self.world), 1.0),
            step_seconds=0.05,
            tokens_per_second=100.0,
            last_migration=None,
            last_failure=None,
            out=self.out,
            last_recovery=self.recovery,
        )

    def serve(self, host: str, port: int) -> Any:
        from malleus.trainer.endpoint.metrics import TrainerMetrics
        from malleus.trainer.switching.plan_inbox import PlanInbox

        job_world = self.world
        inbox = PlanInbox(None, current_generation=self.plan.generation)  # type: ignore[arg-type]
        tm = TrainerMetrics("demo", rank=0, node=0)
        tm.observe_plan(self.plan.generation)
        rates = dict.fromkeys(range(job_world), 1.0)
        tm.observe_rates(rates, {r: r // 4 for r in range(job_world)})
        tm.observe_step(self.step, 0.05, 100.0, 1.0, 0.04)
        return control.ControlServer(
            host,
            port,
            TOKEN,
            status=self.status,
            inbox=inbox,
            metrics=tm,
            inject=None,
            plan=lambda: self.plan.model_dump(mode="json"),
        ).start()


@pytest.fixture
def base_port() -> int:
    return _port_free_on_both()


@pytest.fixture
def job(kube: Kube, memo: kopf.Memo, make_job: Any, base_port: int) -> Iterator[dict[str, Any]]:
    body = make_job(controlPort=base_port, metrics={"scrapeIntervalSeconds": 1})
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", {**patch["status"], "phase": "Running"})
    secret = kube.get("Secret", "ml", resources.secret_name("demo"))
    assert secret is not None  # the trainers here serve TOKEN: the job's Secret says so too
    secret["data"][resources.TOKEN_KEY] = base64.b64encode(TOKEN.encode()).decode()
    kube.put("Secret", secret)
    for i, ip in ((0, "127.0.0.1"), (1, "127.0.0.2")):
        kube.set_pod_phase("ml", f"demo-node-{i}", "Running", podIP=ip)
        pod = kube.get("Pod", "ml", f"demo-node-{i}")
        assert pod is not None
        pod["metadata"]["uid"] = f"pod-{i}"
        kube.put("Pod", pod)
    yield kube.job("ml", "demo")


def _plan(generation: int, excluded: list[int]) -> Plan:
    ranks = [r for r in range(8) if r not in excluded][:2]
    return Plan(
        generation=generation,
        tp=2,
        pipelines=[Pipeline(micro_batches=8, stages=[Stage(ranks=ranks, layers=(0, 8))])],
        excluded=excluded,
    )


def _http(ctx: Context) -> Context:
    settings = ctx.settings.with_(endpoint_template="http://{pod_ip}:{port}")
    return Context(ctx.cluster, settings, ctx.metrics)


def test_the_coordinator_is_the_lowest_running_rank_that_answers(
    kube: Kube, ctx: Context, job: dict[str, Any], base_port: int
) -> None:
    theirs = Trainers(8, _plan(2, [0, 1, 2, 3]))
    kube.set_pod_phase("ml", "demo-node-0", "Failed", podIP="127.0.0.1")
    server = theirs.serve("127.0.0.2", base_port + 1)  # node 1's local rank 1
    try:
        endpoints = trainers.Endpoints(
            ctx.cluster, REF, base_port, "http://{pod_ip}:{port}", gpus_per_node=4, token=TOKEN
        )
        found = run(endpoints.coordinator(2.0))
    finally:
        server.stop()
    assert (found.node, found.local_rank) == (1, 1)
    assert found.url == f"http://127.0.0.2:{base_port + 1}"
    assert found.status.generation == 2


def test_the_loop_follows_a_moved_coordinator_and_reports_the_recovery(
    kube: Kube, ctx: Context, job: dict[str, Any], base_port: int
) -> None:
    ours = _http(ctx)
    first = Trainers(8, jobs_plan(job))
    server = first.serve("127.0.0.1", base_port)
    moved = Trainers(8, _plan(first.plan.generation + 1, [0, 1, 2, 3]))
    moved.out = {0: "killed", 1: "killed", 2: "killed", 3: "killed"}
    moved.recovery = RecoveryRecord(
        epoch=1,
        failed={0: "killed", 1: "killed", 2: "killed", 3: "killed"},
        step=6,
        steps_lost=1,
        seconds=2.5,
        bytes_restored=1 << 20,
        mode="replicas",
        generation=moved.plan.generation,
    )
    other = None

    async def scenario() -> str | None:
        nonlocal other
        stop = Stop()
        task = asyncio.ensure_future(daemon.run_job(ours, job, stop, poll_seconds=0.1))
        await asyncio.sleep(1.5)  # the loop runs against node 0
        server.stop()  # node 0 dies; node 1's rank 0 is the coordinator now
        kube.set_pod_phase("ml", "demo-node-0", "Failed", podIP="127.0.0.1")
        other = moved.serve("127.0.0.2", base_port)
        try:
            return await asyncio.wait_for(task, 30)
        finally:
            stop.event.set()

    try:
        assert run(scenario()) == daemon.COORDINATOR_MOVED
        # kopf restarts the daemon: it resumes on node 1, from the trainers' own plan
        job["status"] = kube.job("ml", "demo")["status"]

        async def again() -> str | None:
            stop = Stop()
            task = asyncio.ensure_future(daemon.run_job(ours, job, stop, poll_seconds=0.1))
            for _ in range(100):
                if "Recovered" in kube.reasons():
                    break
                await asyncio.sleep(0.1)
            job["status"]["phase"] = "Succeeded"
            return await asyncio.wait_for(task, 15)

        assert run(again()) is None
        job["status"] = kube.job("ml", "demo")["status"]
        job["status"]["phase"] = "Running"
        assert run(again()) is None  # a second restart: the same recovery is not told again
    finally:
        if other is not None:
            other.stop()
    st = kube.job("ml", "demo")["status"]
    assert st["plan"]["generation"] == moved.plan.generation  # adopted, not lost nor repeated
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None
    assert Plan.from_json(cm["data"]["plan.json"]) == moved.plan
    assert [(o["gpu"], o["reason"], o["source"]) for o in st["gpusOut"]] == [
        (g, "killed", "trainers") for g in range(4)
    ]
    assert st["lastRecovery"]["epoch"] == 1 and st["lastRecovery"]["stepsLost"] == 1
    assert kube.reasons().count("Recovered") == 1
    message = next(e["message"] for e in kube.events if e["reason"] == "Recovered")
    assert "in 2.5 s, 1 step(s) lost" in message
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "0 (killed)" in degraded["message"]


def jobs_plan(body: dict[str, Any]) -> Plan:
    plan, _ = run(jobs.initial_plan(jobs.resolve(body)))
    return plan


def test_a_restart_mid_replan_and_recovery_keeps_every_generation(
    kube: Kube, ctx: Context, job: dict[str, Any], base_port: int
) -> None:
    """The operator published generation 2 and died; the trainers took it, then lost GPUs and
    went on under a plan of their own (generation 3). The restarted loop runs on 3: 2 is not
    lost (it was recorded as applied on the way) and 3 is not numbered again."""
    posted = _plan(2, [])
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None
    cm["data"]["pending-plan.json"] = posted.to_json()
    kube.put("ConfigMap", cm)
    theirs = Trainers(8, _plan(3, [4, 5, 6, 7]))
    server = theirs.serve("127.0.0.1", base_port)
    try:

        async def resume() -> tuple[Plan, Plan | None]:
            async with daemon.AsyncControlClient(server.url, TOKEN) as client:
                return await daemon._plan_in_force(
                    ctx, REF, jobs.resolve(job), client, theirs.status()
                )

        plan, pending = run(resume())
    finally:
        server.stop()
    assert (plan, pending) == (theirs.plan, None)
    cm = kube.get("ConfigMap", "ml", "demo-config")
    assert cm is not None
    assert Plan.from_json(cm["data"]["plan.json"]) == theirs.plan
    assert "pending-plan.json" not in cm["data"]
