"""The recovery leader's wait: who of the previous members arrived, who is known gone, and when
to stop waiting for the rest.

Separate from the protocol (trainer/recovery/protocol.py) because it is the one part that is a matter
of time: it is tested on its own against a real store with the test's clock
(tests/trainer/recovery/test_recovery_wait.py).

The rule. The leader waits until every previous member has arrived, or is known dead (a
launcher wrote `rec/dead/GPU`), or is silent (its heartbeat stopped: trainer/world/alarm.py), or
`JOIN_WINDOW_S` passed. A hung rank never arrives and, where no launcher can see it (a wedged
GPU is a running process), is not known dead: a bound is needed. When some survivor's
collective timed out, the leader stops once every survivor that arrived has let go of its
process groups (`released/GPU`) and `quiet_after_timeout_s` passed with no new arrival and no
new release. Why that is safe: a timeout fires at the step's deadline, common to every rank
(trainer/world/world.py `step_deadline`), so every survivor blocked on the hung rank times out
at that moment; a survivor blocked on one of those fails as soon as it lets go of its groups
(its sockets close); a survivor computing hears of the recovery through its alarm within one
alarm interval. Once every arrival has released, what is still missing is hung, or (a rank
that entered a collective with only the hung rank so late that its floor outlasts the
deadline) is left out and replaced: slower, never wrong. Before, a fixed 2 s was waited.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from malleus.trainer.world import alarm
from malleus.trainer.world.errors import (
    DEAD_KEY,  # what launchers write when a GPU's process ends
)
from malleus.trainer.world.sealed import Sealer

__all__ = [
    "JOIN_WINDOW_S",
    "QUIET_MIN_S",
    "Gathered",
    "gather",
    "mark_released",
    "quiet_after_timeout_s",
]

JOIN_WINDOW_S = 5.0
"""After its own arrival, how long the leader waits for the other survivors at most."""
QUIET_MIN_S = 0.1
"""The least `quiet_after_timeout_s`: a few polls of the store (20 ms each) with nothing new."""
POLL_S = 0.02


def quiet_after_timeout_s(world: int) -> float:
    """How long, after the last arrival or release, the leader of a hang waits before deciding
    without the ranks still missing: two alarm intervals (a computing survivor hears within one;
    4 ranks: 0.1 s, 1,024: 0.2 s, 8,192: 1.6 s), at least `QUIET_MIN_S`."""
    return max(QUIET_MIN_S, 2 * alarm.interval_s(world))


def mark_released(store: Any, seal: Sealer, prefix: str, gpu: int) -> None:
    """Say that `gpu` let go of its process groups at this recovery epoch (`prefix`), sealed."""
    seal.put(store, prefix + f"released/{gpu}", "1")


@dataclass
class Gathered:
    """What the leader knows when it stops waiting."""

    arrivals: dict[int, dict[str, Any]] = field(default_factory=dict)
    """GPU -> its `alive/GPU` post, in the previous members' order."""
    dead: list[int] = field(default_factory=list)
    """Marked dead by a launcher (`rec/dead/GPU`)."""
    silent: list[int] = field(default_factory=list)
    """Not arrived and not beating (gone with nobody to mark it: a pod deleted, a node lost)."""


def gather(
    store: Any,
    seal: Sealer,
    prefix: str,
    previous: tuple[int, ...],
    silence: alarm.Silence,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Gathered:
    """Wait for the previous members by the rule of this module's docstring. Only values that
    `seal` opens count (arrivals, dead marks, releases): one planted by a stranger is as if
    absent, so it can neither add a member nor make the leader stop waiting for one."""
    quiet_s = quiet_after_timeout_s(len(previous))
    start = last = clock()
    got: dict[int, dict[str, Any]] = {}  # each arrival, read once (posted whole before `arrive`)
    released: set[int] = set()
    while True:
        for g in previous:
            if g not in got and (body := seal.get(store, prefix + f"alive/{g}")) is not None:
                got[g] = json.loads(body)
                last = clock()
        dead = [g for g in previous if seal.get(store, DEAD_KEY + str(g)) is not None]
        silent = [g for g in previous if g not in got and g not in dead and silence.silent(g)]
        if len(set(got) | set(dead) | set(silent)) >= len(previous):
            break
        now = clock()
        if now - start > JOIN_WINDOW_S:
            break
        if any(a["timeout"] for a in got.values()):  # a hang: some collective timed out
            for g in got:
                if g not in released and seal.get(store, prefix + f"released/{g}") is not None:
                    released.add(g)
                    last = now
            if set(got) - set(dead) <= released and now - last > quiet_s:
                break
        sleep(POLL_S)
    return Gathered({g: got[g] for g in previous if g in got}, dead, silent)
