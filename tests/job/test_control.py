"""The control API end to end: both clients against the trainer's real HTTP control endpoint.

The server is `trainer/endpoint/server.py`'s, serving the status that `trainer/engine/services.py` builds
from the loop's state, the coordinator's plan inbox and its stop request: every answer the
clients parse is one the trainer really gives.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from malleus.control import (
    AsyncControlClient,
    ControlClient,
    ControlError,
    ControlStatus,
    MigrationRecord,
    PlanConflict,
    PlanFailure,
)
from malleus.errors import BadInput
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem
from malleus.trainer.endpoint.metrics import TrainerMetrics
from malleus.trainer.endpoint.server import ControlServer
from malleus.trainer.engine.services import Services, WorkerState
from malleus.trainer.measure.emulation import InjectionQueue
from malleus.trainer.switching.plan_inbox import PlanInbox
from malleus.trainer.switching.protocol import StopControl

TOKEN = "s3cret"


def plan(generation: int, **overrides: Any) -> Plan:
    """Two pipelines of one full TP group each on 1 node x 4 GPUs (tp 2, 4 layers)."""
    body: dict[str, Any] = {
        "generation": generation,
        "tp": 2,
        "pipelines": [
            {"micro_batches": 2, "stages": [{"ranks": [0, 1], "layers": [0, 4]}]},
            {"micro_batches": 2, "stages": [{"ranks": [2, 3], "layers": [0, 4]}]},
        ],
    }
    body.update(overrides)
    return Plan.model_validate(body)


class Trainer:
    """Rank 0's services as the loop sees them, served over real HTTP on 127.0.0.1."""

    def __init__(self) -> None:
        problem = PlanningProblem.load(
            {"nodes": 1, "gpus_per_node": 4, "model": {"layers": 4, "tp": 2}, "micro_batches": 4}
        )
        self.services = Services(
            WorkerState("demo", world=4, steps=10),
            inbox=PlanInbox(problem, current_generation=1),
            stop=StopControl(),
        )
        self.services.state.update(generation=1)
        self.injections = InjectionQueue()
        self.metrics = TrainerMetrics("demo", 0, 0)
        self.server = ControlServer(
            "127.0.0.1",
            0,
            TOKEN,
            status=self.services.status,
            inbox=self.services.inbox,
            metrics=self.metrics,
            inject=self.injections.put,
            stop=self.services.stop.request if self.services.stop else None,
        )


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    with t.server:
        yield t


@pytest.fixture
def client(trainer: Trainer) -> Iterator[ControlClient]:
    with ControlClient(trainer.server.url, TOKEN) as c:
        yield c


def test_status_is_the_loops_state(trainer: Trainer, client: ControlClient) -> None:
    first = client.status()
    assert (first.generation, first.step, first.done, first.last_migration) == (1, 0, False, None)
    record = MigrationRecord(generation=2, step=4, seconds=0.5, bytes=4096)
    trainer.services.state.update(
        generation=2,
        step=10,
        step_seconds=1.5,
        tokens_per_second=2048.0,
        rates={3: float("nan"), 0: 1.0, 1: None, 2: 2.5},  # NaN: failed, as the metrics say it
        migration=record,
    )
    assert client.status() == ControlStatus(
        job="demo",
        world=4,
        generation=2,
        pending_generation=None,
        step=10,
        steps=10,
        done=True,
        stopping=False,
        rates={0: 1.0, 1: None, 2: 2.5, 3: None},  # integer ranks, no NaN on the wire
        step_seconds=1.5,
        tokens_per_second=2048.0,
        last_migration=record,
        last_failure=None,
    )
    assert client.healthz()
    assert "malleus_step" in client.metrics_text()


def test_plans_conflicts_and_refusals(trainer: Trainer, client: ControlClient) -> None:
    assert client.post_plan(plan(2)) == 2
    assert client.status().pending_generation == 2
    with pytest.raises(PlanConflict) as conflict:
        client.post_plan(plan(2))
    assert (conflict.value.code, conflict.value.generation, conflict.value.newest) == (409, 1, 2)
    with pytest.raises(BadInput) as bad:
        client.post_plan(plan(3, excluded=[9]))
    assert any(
        f.path == "excluded" and "rank 9 is beyond the world" in f.message for f in bad.value.faults
    )
    with pytest.raises(ControlError) as refused:
        ControlClient(trainer.server.url, "wrong").post_plan(plan(3))
    assert refused.value.code == 401 and "bearer token" in str(refused.value)

    inbox = trainer.services.inbox
    assert inbox is not None and inbox.take() is not None
    inbox.failed(2, "migration timed out")
    status = client.status()
    assert status.last_failure == PlanFailure(generation=2, reason="migration timed out")
    assert status.pending_generation is None


def test_stop_and_inject(trainer: Trainer, client: ControlClient) -> None:
    with pytest.raises(BadInput, match="no checkpoint directory"):
        client.stop()  # this trainer has nowhere to write one
    assert not client.status().stopping
    client.stop(checkpoint=False)
    assert client.status().stopping
    client.inject(2, 3.0)
    assert trainer.injections.drain() == {2: 3.0}
    with pytest.raises(BadInput, match="factor"):
        client.inject(1, 0.5)


def test_failures_are_control_errors(trainer: Trainer) -> None:
    alone = ControlServer("127.0.0.1", 0, TOKEN, status=trainer.services.status, inbox=None,
                          metrics=None, inject=None)  # fmt: skip
    with alone, ControlClient(alone.url, TOKEN) as c:
        with pytest.raises(ControlError) as err:
            c.post_plan(plan(2))  # not the coordinator
        assert err.value.code == 404 and not isinstance(err.value, PlanConflict)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with ControlClient(url, TOKEN, timeout=1.0) as c:
        assert not c.healthz()
        with pytest.raises(ControlError) as err:
            c.status()
        assert err.value.code is None and err.value.url == url + "/status"


def test_async_client_speaks_the_same(trainer: Trainer) -> None:
    async def session() -> tuple[ControlStatus, ControlStatus]:
        async with AsyncControlClient(trainer.server.url, TOKEN) as c:
            assert await c.healthz()
            before = await c.status()
            assert await c.post_plan(plan(2)) == 2
            with pytest.raises(PlanConflict) as conflict:
                await c.post_plan(plan(2))
            assert conflict.value.newest == 2
            with pytest.raises(BadInput):
                await c.post_plan(plan(3, tp=4))
            await c.inject(1, 2.0)
            await c.stop(checkpoint=False)
            assert "malleus_plan_generation" in await c.metrics_text()
            return before, await c.status()

    before, after = asyncio.run(session())
    assert before.pending_generation is None and not before.stopping
    assert after.pending_generation == 2 and after.stopping
    assert trainer.injections.drain() == {1: 2.0}
