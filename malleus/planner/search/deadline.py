"""When the search must stop: one deadline object that every phase of the planner consults.

A `Deadline` ends at a point on a clock (wall time for an explicit `time_limit`, the planning
thread's CPU time for the default budget, so that a busy machine slows the planner down rather
than changing its answer much), or after a number of work units (`work`, for tests and for
load-independent runs). Every phase (grouping enumeration, templates, partitions, hill climbs,
micro-batch solves) asks `expired()` before each unit of work and `spend()`s one when it does
it, so the search stops within one unit of the deadline wherever it is. Sub-deadlines (`until`,
`share`) give a phase part of what is left without ever ending after their parent.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "Deadline", "cpu_clock", "wall_clock"]

Clock = Callable[[], float]

wall_clock: Clock = time.perf_counter


class _CpuClock:
    """CPU seconds of the calling thread (the planner may run in a worker thread), read at
    most every `every` wall seconds: reading it is a system call that can cost tens of
    microseconds (milliseconds on a contended, virtualised machine), and a deadline is asked
    thousands of times. Between reads it stands still, so a deadline on it ends at most one
    read interval late (10 ms, or five times what the last read took, at most `most`).

    A deadline starts from `read()`, never from the cached reading: that one can be a whole
    interval old, and the CPU the thread used since then would count against the new
    deadline's budget. On a loaded machine a preempted read stretched the interval, a plan()
    started from a reading taken before the caller's previous work, found most of its budget
    spent at its first read, and returned what its first phases had found."""

    def __init__(self, every: float = 0.01, most: float = 0.1) -> None:
        self.every = self._least = every
        self._most = most
        self._wall = -math.inf
        self._cpu = 0.0

    def __call__(self) -> float:
        if time.perf_counter() - self._wall >= self.every:
            return self.read()
        return self._cpu

    def read(self) -> float:
        """A reading taken now (and cached)."""
        now = time.perf_counter()
        cpu = time.thread_time()
        after = time.perf_counter()
        # a slow read is read less often (at most a fifth of the wall time in reads); a read
        # preempted for a second must not leave the clock standing still for five
        self.every = min(self._most, max(self._least, 5.0 * (after - now)))
        self._wall, self._cpu = after, cpu
        return cpu


def cpu_clock() -> float:
    """CPU seconds of the calling thread, read sparingly (`_CpuClock`)."""
    return _local_clock()()


_clocks = threading.local()


def _local_clock() -> _CpuClock:
    clock = getattr(_clocks, "clock", None)
    if clock is None:
        clock = _clocks.clock = _CpuClock()
    return clock


def _now(clock: Clock) -> float:
    """A fresh reading of `clock` (the CPU clock's cached one may be an interval old)."""
    return _local_clock().read() if clock is cpu_clock else clock()


class Deadline:
    """Stop at `seconds` after now on `clock`, or after `work` units, or at the parent's end.

    `checks` counts `expired()` calls and `work_done` the units spent, so tests can assert on
    counted work instead of timing. `wall_cap` (seconds of wall time) bounds a CPU-time
    deadline on an overloaded machine.
    """

    def __init__(
        self,
        seconds: float = math.inf,
        *,
        clock: Clock = wall_clock,
        work: int | None = None,
        wall_cap: float | None = None,
        parent: Deadline | None = None,
    ) -> None:
        self.clock = clock
        self.start = _now(clock)
        self.end = self.start + seconds
        self.work = work
        self.work_done = 0
        self.checks = 0
        self.parent = parent
        self._wall_end = None if wall_cap is None else wall_clock() + wall_cap
        self._expired = False

    # ---- the calls every phase makes -----------------------------------------------------
    def expired(self) -> bool:
        """True once the deadline has passed (and from then on)."""
        self.checks += 1
        if self._expired:
            return True
        if (
            (self.parent is not None and self.parent.expired())
            or self.clock() >= self.end
            or (self.work is not None and self.work_done >= self.work)
            or (self._wall_end is not None and wall_clock() >= self._wall_end)
        ):
            self._expired = True
        return self._expired

    def spend(self, units: int = 1) -> None:
        """Record units of work (a layout scored, a pipeline solved, a node grouped)."""
        d: Deadline | None = self
        while d is not None:
            d.work_done += units
            d = d.parent

    # ---- sub-deadlines -------------------------------------------------------------------
    @property
    def root(self) -> Deadline:
        d = self
        while d.parent is not None:
            d = d.parent
        return d

    def left(self) -> float:
        """Clock seconds left (inf without a time bound)."""
        return max(0.0, self.end - self.clock())

    def work_left(self) -> int | None:
        return None if self.work is None else max(0, self.work - self.work_done)

    def used(self) -> float:
        """Fraction of this deadline's span (or of its work) already gone, whichever is more."""
        span = self.end - self.start
        t = (self.clock() - self.start) / span if math.isfinite(span) and span > 0 else 0.0
        w = self.work_done / self.work if self.work else 0.0
        return max(t, w)

    def until(self, fraction: float) -> Deadline:
        """A child ending at `fraction` of this deadline's whole span (and of its work)."""
        span = self.end - self.start
        seconds = self.start + fraction * span - self.clock() if math.isfinite(span) else math.inf
        work = None if self.work is None else max(0, int(fraction * self.work) - self.work_done)
        return Deadline(seconds, clock=self.clock, work=work, parent=self)

    def share(self, fraction: float) -> Deadline:
        """A child getting `fraction` of what is left now (time and work)."""
        left = self.left()
        seconds = fraction * left if math.isfinite(left) else math.inf
        wl = self.work_left()
        work = None if wl is None else int(fraction * wl)
        return Deadline(seconds, clock=self.clock, work=work, parent=self)
