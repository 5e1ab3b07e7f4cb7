"""Planners the planner-process tests run in a process (imported there by name)."""

from __future__ import annotations

import json
import time
from typing import Any

from malleus.planner import Plan, PlanningProblem, uniform_plan


def spin_when_short(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
    """Ignores a time limit under 1 s (burns CPU until killed); otherwise the uniform plan."""
    if time_limit is not None and time_limit < 1:
        while True:
            time.perf_counter()
    plan = uniform_plan(problem)
    assert plan is not None
    return plan


def probe(conn: Any, problem_json: str, until: float, pause: float) -> None:
    """Plan ``problem_json`` again and again until ``until`` (CLOCK_MONOTONIC, shared by every
    process of the machine), pausing ``pause`` between plans; send back the (start, wall
    seconds) of each as JSON: what planning that problem costs on this machine, moment by
    moment, in a process of its own."""
    from malleus.planner.search import plan

    problem = PlanningProblem.load(problem_json)
    plan(problem)  # warm
    samples = []
    while time.monotonic() < until:
        t0 = time.monotonic()
        plan(problem)
        samples.append((t0, time.monotonic() - t0))
        time.sleep(pause)
    conn.send_bytes(json.dumps(samples).encode())
