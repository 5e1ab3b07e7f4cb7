"""TrainerScrapeSource and HttpPlanSink against the trainer's real control server.

The server side is the trainer's own code (ControlServer, TrainerMetrics, PlanInbox and the
status its Services build); a thread stands in for the training loop's step boundary, taking
plans from the inbox and reporting the switch, exactly as the coordinator does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from malleus.control import ControlClient, ControlStatus, MigrationRecord, PlanFailure
from malleus.controller import (
    Ack,
    AckTimeout,
    Controller,
    EventKind,
    GenerationConflict,
    HttpPlanSink,
    PlanRejected,
    TrainerScrapeSource,
)
from malleus.controller.sources import ack_from_status, observation_from_metrics
from malleus.job import StragglerPolicy
from malleus.planner import Plan
from malleus.trainer.endpoint.metrics import TrainerMetrics
from malleus.trainer.endpoint.server import ControlServer
from malleus.trainer.engine.services import Services, WorkerState
from malleus.trainer.switching.plan_inbox import PlanInbox
from tests.statuses import control_status

from .conftest import greedy_planner

TOKEN = "s3cret"
JOB = "ctl-test"


class Coordinator:
    """Rank 0's services, with a step boundary thread that applies posted plans."""

    def __init__(self, builder: Any, plan: Plan) -> None:
        self.metrics = TrainerMetrics(JOB, rank=0, node=0)
        self.inbox = PlanInbox(builder({}, None), plan.generation)
        self.services = Services(WorkerState(JOB, world=8, steps=1000), inbox=self.inbox)
        self.services.state.update(generation=plan.generation)
        self.server = ControlServer(
            "127.0.0.1",
            0,
            TOKEN,
            status=self.services.status,
            inbox=self.inbox,
            metrics=self.metrics,
            inject=None,
        )
        self.step = 0
        self.rates: dict[int, float | None] = dict.fromkeys(range(8), 1.0)
        self.applied: list[Plan] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._boundary, daemon=True)

    def __enter__(self) -> Coordinator:
        self.server.start()
        self.metrics.observe_plan(self.inbox.current_generation)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.stop()

    @property
    def url(self) -> str:
        return self.server.url

    def train_step(self) -> None:
        """One step: every rank's rate and the step time published by the coordinator."""
        self.metrics.observe_rates(self.rates, {r: r // 4 for r in self.rates})
        self.metrics.observe_step(self.step, 16.0, 1000.0, self.rates[0], 1.0)
        self.step += 1

    def _boundary(self) -> None:
        while not self._stop.wait(0.005):
            plan = self.inbox.take()
            if plan is not None:
                self.metrics.observe_migration(0.25, 4_000_000)
                self.metrics.observe_plan(plan.generation)
                self.inbox.applied(plan.generation)
                done = MigrationRecord(
                    generation=plan.generation, step=self.step, seconds=0.25, bytes=4_000_000
                )
                self.services.state.update(generation=plan.generation, migration=done)
                self.applied.append(plan)


@pytest.fixture
def coordinator(builder: Any, initial_plan: Plan) -> Iterator[Coordinator]:
    with Coordinator(builder, initial_plan) as c:
        yield c


def test_scrape_source_reads_steps_rates_and_generation(coordinator: Coordinator) -> None:
    coordinator.rates.update({3: 2.5, 5: None})
    coordinator.train_step()

    async def next_step(_: float) -> None:  # the source polls: the trainer steps meanwhile
        coordinator.train_step()

    async def main() -> None:
        source = TrainerScrapeSource(coordinator.url, job=JOB, sleep=next_step)
        first = await source.read()
        assert first is not None
        assert (first.step, first.step_seconds, first.generation) == (0, 16.0, 0)
        # rank 5 is not measured: the trainer removes its series, so it has no sample
        assert first.rates == {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.5, 4: 1.0, 6: 1.0, 7: 1.0}
        second = await source.read()  # same step on the page: waits for the next one
        assert second is not None and second.step == 1

    asyncio.run(main())


def test_observation_from_metrics_filters_by_job_and_needs_a_step() -> None:
    m = TrainerMetrics("other", rank=0, node=0)
    m.observe_rates({0: 2.0}, {0: 0})
    text = m.render().decode()
    assert observation_from_metrics(text, job=JOB) is None  # another job's page
    obs = observation_from_metrics(text, job="other")
    assert obs is not None and obs.rates == {0: 2.0} and obs.step == 0
    assert obs.step_seconds is None  # the gauge's initial 0 is "not measured"
    assert observation_from_metrics("# nothing here\n") is None


def test_observation_from_metrics_drops_series_that_contradict_the_layout() -> None:
    m = TrainerMetrics(JOB, rank=0, node=0)
    m.observe_rates({0: 2.0, 5: 3.0, 9: 4.0, 6: 1.5}, {0: 0, 5: 0, 9: 2, 6: 1})
    obs = observation_from_metrics(m.render().decode(), JOB, world=8, gpus_per_node=4)
    # rank 5 is on node 1, not 0; the job has no rank 9
    assert obs is not None and obs.rates == {0: 2.0, 6: 1.5}


def test_plan_sink_publishes_and_waits_for_the_switch(
    coordinator: Coordinator, builder: Any
) -> None:
    plan = greedy_planner(builder({3: 4.0}, None)).model_copy(update={"generation": 1})

    async def main() -> None:
        sink = HttpPlanSink(coordinator.url, TOKEN, poll_seconds=0.01)
        assert await sink.publish(plan) == 1
        ack = await sink.wait_applied(1, timeout=5)
        assert (ack.generation, ack.migration_seconds, ack.migration_bytes) == (1, 0.25, 4e6)
        assert ack.step == coordinator.step  # the first step under the new plan
        with pytest.raises(GenerationConflict) as stale:
            await sink.publish(plan)
        assert (stale.value.status, stale.value.generation, stale.value.newest) == (409, 1, 1)
        with pytest.raises(GenerationConflict) as ahead:  # the next generation or nothing
            await sink.publish(plan.model_copy(update={"generation": 10**30}))
        assert (ahead.value.generation, ahead.value.newest) == (1, 1)
        bad = plan.model_copy(update={"generation": 2, "excluded": [0]})
        with pytest.raises(PlanRejected) as invalid:
            await sink.publish(bad)
        assert invalid.value.status == 400 and "rank 0" in invalid.value.reason
        with pytest.raises(PlanRejected) as denied:
            await HttpPlanSink(coordinator.url, "wrong").publish(bad)
        assert denied.value.status == 401
        with pytest.raises(AckTimeout):
            await sink.wait_applied(5, timeout=0.05)

    asyncio.run(main())
    assert [p.generation for p in coordinator.applied] == [1]


def status(**over: Any) -> ControlStatus:
    base: dict[str, Any] = dict(
        job=JOB, world=8, generation=2, step=40, steps=100, step_seconds=1.0,
        tokens_per_second=10.0,
        last_migration=MigrationRecord(generation=2, step=37, seconds=1.5, bytes=10),
    )  # fmt: skip
    return control_status(**(base | over))


def test_ack_from_status_reads_the_trainers_status() -> None:
    assert ack_from_status(status(), 3) is None
    ack = ack_from_status(status(), 2)
    assert ack == Ack(generation=2, step=37, migration_seconds=1.5, migration_bytes=10.0)
    older = status(last_migration=MigrationRecord(generation=1, step=5, seconds=1.0, bytes=1))
    assert ack_from_status(older, 2) == Ack(2, 40, None, None)  # no figures for this switch
    failed = status(generation=1, last_failure=PlanFailure(generation=2, reason="out of memory"))
    with pytest.raises(PlanRejected, match="generation 2: out of memory"):
        ack_from_status(failed, 2)


def test_the_controller_over_http(
    coordinator: Coordinator, builder: Any, initial_plan: Plan
) -> None:
    """The operator's path end to end: scrape, detect, plan, POST, poll /status, Migrated."""
    coordinator.train_step()

    async def next_step(_: float) -> None:
        if coordinator.step >= 5:
            coordinator.rates[3] = 4.0
        coordinator.train_step()

    async def main() -> list[EventKind]:
        stop = asyncio.Event()
        events: list[EventKind] = []

        def on_event(e: Any) -> None:
            events.append(e.kind)
            if e.kind in (EventKind.MIGRATED, EventKind.REPLAN_FAILED):
                stop.set()

        c = Controller(
            TrainerScrapeSource(coordinator.url, job=JOB, sleep=next_step),
            HttpPlanSink(coordinator.url, TOKEN, poll_seconds=0.01),
            initial_plan=initial_plan,
            problem_builder=builder,
            policy=StragglerPolicy(),
            planner=greedy_planner,
            on_event=on_event,
            ack_timeout_seconds=5,
        )
        await asyncio.wait_for(c.run(stop), timeout=10)
        c.close()
        assert c.plan.generation == 1 and c.plan.excluded == [2, 3]
        return events

    events = asyncio.run(main())
    assert events == [
        EventKind.STRAGGLER_DETECTED,
        EventKind.PLANNED,
        EventKind.REPLANNED,
        EventKind.MIGRATED,
    ]
    assert coordinator.applied[0].excluded == [2, 3]


def test_the_controller_over_http_follows_a_plan_posted_by_hand(
    coordinator: Coordinator, builder: Any, initial_plan: Plan
) -> None:
    """A person's POST /plan moved the trainers' counter: the controller, which has no record
    of that plan, follows the generation and its own plan is the next one, applied."""
    by_hand = initial_plan.model_copy(update={"generation": initial_plan.generation + 1})
    with ControlClient(coordinator.url, TOKEN) as client:
        assert client.post_plan(by_hand) == 1
    coordinator.train_step()

    async def next_step(_: float) -> None:
        if coordinator.step >= 5:
            coordinator.rates[3] = 4.0
        coordinator.train_step()

    async def main() -> Controller:
        stop = asyncio.Event()
        c = Controller(
            TrainerScrapeSource(coordinator.url, job=JOB, sleep=next_step),
            HttpPlanSink(coordinator.url, TOKEN, poll_seconds=0.01),
            initial_plan=initial_plan,
            problem_builder=builder,
            policy=StragglerPolicy(),
            planner=greedy_planner,
            on_event=lambda e: stop.set() if e.kind is EventKind.MIGRATED else None,
            ack_timeout_seconds=5,
        )
        await asyncio.wait_for(c.run(stop), timeout=10)
        c.close()
        return c

    c = asyncio.run(main())
    assert [p.generation for p in coordinator.applied] == [1, 2]
    assert c.plan.generation == 2 and c.plan.excluded == [2, 3]
    assert not [e for e in c.history if e.kind is EventKind.REPLAN_FAILED]
