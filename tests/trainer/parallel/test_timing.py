"""The step's stopwatches (trainer/parallel/timing.py): a layer's compute time is its time less
the communication inside it, read at once with the wall clock and at `settle` with events, the
same figures either way; an emulated link refuses a deferred stopwatch; on a GPU (marked
`cuda`), CUDA events time the device's work without a wait per call."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest
import torch

from malleus.trainer.parallel.timing import (
    CommMeter,
    EventStopwatch,
    LayerTimer,
    Stopwatch,
    WallStopwatch,
)

sys.path.insert(0, str(Path(__file__).parents[1]))
cs = importlib.import_module("cuda_stand_in")

SLEEP_COMM, SLEEP_MATH = 0.010, 0.020


class Recorder:
    """A RateProfiler's `record`, kept; a NullClock's `compute`, counted."""

    def __init__(self) -> None:
        self.records: list[tuple[int, float]] = []
        self.charges = 0

    def record(self, units: int, seconds: float) -> None:
        self.records.append((units, seconds))

    def compute(self, kind: str, shards: int, started: float) -> None:
        self.charges += 1


class NoWorld:
    """What the timer asks of a World before a layer: the alarm and the progress mark."""

    class progress:
        @staticmethod
        def mark() -> None:
            return None

    @staticmethod
    def check_alarm() -> None:
        return None


def layer(meter: CommMeter) -> int:
    """A layer call: a collective of SLEEP_COMM inside, then SLEEP_MATH of math."""
    with meter.timed("tp", (0, 1), 64):
        time.sleep(SLEEP_COMM)
    time.sleep(SLEEP_MATH)
    return 7


@pytest.mark.parametrize("watch", ["wall", "events"])
def test_a_layers_time_is_its_own_less_the_communication_inside_it(watch: str) -> None:
    stopwatch: Stopwatch = WallStopwatch() if watch == "wall" else EventStopwatch(cs.StandInEvent)
    meter = CommMeter(stopwatch, gpus_per_node=4)
    rec = Recorder()
    timer = LayerTimer(rec, rec, meter, NoWorld())  # type: ignore[arg-type]
    timer.reset()
    with meter.timed("p2p", (0, 4), 8):  # before the call: not the layer's
        time.sleep(SLEEP_COMM)
    assert timer("forward", 2, lambda: layer(meter)) == 7
    assert timer.end("head", lambda: layer(meter), 1) == 7
    if watch == "events":  # nothing is read before the step settles
        assert (timer.units, timer.seconds, rec.records, meter.stats) == (0, 0.0, [], {})
        assert rec.charges == 0  # an emulated clock's charge needs the wall clock
    timer.settle()
    assert timer.units == 2 and timer.calls == 1 and len(rec.records) == 1
    assert rec.records[0][1] == timer.seconds >= SLEEP_MATH  # wall less its collective
    assert SLEEP_COMM <= timer.comm < timer.seconds + timer.comm
    head = timer.ends["head"]
    assert head[1] == 1 and head[2] >= SLEEP_COMM and head[0] >= SLEEP_COMM + SLEEP_MATH
    assert meter.stat("tp").calls == 2 and meter.stat("p2p").calls == 1
    assert meter.stat("p2p").seconds >= SLEEP_COMM
    assert timer.comm + head[2] == pytest.approx(meter.stat("tp").seconds)
    timer.settle()  # nothing left: no second reading
    assert timer.units == 2 and meter.stat("tp").calls == 2


def test_settle_waits_once_for_the_whole_step() -> None:
    waits: list[int] = []
    watch = EventStopwatch(lambda: cs.StandInEvent(lambda: waits.append(1)))
    meter = CommMeter(watch)
    rec = Recorder()
    timer = LayerTimer(rec, rec, meter, NoWorld())  # type: ignore[arg-type]
    for _ in range(5):
        timer("forward", 1, lambda: layer(meter))
    assert waits == []
    timer.settle()
    assert waits == [1] and timer.calls == 5
    timer.settle()
    assert waits == [1]  # nothing pending: no wait


def test_an_emulated_link_needs_the_wall_clock() -> None:
    def link(key: object, nodes: frozenset[int], seconds: float) -> float:
        return 0.0

    with pytest.raises(ValueError, match="wall stopwatch"):
        CommMeter(EventStopwatch(cs.StandInEvent), link=link)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_events_time_the_devices_work() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        a @ a  # warm-up: cuBLAS handles, clocks
    torch.cuda.synchronize()
    rec = Recorder()
    timer = LayerTimer(rec, rec, CommMeter(EventStopwatch()), NoWorld())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for _ in range(20):
        timer("forward", 1, lambda: a @ a)
    queued = time.perf_counter() - t0
    timer.settle()
    wall = time.perf_counter() - t0
    # 20 float32 matmuls of 4096^3 take milliseconds each on an H200, their launches and events
    # microseconds: the host queued them all without waiting for one (a wait per call would
    # make `queued` the device's time), and the events' sum is the device's time, within the
    # wall time of it all.
    assert 0 < timer.seconds <= wall
    assert queued < timer.seconds / 2
    assert len(rec.records) == 20 and all(s > 0 for _, s in rec.records)
