"""The coordinator's plan inbox: the switch protocol, without HTTP or torch.

`POST /plan` may arrive at any moment, mid-step included; the plan waits here until the training
loop reaches a step boundary and `take()`s it, so every rank switches between the same two steps.
Generations go up by one, and the inbox is their one owner: the only generation it accepts is
the next one, one above the newest it knows (in force, being applied, or pending), so a newer
plan replaces a pending one. Anything else is a conflict (409): a generation not newer is stale,
one further ahead would let a single POST (a generation of 10^30, say) put every later
controller behind for good. The 409 names the generation in force and the newest, from which a
controller resynchronises (`malleus.controller`). Invalid plans are
refused (400) with every `validate_plan` message as a fault, before any collective could start
on them. The answers' bodies are what `malleus.control`'s clients read: a 409 names the
generation in force and the newest known, a 400 lists ``faults`` of ``{path, message}``.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pydantic import ValidationError

from malleus.control import PlanFailure
from malleus.errors import Fault
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem
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
        self._failure: PlanFailure | None = None

    # ---- state ------------------------------------------------------------------------------
    @property
    def current_generation(self) -> int:
        return self._current

    @property
    def pending_generation(self) -> int | None:
        p = self._pending
        return p.generation if p is not None else None

    @property
    def applying(self) -> int | None:
        """The generation taken for a step boundary and not applied (or failed) yet."""
        return self._applying

    def newest(self) -> int:
        """The highest generation known: in force, being applied, or pending."""
        g = self._current
        if self._applying is not None:
            g = max(g, self._applying)
        if self._pending is not None:
            g = max(g, self._pending.generation)
        return g

    @property
    def last_failure(self) -> PlanFailure | None:
        """The latest taken plan that could not be applied (None once a later one is)."""
        return self._failure

    # ---- the HTTP side -----------------------------------------------------------------------
    def offer(self, plan_json: bytes | str | dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Answer a POST /plan: (202, {generation}), (409, {error, generation, newest, pending})
        or (400, {error, faults})."""
        try:
            if isinstance(plan_json, dict):
                plan = Plan.model_validate(plan_json)
            else:
                json.loads(plan_json)  # a clear message for text that is not JSON at all
                plan = Plan.from_json(plan_json)
        except (ValueError, UnicodeDecodeError) as e:
            if isinstance(e, ValidationError):
                faults = [
                    Fault(".".join(str(x) for x in err["loc"]), err["msg"]) for err in e.errors()
                ]
            else:
                faults = [Fault("", f"body is not JSON: {e}")]
            return _invalid(faults)

        conflict = self._conflict(plan.generation)
        if conflict is not None:
            return conflict
        reasons = self._violations(plan)
        if reasons:
            log.warning("refused plan generation %d: %s", plan.generation, "; ".join(reasons))
            return _invalid([_fault(line) for line in reasons])
        with self._lock:
            conflict = self._conflict_locked(plan.generation)
            if conflict is not None:  # another plan arrived while this one was being validated
                return conflict
            replaced = self.pending_generation
            self._pending = plan
        if replaced is not None:
            log.info("plan generation %d replaces pending %d", plan.generation, replaced)
        else:
            log.info("plan generation %d pending", plan.generation)
        return 202, {"generation": plan.generation}

    def _conflict(self, generation: int) -> tuple[int, dict[str, Any]] | None:
        with self._lock:
            return self._conflict_locked(generation)

    def _conflict_locked(self, generation: int) -> tuple[int, dict[str, Any]] | None:
        """None for the next generation; otherwise the 409 answer."""
        newest = self.newest()
        if generation == newest + 1:
            return None
        if generation <= newest:
            why = f"generation {generation} is not newer than {newest}"
        else:
            why = f"generation {generation} skips ahead: the next one is {newest + 1}"
        return 409, {
            "error": why,
            "generation": self._current,
            "newest": newest,
            "pending": self.pending_generation,
        }

    def _violations(self, plan: Plan) -> list[str]:
        problem = self._problem
        placed = set(plan.active_ranks()) | set(plan.excluded)
        unplaced = {r: None for r in range(problem.world) if r not in placed}
        if placed and unplaced:  # left-out ranks count as unusable: validate_plan won't ask
            problem = problem.model_copy(update={"rates": {**problem.rates, **unplaced}})
        return validate_plan(problem, plan)

    def replan(self, problem: PlanningProblem) -> None:
        """After a recovery: judge later plans against this problem (the failed GPUs unusable);
        a pending plan for the old membership is dropped by the recovery's `applied`."""
        with self._lock:
            self._problem = problem

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
            self._failure = None

    def failed(self, generation: int, reason: str) -> None:
        """A taken plan could not be applied; its generation may be offered again."""
        with self._lock:
            if self._applying == generation:
                self._applying = None
            self._failure = PlanFailure(generation=generation, reason=reason)
        log.error("plan generation %d failed: %s", generation, reason)


def _fault(line: str) -> Fault:
    """A `validate_plan` line (``pipelines[0].stages[1].ranks: rank 9 is ...``) as a fault."""
    head, sep, rest = line.partition(": ")
    return Fault(head, rest) if sep and " " not in head else Fault("", line)


def _invalid(faults: list[Fault]) -> tuple[int, dict[str, Any]]:
    return 400, {
        "error": "invalid plan",
        "faults": [{"path": f.path, "message": f.message} for f in faults],
    }
