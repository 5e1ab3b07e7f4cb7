"""A stand-in for `torch.cuda.Event(enable_timing=True)` on a machine without a GPU.

It records the host's clock at once and its wait calls `on_wait` (the host synchronisation
count passes its counting `torch.cuda.synchronize`), so the deferred stopwatch's bookkeeping
(trainer/parallel/timing.py `EventStopwatch`) runs here as it does on a GPU; the events
themselves are tested on one (tests/trainer/parallel/test_timing.py, marked `cuda`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StandInEvent:
    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self.at: float | None = None
        self.on_wait = on_wait

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        if self.on_wait is not None:
            self.on_wait()

    def elapsed_time(self, end: StandInEvent) -> float:
        """Milliseconds, as CUDA's."""
        assert self.at is not None and end.at is not None, "an event read before it was recorded"
        return (end.at - self.at) * 1000.0
