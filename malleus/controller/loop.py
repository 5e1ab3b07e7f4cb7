"""The decision loop: rates -> detect a shift -> plan -> is it worth it -> publish -> acknowledge.

One component, used unchanged by the operator and by the local runner (DESIGN §2); they differ
only in the RateSource and PlanSink they hand it. Everything that can go wrong on the way
(planner error or timeout, an invalid plan, a refused POST, no acknowledgement) is reported as a
ReplanFailed event and leaves the plan in force alone: the loop itself never dies of it, since
a job that trains on a stale plan is better than one whose controller crashed.

State is small and explicit: the plan in force, the detector's believed rates, the time of the
last applied plan (cooldown) and of the last failure (retry), a calibration of the cost model in
seconds, and the migration bandwidth learned so far.

The first `warmup_steps` steps under each plan pay one-off costs (allocations, new groups) that
look like stragglers; they are ignored here, so the operator and the runner decide alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from malleus.job.spec import StragglerPolicy
from malleus.planner.cost import (
    ideal_step_time,
    plan_step_time,
    reference_step_time,
    uniform_step_time,
)
from malleus.planner.plan import Estimate, Plan
from malleus.planner.problem import PlanningProblem
from malleus.planner.validate import validate_plan

from .decision import MIB, Decision, MigrationModel, decide
from .detector import Shift, ShiftDetector
from .events import (
    DecisionEvent,
    EventData,
    Migrated,
    Planned,
    ReplanFailed,
    Replanned,
    ReplanSkipped,
    StragglerDetected,
)
from .planning import Planner, default_planner, run_planner
from .ports import Ack, Observation, PlanSink, RateSource

__all__ = ["Controller", "EventCallback", "ProblemBuilder"]

log = logging.getLogger(__name__)

ProblemBuilder = Callable[[Mapping[int, "float | None"], "Plan | None"], PlanningProblem]
"""`builder(rates, plan_in_force) -> PlanningProblem`: `malleus.job.ResolvedJob.problem`."""
EventCallback = Callable[[DecisionEvent], Any]
"""Called with every event; may be a coroutine function. Its failures are logged, not raised."""


def _finite(x: float) -> float | None:
    """JSON has no infinity: a reference step time of a job that cannot run is None."""
    return x if math.isfinite(x) else None


@dataclass
class _Pending:
    """A published plan whose acknowledgement did not come in time: it may still be applied."""

    plan: Plan
    rates: dict[int, float | None]
    reason: str
    planning_seconds: float


class Controller:
    """Watches rates, re-plans when they shift, and switches the trainers when it pays."""

    def __init__(
        self,
        source: RateSource,
        sink: PlanSink,
        *,
        initial_plan: Plan,
        problem_builder: ProblemBuilder,
        policy: StragglerPolicy | None = None,
        planner: Planner = default_planner,
        clock: Callable[[], float] = time.time,
        on_event: EventCallback | None = None,
        migration: MigrationModel | None = None,
        initial_rates: Mapping[int, float | None] | None = None,
        ack_timeout_seconds: float = 600.0,
        planner_grace_seconds: float = 1.0,
        read_retry_seconds: float = 5.0,
        warmup_steps: int = 2,
        history_limit: int = 1000,
    ) -> None:
        self.source = source
        self.sink = sink
        self.policy = policy or StragglerPolicy()
        self.planner = planner
        self.problem_builder = problem_builder
        self.clock = clock
        self.on_event = on_event
        self.migration = migration or MigrationModel()
        self.ack_timeout_seconds = ack_timeout_seconds
        self.planner_grace_seconds = planner_grace_seconds
        self.read_retry_seconds = read_retry_seconds
        self.warmup_steps = warmup_steps

        self.plan: Plan = initial_plan
        """The plan in force (acknowledged by the trainers)."""
        self.detector = ShiftDetector(self.policy, believed=initial_rates)
        self._history: deque[DecisionEvent] = deque(maxlen=history_limit)
        self.last_step = -1
        """The last step observed."""
        self._plan_first_step: int | None = None
        """The first step observed under the plan in force (None: none yet)."""

        self._published = initial_plan.generation
        self._pending: _Pending | None = None
        self._applied_at: float | None = None
        self._retry_at: float | None = None
        self._deferral_reported = False
        self._step_seconds: deque[float] = deque(maxlen=self.policy.window_steps)
        self._seconds_per_unit: float | None = None
        self._evidence: dict[int, str] = {}
        self._warned_generation = -1
        # Its own pool, not asyncio's default: a planner thread that ignores its time limit
        # must not hang asyncio.run's shutdown. Daemon-free threads still end with the planner.
        self._planner_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="malleus-planner")

    # ---- public API ------------------------------------------------------------------------
    @property
    def history(self) -> list[DecisionEvent]:
        """Every decision event, oldest first (the last `history_limit`)."""
        return list(self._history)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Observe until `stop` is set or the source ends (read() returns None)."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            reader = asyncio.ensure_future(self.source.read())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if reader not in done:
                reader.cancel()
                break
            stopper.cancel()
            try:
                obs = reader.result()
            except Exception as e:  # a metrics endpoint down is not the controller's death
                log.warning(
                    "reading rates failed: %r; retrying in %g s", e, self.read_retry_seconds
                )
                await asyncio.sleep(self.read_retry_seconds)
                continue
            if obs is None:
                break
            await self.observe(obs)

    def close(self) -> None:
        """Release the planner's threads (a planner still running finishes on its own)."""
        self._planner_pool.shutdown(wait=False, cancel_futures=True)

    async def step(self) -> Observation | None:
        """Read and process one observation; None when the source has ended."""
        obs = await self.source.read()
        if obs is not None:
            await self.observe(obs)
        return obs

    async def observe(self, obs: Observation) -> None:
        """Process one step's observation: detect, and if needed plan, decide, publish, wait."""
        if obs.step <= self.last_step:
            return  # the same step read twice (a scrape faster than the training)
        self.last_step = obs.step
        now = self.clock()
        await self._adopt_if_seen(obs)
        if self._warming_up(obs):
            return
        if (
            obs.generation == self.plan.generation
            and obs.step_seconds is not None
            and math.isfinite(obs.step_seconds)
            and obs.step_seconds > 0
        ):
            self._step_seconds.append(obs.step_seconds)
        self._evidence = dict(obs.evidence)  # only current evidence: a past throttle is no reason
        shift = self.detector.observe(obs.step, obs.rates, now)
        if shift is None:
            self._deferral_reported = False
            return
        await self._handle(shift, now)

    def _warming_up(self, obs: Observation) -> bool:
        """Whether `obs` is one of the first `warmup_steps` observed under the plan in force."""
        if obs.generation != self.plan.generation:
            return False
        if self._plan_first_step is None:
            self._plan_first_step = obs.step
        return obs.step - self._plan_first_step < self.warmup_steps

    # ---- the decision ----------------------------------------------------------------------
    async def _handle(self, shift: Shift, now: float) -> None:
        if self._retry_at is not None and now < self._retry_at:
            await self._defer(
                shift, f"retrying {self._retry_at - now:.0f} s after the last failure"
            )
            return
        if (
            not shift.urgent
            and self._applied_at is not None
            and now - self._applied_at < self.policy.cooldown_seconds
        ):
            left = self.policy.cooldown_seconds - (now - self._applied_at)
            await self._defer(
                shift, f"cooldown: {left:.0f} s left of {self.policy.cooldown_seconds:g} s"
            )
            return
        self._deferral_reported = False
        evidence = {r: self._evidence[r] for r in shift.ranks if r in self._evidence}
        rates = self.detector.smoothed()
        await self._emit(shift.reason, StragglerDetected(shift, rates, evidence))
        try:
            problem = self.problem_builder(rates, self.plan)
        except Exception as e:
            await self._fail(f"cannot build the planning problem: {e}")
            return
        try:
            new, planning_seconds = await run_planner(
                self.planner,
                problem,
                time_limit=self.policy.planning_timeout_seconds,
                grace=self.planner_grace_seconds,
                clock=self.clock,
                executor=self._planner_pool,
            )
        except Exception as e:
            await self._fail(f"planner failed: {e}")
            return
        violations = validate_plan(problem, new)
        if violations:
            await self._fail(
                f"the planner's plan is invalid ({len(violations)} violations)", violations
            )
            return

        decision = self._decide(problem, new, planning_seconds)
        new = self._with_estimate(problem, new, decision, planning_seconds)
        await self._emit(
            f"planned in {planning_seconds:.2f} s: step time {decision.new_units:.1f} vs "
            f"{decision.old_units:.1f} (layer-time units), {decision.migration_mb:.1f} MiB to move",
            Planned(new, decision),
        )
        excluded = [r for r in new.excluded if problem.rate(r) is not None]
        if excluded and not self.policy.allow_exclusion and decision.apply:
            decision = dataclasses.replace(
                decision,
                apply=False,
                reason=f"the plan leaves usable ranks {excluded} idle and allowExclusion is false",
            )
        if not decision.apply:
            await self._emit(decision.reason, ReplanSkipped(decision.reason, decision=decision))
            self.detector.rebase(rates)
            return
        await self._switch(new, rates, shift.reason, planning_seconds, decision)

    def _decide(self, problem: PlanningProblem, new: Plan, planning_seconds: float) -> Decision:
        t_old = plan_step_time(problem, self.plan)
        if self._step_seconds and math.isfinite(t_old) and t_old > 0:
            self._seconds_per_unit = statistics.median(self._step_seconds) / t_old
        return decide(
            problem,
            self.plan,
            new,
            policy=self.policy,
            seconds_per_unit=self._seconds_per_unit,
            planning_seconds=planning_seconds,
            migration=self.migration,
        )

    @staticmethod
    def _with_estimate(
        problem: PlanningProblem, plan: Plan, decision: Decision, planning_seconds: float
    ) -> Plan:
        """The plan with its cost-model estimate (filled in if the planner gave none)."""
        est = plan.estimate
        if est is None:
            est = Estimate(
                step_time=decision.new_units,
                uniform_step_time=_finite(uniform_step_time(problem)),
                ideal_step_time=_finite(ideal_step_time(problem)),
                reference_step_time=_finite(reference_step_time(problem)),
            )
        est = est.model_copy(
            update={"migration_mb": decision.migration_mb, "planning_seconds": planning_seconds}
        )
        return plan.model_copy(update={"estimate": est})

    async def _switch(
        self,
        new: Plan,
        rates: dict[int, float | None],
        reason: str,
        planning_seconds: float,
        decision: Decision,
    ) -> None:
        new = new.model_copy(update={"generation": max(self._published, self.plan.generation) + 1})
        try:
            generation = await self.sink.publish(new)
        except Exception as e:
            await self._fail(f"publishing generation {new.generation} failed: {e}")
            return
        self._published = max(self._published, generation)
        new = new.model_copy(update={"generation": generation})
        await self._emit(
            f"published plan generation {generation}: {decision.reason}",
            Replanned(generation, new, decision),
        )
        pending = _Pending(new, rates, reason, planning_seconds)
        try:
            ack = await self.sink.wait_applied(generation, self.ack_timeout_seconds)
        except Exception as e:
            self._pending = pending  # the trainers may still switch; _adopt_if_seen will notice
            await self._fail(f"generation {generation} was not acknowledged: {e}")
            return
        await self._adopt(pending, ack)

    async def _adopt(self, pending: _Pending, ack: Ack) -> None:
        now = self.clock()
        self.plan = pending.plan
        self._plan_first_step = None
        self._pending = None
        self._applied_at = now
        self._retry_at = None
        self._step_seconds.clear()
        self.detector.rebase(pending.rates)
        self.migration.observe(ack.migration_bytes, ack.migration_seconds)
        secs = "?" if ack.migration_seconds is None else f"{ack.migration_seconds:.2f}"
        moved = "?" if ack.migration_bytes is None else f"{ack.migration_bytes / MIB:.1f}"
        await self._emit(
            f"trainers run generation {pending.plan.generation} from step {ack.step}: "
            f"migrated {moved} MiB in {secs} s",
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
        p = self._pending
        if p is not None and obs.generation >= p.plan.generation:
            await self._adopt(p, Ack(p.plan.generation, obs.step, None, None))
        elif obs.generation > max(self.plan.generation, self._warned_generation) and p is None:
            self._warned_generation = obs.generation
            log.warning(
                "trainers report plan generation %d, newer than the %d this controller applied",
                obs.generation,
                self.plan.generation,
            )

    # ---- helpers ---------------------------------------------------------------------------
    async def _defer(self, shift: Shift, why: str) -> None:
        """A shift that must wait: reported once per wait, then re-examined every step."""
        if not self._deferral_reported:
            self._deferral_reported = True
            await self._emit(f"{why} ({shift.reason})", ReplanSkipped(why, shift=shift))

    async def _fail(self, message: str, violations: list[str] | None = None) -> None:
        self._retry_at = self.clock() + self.policy.cooldown_seconds
        self._deferral_reported = False
        await self._emit(message, ReplanFailed(message, tuple(violations or ())))

    async def _emit(self, message: str, data: EventData) -> None:
        event = DecisionEvent(step=self.last_step, time=self.clock(), message=message, data=data)
        kind = event.kind
        self._history.append(event)
        log.info("%s at step %d: %s", kind.value, self.last_step, message)
        if self.on_event is None:
            return
        try:
            result = self.on_event(event)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("event callback failed for %s", kind.value)
