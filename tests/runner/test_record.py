"""The run record: step lines and scrapes merged by step index, plan switches labelling steps."""

from __future__ import annotations

import asyncio

import pytest

from malleus.controller.ports import Observation
from malleus.job import StragglerPolicy
from malleus.runner.record import (
    PlanSwitch,
    RecordingSource,
    RunRecord,
    parse_step_line,
    stragglers,
)

# Verbatim from a trainer's stdout (trainer/engine/trainer.py's step line).
LINE = "[malleus] step 9 (10/30) loss 4.2036 norm 1.765 lr 3.00e-03 0.952s 1,075 tok/s"


def test_a_step_line_is_parsed_to_a_zero_based_index() -> None:
    got = parse_step_line(LINE)
    assert got is not None
    assert (got.index, got.total, got.loss, got.seconds) == (9, 30, 4.2036, 0.952)
    assert got.tokens_per_second == 1075.0


@pytest.mark.parametrize(
    "line",
    [
        "[malleus] resumed from /tmp/ckpt/step-00000004 at step 4",
        "plan generation 0, tp 2, 4 pipeline(s)",
        "[malleus] saved model (42 tensors) to /tmp/model.pt",
        "",
    ],
)
def test_other_lines_are_not_steps(line: str) -> None:
    assert parse_step_line(line) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_and_scrapes_merge_by_step() -> None:
    clock = Clock()
    rec = RunRecord(tokens_per_step=1024, clock=clock)
    clock.now = 103.0
    line = parse_step_line(LINE)
    assert line is not None
    rec.add_line(line)
    # The scrape after 10 steps carries the rates of step index 9; its step time loses to the line.
    rec.add_observation(Observation(10, 0.5, {0: 1.0, 1: 3.1}, generation=0))
    # A scrape of a step whose line has not arrived yet fills the time from the gauge.
    rec.add_observation(Observation(11, 0.25, {0: 1.0, 1: 3.0}, generation=0))
    steps = rec.steps()
    assert [s.index for s in steps] == [9, 10]
    assert (steps[0].seconds, steps[0].loss, steps[0].rates) == (0.952, 4.2036, {0: 1.0, 1: 3.1})
    assert steps[0].time == pytest.approx(3.0)
    assert (steps[1].seconds, steps[1].tokens_per_second, steps[1].loss) == (0.25, 4096.0, None)
    assert rec.steps_done() == 11
    latest = rec.latest()
    assert latest is not None and latest.index == 10 and latest.rates[1] == 3.0


def test_switches_label_the_steps_they_cover() -> None:
    rec = RunRecord(tokens_per_step=1, initial_generation=0)
    for k in range(1, 9):
        rec.add_observation(Observation(k, 1.0, {}, generation=0))
    rec.add_switch(PlanSwitch(1, 3, 0.2, 1000.0))
    rec.add_switch(PlanSwitch(2, 6))
    assert [r["generation"] for r in rec.rows()] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert rec.last_generation == 2


def test_stragglers_are_rates_at_the_threshold_or_unusable() -> None:
    rates = {0: 1.0, 1: 1.19, 2: 1.2, 3: None, 4: 3.0}
    assert stragglers(rates, StragglerPolicy(threshold=1.2)) == {2: 1.2, 3: None, 4: 3.0}


class FailingSource:
    def __init__(self) -> None:
        self.calls = 0

    async def read(self) -> Observation | None:
        self.calls += 1
        raise ConnectionRefusedError("gone")


def test_failed_reads_are_retried_quietly_then_raised_or_ended() -> None:
    rec = RunRecord(tokens_per_step=1)
    ended = False
    inner = FailingSource()
    source = RecordingSource(inner, rec, lambda: ended, retry_seconds=0.01, patience=0.2)
    with pytest.raises(ConnectionRefusedError):  # trainers alive but silent: the controller hears
        asyncio.run(source.read())
    assert inner.calls > 3
    ended = True
    assert asyncio.run(source.read()) is None


def test_calibrations_are_kept_per_generation() -> None:
    """What /status carried: the latest calibration seen while each generation ran."""
    rec = RunRecord(tokens_per_step=1, initial_generation=0)
    rec.add_observation(Observation(1, 1.0, {}, generation=0))  # not measured yet
    cal = {"layer_seconds": 0.1, "p2p": 0.02}
    rec.add_observation(Observation(5, 1.0, {}, generation=0, calibration=cal, link_rates={1: 2}))
    rec.add_observation(Observation(9, 1.0, {}, generation=1, calibration={"layer_seconds": 0.2}))
    got = rec.calibrations()
    assert got[0] == {"generation": 0, "calibration": cal, "link_rates": {1: 2.0}}
    assert got[1]["calibration"] == {"layer_seconds": 0.2} and got[1]["link_rates"] == {}
