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
    "announce",
    "gather",
    "mark_released",
    "poll_s",
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


def poll_s(world: int) -> float:
    """Seconds between two polls of a survivor waiting for the leader's decision (two store
    calls each), so that all of them together stay within the alarm's budget of store calls
    (`alarm.STORE_CHECKS_PER_S`): 20 ms up to 100 ranks, 0.2 s at 1,024, 0.8 s at 4,096."""
    return max(POLL_S, 2 * world / alarm.STORE_CHECKS_PER_S)


def mark_released(store: Any, seal: Sealer, prefix: str, gpu: int) -> None:
    """Say that `gpu` let go of its process groups at this recovery epoch (`prefix`), sealed."""
    seal.put(store, prefix + f"released/{gpu}", "1")


def announce(store: Any, seal: Sealer, prefix: str, gpu: int, body: str) -> None:
    """A survivor's arrival at this recovery epoch (`prefix`): its post `alive/GPU` (sealed),
    then its place in the order of arrivals: the count `arrivals` (one `add`) and `arrival/K`
    = GPU (sealed), so that the leader reads each arrival once, found through one counter,
    instead of checking every member's key at every poll."""
    seal.put(store, prefix + f"alive/{gpu}", body)
    k = store.add(prefix + "arrivals", 1)
    seal.put(store, prefix + f"arrival/{k}", str(gpu))


class _Book:
    """The leader's reading of the arrivals in their order (`announce`): one `add(0)` of the
    counter per poll, then the slots it has not read. A slot counted but not posted yet (the
    survivor between its two calls), or one whose value does not open (a stranger's `add` or
    value), stays unread and is tried again at the next poll: it holds no other slot back."""

    def __init__(self, store: Any, seal: Sealer, prefix: str, members: set[int]) -> None:
        self._store, self._seal, self._prefix, self._members = store, seal, prefix, members
        self._counted = 0
        self._unread: list[int] = []

    def read(self, got: dict[int, dict[str, Any]]) -> bool:
        """Add the arrivals posted since the last call to `got`; whether any was."""
        count = int(self._store.add(self._prefix + "arrivals", 0))
        self._unread += range(self._counted + 1, count + 1)
        self._counted = max(self._counted, count)
        new, still = False, []
        for k in self._unread:
            gpu = self._seal.get(self._store, self._prefix + f"arrival/{k}")
            if gpu is None or not gpu.isdigit():
                still.append(k)
                continue
            g = int(gpu)
            if g in self._members and g not in got:
                body = self._seal.get(self._store, self._prefix + f"alive/{g}")
                if body is None:  # overwritten by a stranger since: as if absent
                    continue
                got[g] = json.loads(body)
                new = True
        self._unread = still
        return new


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
    book = _Book(store, seal, prefix, set(previous))
    while True:
        if book.read(got):
            last = clock()
        missing = [g for g in previous if g not in got]
        silent = [g for g in missing if silence.silent(g)]  # reads rate-limited by `Silence`
        # One call says whether every missing member that still beats is marked dead; only
        # then is each mark read (its seal checked). Reading every member's mark at every poll
        # made the leader's calls grow as N x polls.
        unknown = [g for g in missing if g not in silent]
        dead: list[int] = []
        if unknown and store.check([DEAD_KEY + str(g) for g in unknown]):
            dead = [g for g in unknown if seal.get(store, DEAD_KEY + str(g)) is not None]
        hang = any(a["timeout"] for a in got.values())  # some collective timed out
        if hang:  # an arrival that died before letting go is not waited for
            dead += [
                g
                for g in got
                if g not in released and seal.get(store, DEAD_KEY + str(g)) is not None
            ]
        if len(set(got) | set(dead) | set(silent)) >= len(previous):
            break
        now = clock()
        if now - start > JOIN_WINDOW_S:
            break
        if hang:
            for g in got:
                if g not in released and seal.get(store, prefix + f"released/{g}") is not None:
                    released.add(g)
                    last = now
            if set(got) - set(dead) <= released and now - last > quiet_s:
                break
        sleep(POLL_S)
    return Gathered({g: got[g] for g in previous if g in got}, dead, silent)
