"""Straggling rates from real timings of the emulated clock, and the healthy reference."""

from __future__ import annotations

import time

import pytest

from malleus.trainer.measure.emulation import EmulatedClock
from malleus.trainer.measure.profiling import RateProfiler, healthy_reference, time_per_unit


def run_step(clock: EmulatedClock, prof: RateProfiler, shards: int, wall: bool) -> float | None:
    """One step of 2 micro-batches through a stage, recording the wall time or the charge."""
    for kind in ("forward", "backward") * 2:
        t0 = time.perf_counter()
        charged = clock.compute(kind, shards, t0)  # type: ignore[arg-type]
        prof.record(shards, time.perf_counter() - t0 if wall else charged)
    return prof.end_step()


def test_injected_clock_reports_its_factor_by_wall_clock() -> None:
    """Real waits, real timings: rates of 1.0 and then 3.0, within 10%.

    On a starved host a wait can wake a scheduler tick late; the clock measures that lateness
    itself, and the rate must then be the factor inflated by exactly that much.
    """
    clock = EmulatedClock(rank=0, forward_s=0.010, backward_s=0.020)
    prof = RateProfiler(reference_s=clock.reference_s)
    for factor, shards in ((1.0, 2), (3.0, 1)):
        clock.inject(factor)
        before = clock.stats()
        rate = run_step(clock, prof, shards=shards, wall=True)
        after = clock.stats()
        late = (after["late_seconds"] - before["late_seconds"]) / (
            after["charged_seconds"] - before["charged_seconds"]
        )
        assert rate == pytest.approx(factor * (1 + late), rel=0.03)
        if late < 0.05:
            assert rate == pytest.approx(factor, rel=0.1)
    assert prof.compute_seconds >= 3.0 * 2 * 0.030  # the last step's compute


def test_charged_durations_give_exact_rates() -> None:
    """What the worker records: the charge, which leaves out the host's wake-up lateness, so
    8 ranks on 2 cores do not look like stragglers."""
    clock = EmulatedClock(rank=0, forward_s=0.002, backward_s=0.004)
    prof = RateProfiler(reference_s=clock.reference_s)
    assert run_step(clock, prof, shards=2, wall=False) == pytest.approx(1.0)
    clock.inject(3.0)
    assert run_step(clock, prof, shards=1, wall=False) == pytest.approx(3.0)
    assert prof.compute_seconds == pytest.approx(3.0 * 2 * 0.006)


def test_window_and_empty_steps() -> None:
    prof = RateProfiler(reference_s=0.01, window=2)
    prof.record(1, 0.01)
    assert prof.end_step() == 1.0
    prof.record(2, 0.06)
    assert prof.end_step() == pytest.approx(3.0)
    assert prof.rate == pytest.approx(0.07 / 3 / 0.01)  # both steps, weighted by units
    assert prof.end_step() is None  # nothing recorded (an idle rank)
    prof.record(1, 0.005)
    assert prof.end_step() == 1.0  # faster than the reference is healthy: clamped


def test_calibration_from_all_ranks() -> None:
    prof = RateProfiler(reference_s=None)
    prof.record(4, 0.10)
    assert prof.end_step() is None  # no reference yet
    assert prof.seconds_per_unit == pytest.approx(0.025)
    # 8 ranks: 6 healthy with noise, 2 stragglers, one rank not reporting
    ref = healthy_reference([0.0101, 0.0100, 0.0099, 0.0102, 0.05, 0.03, 0.0100, None, 0.0098])
    assert ref == pytest.approx(0.0099, abs=1e-4)
    prof.calibrate(ref)
    assert prof.rate == pytest.approx(0.025 / ref)
    with pytest.raises(ValueError):
        healthy_reference([None, float("nan"), 0.0])


def test_time_per_unit() -> None:
    clock = EmulatedClock(rank=0, forward_s=0.005, backward_s=0.005)
    spu = time_per_unit(lambda: clock.compute("forward", 2, time.perf_counter()), units=2)
    assert 0.005 <= spu < 0.010
