"""How a step's seconds are measured: the stopwatches, the communication meter, the layer timer.

Every figure a step reports (a rank's compute time per layer-shard, behind its straggling rate;
the cost model's terms) is a difference of two readings of a `Stopwatch`:

- `WallStopwatch`: the host's `perf_counter`, read at once. On a GPU it first waits for the
  device (`sync`), so that a reading includes the queued work: two host synchronisations per
  timed call. The emulated clock needs this: it charges each call as it ends (it waits until the
  call's start + its communication + its budget), and so does an emulated slow link.
- `EventStopwatch`: CUDA events recorded on the current stream, read once per step (`settle`:
  one host synchronisation), so the host keeps queueing kernels ahead of the GPU. A reading is
  the device's time between two points of the stream: a layer's kernels, or the time the stream
  waited for a collective (NCCL runs on its own stream; `work.wait()` makes this one wait).

With a deferred stopwatch the timings are resolved at `settle()`, in the order they were taken;
nothing reads them before that: the step settles after its schedule, before the world vector
(trainer/engine/trainer.py), and a calibration window's steps once more after it, for their
gradient sync (trainer/engine/calibrator.py); a new step drops what was not read.

`CommMeter` times communication (per kind, for calibration: `CommStat`); `LayerTimer` times layer
math apart from the communication inside it, charges the (optionally emulated) clock and feeds
the rate profiler.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from malleus.trainer.world.world import World

__all__ = [
    "Clock",
    "CommMeter",
    "CommStat",
    "EventStopwatch",
    "LayerTimer",
    "Profiler",
    "Stopwatch",
    "Timing",
    "WallStopwatch",
    "stopwatch_for",
]

T = TypeVar("T")

LinkHook = Callable[[tuple[Any, ...], frozenset[int], float], float]
"""`hook(key, nodes, seconds) -> extra seconds waited`: an emulated slow link's charge."""


class Stopwatch(Protocol):
    deferred: bool
    """True: readings are only valid after `settle()`; False: at once."""

    def mark(self) -> Any:
        """A reading now (after the work queued so far)."""
        ...

    def settle(self) -> None:
        """Wait until every mark taken so far can be read."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks."""
        ...


class WallStopwatch:
    """The host's clock, read at once; `sync` (a GPU's `torch.cuda.synchronize`) runs before
    every reading, so that a reading comes after the work queued so far."""

    deferred = False

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync

    def mark(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def settle(self) -> None:
        return None

    def seconds(self, start: float, end: float) -> float:
        return end - start


class EventStopwatch:
    """CUDA events (`event()` makes one; timing-enabled) recorded on the current stream; read
    after `settle`, which waits for the last one: the only host synchronisation it costs."""

    deferred = True

    def __init__(self, event: Callable[[], Any] | None = None) -> None:
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._last: Any = None

    def mark(self) -> Any:
        e = self.event()
        e.record()
        self._last = e
        return e

    def settle(self) -> None:
        if self._last is not None:
            self._last.synchronize()  # every earlier event on the stream has completed too
            self._last = None

    def seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0  # milliseconds


def stopwatch_for(device: torch.device, *, emulated: bool) -> Stopwatch:
    """CUDA events on a GPU with real timings; the synchronising wall clock where an emulated
    clock or link charges each call as it ends (and on the CPU, where a reading is the work)."""
    if device.type == "cuda" and not emulated:
        return EventStopwatch()
    return WallStopwatch(torch.cuda.synchronize if device.type == "cuda" else None)


@dataclass
class CommStat:
    """One kind of communication since the last `CommMeter.reset_stats()`."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0
    best: float = math.inf
    """The shortest call: the transfer itself, without waiting for a late peer."""

    def add(self, seconds: float, nbytes: int) -> None:
        self.seconds += seconds
        self.calls += 1
        self.bytes += nbytes
        self.best = min(self.best, seconds)


@dataclass
class Timing:
    """One timed communication: its kind, members and bytes, and its seconds once read (None
    until its stopwatch settled)."""

    kind: str
    members: tuple[int, ...]
    nbytes: int
    seconds: float | None = None


class CommMeter:
    """Accumulates seconds spent in communication, read with the step's stopwatch.

    `timed(kind, members, nbytes)` also files the call under `kind` (`stats`); gradient sync
    (`kind="grad"`) is filed as `grad_intra` or `grad_inter` by whether its members share one
    node (`gpus_per_node`). With a `link` hook (emulation; needs a stopwatch read at once) a
    collective whose members touch a slowed node is charged extra inside the timing, so every
    figure here sees the slow link. `tape` keeps the step's timings in the order they ended, so
    a layer's timer can tell which ones fell inside its call.
    """

    def __init__(
        self,
        watch: Stopwatch | None = None,
        *,
        gpus_per_node: int | None = None,
        link: LinkHook | None = None,
    ) -> None:
        self.watch: Stopwatch = watch or WallStopwatch()
        if link is not None and self.watch.deferred:
            raise ValueError("an emulated link charges a call as it ends: needs a wall stopwatch")
        self.gpus_per_node = gpus_per_node
        self.link = link
        self.stats: dict[str, CommStat] = {}
        self.tape: list[Timing] = []  # this step's timings (`new_step` clears it)
        self._pending: list[tuple[Timing, Any, Any]] = []

    @property
    def pending(self) -> bool:
        """Whether timings wait to be read (`settle`)."""
        return bool(self._pending)

    def reset_stats(self) -> None:
        self.stats = {}

    def new_step(self) -> None:
        """A step begins: its tape starts empty, and what the last one did not read is dropped
        (a failed step's timings: their events may wait behind a collective that never ends)."""
        self.tape.clear()
        self._pending = []

    def stat(self, kind: str) -> CommStat:
        return self.stats.get(kind) or CommStat()

    @contextmanager
    def timed(
        self, kind: str = "other", members: tuple[int, ...] = (), nbytes: int = 0
    ) -> Iterator[Timing]:
        """Time the block; the `Timing` yielded has its seconds once the stopwatch settled."""
        timing = Timing(kind, members, nbytes)
        start = self.watch.mark()
        yield timing  # a call that raises is not filed: its step fails
        end = self.watch.mark()
        self.tape.append(timing)
        if self.watch.deferred:
            self._pending.append((timing, start, end))
            return
        seconds = self.watch.seconds(start, end)
        nodes = self._nodes(members)
        if self.link is not None and nodes:
            self.link((kind, members, nbytes), nodes, seconds)
            seconds = self.watch.seconds(start, self.watch.mark())  # the charge is the link's
        self._file(timing, seconds)

    def settle(self) -> None:
        """Read every timing taken so far (one host synchronisation on a GPU, none if none)."""
        if not self._pending:
            return
        self.watch.settle()
        for timing, start, end in self._pending:
            self._file(timing, self.watch.seconds(start, end))
        self._pending = []

    def seconds_of(self, timings: Sequence[Timing]) -> list[float]:
        """The seconds of `timings` (taken by this meter), read now if they wait to be."""
        self.settle()
        return [t.seconds for t in timings if t.seconds is not None]

    def _nodes(self, members: tuple[int, ...]) -> frozenset[int]:
        gpn = self.gpus_per_node
        return frozenset(m // gpn for m in members) if gpn else frozenset()

    def _file(self, timing: Timing, seconds: float) -> None:
        timing.seconds = seconds
        kind, nodes = timing.kind, self._nodes(timing.members)
        if kind == "grad" and nodes:
            kind = "grad_intra" if len(nodes) == 1 else "grad_inter"
        self.stats.setdefault(kind, CommStat()).add(seconds, timing.nbytes)


class Clock(Protocol):
    def compute(self, kind: str, shards: int, started: float) -> None: ...


class Profiler(Protocol):
    def record(self, units: int, seconds: float) -> None: ...


@dataclass
class _Call:
    """One timed call, until its stopwatch settled: its marks and its span on the meter's tape."""

    name: str  # "forward" / "backward" (a layer), "embedding" / "head" (an end)
    shards: int  # layer-shards (a layer); micro-batches (an end)
    start: Any
    end: Any
    tape: tuple[int, int]  # the meter's timings inside the call: tape[a:b]


class LayerTimer:
    """Times layer math apart from communication, charges the clock, feeds the profiler.

    A layer's compute time is its time minus the time its TP collectives spent (the meter's
    timings inside the call); an emulated clock then waits until `start + comm + budget`, so a
    GPU that waited for a slow peer inside a layer is still charged its own full budget (the
    emulated clock needs the wall stopwatch: it charges a call as it ends). Before each layer
    it checks the `World`'s recovery alarm (trainer/world/alarm.py). With a deferred stopwatch
    the calls are read at `settle()`.
    """

    def __init__(
        self,
        clock: Clock,
        profiler: Profiler,
        meter: CommMeter,
        world: World,
    ) -> None:
        self.clock, self.profiler, self.meter, self.world = clock, profiler, meter, world
        self.seconds = 0.0  # summed since the last reset
        self.units = 0  # layer-shard passes (forward or backward, one micro-batch) since then
        self.calls = 0  # layer calls (forward or backward) since then
        self.comm = 0.0  # TP communication seconds inside those calls
        # "embedding"/"head" -> [seconds, micro-batches, seconds in their own TP collectives]
        self.ends: dict[str, list[float]] = {}
        self.started: float | None = None  # perf_counter of this step's schedule, start / end
        self.ended: float | None = None
        self._pending: list[_Call] = []

    @property
    def watch(self) -> Stopwatch:
        return self.meter.watch  # one stopwatch for the step's compute and communication

    def reset(self) -> None:
        self.seconds, self.units, self.calls, self.comm = 0.0, 0, 0, 0.0
        self.ends, self.started, self.ended = {}, None, None
        self._pending = []
        self.meter.new_step()

    def end(self, name: str, fn: Callable[[], T], micro_batches: int = 0) -> T:
        """Run the embedding's or the head's work (forward or backward) and time it. An
        emulated clock stretches its compute (its wall time less its TP collectives) by the
        rank's slowdown, as a slow GPU would."""
        stretch = getattr(self.clock, "stretch", None)
        return self._timed(name, micro_batches, fn, lambda start: stretch(start) if stretch else 0)

    def __call__(self, kind: str, shards: int, fn: Callable[[], T]) -> T:
        self.world.check_alarm()  # a peer entered recovery: this step is lost anyway
        self.world.progress.mark()  # this rank's training thread got somewhere
        return self._timed(kind, shards, fn, lambda start: self.clock.compute(kind, shards, start))

    def settle(self) -> None:
        """Read every call and communication timed so far: one host synchronisation on a GPU
        with events, none when nothing waits to be read."""
        if not self._pending and not self.meter.pending:
            return
        self.watch.settle()
        self.meter.settle()  # the same stopwatch, settled: no second wait
        for call in self._pending:
            self._resolve(call)
        self._pending = []

    def _timed(
        self, name: str, shards: int, fn: Callable[[], T], charge: Callable[[float], object]
    ) -> T:
        """Run `fn` between two marks. With a wall stopwatch the emulated clock is charged
        before the second (`charge(start + the call's communication)`: it waits out the rest of
        the call's budget, which is then part of its time) and the call is read at once."""
        start, first = self.watch.mark(), len(self.meter.tape)
        out = fn()
        tape = (first, len(self.meter.tape))
        if self.watch.deferred:
            self._pending.append(_Call(name, shards, start, self.watch.mark(), tape))
            return out
        charge(start + self._comm(tape))
        self._resolve(_Call(name, shards, start, self.watch.mark(), tape))
        return out

    def _comm(self, tape: tuple[int, int]) -> float:
        """The seconds of the meter's timings tape[a:b] (read: the call's are by now)."""
        a, b = tape
        return sum(t.seconds or 0.0 for t in self.meter.tape[a:b])

    def _resolve(self, call: _Call) -> None:
        comm = self._comm(call.tape)
        wall = self.watch.seconds(call.start, call.end)
        if call.name in ("embedding", "head"):
            acc = self.ends.setdefault(call.name, [0.0, 0, 0.0])
            acc[0] += wall
            acc[1] += call.shards
            acc[2] += comm
            return
        seconds = wall - comm
        self.profiler.record(call.shards, seconds)
        self.seconds += seconds
        self.units += call.shards
        self.calls += 1
        self.comm += comm
