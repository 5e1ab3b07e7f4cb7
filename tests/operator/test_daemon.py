"""The per-job daemon: events -> status/events/metrics, the ConfigMap-backed sink, resuming,
and one whole loop against a real (torch-free) trainer control endpoint on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any

import kopf
import pytest

from malleus.controller.events import DecisionEvent, EventKind
from malleus.controller.policy import StragglerPolicy
from malleus.controller.ports import Ack
from malleus.controller.problem import build_problem
from malleus.operator import daemon, handlers, jobs, metrics, resources, sink
from malleus.operator.settings import Settings
from malleus.planner.plan import Pipeline, Plan, Stage
from malleus.planner.problem import PlanningProblem

REF = resources.JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def created(cluster: Any, body: dict[str, Any], phase: str = "Running") -> dict[str, Any]:
    """A job after on_create, its pods in ``phase``; returns the live stored body."""
    stored = cluster.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch))
    stored.setdefault("status", {}).update(patch["status"])
    stored["status"]["phase"] = phase
    return stored


class Stop:
    """kopf's DaemonStopped, as far as the daemon uses it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self, timeout: float | None = None) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)
        return self.event.is_set()


# ---- the reporter ---------------------------------------------------------------------------


class FakeController:
    def __init__(self, plan: Plan, smoothed: Mapping[int, float | None]) -> None:
        self.plan = plan
        self.last_replan: dict[str, Any] | None = None

        class _Detector:
            def smoothed(self) -> dict[int, float | None]:
                return dict(smoothed)

        self.detector = _Detector()


def _reporter(cluster: Any, make_job: Any) -> tuple[daemon.JobReporter, dict[str, Any]]:
    body = created(cluster, make_job())
    job = jobs.parse_job(body)
    reporter = daemon.JobReporter(REF, job, StragglerPolicy.from_job(job), body)
    return reporter, body


def _event(kind: EventKind, message: str = "m", **data: Any) -> DecisionEvent:
    return DecisionEvent(kind=kind, step=7, time=1_700_000_000.0, message=message, data=data)


def test_observations_update_step_tokens_and_stragglers(cluster: Any, make_job: Any) -> None:
    reporter, body = _reporter(cluster, make_job)
    plan = Plan.from_json(cluster.objects[("ConfigMap", "ml", "demo-config")]["data"]["plan.json"])
    reporter.controller = FakeController(plan, {3: 2.5, 4: 1.0})  # type: ignore[assignment]
    run(reporter.on_observation(12, 0.5))
    st = body["status"]
    assert st["step"] == 12
    # tiny preset: sequence 64, global batch 16 -> 1024 tokens per step, 0.5 s per step
    assert st["tokensPerSecond"] == 2048.0
    assert st["stragglers"] == [{"rank": 3, "node": 0, "rate": 2.5}]
    assert st["stragglerSummary"] == "1 (r3 2.5x)"
    cond = next(c for c in st["conditions"] if c["type"] == "Straggling")
    assert cond["status"] == "True"
    # nothing changed: no second patch
    n = len([c for c in cluster.calls if c[0] == "patch_job_status"])
    run(reporter.on_observation(12, 0.5))
    assert len([c for c in cluster.calls if c[0] == "patch_job_status"]) == n


def test_decision_events_become_kubernetes_events(cluster: Any, make_job: Any) -> None:
    reporter, _body = _reporter(cluster, make_job)
    for kind in EventKind:
        run(reporter.on_event(_event(kind, f"about {kind.value}")))
    posted = [(e["type"], e["reason"]) for e in cluster.events[1:]]  # after "Created"
    assert posted == [
        ("Warning", "StragglerDetected"),
        ("Normal", "ReplanSkipped"),
        ("Normal", "Replanned"),
        ("Normal", "Migrated"),
        ("Warning", "ReplanFailed"),
    ]  # Planned is not an event: it is in the status and the metrics


def test_replanned_then_migrated_updates_phase_plan_and_last_replan(
    cluster: Any, make_job: Any
) -> None:
    reporter, body = _reporter(cluster, make_job)
    new = Plan(
        generation=2,
        tp=2,
        pipelines=[Pipeline(micro_batches=8, stages=[Stage(ranks=[0, 1], layers=(0, 8))])],
        excluded=[2, 3, 4, 5, 6, 7],
    )
    fake = FakeController(new, {})
    reporter.controller = fake  # type: ignore[assignment]
    replans = metrics.REPLANS.labels(namespace="ml", job="demo")._value.get()
    run(reporter.on_event(_event(EventKind.REPLANNED, "published plan generation 2")))
    assert body["status"]["phase"] == "Replanning"
    fake.last_replan = {
        "time": 1_700_000_000.0,
        "reason": "rank 3 slowed (1.00 -> 3.00)",
        "generation": 2,
        "planning_seconds": 0.01,
        "migration_seconds": 1.5,
        "migration_bytes": 4096.0,
    }
    run(reporter.on_event(_event(EventKind.MIGRATED, "trainers run generation 2")))
    st = body["status"]
    assert st["phase"] == "Running"
    assert st["plan"]["generation"] == 2
    assert st["lastReplan"] == {
        "time": "2023-11-14T22:13:20Z",
        "reason": "rank 3 slowed (1.00 -> 3.00)",
        "generation": 2,
        "planningSeconds": 0.01,
        "migrationSeconds": 1.5,
        "migrationBytes": 4096,
    }
    assert metrics.REPLANS.labels(namespace="ml", job="demo")._value.get() == replans + 1


def test_the_daemon_never_overrides_a_terminal_phase(cluster: Any, make_job: Any) -> None:
    reporter, body = _reporter(cluster, make_job)
    body["status"]["phase"] = "Failed"
    reporter.controller = FakeController(Plan(tp=2, pipelines=[]), {})  # type: ignore[assignment]
    run(reporter.on_event(_event(EventKind.REPLANNED)))
    run(reporter.on_event(_event(EventKind.REPLAN_FAILED)))
    assert body["status"]["phase"] == "Failed"


def test_planned_events_feed_the_planning_histogram(cluster: Any, make_job: Any) -> None:
    reporter, _ = _reporter(cluster, make_job)

    def count() -> float:
        for family in metrics.REGISTRY.collect():
            if family.name == "malleus_operator_planning_seconds":
                for s in family.samples:
                    if s.name.endswith("_count"):
                        return s.value
        return 0.0

    before = count()
    run(reporter.on_event(_event(EventKind.PLANNED, decision={"planning_seconds": 0.2})))
    assert count() == before + 1


# ---- the ConfigMap-backed sink and resuming ------------------------------------------------


class InnerSink:
    def __init__(self) -> None:
        self.published: list[Plan] = []

    async def publish(self, plan: Plan) -> int:
        self.published.append(plan)
        return plan.generation

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        return Ack(generation=generation, step=9, migration_seconds=0.5, migration_bytes=10.0)


def _cm(cluster: Any) -> dict[str, str]:
    data: dict[str, str] = cluster.objects[("ConfigMap", "ml", "demo-config")]["data"]
    return data


def test_sink_records_pending_then_in_force(cluster: Any, make_job: Any) -> None:
    created(cluster, make_job())
    new = Plan.from_json(_cm(cluster)["plan.json"]).model_copy(update={"generation": 2})
    s = sink.ConfigMapPlanSink(REF, InnerSink())

    async def go() -> None:
        assert await s.publish(new) == 2
        assert Plan.from_json(_cm(cluster)[sink.PENDING_KEY]).generation == 2
        assert Plan.from_json(_cm(cluster)[sink.PLAN_KEY]).generation == 1
        ack = await s.wait_applied(2, 1.0)
        assert ack.migration_seconds == 0.5

    run(go())
    assert sink.PENDING_KEY not in _cm(cluster)
    assert Plan.from_json(_cm(cluster)[sink.PLAN_KEY]).generation == 2


@pytest.mark.parametrize(("running", "expected"), [(2, 2), (1, 1), (None, 1)])
def test_resume_promotes_a_pending_plan_only_if_it_runs(
    cluster: Any, make_job: Any, running: int | None, expected: int
) -> None:
    created(cluster, make_job())
    pending = Plan.from_json(_cm(cluster)["plan.json"]).model_copy(update={"generation": 2})
    _cm(cluster)[sink.PENDING_KEY] = pending.to_json()
    plan = run(sink.resume_plan(REF, running))
    assert plan is not None and plan.generation == expected
    assert sink.PENDING_KEY not in _cm(cluster)
    assert Plan.from_json(_cm(cluster)[sink.PLAN_KEY]).generation == expected


def test_effective_job_keeps_the_started_layout_and_the_live_policy(
    cluster: Any, make_job: Any
) -> None:
    body = created(cluster, make_job())
    body["spec"]["nodes"] = 4  # a structural edit: the running pods do not change
    body["spec"]["stragglerPolicy"] = {"threshold": 1.7}
    job = run(daemon.effective_job(REF, body))
    assert job.spec.nodes == 2
    assert job.spec.straggler_policy.threshold == 1.7


def test_a_restarted_daemon_believes_the_stragglers_the_status_shows() -> None:
    body = {"status": {"stragglers": [{"rank": 3, "node": 0, "rate": 2.5}, {"rank": 7, "node": 1}]}}
    assert daemon.believed_rates(body) == {3: 2.5, 7: None}
    assert daemon.believed_rates({}) == {}


# ---- a whole loop against a real control endpoint -------------------------------------------


def _exclude_slow_groups(problem: PlanningProblem, time_limit: float | None) -> Plan:
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


def test_run_job_replans_around_a_straggler_end_to_end(cluster: Any, make_job: Any) -> None:
    control = pytest.importorskip("malleus.trainer.control")
    from malleus.trainer.metrics import TrainerMetrics
    from malleus.trainer.plan_inbox import PlanInbox

    body = created(
        cluster,
        make_job(
            stragglerPolicy={"windowSteps": 1, "cooldownSeconds": 0, "minGain": 0.05},
            metrics={"scrapeIntervalSeconds": 1},
        ),
    )
    job = jobs.parse_job(body)
    token = run(cluster.read_secret_value("ml", "demo-control", "token"))
    inbox = PlanInbox(build_problem(job, {}), current_generation=1)
    tm = TrainerMetrics("demo", rank=0, node=0)
    tm.observe_plan(1)
    server = control.ControlServer(
        "127.0.0.1",
        0,
        token,
        status=lambda: {**tm.snapshot(), **inbox.status()},
        inbox=inbox,
        metrics=tm,
        inject=None,
    ).start()
    settings = Settings(metrics_port=0, endpoint_template=f"http://127.0.0.1:{server.port}")

    async def train(stop: Stop) -> None:
        """The coordinator's side: steps, rates (rank 3 slows at step 3), plan switches."""
        step = 0
        while not stop:
            step += 1
            plan = inbox.take()
            if plan is not None:
                inbox.applied(plan.generation)
                tm.observe_plan(plan.generation)
                tm.observe_migration(0.25, 4096)
            rates = {r: (3.0 if r == 3 and step >= 3 else 1.0) for r in range(8)}
            tm.observe_rates(rates, {r: r // 4 for r in range(8)})
            tm.observe_step(step, 0.05, 20480.0, rates[0], 0.04)
            await asyncio.sleep(0.05)

    async def scenario() -> str | None:
        stop = Stop()
        trainer = asyncio.ensure_future(train(stop))
        runner = asyncio.ensure_future(
            daemon.run_job(body, stop, settings, planner=_exclude_slow_groups, poll_seconds=0.1)
        )
        try:
            for _ in range(300):  # bounded: 30 s at most
                if "Migrated" in cluster.reasons() or runner.done():
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
        server.stop()
    assert result is None
    reasons = cluster.reasons()
    assert (
        reasons.index("StragglerDetected") < reasons.index("Replanned") < reasons.index("Migrated")
    ), reasons
    st = body["status"]
    assert st["plan"]["generation"] == 2
    assert st["plan"]["excluded"] == [2, 3]
    assert st["lastReplan"]["generation"] == 2
    assert st["lastReplan"]["migrationBytes"] == 4096
    assert st["step"] > 0 and st["tokensPerSecond"] > 0
    assert st["stragglers"][0]["rank"] == 3
    cm = cluster.objects[("ConfigMap", "ml", "demo-config")]["data"]
    assert Plan.from_json(cm["plan.json"]).generation == 2
    assert "pending-plan.json" not in cm
    assert inbox.current_generation == 2
    # the token from the Secret is what authorised the POST
    assert json.loads(cm["job.json"])["metadata"]["name"] == "demo"


def test_run_job_returns_when_the_job_ends_before_running(cluster: Any, make_job: Any) -> None:
    body = created(cluster, make_job(), phase="Pending")

    async def scenario() -> str | None:
        stop = Stop()
        task = asyncio.ensure_future(
            daemon.run_job(body, stop, Settings(metrics_port=0), poll_seconds=0.05)
        )
        await asyncio.sleep(0.2)
        body["status"]["phase"] = "Failed"
        return await asyncio.wait_for(task, 5)

    assert run(scenario()) is None


def test_run_job_stops_when_kopf_stops_it(cluster: Any, make_job: Any) -> None:
    body = created(cluster, make_job(), phase="Pending")

    async def scenario() -> str | None:
        stop = Stop()
        task = asyncio.ensure_future(
            daemon.run_job(body, stop, Settings(metrics_port=0), poll_seconds=0.05)
        )
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


def pending_with_running_pods(cluster: Any, make_job: Any) -> dict[str, Any]:
    """Pods turned Running before the job had its Pending phase: the pod events changed
    nothing, so the job is Pending although every worker runs."""
    body = created(cluster, make_job(), phase="Pending")
    for i in range(body["spec"]["nodes"]):
        cluster.set_pod_phase("ml", resources.pod_name("demo", i), "Running")
    return body


def _status_patches(cluster: Any) -> int:
    return len([c for c in cluster.calls if c[0] == "patch_job_status"])


def test_wait_running_resyncs_a_pending_job_whose_pods_run(cluster: Any, make_job: Any) -> None:
    body = pending_with_running_pods(cluster, make_job)
    stop = Ticks(limit=10)
    resynced_at: list[int] = []

    async def resync() -> None:
        resynced_at.append(stop.polls)
        await handlers._sync_pods("ml", "demo")

    running = run(asyncio.wait_for(daemon._wait_running(body, stop, 2.0, resync), 5))
    assert running is True
    assert not stop  # it got there before the deadline
    assert resynced_at == [1]  # after the first poll (not before it), and once: then Running
    st = body["status"]
    assert st["phase"] == "Running"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert "Running" in cluster.reasons()


def test_wait_running_keeps_resyncing_after_a_failed_resync(cluster: Any, make_job: Any) -> None:
    body = pending_with_running_pods(cluster, make_job)
    stop = Ticks(limit=10)
    resynced_at: list[int] = []

    async def resync() -> None:
        resynced_at.append(stop.polls)
        if len(resynced_at) == 1:
            raise ConnectionError("API server unreachable")
        await handlers._sync_pods("ml", "demo")

    assert run(asyncio.wait_for(daemon._wait_running(body, stop, 2.0, resync), 5)) is True
    assert resynced_at == [1, 2]
    assert body["status"]["phase"] == "Running"


def test_wait_running_without_resync_waits_for_a_pod_event(cluster: Any, make_job: Any) -> None:
    body = pending_with_running_pods(cluster, make_job)
    before = _status_patches(cluster)
    stop = Ticks(limit=5)
    assert run(asyncio.wait_for(daemon._wait_running(body, stop, 2.0), 5)) is False
    assert stop.polls == 5  # polled until stopped
    assert body["status"]["phase"] == "Pending"
    assert _status_patches(cluster) == before


@pytest.mark.parametrize(("resync", "phase"), [(True, "Running"), (False, "Pending")])
def test_run_job_passes_resync_to_the_wait(
    cluster: Any, make_job: Any, resync: bool, phase: str
) -> None:
    body = pending_with_running_pods(cluster, make_job)
    # The coordinator's address needs the pod's IP, which the fake pods lack: once Running,
    # run_job waits for it until the stop flag's deadline, with no network involved.
    settings = Settings(metrics_port=0, endpoint_template="http://{pod_ip}:{port}")
    stop = Ticks(limit=5)

    async def sync() -> None:
        await handlers._sync_pods("ml", "demo")

    result = run(
        asyncio.wait_for(daemon.run_job(body, stop, settings, resync=sync if resync else None), 5)
    )
    assert result is None
    assert stop.polls == 5
    assert body["status"]["phase"] == phase


# ---- stragglers refreshed by a StragglerDetected event --------------------------------------


def test_straggler_detected_refreshes_stragglers_and_condition(cluster: Any, make_job: Any) -> None:
    reporter, body = _reporter(cluster, make_job)
    plan = Plan.from_json(cluster.objects[("ConfigMap", "ml", "demo-config")]["data"]["plan.json"])
    smoothed: dict[int, float | None] = {}
    reporter.controller = FakeController(plan, smoothed)  # type: ignore[assignment]
    run(reporter.on_observation(12, 0.5))  # reported before the detector saw the shift
    assert body["status"]["stragglers"] == []
    before = _status_patches(cluster)

    smoothed[3] = 2.5  # the controller fed that observation to the detector: rank 3 slowed
    run(reporter.on_event(_event(EventKind.STRAGGLER_DETECTED, "rank 3 slowed")))
    patches = [c[1] for c in cluster.calls if c[0] == "patch_job_status"][before:]
    assert len(patches) == 1
    ns, name, written = patches[0]
    assert (ns, name) == ("ml", "demo")
    assert written["stragglers"] == [{"rank": 3, "node": 0, "rate": 2.5}]
    assert written["stragglerSummary"] == "1 (r3 2.5x)"
    cond = next(c for c in written["conditions"] if c["type"] == "Straggling")
    assert (cond["status"], cond["reason"]) == ("True", "StragglersDetected")
    assert "step" not in written  # only what the event concerns
    st = body["status"]
    assert st["stragglers"] == written["stragglers"]
    assert next(c for c in st["conditions"] if c["type"] == "Straggling")["status"] == "True"
    assert next(c for c in st["conditions"] if c["type"] == "Ready")  # merged, not replaced
    assert cluster.reasons()[-1] == "StragglerDetected"

    # the next observation sees the same stragglers: nothing more to write for them
    run(reporter.on_observation(12, 0.5))
    assert _status_patches(cluster) == before + 1
