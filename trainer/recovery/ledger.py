"""Recovery's own state on one rank: what it knows of the job's failures, kept apart from the Trainer.

The Trainer (trainer/engine/trainer.py) owns the plan, the pieces and the step; what only
recovery reads and writes lives here, in one `Ledger` that the rank's loop (trainer/run/loop.py)
makes once and hands to every recovery and admission:

- `out`: the GPUs out of the job (failed or left out), with why; the next plan is made
  without them, and a replacement's admission takes its GPU off;
- `recovering`: a recovery whose first committed step has not run yet (`Pending`); its record
  is completed by that step (trainer/recovery/restore.py `settled`);
- `recoveries`: the records of the completed ones (the run's report and the tests read them);
- `spurious`: per step, the recoveries in which every rank arrived (nobody had failed);
- `admitted`: per GPU, the nonce of its replacement admitted last (trainer/recovery/join.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ledger", "Pending"]


@dataclass
class Pending:
    """A recovery whose first committed step has not run yet (its record is completed then)."""

    epoch: int
    failed: dict[int, str]
    step: int
    steps_lost: int
    bytes_restored: int
    mode: str
    generation: int
    detected: float
    fault_at: dict[int, float] = field(default_factory=dict)
    at: int = 0  # the step the failure interrupted
    store: dict[str, Any] | None = None
    """What the recovery cost this rank's store client (trainer/recovery/tally.py `Tally`), and
    `led`: the leader's wait and decision times, one per epoch it led."""


@dataclass
class Ledger:
    """What recovery keeps on one rank across recoveries and admissions (see the module)."""

    out: dict[int, str] = field(default_factory=dict)
    recovering: Pending | None = None
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    spurious: dict[int, int] = field(default_factory=dict)
    admitted: dict[int, str] = field(default_factory=dict)
