"""Progress: whether this rank's training thread is getting anywhere, judged by the rank itself.

The second of the two signals a fault-tolerant rank gives (the first is its heartbeat,
trainer/world/alarm.py: a process stopped, frozen or gone stops beating). A rank that still
beats can still be stuck: a CPU-side deadlock, a wedged kernel, a Python loop that never ends.
Its peers, blocked in a collective with it, cannot tell that from a slow rank; the rank itself
can, because it knows where its training thread is.

Marks. The training thread marks progress before every layer call (trainer/parallel/pipeline.py
`LayerTimer`) and on entering and leaving every collective wait of a step (trainer/world/world.py
`World.wait`). The alarm thread asks `overdue()` at each of its checks; when the thread has made
no mark for longer than the bound, the rank declares itself hung: it writes its sealed dead mark
and exits (trainer/world/alarm.py), so its sockets close and every peer blocked on it fails at
once, the path of a killed rank; the recovery (trainer/recovery/protocol.py) is the same.

What is judged, and what is not:
- Only inside a step (`World.step_deadline` arms it), and not in the first `MEASURED_STEPS`
  steps of a layout (`relayout` after a switch, a recovery or an admission): those pay
  allocations, new groups, a new shard shape, and are neither judged nor measured.
- Never while waiting in a collective: a rank blocked on a slow or stuck peer is not the one
  stuck (the peer is judged by its own watchdog, or by its heartbeat if it stopped). A
  straggler is therefore never declared hung by its peers; its own marks come once per layer,
  so its gaps grow with its slowness and are measured.
- Never inside a phase the job does not time (`outside`): the data source (a data stall), and
  everything between steps (checkpoints, switches, recoveries, admissions, the final save),
  which no step deadline arms. Those stay bounded by the hang timeout (the collectives' bound,
  `spec.failurePolicy.hangTimeoutSeconds`), as before.

The bound: `GAP_MARGIN` (10) times the longest gap between two marks in the last `RECENT_STEPS`
measured steps, at least `FLOOR_S` (3 s), at most the hang timeout. A gap is one layer's compute
(or the step's work between two collectives), so a GPU that turns 8x slow from one step to the
next stays within 10x its measured gaps, and the floor covers what one step's gaps do not show
(a page fault, a busy host's scheduling).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator

__all__ = ["FLOOR_S", "GAP_MARGIN", "MEASURED_STEPS", "RECENT_STEPS", "Progress"]

GAP_MARGIN = 10.0
"""The bound is this many times the longest gap measured (a straggler 8x slow stays within)."""
FLOOR_S = 3.0
"""The least bound, whatever was measured."""
RECENT_STEPS = 20
"""The measured steps whose longest gap sets the bound."""
MEASURED_STEPS = 1
"""The first steps of a layout, neither judged nor measured (its warm-up)."""


class Progress:
    """One rank's progress marks (the training thread writes, the alarm thread reads; each
    field is one assignment, so no lock is needed). `cap()`: the hang timeout in force."""

    def __init__(self, cap: Callable[[], float], *, clock: Callable[[], float] = time.monotonic):
        self._cap, self._clock = cap, clock
        self._armed = False  # inside a step of a measured layout
        self._measuring = False  # inside a step
        self._waiting = 0  # collective waits (or untimed phases) in progress
        self._last = clock()  # the last mark
        self._gap = 0.0  # the longest gap of the step in progress
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._steps = 0  # steps measured under the layout in force
        self.step: int | None = None
        """The step in progress (the alarm names it when it declares this rank hung)."""

    # ---- the training thread --------------------------------------------------------------------
    @contextlib.contextmanager
    def in_step(self, step: int | None = None) -> Iterator[None]:
        """Inside: a step; judged and measured past the layout's first `MEASURED_STEPS`."""
        self.step, self._gap = step, 0.0
        self._last = self._clock()
        self._measuring = True
        self._armed = self._steps >= MEASURED_STEPS
        ended = False
        try:
            yield
            ended = True
        finally:
            self._armed = self._measuring = False
            if ended and self._steps >= MEASURED_STEPS:  # a failed step's gaps, or those
                # of a layout's first steps (its warm-up), are not the layout's
                self._recent.append(max(self._gap, self._clock() - self._last))
            if ended:
                self._steps += 1

    def mark(self) -> None:
        """The training thread got somewhere (a layer call starts)."""
        now = self._clock()
        if self._measuring and not self._waiting:
            self._gap = max(self._gap, now - self._last)
        self._last = now

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Inside: not this rank's compute (a collective wait, the data source): not judged,
        and not counted in the gaps."""
        self.mark()
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1
            self._last = self._clock()

    def relayout(self) -> None:
        """A new layout is in force: its first `MEASURED_STEPS` steps are neither judged nor
        measured (the gaps measured before still count toward the bound)."""
        self._steps = 0

    # ---- the alarm thread -----------------------------------------------------------------------
    def bound(self) -> float:
        """Seconds without a mark past which this rank is hung (see the module)."""
        measured = max(self._recent, default=0.0)
        return min(self._cap(), max(FLOOR_S, GAP_MARGIN * measured))

    def overdue(self) -> float | None:
        """Seconds since the last mark when past the bound and judged; None otherwise."""
        if not self._armed or self._waiting:
            return None
        idle = self._clock() - self._last
        if not self._armed or self._waiting:  # it moved on while this was read
            return None
        return idle if idle > self.bound() else None
