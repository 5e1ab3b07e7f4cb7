"""Calling the planner: the default one, and running any planner off the event loop, in time.

The planner is pure CPU work; run on the event loop it would freeze the operator (kopf's
handlers, health probes, the metrics reads) for as long as it thinks. It runs in a worker thread
instead, and the loop stops waiting after the policy's budget plus a grace period. A thread
cannot be killed, so a planner should honour its `time_limit` itself; one that does not keeps
its thread busy until it returns, and its late answer is dropped. The controller gives the
planner its own small pool rather than asyncio's default executor: `asyncio.run` joins the
default executor on exit, so one hung planner would hang the operator's shutdown.

The operator hands the controller a planner whose work runs in a planner process
(`processes.JobPlanner`): the worker thread then only waits on a pipe, and an overrunning plan
is killed there. The local runner keeps the search itself in the thread.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Protocol

from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem
from malleus.planner.search import plan as search_plan

__all__ = ["Planner", "PlanningTimeout", "default_planner", "run_planner"]


class Planner(Protocol):
    """`planner(problem, time_limit=seconds) -> Plan`, e.g. `malleus.planner.search.plan`."""

    def __call__(self, problem: PlanningProblem, *, time_limit: float | None = None) -> Plan: ...


class PlanningTimeout(TimeoutError):
    """The planner did not answer within its budget."""


def default_planner(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
    """The planner's search (`malleus.planner.search.plan`)."""
    return search_plan(problem, time_limit=time_limit)


async def run_planner(
    planner: Planner,
    problem: PlanningProblem,
    *,
    time_limit: float,
    grace: float = 1.0,
    clock: Callable[[], float] = time.perf_counter,
    executor: Executor | None = None,
) -> tuple[Plan, float]:
    """Run `planner` in a worker thread; returns (plan, seconds by `clock`).

    Raises PlanningTimeout after `time_limit + grace` real seconds. `executor` None: asyncio's
    default one.
    """
    started = clock()
    call = functools.partial(planner, problem, time_limit=time_limit)
    future = asyncio.get_running_loop().run_in_executor(executor, call)
    try:
        plan = await asyncio.wait_for(future, timeout=time_limit + grace)
    except TimeoutError:
        raise PlanningTimeout(
            f"the planner did not answer within {time_limit:g} s (+{grace:g} s grace)"
        ) from None
    return plan, clock() - started
