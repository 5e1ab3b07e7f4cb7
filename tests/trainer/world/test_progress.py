"""A rank's progress watchdog (trainer/world/progress.py) on the test's clock: judged only inside
a step of a measured layout and outside waits, its bound 10x the longest measured gap (at least
the floor, at most the hang timeout)."""

from __future__ import annotations

import pytest

from malleus.trainer.world.progress import FLOOR_S, GAP_MARGIN, Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(p: Progress, clock: Clock, gaps: list[float], step: int = 0) -> None:
    with p.in_step(step):
        for gap in gaps:
            clock.now += gap
            p.mark()


def test_the_first_step_of_a_layout_is_neither_judged_nor_measured() -> None:
    clock = Clock()
    p = Progress(lambda: 600.0, clock=clock)
    with p.in_step(0):
        clock.now += 100.0  # a long warm-up
        assert p.overdue() is None
        p.mark()
    assert p.bound() == FLOOR_S  # nothing measured yet
    with p.in_step(1):
        clock.now += FLOOR_S + 0.1
        assert p.overdue() == pytest.approx(FLOOR_S + 0.1)  # now judged
    assert p.overdue() is None  # between steps: never


def test_the_bound_grows_with_the_measured_gaps_and_stops_at_the_hang_timeout() -> None:
    clock = Clock()
    cap = [600.0]
    p = Progress(lambda: cap[0], clock=clock)
    _step(p, clock, [0.01])  # warm-up
    _step(p, clock, [0.1, 0.5, 0.2], 1)
    assert p.bound() == pytest.approx(GAP_MARGIN * 0.5)  # 10x its longest gap, above the floor
    _step(p, clock, [0.9], 2)  # a straggler's layer: 0.9 s
    assert p.bound() == pytest.approx(GAP_MARGIN * 0.9)
    with p.in_step(3):  # 8x slower still than its own 0.9 s: within the bound
        clock.now += 8 * 0.9
        assert p.overdue() is None
        clock.now += 2.0
        assert p.overdue() is not None
    cap[0] = 4.0  # hangTimeoutSeconds: the user's upper bound
    assert p.bound() == 4.0


def test_waiting_on_a_peer_and_the_data_source_are_not_judged_nor_counted() -> None:
    clock = Clock()
    p = Progress(lambda: 600.0, clock=clock)
    _step(p, clock, [0.01])
    with p.in_step(1):
        with p.outside():  # a collective wait on a slow peer, or a data stall
            clock.now += 60.0
            assert p.overdue() is None
        clock.now += 0.01
        assert p.overdue() is None
        p.mark()
    assert p.bound() == FLOOR_S  # the 60 s wait is not a gap of this rank's


def test_a_new_layout_is_measured_again_before_it_is_judged() -> None:
    clock = Clock()
    p = Progress(lambda: 600.0, clock=clock)
    _step(p, clock, [0.01])
    _step(p, clock, [0.01], 1)
    p.relayout()  # a switch: its first step runs on new shapes
    with p.in_step(2):
        clock.now += 30.0
        assert p.overdue() is None
    with p.in_step(3):
        clock.now += FLOOR_S + 1
        assert p.overdue() is not None


def test_a_failed_step_is_not_measured() -> None:
    clock = Clock()
    p = Progress(lambda: 600.0, clock=clock)
    _step(p, clock, [0.01])
    with pytest.raises(RuntimeError), p.in_step(1):
        clock.now += 50.0
        raise RuntimeError("a peer failed")
    assert p.bound() == FLOOR_S
