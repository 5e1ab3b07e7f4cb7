"""Reported rates are input, not truth: bound them, and limit how much of the job they can idle.

The rates come from processes and series the controller does not control. Two limits keep a
wrong or hostile report from steering the job:

- `malleus.job.rates.bounded_rates` (applied by the loop): only the job's ranks, finite figures capped at `MAX_RATE` (the planner's own
  bound; beyond it a GPU is as good as gone, and 1e307 used to overflow the cost model), and
  None (unusable) for NaN or infinity, before anything is smoothed.
- `ExclusionGuard`: one re-plan may newly count at most `maxExclusionShare` of the GPUs (at
  least one) as straggling or failed. A larger set at once, say 7 of 8 GPUs "50x slower", is
  what a bad exporter or a spoofed series looks like and would leave one GPU training; it is
  believed only once every one of them has been a straggler for `PERSIST_WINDOWS` windows of
  smoothed rates. Until then those ranks are planned at the rate the plan in force assumed.
  GPUs the plan in force already works around, and signals that persisted, always count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from malleus.job.spec import StragglerPolicy

__all__ = ["PERSIST_WINDOWS", "ExclusionGuard"]

PERSIST_WINDOWS = 3
"""Windows of `windowSteps` a straggler signal must last to be believed beyond the share."""

Rates = Mapping[int, "float | None"]


class ExclusionGuard:
    """Tracks how long each rank has straggled and holds back implausibly large shifts."""

    def __init__(self, policy: StragglerPolicy, world: int) -> None:
        self.policy = policy
        self.world = world
        self.allowed = max(1, math.floor(policy.max_exclusion_share * world + 1e-9))
        """GPUs one re-plan may newly count as straggling or failed."""
        self.persist_steps = PERSIST_WINDOWS * policy.window_steps
        self._since: dict[int, int] = {}  # rank -> first step of its current straggling streak

    def track(self, step: int, smoothed: Rates) -> None:
        """After each observation: start or end each rank's straggling streak."""
        for rank, rate in smoothed.items():
            if self.policy.is_straggler(rate):
                self._since.setdefault(rank, step)
            else:
                self._since.pop(rank, None)

    def persisted(self, rank: int, step: int) -> bool:
        """Whether `rank` has straggled for `persist_steps` steps by `step`."""
        since = self._since.get(rank)
        return since is not None and step - since >= self.persist_steps

    def steps_left(self, ranks: list[int], step: int) -> int:
        """Steps until every rank in `ranks` has persisted (they are all straggling now)."""
        return max((self._since.get(r, step) + self.persist_steps - step for r in ranks), default=0)

    def limit(
        self, rates: Rates, believed: Rates, step: int
    ) -> tuple[dict[int, float | None], list[int]]:
        """(rates to plan with, ranks held back) for the smoothed `rates` at `step`.

        Ranks that the plan in force already believes straggling, and ranks whose signal
        persisted, count as they are; the rest of the newly straggling ranks count only if all
        of it stays within `allowed`; otherwise every one of them is held at its believed rate
        (absent: healthy). All or none: taking the worst few of a spoofed set would still
        shrink the job.
        """
        straggler = self.policy.is_straggler
        flagged = [r for r, v in rates.items() if straggler(v)]
        settled = [r for r in flagged if straggler(believed.get(r, 1.0)) or self.persisted(r, step)]
        doubtful = sorted(r for r in flagged if r not in settled)
        if len(settled) + len(doubtful) <= self.allowed:
            return dict(rates), []
        out = dict(rates)
        for rank in doubtful:
            out[rank] = believed.get(rank, 1.0)
        return out, doubtful
