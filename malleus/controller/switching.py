"""Publishing a plan and following the trainers' generations: the loop's side that switches.

`Controller` (malleus.controller.loop) decides whether a new plan pays; this part of it carries
the decision out: publish the plan to the sink, wait for the trainers' acknowledgement and adopt
it as the plan in force, and catch up with a generation the trainers run that the loop did not
publish (a 409 `GenerationConflict`, a manual `POST /plan`, a plan published before a restart).
A module of its own so that the decision loop reads in one sitting; `PlanSwitching` has no state
of its own: it is a base of `Controller` and works on the Controller's (annotated below).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable

from malleus.notation import size
from malleus.planner.plan import Plan

from .decision import Decision, MigrationModel
from .detector import ShiftDetector
from .events import EventData, Migrated, ReplanFailed, Replanned
from .generations import Generations, Pending
from .ports import Ack, GenerationConflict, Observation, PlanSink

__all__ = ["PlanSwitching"]


class PlanSwitching:
    """Publish -> acknowledge -> adopt, and catching up with the trainers' generations."""

    # The Controller's, declared here for the reader (no values: nothing changes at run time).
    sink: PlanSink
    plan: Plan
    clock: Callable[[], float]
    generations: Generations
    detector: ShiftDetector
    migration: MigrationModel
    ack_timeout_seconds: float
    last_step: int
    _plan_first_step: int | None
    _applied_at: float | None
    _retry_at: float | None
    _step_seconds: deque[float]
    _deferral_reported: bool
    _emit: Callable[[str, EventData], Awaitable[None]]
    _fail: Callable[..., Awaitable[None]]

    async def _switch(
        self,
        new: Plan,
        rates: dict[int, float | None],
        reason: str,
        planning_seconds: float,
        decision: Decision,
    ) -> None:
        new = new.model_copy(update={"generation": self.generations.next_generation()})
        try:
            generation = await self.sink.publish(new)
        except GenerationConflict as e:
            await self._resync(e, new.generation)
            return
        except Exception as e:
            await self._fail(f"publishing generation {new.generation} failed: {e}")
            return
        self.generations.published(generation)
        new = new.model_copy(update={"generation": generation})
        await self._emit(
            f"published plan generation {generation}: {decision.reason}",
            Replanned(generation, new, decision),
        )
        pending = Pending(new, rates, reason, planning_seconds)
        try:
            ack = await self.sink.wait_applied(generation, self.ack_timeout_seconds)
        except Exception as e:
            self.generations.pending = pending  # the trainers may still switch to it
            await self._fail(f"generation {generation} was not acknowledged: {e}")
            return
        await self._adopt(pending, ack)

    async def _adopt(self, pending: Pending, ack: Ack) -> None:
        now = self.clock()
        self.generations.plan = pending.plan
        self.generations.pending = None
        self._plan_first_step = None
        self._applied_at = now
        self._retry_at = None
        self._step_seconds.clear()
        self.detector.rebase(pending.rates)
        self.migration.observe(ack.migration_bytes, ack.migration_seconds)
        if ack.migration_seconds is None and ack.migration_bytes is None:
            how = f"adopted ({pending.reason})"  # caught up: nothing measured here
        else:
            secs = "?" if ack.migration_seconds is None else f"{ack.migration_seconds:.2f}"
            moved = "?" if ack.migration_bytes is None else size(ack.migration_bytes)
            how = f"migrated {moved} in {secs} s"
        await self._emit(
            f"trainers run generation {pending.plan.generation} from step {ack.step}: {how}",
            Migrated(
                pending.plan.generation,
                ack.step,
                ack.migration_seconds,
                ack.migration_bytes,
                pending.plan,
                pending.reason,
                pending.planning_seconds,
            ),
        )

    async def _adopt_if_seen(self, obs: Observation) -> None:
        if obs.generation > self.plan.generation:
            await self._catch_up(obs.generation, obs.step)

    async def _catch_up(self, generation: int, step: int) -> None:
        """The trainers run `generation`, not the plan in force here: make it the plan in force."""
        pending = await self.generations.catch_up(generation, self.sink)
        if pending is not None:
            await self._adopt(pending, Ack(generation, step, None, None))
        else:  # the layout is unknown: only its measurements start afresh
            self._plan_first_step = None
            self._step_seconds.clear()

    async def _resync(self, conflict: GenerationConflict, offered: int) -> None:
        """A 409: follow the trainers' generations, and re-plan from them at the next step."""
        if conflict.generation != self.plan.generation:
            await self._catch_up(conflict.generation, self.last_step)
        self.generations.conflict(conflict)
        self._deferral_reported = False
        message = (
            f"generation {offered} refused: the trainers run {conflict.generation} and know "
            f"{conflict.newest}; re-planning from there"
        )
        await self._emit(message, ReplanFailed(message))
