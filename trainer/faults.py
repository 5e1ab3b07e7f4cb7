"""Fault injection for failure tests and demos: a GPU's trainer dies or hangs mid-step.

`spec.emulation.schedule` entries `{step, rank, fail: kill|hang}` (`ResolvedJob.failures`) and
the `$MALLEUS_FAULT` hook `step:RANK[:STEP]` (trainer/switch.py `fault_point`) act in the
middle of a step: right after the rank's first layer forward of that step (an excluded rank's
benchmark forward included), so its peers are left inside the step's collectives. `kill` is
SIGKILL (the process is gone, its sockets close at once); `hang` is SIGSTOP (the process stays,
silent, until someone sends SIGCONT or SIGKILL): the survivors detect it only by timeout.

`$MALLEUS_FAULT=lead:RANK:EPOCH` (`at_lead`; RANK may be `*`, any rank) kills the survivor that
took the lead of recovery epoch EPOCH right after it claimed it, before it decides: who leads
is a race among the survivors, so a test cannot name that rank in advance.
`$MALLEUS_FAULT=rollback:RANK:EPOCH` (`at_rollback`) kills RANK in the middle of recovery epoch
EPOCH's rollback: its state rebuilt under the recovery plan, the checkpoint not read yet, its
peers inside the read's agreement on which checkpoint to load (trainer/state.py `resume`).

Before acting the rank writes the wall time into the job's store (`rec/fault/GPU`), so a test
can measure how long the survivors took to notice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import Any

from . import membership
from .switch import FAULT_ENV

__all__ = ["FAULT_KEY", "Faults", "at_lead", "at_rollback", "die"]

log = logging.getLogger(__name__)

FAULT_KEY = "rec/fault/"


def die(rank: int, how: str, where: str) -> None:
    """SIGKILL (`kill`) or SIGSTOP (`hang`) this process, after noting when in the store."""
    store = membership.store()
    if store is not None:
        with contextlib.suppress(RuntimeError, OSError):
            store.set(
                f"{FAULT_KEY}{rank}", json.dumps({"how": how, "at": time.time(), "where": where})
            )
    log.error(
        "fault injection: rank %d %s at %s", rank, "dies" if how == "kill" else "hangs", where
    )
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _wanted(point: str, rank: int, epoch: int) -> bool:
    want = os.environ.get(FAULT_ENV, "").split(":")
    return want[:1] == [point] and want[1:] in (["*", str(epoch)], [str(rank), str(epoch)])


def at_lead(rank: int, epoch: int) -> None:
    """Die here (SIGKILL) when `$MALLEUS_FAULT` is `lead:RANK:EPOCH` (or `lead:*:EPOCH`): this
    rank has just claimed the lead of recovery epoch `epoch` (trainer/recovery.py)."""
    if _wanted("lead", rank, epoch):
        die(rank, "kill", f"the lead of recovery epoch {epoch}")


def at_rollback(rank: int, epoch: int) -> None:
    """Die here (SIGKILL) when `$MALLEUS_FAULT` is `rollback:RANK:EPOCH`: this rank is about to
    read the checkpoint back in recovery epoch `epoch` (trainer/recovery_restore.py)."""
    if _wanted("rollback", rank, epoch):
        die(rank, "kill", f"the checkpoint read of recovery epoch {epoch}")


class Faults:
    """This rank's scheduled failures; `arm(step)` at each step start."""

    def __init__(self, failures: Iterable[tuple[int, int, str]], rank: int) -> None:
        self.rank = rank
        self.due = {step: how for step, r, how in failures if r == rank}
        env = os.environ.get(FAULT_ENV, "").split(":")
        if len(env) == 3 and env[0] == "step" and env[1] == str(rank) and env[2].isdigit():
            self.due.setdefault(int(env[2]), "kill")
        self.armed: str | None = None
        self.step = -1

    def arm(self, step: int) -> None:
        if self.step < 0 and step > 0:
            # A process that starts past step 0 (a replacement admitted at `step`, a resumed
            # run) did not live through the earlier steps: their failures were its
            # predecessor's, and must not fire again when it trains on.
            self.due = {s: how for s, how in self.due.items() if s >= step}
        self.step = step
        self.armed = self.due.pop(step, None)

    def clock(self, clock: Any) -> Any:
        """The clock the layer timer charges: `clock` itself, or one that fires the armed fault
        after the step's first layer forward."""
        return _FaultyClock(clock, self) if self.due else clock

    def after(self, kind: str) -> None:
        if self.armed is not None and kind == "forward":
            how, self.armed = self.armed, None
            die(self.rank, how, f"step {self.step}")


class _FaultyClock:
    def __init__(self, clock: Any, faults: Faults) -> None:
        self._clock, self._faults = clock, faults

    def compute(self, kind: str, shards: int, started: float) -> Any:
        out = self._clock.compute(kind, shards, started)
        self._faults.after(kind)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)
