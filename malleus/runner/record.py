"""What a local run observed, step by step: the raw material of progress, report and plot.

Two feeds fill it, because neither alone is complete. Rank 0's step lines (stdout) arrive for
every step, in order, with the loss and the step time; the controller's scrapes of /metrics
carry every rank's straggling rate but may skip a step when the training is faster than the
scrape. Plan switches come from the trainers' acknowledgements. All three are merged here by
step index.

Steps are numbered by their 0-based index, like the emulation schedule: a slowdown scheduled at
step 40 first shows in step 40. (The trainer's own counters report completed steps, one more.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from malleus.controller.ports import Observation, RateSource
from malleus.job import INITIAL_GENERATION, StragglerPolicy
from malleus.job.report import step_row
from malleus.notation import STEP_LINE

__all__ = [
    "PlanSwitch",
    "RecordingSource",
    "RunRecord",
    "StepLine",
    "StepRecord",
    "parse_step_line",
    "stragglers",
]


@dataclass(frozen=True)
class StepLine:
    """One parsed step line of rank 0: `[malleus] step 4 (5/30) loss 5.04 ... 0.846s 1,211 tok/s`
    (`malleus.notation.STEP_LINE`: step 4 is the fifth, as the report numbers it)."""

    index: int
    total: int
    loss: float
    seconds: float
    tokens_per_second: float


def parse_step_line(line: str) -> StepLine | None:
    """The step figures of a trainer log line, None for any other line."""
    m = STEP_LINE.search(line)
    if m is None:
        return None
    try:
        return StepLine(
            index=int(m["index"]),
            total=int(m["total"]),
            loss=float(m["loss"]),
            seconds=float(m["seconds"]),
            tokens_per_second=float(m["tps"].replace(",", "")),
        )
    except ValueError:
        return None


@dataclass
class StepRecord:
    """Everything known about one step."""

    index: int
    time: float | None = None
    """Seconds since the run started when the step was reported done."""
    seconds: float | None = None
    tokens_per_second: float | None = None
    loss: float | None = None
    rates: dict[int, float | None] = field(default_factory=dict)

    def to_dict(self, generation: int) -> dict[str, Any]:
        return step_row(
            self.index,
            time=self.time,
            seconds=self.seconds,
            tokens_per_second=self.tokens_per_second,
            loss=self.loss,
            generation=generation,
            rates=self.rates,
        )


@dataclass(frozen=True)
class PlanSwitch:
    """Plan `generation` runs from step `step` on."""

    generation: int
    step: int
    migration_seconds: float | None = None
    migration_bytes: float | None = None


class RunRecord:
    """Thread-safe accumulator of step records and plan switches (stdout thread + event loop)."""

    def __init__(
        self,
        tokens_per_step: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        initial_generation: int = INITIAL_GENERATION,
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self._clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self._steps: dict[int, StepRecord] = {}
        self._initial = PlanSwitch(initial_generation, 0)
        self._switches: dict[int, PlanSwitch] = {initial_generation: self._initial}
        self.last_generation = initial_generation
        """The newest generation the trainers reported (scrapes and acknowledgements)."""
        self.total_steps: int | None = None
        self._calibrations: dict[int, dict[str, Any]] = {}  # generation -> the latest measured

    def _step(self, index: int) -> StepRecord:
        rec = self._steps.get(index)
        if rec is None:
            rec = self._steps[index] = StepRecord(index)
        return rec

    # ---- feeds -------------------------------------------------------------------------------
    def add_line(self, line: StepLine) -> None:
        with self._lock:
            rec = self._step(line.index)
            rec.time = self._clock() - self.started
            rec.loss, rec.seconds = line.loss, line.seconds
            rec.tokens_per_second = line.tokens_per_second
            self.total_steps = line.total

    def add_observation(self, obs: Observation) -> None:
        """A scrape: `obs.step` steps done, so its rates are those of step `obs.step - 1`."""
        if obs.step < 1:
            return
        with self._lock:
            rec = self._step(obs.step - 1)
            rec.rates = dict(obs.rates)
            if rec.seconds is None and obs.step_seconds is not None:
                rec.seconds = obs.step_seconds
                rec.tokens_per_second = self.tokens_per_step / obs.step_seconds
            if rec.time is None:
                rec.time = self._clock() - self.started
            self.last_generation = max(self.last_generation, obs.generation)
            if obs.calibration is not None:  # the cost model's terms, as /status carried them
                self._calibrations[obs.generation] = {
                    "generation": obs.generation,
                    "calibration": dict(obs.calibration),
                    "link_rates": {int(n): float(v) for n, v in obs.link_rates.items()},
                }

    def add_switch(self, switch: PlanSwitch) -> None:
        with self._lock:
            self._switches[switch.generation] = switch
            self.last_generation = max(self.last_generation, switch.generation)

    # ---- views -------------------------------------------------------------------------------
    def switches(self) -> list[PlanSwitch]:
        with self._lock:
            return sorted(self._switches.values(), key=lambda s: s.generation)

    def calibrations(self) -> dict[int, dict[str, Any]]:
        """Per plan generation, the latest calibration observed while it ran (`generation`,
        `calibration`, `link_rates`); the trainers re-measure in each generation's first steps,
        so until then a generation's observations can still carry the previous one's."""
        with self._lock:
            return {g: dict(c) for g, c in sorted(self._calibrations.items())}

    def generation_at(self, index: int) -> int:
        """The plan generation step `index` ran under (the newest switch at or before it)."""
        best = self._initial.generation
        for s in self.switches():
            if s.step <= index:
                best = max(best, s.generation)
        return best

    def get(self, index: int) -> StepRecord | None:
        """A copy of step `index`'s record, None if nothing is known of it."""
        with self._lock:
            r = self._steps.get(index)
            if r is None:
                return None
            return StepRecord(
                r.index, r.time, r.seconds, r.tokens_per_second, r.loss, dict(r.rates)
            )

    def steps(self) -> list[StepRecord]:
        """Copies of the step records, by index."""
        with self._lock:
            return [
                StepRecord(r.index, r.time, r.seconds, r.tokens_per_second, r.loss, dict(r.rates))
                for _, r in sorted(self._steps.items())
            ]

    def latest(self) -> StepRecord | None:
        """The newest step with a time (rates filled from the newest scrape if it lacks them)."""
        with self._lock:
            done = [r for r in self._steps.values() if r.seconds is not None]
            if not done:
                return None
            last = max(done, key=lambda r: r.index)
            rated = [r for r in self._steps.values() if r.rates]
            rates = max(rated, key=lambda r: r.index).rates if rated else {}
            return StepRecord(
                last.index, last.time, last.seconds, last.tokens_per_second, last.loss, dict(rates)
            )

    def steps_done(self) -> int:
        with self._lock:
            return 1 + max(self._steps) if self._steps else 0

    def rows(self) -> list[dict[str, Any]]:
        """JSON-ready per-step rows with the generation each step ran under."""
        return [r.to_dict(self.generation_at(r.index)) for r in self.steps()]


class RecordingSource:
    """A RateSource that records every observation on its way to the controller.

    A failed read while the trainers run (rank 0 busy, or between steps at the very end) is
    retried quietly for up to `patience` seconds; once the trainers are gone (`ended()`), the
    source ends instead. (The warm-up steps after a launch or a switch are passed on: the
    controller itself ignores them, in the cluster as here.)
    """

    def __init__(
        self,
        inner: RateSource,
        record: RunRecord,
        ended: Callable[[], bool],
        *,
        retry_seconds: float = 0.2,
        patience: float = 60.0,
    ) -> None:
        self.inner = inner
        self.record = record
        self.ended = ended
        self.retry_seconds = retry_seconds
        self.patience = patience

    async def read(self) -> Observation | None:
        failing_since: float | None = None
        while True:
            try:
                obs = await self.inner.read()
            except Exception:
                if self.ended():
                    return None
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self.patience:
                    raise
                await asyncio.sleep(self.retry_seconds)
                continue
            failing_since = None
            if obs is None:
                return None
            self.record.add_observation(obs)
            return obs


def stragglers(
    rates: Mapping[int, float | None], policy: StragglerPolicy
) -> dict[int, float | None]:
    """The stragglers among `rates`, by the policy's one definition."""
    return {r: v for r, v in sorted(rates.items()) if policy.is_straggler(v)}
