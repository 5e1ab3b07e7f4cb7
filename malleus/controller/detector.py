"""Shift detection: decide from a stream of per-step, per-rank rates when the plan is out of date.

A plan is made for a set of *believed* rates. The detector smooths each rank's rate with the
median of its last `window_steps` samples (a one-step spike, a garbage-collection pause, a
checkpoint write never wins a median) and compares it with what the plan in force believed:

- failed: the latest sample is None (the GPU is gone). No smoothing: waiting would only stall
  the job, which cannot step without it. This is the one *urgent* shift.
- returned: a rank believed failed reports numbers again, for a majority of a window.
- slowed: believed below `threshold`, now at or above it.
- recovered: believed a straggler, now below `threshold` and lower by more than `hysteresis`.
- changed: a straggler before and after, whose rate moved by more than `hysteresis`.

Anything else (a healthy rank drifting between 1.0 and the threshold, a straggler wobbling by
less than the hysteresis) is not a shift: that band is what keeps a GPU that hovers around the
threshold from causing a re-plan every few steps. Re-planning is triggered on crossing up, but
crossing back down needs a move of more than `hysteresis`, so oscillation inside the band costs
at most one plan.

Why "recovered" is not `smoothed <= threshold - hysteresis`: with the CRD's defaults (1.2, 0.3)
that bound is 0.9, which a healthy GPU (1.0) never reaches, so a recovered GPU would never be
re-admitted. A drop of more than `hysteresis` below the believed rate includes that case
(`believed >= threshold` implies `believed - smoothed >= hysteresis` once
`smoothed <= threshold - hysteresis`) and also re-admits a GPU that went from 2.5 back to 1.0.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from malleus.job.spec import StragglerPolicy

__all__ = ["Rates", "Shift", "ShiftDetector"]

Rates = Mapping[int, "float | None"]


@dataclass(frozen=True)
class Shift:
    """Rates moved far enough from what the plan in force assumed to warrant planning again."""

    step: int
    time: float
    reason: str
    """One line for people: what happened to which ranks."""
    ranks: dict[int, tuple[float | None, float | None]]
    """rank -> (believed rate, smoothed rate now); None = unusable."""
    causes: dict[int, str] = field(default_factory=dict)
    """rank -> failed | returned | slowed | recovered | changed."""

    @property
    def urgent(self) -> bool:
        """A rank failed: the plan in force cannot run, so cooldowns do not apply."""
        return "failed" in self.causes.values()

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "time": self.time,
            "reason": self.reason,
            "ranks": {str(r): list(v) for r, v in sorted(self.ranks.items())},
            "causes": {str(r): c for r, c in sorted(self.causes.items())},
        }


def _fmt(rate: float | None) -> str:
    return "failed" if rate is None else f"{rate:.2f}"


class ShiftDetector:
    """Per-rank sliding windows, the believed rates of the plan in force, and the shift rules."""

    def __init__(self, policy: StragglerPolicy, believed: Rates | None = None) -> None:
        self.policy = policy
        self._windows: dict[int, deque[float]] = {}
        self._failed: set[int] = set()
        self._believed: dict[int, float | None] = dict(believed or {})
        self._quorum = policy.window_steps // 2 + 1

    # ---- input -----------------------------------------------------------------------------
    def add(self, rates: Rates) -> None:
        """Record one step's samples. A rank absent from `rates` simply has no sample."""
        for rank, rate in rates.items():
            if rate is None:
                self._failed.add(rank)
                self._windows.pop(rank, None)  # a returning GPU is judged on fresh samples
                continue
            window = self._windows.get(rank)
            if window is None:
                window = self._windows[rank] = deque(maxlen=self.policy.window_steps)
            window.append(float(rate))
            if rank in self._failed and len(window) >= self._quorum:
                self._failed.discard(rank)

    def observe(self, step: int, rates: Rates, now: float) -> Shift | None:
        """Record a step's samples and report whether the plan in force is out of date."""
        self.add(rates)
        return self.shift(step, now)

    # ---- views -----------------------------------------------------------------------------
    def smoothed(self) -> dict[int, float | None]:
        """Median rate of each rank with enough samples; None for a failed rank."""
        out: dict[int, float | None] = {}
        for rank, window in self._windows.items():
            if len(window) >= self._quorum and rank not in self._failed:
                out[rank] = statistics.median(window)
        for rank in self._failed:
            out[rank] = None
        return dict(sorted(out.items()))

    @property
    def believed(self) -> dict[int, float | None]:
        """The rates the plan in force was made for (absent = 1.0)."""
        return dict(self._believed)

    def rebase(self, rates: Rates | None = None) -> None:
        """The plan in force now accounts for `rates` (default: the smoothed rates now).

        Called when a plan is applied, and also when a new plan was judged not worth its
        migration: the plan in force was then re-evaluated against these rates and kept, and
        asking again every step would only re-run the planner for the same answer.
        """
        self._believed.update(self.smoothed() if rates is None else rates)

    # ---- the rules -------------------------------------------------------------------------
    def _cause(self, believed: float | None, now: float | None) -> str | None:
        straggler, hy = self.policy.is_straggler, self.policy.hysteresis
        if now is None:
            return None if believed is None else "failed"
        if believed is None:
            return "returned"
        if not straggler(believed):
            return "slowed" if straggler(now) else None
        if not straggler(now):
            return "recovered" if believed - now > hy else None
        return "changed" if abs(now - believed) > hy else None

    def shift(self, step: int, now: float) -> Shift | None:
        """The shift of the current smoothed rates against the believed ones, if any."""
        ranks: dict[int, tuple[float | None, float | None]] = {}
        causes: dict[int, str] = {}
        for rank, rate in self.smoothed().items():
            believed = self._believed.get(rank, 1.0)
            cause = self._cause(believed, rate)
            if cause is not None:
                ranks[rank] = (believed, rate)
                causes[rank] = cause
        if not ranks:
            return None
        parts = [
            f"rank {r} {causes[r]} ({_fmt(old)} -> {_fmt(new)})" for r, (old, new) in ranks.items()
        ]
        return Shift(step=step, time=now, reason="; ".join(parts), ranks=ranks, causes=causes)
