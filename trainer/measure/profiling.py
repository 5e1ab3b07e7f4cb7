"""Straggling rates: a rank's compute time per unit of work over a healthy reference.

A unit is one logical layer-shard for one micro-batch in one pass: a forward of a stage with
`l` layers on a GPU holding `2^k` shards records `l * 2^k` units, and so does its backward. Only
compute is timed, never waits on communication, so a rank stalled by a slow peer still reports
its own speed; group size cancels out (2^k shards take 2^k times as long), so ranks are
comparable whatever plan they serve, and the rate feeds the planner directly (1.0 = healthy).

The cost model's other terms (calibration) are trainer/engine/calibrator.py's and
trainer/measure/calibration_terms.py's.

Torch-free. On real GPUs the caller must synchronise the device before reading the clock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["RateProfiler", "healthy_reference", "time_per_unit"]


def healthy_reference(per_rank_seconds_per_unit: Sequence[float | None]) -> float:
    """A healthy GPU's seconds per unit, from every rank's measurement (after an all_gather).

    The median of the fastest half: stragglers only ever make a GPU slower, and they are a
    minority, so the fastest half is healthy and its median ignores one lucky fast outlier as
    well as every slow one. A plain median would drift upwards as soon as stragglers approach
    half the ranks; the minimum would turn one noisy fast measurement into a false reference.
    Missing (None), non-finite and non-positive entries are ignored.
    """
    xs = sorted(
        float(x) for x in per_rank_seconds_per_unit if x is not None and math.isfinite(x) and x > 0
    )
    if not xs:
        raise ValueError("healthy_reference: no rank reported a positive, finite time per unit")
    return statistics.median(xs[: (len(xs) + 1) // 2])


def time_per_unit(fn: Callable[[], object], units: int, repeats: int = 3) -> float:
    """Seconds per unit of `fn` (which does `units` units of work), best of `repeats`.

    The self-benchmark of an excluded rank on a real GPU: `fn` must run a representative
    layer-shard and synchronise the device. The best run filters out one-off interference.
    """
    if units < 1 or repeats < 1:
        raise ValueError("time_per_unit: units and repeats must be >= 1")
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / units


class RateProfiler:
    """Accumulates one rank's timed computes per step and turns them into a straggling rate.

    `reference_s`: healthy seconds per unit. Known up front under emulation
    (`EmulatedClock.reference_s`); on real GPUs pass None and `calibrate()` once, after a few
    warm-up steps, with `healthy_reference()` of all ranks' `seconds_per_unit`. The reference
    then stays fixed: re-calibrating every step would follow a job that slows down as a whole,
    and a rate must compare against healthy hardware, not against today's average.
    `window`: steps averaged by `rate` and `seconds_per_unit` (smooths noise; 1 = last step).
    Rates are clamped to >= 1.0: a GPU faster than the reference is healthy, and the planner's
    contract takes rates >= 1.0.
    """

    def __init__(self, reference_s: float | None, window: int = 1) -> None:
        if window < 1:
            raise ValueError(f"window: {window}; need at least 1 step")
        self._reference: float | None = None
        if reference_s is not None:
            self.calibrate(reference_s)
        self._units = 0
        self._seconds = 0.0
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._last_seconds = 0.0
        self._last_rate: float | None = None

    @property
    def reference_s(self) -> float | None:
        return self._reference

    def calibrate(self, reference_s: float) -> None:
        """Fix the healthy reference (seconds per unit)."""
        if not (math.isfinite(reference_s) and reference_s > 0):
            raise ValueError(f"reference_s: {reference_s}; need a finite number > 0")
        self._reference = float(reference_s)

    def record(self, units: int, seconds: float) -> None:
        """One timed compute: `units` layer-shards x micro-batches, `seconds` of pure compute."""
        if units < 0 or not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"record({units}, {seconds}): need units >= 0 and seconds >= 0")
        self._units += units
        self._seconds += seconds

    def end_step(self) -> float | None:
        """Close the step; return its rate (None if nothing was recorded or not calibrated)."""
        self._last_seconds = self._seconds
        rate = None
        if self._units:
            self._steps.append((self._units, self._seconds))
            rate = self._rate(self._seconds / self._units)
        self._units, self._seconds = 0, 0.0
        self._last_rate = rate
        return rate

    def _rate(self, spu: float | None) -> float | None:
        if spu is None or self._reference is None:
            return None
        return max(1.0, spu / self._reference)

    @property
    def seconds_per_unit(self) -> float | None:
        """Mean seconds per unit over the window (None before any step with work)."""
        units = sum(u for u, _ in self._steps)
        return sum(s for _, s in self._steps) / units if units else None

    @property
    def rate(self) -> float | None:
        """Straggling rate over the window (None before calibration or any work)."""
        return self._rate(self.seconds_per_unit)

    @property
    def last_rate(self) -> float | None:
        """The rate `end_step()` returned last (this step alone, not the window)."""
        return self._last_rate

    @property
    def compute_seconds(self) -> float:
        """Compute seconds of the last ended step (what `malleus_gpu_compute_seconds` shows)."""
        return self._last_seconds
