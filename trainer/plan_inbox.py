"""The coordinator's plan inbox: the switch protocol of DESIGN §4.4, without HTTP or torch.

`POST /plan` may arrive at any moment, mid-step included; the plan waits here until the training
loop reaches a step boundary and `take()`s it, so every rank switches between the same two steps.
Generations only go up: one not newer than the plan in force, the one pending, or the one being
applied is stale (409). A newer plan replaces a pending one (the newest wins). Invalid plans are
refused (400) with every `validate_plan` message, before any collective could start on them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from pydantic import ValidationError

from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem, validation_faults
from malleus.planner.validate import validate_plan

__all__ = ["PlanInbox"]

log = logging.getLogger(__name__)


class PlanInbox:
    """Thread-safe holder of the next plan; the HTTP thread offers, the training loop takes.

    `problem` is the job's structure (world, tp, layers, micro-batches, memory). A rank that a
    plan names neither in a stage nor in `excluded` is accepted and must be treated as excluded:
    every trainer process is alive, and a controller that deems a GPU unusable (rate null) may
    leave it out; the controller checks the plan against its own rates before posting.
    """

    def __init__(self, problem: PlanningProblem, current_generation: int) -> None:
        self._problem = problem
        self._lock = threading.Lock()
        self._current = current_generation
        self._pending: Plan | None = None
        self._applying: int | None = None  # taken, not yet applied
        self._last_error: str | None = None
        self._applied_at: float | None = None

    # ---- state ------------------------------------------------------------------------------
    @property
    def current_generation(self) -> int:
        return self._current

    @property
    def pending_generation(self) -> int | None:
        p = self._pending
        return p.generation if p is not None else None

    def _newest(self) -> int:
        """The highest generation known: in force, being applied, or pending."""
        g = self._current
        if self._applying is not None:
            g = max(g, self._applying)
        if self._pending is not None:
            g = max(g, self._pending.generation)
        return g

    def status(self) -> dict[str, Any]:
        """For /status: generations in force, pending and being applied; the last failure."""
        with self._lock:
            return {
                "current_generation": self._current,
                "pending_generation": self.pending_generation,
                "applying_generation": self._applying,
                "applied_at": self._applied_at,
                "last_error": self._last_error,
            }

    # ---- the HTTP side -----------------------------------------------------------------------
    def offer(self, plan_json: bytes | str | dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Answer a POST /plan: (202, {generation}), (409, {error, current, pending}) or
        (400, {error, reasons})."""
        try:
            if isinstance(plan_json, dict):
                plan = Plan.model_validate(plan_json)
            else:
                json.loads(plan_json)  # a clear message for text that is not JSON at all
                plan = Plan.from_json(plan_json)
        except (ValueError, UnicodeDecodeError) as e:
            if isinstance(e, ValidationError):
                reasons = validation_faults(e)
            else:
                reasons = [f"body is not JSON: {e}"]
            return 400, {"error": "invalid plan", "reasons": reasons}

        stale = self._stale(plan.generation)
        if stale is not None:
            return stale
        reasons = self._violations(plan)
        if reasons:
            log.warning("refused plan generation %d: %s", plan.generation, "; ".join(reasons))
            return 400, {"error": "invalid plan", "reasons": reasons}
        with self._lock:
            stale = self._stale_locked(plan.generation)
            if stale is not None:  # a newer plan arrived while this one was being validated
                return stale
            replaced = self.pending_generation
            self._pending = plan
        if replaced is not None:
            log.info("plan generation %d replaces pending %d", plan.generation, replaced)
        else:
            log.info("plan generation %d pending", plan.generation)
        return 202, {"generation": plan.generation}

    def _stale(self, generation: int) -> tuple[int, dict[str, Any]] | None:
        with self._lock:
            return self._stale_locked(generation)

    def _stale_locked(self, generation: int) -> tuple[int, dict[str, Any]] | None:
        if generation > self._newest():
            return None
        return 409, {
            "error": f"generation {generation} is not newer than {self._newest()}",
            "current": self._current,
            "pending": self.pending_generation,
        }

    def _violations(self, plan: Plan) -> list[str]:
        problem = self._problem
        placed = set(plan.active_ranks()) | set(plan.excluded)
        unplaced = {r: None for r in range(problem.world) if r not in placed}
        if placed and unplaced:  # left-out ranks count as unusable: validate_plan won't ask
            problem = problem.model_copy(update={"rates": {**problem.rates, **unplaced}})
        return validate_plan(problem, plan)

    # ---- the training loop's side --------------------------------------------------------------
    def take(self) -> Plan | None:
        """At a step boundary: the pending plan (now 'being applied'), or None."""
        with self._lock:
            plan, self._pending = self._pending, None
            if plan is not None:
                self._applying = plan.generation
            return plan

    def applied(self, generation: int) -> None:
        """The plan of `generation` is in force on every rank."""
        with self._lock:
            self._current = max(self._current, generation)
            if self._applying is not None and self._applying <= generation:
                self._applying = None
            if self._pending is not None and self._pending.generation <= generation:
                self._pending = None
            self._applied_at = time.time()
            self._last_error = None

    def failed(self, generation: int, reason: str) -> None:
        """A taken plan could not be applied; its generation may be offered again."""
        with self._lock:
            if self._applying == generation:
                self._applying = None
            self._last_error = f"generation {generation}: {reason}"
        log.error("plan generation %d failed: %s", generation, reason)
