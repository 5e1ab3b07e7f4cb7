"""Planners the planner-process tests run in a process (imported there by name)."""

from __future__ import annotations

import time

from malleus.planner import Plan, PlanningProblem, uniform_plan


def spin_when_short(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
    """Ignores a time limit under 1 s (burns CPU until killed); otherwise the uniform plan."""
    if time_limit is not None and time_limit < 1:
        while True:
            time.perf_counter()
    plan = uniform_plan(problem)
    assert plan is not None
    return plan
