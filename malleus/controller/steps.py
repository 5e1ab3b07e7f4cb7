"""Which observed steps to believe: forward, and not further than training could have gone.

The step orders observations (the sources poll until it moves, the loop ignores a step it has
seen), so a single forged figure used to be fatal: a series claiming step 10^9 (a pod scraped
with ``honor_labels: true`` can claim to be the coordinator's) made every real observation
after it "old" for good. `StepGuard` accepts a step only if it is ahead of the last one it
accepted by at most `STEP_JUMP_FLOOR` plus `STEPS_PER_SECOND` for every second since; a step out
of that line is ignored with a warning, unless `CONFIRMATIONS` observations in a row agree on a
new line (each ahead of the one before by a plausible amount): a trainer really restarted from
an older checkpoint, or an operator that missed many steps, is followed after a few reads, and
a forger must keep forging a believable run to steer anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["CONFIRMATIONS", "STEPS_PER_SECOND", "STEP_JUMP_FLOOR", "StepGuard"]

STEP_JUMP_FLOOR = 1000
"""Steps an observation may be ahead of the last one believed, however little time passed."""
STEPS_PER_SECOND = 100.0
"""...plus this many for every second since: faster than any real training step."""
CONFIRMATIONS = 3
"""Observations in a row, each plausibly ahead of the one before, that move the line."""

log = logging.getLogger(__name__)


class StepGuard:
    """The last believed step, and whether a new one is believable (see the module).

    `clock`: seconds, any origin (the controller's clock, or `time.monotonic`); `what`: who
    observes, for the warnings.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        floor: int = STEP_JUMP_FLOOR,
        per_second: float = STEPS_PER_SECOND,
        confirmations: int = CONFIRMATIONS,
        what: str = "observation",
    ) -> None:
        self.clock, self.floor, self.per_second = clock, floor, per_second
        self.confirmations, self.what = confirmations, what
        self.last = -1
        """The last step believed (-1: none yet)."""
        self.moved = False
        """Whether the last step believed moved the line (a confirmed jump, not a step on)."""
        self._at: float | None = None
        self._doubted: list[tuple[int, float]] = []

    def _plausible(self, step: int, after: int, since: float, now: float) -> bool:
        return after < step <= after + self.floor + self.per_second * max(0.0, now - since)

    def accept(self, step: int) -> bool:
        """Whether `step` is news to believe (then it is the last step); False for a step seen
        already or one out of line (warned about once per run of them)."""
        now = self.clock()
        if self._at is None or self._plausible(step, self.last, self._at, now):
            return self._believe(step, now)
        if step == self.last:
            return False  # the same step read twice: a scrape faster than the training
        doubted = self._doubted
        if doubted and step == doubted[-1][0]:
            return False  # the doubted step read again (a restarted trainer still at its start)
        if doubted and self._plausible(step, *doubted[-1], now):
            doubted.append((step, now))
        else:
            doubted[:] = [(step, now)]
        if len(doubted) >= self.confirmations:
            log.warning(
                "%s: step moved from %d to %d, confirmed by %d observations in a row",
                self.what,
                self.last,
                step,
                len(doubted),
            )
            return self._believe(step, now)
        level = logging.WARNING if len(doubted) == 1 else logging.DEBUG
        log.log(
            level,
            "%s: step %d ignored: the last believed is %d (at most %d + %g/s ahead is "
            "plausible; %d more in line would move it)",
            self.what,
            step,
            self.last,
            self.floor,
            self.per_second,
            self.confirmations - len(doubted),
        )
        return False

    def _believe(self, step: int, now: float) -> bool:
        self.moved = len(self._doubted) >= self.confirmations
        self.last, self._at = step, now
        self._doubted.clear()
        return True
