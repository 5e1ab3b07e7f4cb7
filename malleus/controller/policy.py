"""When a straggler counts and when a new plan is worth its migration (spec.stragglerPolicy).

The controller's own copy of the policy, as plain numbers: the decision logic must not depend on
how the job was described (a CR, a YAML file, a test), only on these values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["StragglerPolicy"]


@dataclass(frozen=True)
class StragglerPolicy:
    """The knobs of DESIGN §4.5 `stragglerPolicy`, with the CRD's defaults."""

    threshold: float = 1.2
    """A GPU whose smoothed straggling rate reaches this is a straggler (1.0 = healthy)."""
    hysteresis: float = 0.3
    """A straggler's rate must move by more than this since the plan in force to count again."""
    window_steps: int = 5
    """Samples per rank the median is taken over: a spike shorter than half of it is ignored."""
    cooldown_seconds: float = 30.0
    """No new plan this soon after the last applied one (or failed attempt), unless a rank died."""
    min_gain: float = 0.05
    """Minimum predicted relative step-time gain for a new plan to be adopted."""
    horizon_steps: int = 100
    """Steps over which the predicted gain must repay the migration and the planning."""
    allow_exclusion: bool = True
    """Whether a plan may leave usable GPUs idle."""
    planning_timeout_seconds: float = 30.0
    """Time budget of one planner run."""

    def __post_init__(self) -> None:
        faults = []
        if not (math.isfinite(self.threshold) and self.threshold >= 1.0):
            faults.append(f"threshold: {self.threshold}; need a finite number >= 1.0")
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 0):
            faults.append(f"hysteresis: {self.hysteresis}; need a finite number >= 0")
        if self.window_steps < 1:
            faults.append(f"window_steps: {self.window_steps}; need at least 1")
        if self.cooldown_seconds < 0:
            faults.append(f"cooldown_seconds: {self.cooldown_seconds}; need >= 0")
        if self.min_gain < 0:
            faults.append(f"min_gain: {self.min_gain}; need >= 0")
        if self.horizon_steps < 1:
            faults.append(f"horizon_steps: {self.horizon_steps}; need at least 1")
        if not self.planning_timeout_seconds > 0:
            faults.append(f"planning_timeout_seconds: {self.planning_timeout_seconds}; need > 0")
        if faults:
            raise ValueError("invalid straggler policy: " + "; ".join(faults))

    @classmethod
    def from_spec(cls, spec: Any) -> StragglerPolicy:
        """From `spec.stragglerPolicy` (snake_case attributes or a dict); absent fields default."""
        if spec is None:
            return cls()
        names = [f.name for f in fields(cls)]
        if isinstance(spec, dict):
            values = {n: spec[n] for n in names if spec.get(n) is not None}
        else:
            values = {n: getattr(spec, n) for n in names if getattr(spec, n, None) is not None}
        return cls(**values)

    @classmethod
    def from_job(cls, job: Any) -> StragglerPolicy:
        """From a MalleusJob (`job.spec.straggler_policy`), duck-typed."""
        return cls.from_spec(getattr(job.spec, "straggler_policy", None))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
