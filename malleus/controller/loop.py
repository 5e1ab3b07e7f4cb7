"""The decision loop: rates -> detect a shift -> plan -> is it worth it -> publish -> acknowledge.

One component, used unchanged by the operator and by the local runner; they differ
only in the RateSource and PlanSink they hand it. Everything that can go wrong on the way
(planner error or timeout, an invalid plan, a refused POST, no acknowledgement) is reported as a
ReplanFailed event and leaves the plan in force alone: the loop itself never dies of it, since
a job that trains on a stale plan is better than one whose controller crashed.

State is small and explicit: the plan in force, the detector's believed rates, the time of the
last applied plan (cooldown) and of the last failure (retry), the trainers' latest calibration
(cost terms, link rates: every problem carries it, `calibrated`), the migration bandwidth.

Generations: the trainers own the counter and this loop follows it (`generations`). A 409
(`GenerationConflict`) is adopted and the loop re-plans from there at the next step; trainers
seen running a generation newer than the plan in force here are caught up with likewise.
Publishing, acknowledging and adopting a plan, and that catching up, are `switching`'s.

Rates are bounded and the share of the job one re-plan may write off is limited (`guard`).

Steps are believed only forward and within what training could have done since the last one
(`steps.StepGuard`): one forged ``step 10^9`` is ignored, with a warning, instead of making
every real observation after it look old.

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
from typing import Any

from malleus.job.rates import bounded_rates
from malleus.job.spec import StragglerPolicy
from malleus.notation import size_mib
from malleus.planner.cost import plan_step_time
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem
from malleus.planner.validate import validate_plan

from .decision import Decision, MigrationModel, calibrated, decide, with_estimate
from .detector import Shift, ShiftDetector
from .events import (
    DecisionEvent,
    EventData,
    Planned,
    ReplanFailed,
    ReplanSkipped,
    StragglerDetected,
)
from .generations import Generations
from .guard import ExclusionGuard
from .planning import Planner, default_planner, run_planner
from .ports import Observation, PlanSink, RateSource
from .steps import StepGuard
from .switching import PlanSwitching

__all__ = ["Controller", "EventCallback", "ProblemBuilder", "RatesCallback"]

log = logging.getLogger(__name__)

ProblemBuilder = Callable[[Mapping[int, "float | None"], "Plan | None"], PlanningProblem]
"""`builder(rates, plan_in_force) -> PlanningProblem`: `malleus.job.ResolvedJob.problem`."""
EventCallback = Callable[[DecisionEvent], Any]
"""Called with every event; may be a coroutine function. Its failures are logged, not raised."""
RatesCallback = Callable[[int, Mapping[int, "float | None"]], Any]
"""`on_rates(step, smoothed)`: the rates the decisions are made from, after every observation
the detector takes (warm-up ones are not), before any decision on them; may be a coroutine
function. Its failures are logged, not raised."""


class Controller(PlanSwitching):
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
        on_rates: RatesCallback | None = None,
        migration: MigrationModel | None = None,
        initial_rates: Mapping[int, float | None] | None = None,
        pending_plan: Plan | None = None,
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
        self.on_rates = on_rates
        self.migration = migration or MigrationModel()
        self.ack_timeout_seconds = ack_timeout_seconds
        self.planner_grace_seconds = planner_grace_seconds
        self.read_retry_seconds = read_retry_seconds
        self.warmup_steps = warmup_steps

        self.generations = Generations(initial_plan, pending_plan)
        self.detector = ShiftDetector(self.policy, believed=initial_rates)
        self.world = problem_builder({}, None).world
        self.guard = ExclusionGuard(self.policy, self.world)
        self._history: deque[DecisionEvent] = deque(maxlen=history_limit)
        self.steps = StepGuard(clock=clock, what="controller")
        self.last_step = -1  # the last step observed and believed
        self._plan_first_step: int | None = None  # first step seen under the plan in force

        self._applied_at: float | None = None
        self._retry_at: float | None = None
        self._deferral_reported = False
        self._step_seconds: deque[float] = deque(maxlen=self.policy.window_steps)
        self._seconds_per_unit: float | None = None
        self._calibration: tuple[Mapping[str, Any] | None, dict[int, float]] = (None, {})
        self._evidence: dict[int, str] = {}
        # Its own pool, not asyncio's default: a planner thread that ignores its time limit
        # must not hang asyncio.run's shutdown. Daemon-free threads still end with the planner.
        self._planner_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="malleus-planner")

    # ---- public API ------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan in force (acknowledged by the trainers, or seen running there)."""
        return self.generations.plan

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
        if not self.steps.accept(obs.step):
            return  # the same step read twice (a scrape faster than the training), or implausible
        self.last_step = obs.step
        if self.steps.moved:  # a confirmed jump (a restart from a checkpoint): warm up anew
            self._plan_first_step = None
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
        if obs.calibration is not None:  # the trainers' latest measurement of the cost model
            self._calibration = (obs.calibration, dict(obs.link_rates))
        shift = self.detector.observe(obs.step, bounded_rates(obs.rates, self.world), now)
        smoothed = self.detector.smoothed()
        self.guard.track(obs.step, smoothed)
        # Before the decision: whoever shows the rates (the operator's status) shows the
        # straggler a re-plan is about before the re-plan, from the very windows it was decided on
        await self._call(self.on_rates, "rates", obs.step, smoothed)
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
        rates, held = self.guard.limit(self.detector.smoothed(), self.detector.believed, shift.step)
        if held and set(shift.ranks) <= set(held):
            left = self.guard.steps_left(held, shift.step)
            await self._defer(
                shift,
                f"{len(held)} of {self.world} GPUs report straggling at once, more than "
                f"maxExclusionShare allows ({self.guard.allowed}): believed if it lasts "
                f"{left} more step(s)",
            )
            return
        self._deferral_reported = False
        evidence = {r: self._evidence[r] for r in shift.ranks if r in self._evidence}
        await self._emit(shift.reason, StragglerDetected(shift, rates, evidence))
        try:
            problem = calibrated(self.problem_builder(rates, self.plan), *self._calibration)
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
        new = with_estimate(problem, new, decision, planning_seconds)
        await self._emit(
            f"planned in {planning_seconds:.2f} s: step time {decision.new_units:.1f} vs "
            f"{decision.old_units:.1f} (layer-time units), {size_mib(decision.migration_mb)} to move",
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
        await self._call(self.on_event, kind.value, event)

    @staticmethod
    async def _call(callback: Callable[..., Any] | None, what: str, *args: Any) -> None:
        """`callback(*args)`, awaited if it returns an awaitable; its failure is logged: a
        status that could not be written is no reason to stop deciding."""
        if callback is None:
            return
        try:
            result = callback(*args)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("%s callback failed", what)
