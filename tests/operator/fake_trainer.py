"""A trainer coordinator for the operator's decision loop, served on 127.0.0.1.

`Coordinator` is the trainer's own (torch-free) control endpoint, plan inbox and metrics for job
"demo": `ControlServer` answering /status, /metrics and POST /plan, with a `train` loop that
plays the coordinator's step boundaries. `Stop` is kopf's DaemonStopped as the daemon uses it.
The trainer modules are imported when a `Coordinator` is made (a skip where they are absent),
so a test module importing this one still loads without them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

import pytest

from malleus.control import ControlStatus, MigrationRecord
from malleus.job import ResolvedJob
from malleus.operator.context import Context

__all__ = ["Coordinator", "Stop"]


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


class Coordinator:
    """Rank 0 of `job` ("demo", 8 ranks, 4 a node) at generation 1, its endpoint started on
    127.0.0.1 (`server.stop()` ends it) and answering `token`.

    Each step boundary of `train` takes a posted plan unless `hold` is set and applies it (a
    migration of 0.25 s and 4096 bytes), then publishes the rates: 3.0 for the ranks in `slow`
    from step `slow_from` on, 1.0 for the others. The attributes may change while it trains."""

    def __init__(
        self,
        job: ResolvedJob,
        token: str,
        *,
        slow: Iterable[int],
        slow_from: int = 1,
        hold: bool = False,
    ) -> None:
        control = pytest.importorskip("malleus.trainer.endpoint.server")
        from malleus.trainer.endpoint.metrics import TrainerMetrics
        from malleus.trainer.switching.plan_inbox import PlanInbox

        self.job = job
        self.slow, self.slow_from, self.hold = set(slow), slow_from, hold
        self.step = 0
        self.migration: MigrationRecord | None = None
        self.inbox = PlanInbox(job.problem(), current_generation=1)
        self.metrics = TrainerMetrics("demo", rank=0, node=0)
        self.metrics.observe_plan(1)
        self.server: Any = control.ControlServer(
            "127.0.0.1",
            0,
            token,
            status=self.status,
            inbox=self.inbox,
            metrics=self.metrics,
            inject=None,
        ).start()

    def status(self) -> ControlStatus:
        """What the endpoint serves at /status."""
        return ControlStatus(
            job="demo",
            world=self.job.world,
            generation=self.inbox.current_generation,
            pending_generation=self.inbox.pending_generation,
            step=self.step,
            steps=self.job.steps,
            done=False,
            stopping=False,
            rates={},
            step_seconds=0.05,
            tokens_per_second=20480.0,
            last_migration=self.migration,
            last_failure=self.inbox.last_failure,
        )

    def context(self, ctx: Context) -> Context:
        """`ctx` with the operator's endpoint template aimed at this endpoint."""
        settings = ctx.settings.with_(endpoint_template=f"http://127.0.0.1:{self.server.port}")
        return Context(ctx.cluster, settings, ctx.metrics)

    async def train(self, stop: Stop) -> None:
        """Step boundaries every 50 ms until `stop`."""
        step = 0
        while not stop:
            step += 1
            plan = None if self.hold else self.inbox.take()
            if plan is not None:
                self.inbox.applied(plan.generation)
                self.metrics.observe_plan(plan.generation)
                self.metrics.observe_migration(0.25, 4096)
                self.migration = MigrationRecord(
                    generation=plan.generation, step=step, seconds=0.25, bytes=4096
                )
            slow = self.slow if step >= self.slow_from else set()
            rates = {r: (3.0 if r in slow else 1.0) for r in range(8)}
            self.metrics.observe_rates(rates, {r: r // 4 for r in range(8)})
            self.metrics.observe_step(step, 0.05, 20480.0, rates[0], 0.04)
            self.step = step
            await asyncio.sleep(0.05)
