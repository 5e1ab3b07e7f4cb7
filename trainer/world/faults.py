"""Fault injection for failure tests and demos: a GPU's trainer dies or hangs mid-step.

`spec.emulation.schedule` entries `{step, rank, fail: kill|hang}` (`ResolvedJob.failures`) and
the `$MALLEUS_FAULT` hook `step:RANK[:STEP]` (`fault_point`) act in the
middle of a step: right after the rank's first layer forward of that step (an excluded rank's
benchmark forward included), so its peers are left inside the step's collectives. `kill` is
SIGKILL (the process is gone, its sockets close at once); `hang` is SIGSTOP (the process stays,
silent, until someone sends SIGCONT or SIGKILL): its heartbeat stops, and the peer watching it
declares it dead (trainer/world/alarm.py). `$MALLEUS_FAULT=stall:RANK:STEP` is a hang in Python:
the training thread blocks for good at that point while the process and its other threads live
on (its heartbeat goes on): only its progress tells (trainer/world/progress.py).

`$MALLEUS_PAUSE=POINT:RANK:STEP:SECONDS[,...]` (`pause_point`) makes GPU RANK wait SECONDS at
POINT of step STEP: `data` (the first micro-batch's samples: a data stall) or `checkpoint` (the
checkpoint written after STEP steps): work that is slow, not stuck, and must not be declared
hung (tests).

`$MALLEUS_FAULT=lead:RANK:EPOCH` (`at_lead`; RANK may be `*`, any rank) kills the survivor that
took the lead of recovery epoch EPOCH right after it claimed it, before it decides: who leads
is a race among the survivors, so a test cannot name that rank in advance.
`$MALLEUS_FAULT=rollback:RANK:EPOCH` (`at_rollback`) kills RANK in the middle of recovery epoch
EPOCH's rollback: its state rebuilt under the recovery plan, the checkpoint not read yet, its
peers inside the read's agreement on which checkpoint to load (trainer/engine/state.py `resume`).

Before acting the rank writes the wall time into the job's store (`rec/fault/GPU`; the caller
hands it the store, `World.store`, None when failures are fatal), so a test can measure how
long the survivors took to notice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = [
    "FAULT_ENV",
    "FAULT_KEY",
    "PAUSE_ENV",
    "Faults",
    "at_lead",
    "at_rollback",
    "die",
    "fault_point",
    "pause_point",
]

log = logging.getLogger(__name__)

FAULT_ENV = "MALLEUS_FAULT"
"""Test hook: `POINT:RANK` (or `POINT:RANK:STEP`) makes GPU RANK kill itself (SIGKILL) at POINT
(with `:hang` after it: stop itself, SIGSTOP, for `fault_point`'s points):
`migration` (in the middle of a migration), `checkpoint` (its checkpoint file written, the
manifest not yet), `step` (mid-step, after its first layer forward; trainer/world/faults.py), `lead`
(`lead:RANK:EPOCH`, RANK may be `*`: the leader of a recovery, before it decides; faults.py),
`admit` (at a step boundary that admits a replacement, before the new group forms;
trainer/recovery/join.py)."""
FAULT_KEY = "rec/fault/"
PAUSE_ENV = "MALLEUS_PAUSE"
"""Test hook: `POINT:RANK:STEP:SECONDS` (`pause_point`)."""


def die(rank: int, how: str, where: str, *, store: Any) -> None:
    """SIGKILL (`kill`) or SIGSTOP (`hang`) this process, after noting when in `store`."""
    if store is not None:
        with contextlib.suppress(RuntimeError, OSError):
            store.set(
                f"{FAULT_KEY}{rank}", json.dumps({"how": how, "at": time.time(), "where": where})
            )
    log.error(
        "fault injection: rank %d %s at %s", rank, "dies" if how == "kill" else "hangs", where
    )
    if how == "stall":  # a hang in Python: this thread never goes on, the others do
        threading.Event().wait()
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def pause_point(name: str, rank: int, step: int) -> None:
    """Wait here when `$MALLEUS_PAUSE` holds `name:rank:step:SECONDS` (tests: slow, not stuck)."""
    for item in os.environ.get(PAUSE_ENV, "").split(","):
        want = item.split(":")
        if want[:3] == [name, str(rank), str(step)] and len(want) == 4:
            log.warning(
                "pause injection: rank %d waits %s s at %s of step %d", rank, want[3], name, step
            )
            time.sleep(float(want[3]))


def fault_point(name: str, rank: int, step: int | None = None, *, store: Any) -> None:
    """Die here (SIGKILL, no cleanup) when `$MALLEUS_FAULT` is `name:rank` (or
    `name:rank:step` at that step), or stop here (SIGSTOP) when it ends in `:hang`: failure
    tests."""
    want = os.environ.get(FAULT_ENV, "")
    how = "hang" if want.endswith(":hang") else "kill"
    want = want.removesuffix(":hang")
    if want == f"{name}:{rank}" or (step is not None and want == f"{name}:{rank}:{step}"):
        die(rank, how, name, store=store)


def _wanted(point: str, rank: int, epoch: int) -> bool:
    want = os.environ.get(FAULT_ENV, "").split(":")
    return want[:1] == [point] and want[1:] in (["*", str(epoch)], [str(rank), str(epoch)])


def at_lead(rank: int, epoch: int, *, store: Any) -> None:
    """Die here (SIGKILL) when `$MALLEUS_FAULT` is `lead:RANK:EPOCH` (or `lead:*:EPOCH`): this
    rank has just claimed the lead of recovery epoch `epoch` (trainer/recovery/protocol.py)."""
    if _wanted("lead", rank, epoch):
        die(rank, "kill", f"the lead of recovery epoch {epoch}", store=store)


def at_rollback(rank: int, epoch: int, *, store: Any) -> None:
    """Die here (SIGKILL) when `$MALLEUS_FAULT` is `rollback:RANK:EPOCH`: this rank is about to
    read the checkpoint back in recovery epoch `epoch` (trainer/recovery/restore.py)."""
    if _wanted("rollback", rank, epoch):
        die(rank, "kill", f"the checkpoint read of recovery epoch {epoch}", store=store)


class Faults:
    """This rank's scheduled failures; `arm(step)` at each step start; `store`: where a fault
    is noted (`die`)."""

    def __init__(
        self, failures: Iterable[tuple[int, int, str]], rank: int, store: Any = None
    ) -> None:
        self.rank, self.store = rank, store
        self.due = {step: how for step, r, how in failures if r == rank}
        env = os.environ.get(FAULT_ENV, "").split(":")
        ours = len(env) == 3 and env[0] in ("step", "stall") and env[1] == str(rank)
        if ours and env[2].isdigit():
            self.due.setdefault(int(env[2]), "kill" if env[0] == "step" else "stall")
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
            die(self.rank, how, f"step {self.step}", store=self.store)


class _FaultyClock:
    def __init__(self, clock: Any, faults: Faults) -> None:
        self._clock, self._faults = clock, faults

    def compute(self, kind: str, shards: int, started: float) -> Any:
        out = self._clock.compute(kind, shards, started)
        self._faults.after(kind)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)
