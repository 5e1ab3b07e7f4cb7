"""Which plan generation runs where, as the decision loop follows the trainers' counter.

The trainers own the generation counter: their inbox accepts only the next generation after
the newest it knows (`trainer/switching/plan_inbox.py`). A controller can only mirror it, and
its mirror goes stale whenever someone else moves the counter: a person's ``POST /plan``, a
``--switch``, or the controller itself before a restart, with a plan the trainers took after it.
A stale mirror used to mean a 409 for every later plan, for good. `Generations` keeps the
mirror (the plan in force, the plan published and not yet seen applied, the newest generation
the trainers know) and resynchronises it from what the trainers say, in their 409s and in
every observation's generation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from malleus.planner.plan import Plan

from .ports import GenerationConflict, PlanRecords, PlanSink

__all__ = ["Generations", "Pending"]

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A published plan not yet seen applied: the trainers may still switch to it."""

    plan: Plan
    rates: dict[int, float | None]
    """The rates it was made for (the detector's new belief once it is applied)."""
    reason: str
    planning_seconds: float


class Generations:
    """The plan in force, the pending one, and the newest generation the trainers know."""

    def __init__(self, plan: Plan, pending: Plan | None = None) -> None:
        self.plan = plan
        """The plan in force on the trainers, as far as this controller knows."""
        self.pending: Pending | None = None
        self.newest = plan.generation
        """The highest generation the trainers know (in force or pending)."""
        if pending is not None:  # published before a restart: the trainers may take it yet
            self.pending = Pending(pending, {}, "published before a restart", 0.0)
            self.newest = max(self.newest, pending.generation)

    def next_generation(self) -> int:
        """The generation of the next plan to publish: the one the trainers will accept."""
        return max(self.newest, self.plan.generation) + 1

    def published(self, generation: int) -> None:
        """The trainers accepted `generation`."""
        self.newest = max(self.newest, generation)

    def conflict(self, conflict: GenerationConflict) -> None:
        """A 409: the trainers' newest is the truth, even when lower than the mirror's (then a
        plan published and not seen applied was lost: a failed switch, a restarted coordinator)."""
        self.newest = conflict.newest
        if self.pending is not None and self.pending.plan.generation > conflict.newest:
            self.pending = None

    async def catch_up(self, generation: int, sink: PlanSink) -> Pending | None:
        """The trainers run `generation`, not the plan in force here: what to adopt.

        The pending plan if it is that generation, else the sink's record of it (`PlanRecords`).
        None when its plan is nowhere on record: the last known layout is then relabelled
        `generation`, so that the next plan still gets the generation the trainers expect.
        """
        self.newest = max(self.newest, generation)
        p, self.pending = self.pending, None
        if p is not None and p.plan.generation == generation:
            return p
        plan = None
        if isinstance(sink, PlanRecords):
            try:
                plan = await sink.recorded_plan(generation)
            except Exception as e:  # the records are a help, not a must
                log.warning("looking up the plan of generation %d failed: %r", generation, e)
        if plan is not None and plan.generation == generation:
            why = f"the trainers run generation {generation}, not published by this controller"
            # GPUs that plan leaves out altogether (a recovery's plan drops the failed ones, it
            # does not exclude them) count as failed: a healthy rate of theirs later (a
            # replacement joined) is then a return, and a later plan re-admits them.
            kept = {*plan.active_ranks(), *plan.excluded}
            dropped = {*self.plan.active_ranks(), *self.plan.excluded} - kept
            return Pending(plan, dict.fromkeys(sorted(dropped)), why, 0.0)
        log.warning(
            "the trainers run generation %d, whose plan is not on record: planning from the "
            "layout of generation %d",
            generation,
            self.plan.generation,
        )
        self.plan = self.plan.model_copy(update={"generation": generation})
        return None
