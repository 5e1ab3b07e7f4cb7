"""ShiftDetector on synthetic rate streams: spikes ignored, slowdowns caught, no flapping."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from malleus.controller import Shift, ShiftDetector
from malleus.job import StragglerPolicy

POLICY = StragglerPolicy()  # threshold 1.2, hysteresis 0.3, window 5


def feed(
    detector: ShiftDetector,
    rates_at: Callable[[int], dict[int, float | None]],
    steps: Iterable[int],
) -> list[Shift]:
    """Run the stream, rebasing after each shift as the controller does once it has decided."""
    shifts = []
    for step in steps:
        shift = detector.observe(step, rates_at(step), now=float(step))
        if shift is not None:
            shifts.append(shift)
            detector.rebase()
    return shifts


def healthy(world: int = 8) -> dict[int, float | None]:
    return dict.fromkeys(range(world), 1.0)


def test_one_step_spike_is_not_a_shift() -> None:
    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: 5.0} if step == 10 else healthy()

    assert feed(ShiftDetector(POLICY), rates, range(40)) == []


def test_two_step_spike_in_a_window_of_five_is_not_a_shift() -> None:
    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: 5.0} if step in (10, 11) else healthy()

    assert feed(ShiftDetector(POLICY), rates, range(40)) == []


def test_a_spike_before_the_window_fills_is_not_a_shift() -> None:
    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: 5.0} if step == 0 else healthy()

    assert feed(ShiftDetector(POLICY), rates, range(10)) == []


def test_lasting_slowdown_is_a_shift_within_the_window() -> None:
    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: 2.5} if step >= 10 else healthy()

    shifts = feed(ShiftDetector(POLICY), rates, range(40))
    assert len(shifts) == 1
    s = shifts[0]
    assert 10 <= s.step < 10 + POLICY.window_steps
    assert s.causes == {3: "slowed"}
    assert s.ranks == {3: (1.0, 2.5)}
    assert not s.urgent
    assert "rank 3 slowed (1.00 -> 2.50)" in s.reason


def test_recovery_is_a_shift() -> None:
    detector = ShiftDetector(POLICY, believed={3: 2.5})
    shifts = feed(detector, lambda step: healthy(), range(10))
    assert [s.causes for s in shifts] == [{3: "recovered"}]
    assert detector.believed[3] == 1.0


def test_failed_rank_is_an_immediate_urgent_shift() -> None:
    detector = ShiftDetector(POLICY)
    feed(detector, lambda step: healthy(), range(10))
    shift = detector.observe(10, {**healthy(), 5: None}, now=10.0)
    assert shift is not None
    assert shift.causes == {5: "failed"} and shift.urgent
    assert shift.ranks == {5: (1.0, None)}


def test_failed_rank_that_returns_is_a_shift_once_a_majority_of_samples_came_back() -> None:
    detector = ShiftDetector(POLICY)

    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 5: None} if 5 <= step < 10 else healthy()

    shifts = feed(detector, rates, range(20))
    assert [(s.step, s.causes) for s in shifts] == [(5, {5: "failed"}), (12, {5: "returned"})]


def test_rates_hovering_around_the_threshold_cause_at_most_one_shift() -> None:
    pattern = [1.05, 1.3, 1.1, 1.35, 1.15, 1.25, 1.1, 1.3, 1.0, 1.32]

    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: pattern[step % len(pattern)]}

    shifts = feed(ShiftDetector(POLICY), rates, range(200))
    assert len(shifts) <= 1


def test_a_straggler_wobbling_within_the_hysteresis_is_not_a_shift() -> None:
    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: 2.0 + (0.25 if step % 2 else -0.25)}

    detector = ShiftDetector(POLICY, believed={3: 2.0})
    assert feed(detector, rates, range(100)) == []


def test_a_healthy_drift_below_the_threshold_is_not_a_shift() -> None:
    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: 1.15}

    assert feed(ShiftDetector(POLICY), rates, range(50)) == []


def test_a_straggler_that_gets_much_slower_is_a_shift() -> None:
    def rates(step: int) -> dict[int, float | None]:
        return {**healthy(), 3: 2.0 if step < 10 else 4.0}

    detector = ShiftDetector(POLICY, believed={3: 2.0})
    shifts = feed(detector, rates, range(30))
    assert [s.causes for s in shifts] == [{3: "changed"}]


def test_a_mild_straggler_returning_to_health_by_less_than_the_hysteresis_is_kept() -> None:
    # 1.25 -> 1.0 moves 0.25 < 0.3: not worth a re-plan, and the band stops flapping.
    detector = ShiftDetector(POLICY, believed={3: 1.25})
    assert feed(detector, lambda step: healthy(), range(20)) == []


def test_smoothed_is_the_median_and_absent_ranks_have_no_sample() -> None:
    detector = ShiftDetector(POLICY)
    for step, r in enumerate([1.0, 9.0, 1.1, 1.2, 1.05]):
        detector.observe(step, {0: r}, now=0.0)
    assert detector.smoothed() == {0: 1.1}
    detector.observe(5, {}, now=0.0)  # no sample: nothing changes
    assert detector.smoothed() == {0: 1.1}
