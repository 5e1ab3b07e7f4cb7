"""The recovery alarm: a rank busy computing learns that a peer entered recovery, and stops.

A rank that dies breaks at once only the collectives its peers are blocked in with it; a rank
computing its share of the step (another pipeline's layers, say) would find out at its next
collective with a broken peer, often the gradient sync at the end of the step, so the whole
job waits out the rest of a step that is going to be redone anyway. Each survivor that enters
recovery epoch E+1 says so at `rec/E+1/arrive`, sealed with the job's key
(trainer/recovery/protocol.py, trainer/world/sealed.py); this thread watches for that key on its
own connection to the job's store and, once its seal checks (a value a stranger planted is
ignored: no spurious recovery), raises a flag, and the
step's layer calls (trainer/parallel/pipeline.py `LayerTimer`) check the flag before each
layer and raise `PeerRecovering`, which the step loop treats like any failed collective
(trainer/recovery/protocol.py `as_failure`): the step commits or is redone by the same rule.

Polling is the price: one `check` of one key per interval per rank. The interval grows with
the world (`interval_s`) so that the store serves at most ~10,000 checks a second whatever the
job's size; a flag read costs an attribute lookup, nothing else. The process's alarm is started
and held by its `World` (trainer/world/world.py `start_alarm`, `check_alarm`, `silence`).

Heartbeats. The same thread counts `rec/beat/GPU` up every `beat_s(world)` (at most ~2,000
adds a second in all). A process that is gone (its pod deleted, its node lost) or stopped
stops counting, and no launcher may be left to write `rec/dead/GPU` for it: `Silence` tells
the recovery leader that a rank which has not arrived is silent (its count unchanged for
`SILENT_BEATS` beats), so it need not wait out the whole join window, and tells the survivors that
a leader which has not decided is gone, so they need not wait out `DECISION_WAIT_S`. A rank
that is slow but alive (a loaded host, a long collection) still counts: its thread needs the
interpreter for microseconds per beat, and the window is many beats long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sealed import Sealer

__all__ = ["BEAT_KEY", "Alarm", "PeerRecovering", "Silence", "beat_s", "interval_s"]

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.05
STORE_CHECKS_PER_S = 10_000
BEAT_KEY = "rec/beat/"
MIN_BEAT_S = 0.5
STORE_BEATS_PER_S = 2_000
SILENT_BEATS = 6
"""Beats a rank's count stays unchanged before it counts as silent: at least 3 s."""


class PeerRecovering(RuntimeError):
    """A peer entered recovery while this rank was computing (no collective of its failed)."""


def interval_s(world: int) -> float:
    """Seconds between two checks of one rank, so that all ranks together stay within
    `STORE_CHECKS_PER_S` (4 ranks: 50 ms; 1,024: 100 ms; 8,192: 0.8 s)."""
    return max(MIN_INTERVAL_S, world / STORE_CHECKS_PER_S)


def beat_s(world: int) -> float:
    """Seconds between two heartbeats of one rank (4 ranks: 0.5 s; 8,192: 4.1 s)."""
    return max(MIN_BEAT_S, world / STORE_BEATS_PER_S)


class Silence:
    """Which ranks stopped beating, as seen from now on: a rank is silent once its count in
    `rec/beat/GPU` has not changed for `after` seconds of this watcher's clock (the counts are
    compared, never the ranks' clocks, so skew between hosts does not matter)."""

    def __init__(
        self, store: Any, after: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store, self._after, self._clock = store, after, clock
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last changed)
        self._read_at: dict[int, float] = {}

    def silent(self, rank: int) -> bool:
        """Whether `rank` has not beaten for `after` seconds (its count read at most every
        tenth of the window, so a watcher polling fast does not load the store)."""
        now = self._clock()
        if rank in self._read_at and now - self._read_at[rank] < self._after / 10:
            return now - self._seen[rank][1] >= self._after
        self._read_at[rank] = now
        count = int(self._store.add(f"{BEAT_KEY}{rank}", 0))
        old = self._seen.get(rank)
        if old is None or old[0] != count:
            self._seen[rank] = (count, now)
            return False
        return now - old[1] >= self._after


class Alarm:
    """Watches `rec/E+1/arrive` on its own connection to the job's store (`store.clone()`),
    E being the epoch of the membership in force (`epoch()`, read at every check), believing it
    only when `sealer` opens it, and beats for `rank` (`rec/beat/RANK`) every `beat` seconds
    (None: no heartbeat)."""

    def __init__(
        self,
        store: Any,
        every: float,
        epoch: Callable[[], int | None],
        *,
        rank: int | None = None,
        beat: float = MIN_BEAT_S,
        sealer: Sealer,
    ) -> None:
        self._store, self._every, self._epoch = store.clone(), every, epoch
        self._sealer = sealer
        self._rank, self._beat = rank, beat
        self._raised: int | None = None  # the epoch a peer entered; None while none did
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="malleus-alarm", daemon=True)

    def start(self) -> Alarm:
        self._thread.start()
        return self

    @property
    def beat(self) -> float:
        """Seconds between two heartbeats of this rank."""
        return self._beat

    def close(self) -> None:
        """Stop and join the thread. Needed before the interpreter finalizes: a daemon thread
        caught inside the store's C++ call then is ended by pthread_exit, which aborts the
        process ("terminate called without an active exception")."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _watch(self) -> None:
        next_beat = 0.0
        while not self._done.wait(self._every):
            if self._rank is not None and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._beat
                try:
                    self._store.add(f"{BEAT_KEY}{self._rank}", 1)
                except (RuntimeError, OSError) as e:
                    log.debug("heartbeat stops: %s", e)
                    return
            epoch = self._epoch()
            if epoch is None:
                continue
            if self._raised is not None and self._raised <= epoch:
                self._raised = None  # that recovery is over: this rank took part in it
            try:
                if self._raised is None and self._sealer.get(
                    self._store, f"rec/{epoch + 1}/arrive"
                ):
                    self._raised = epoch + 1
            except (RuntimeError, OSError) as e:  # the store is gone: the job is ending
                log.debug("recovery alarm stops: %s", e)
                return

    def check(self) -> None:
        """Raise `PeerRecovering` when a peer entered a recovery this rank is not in yet."""
        raised, epoch = self._raised, self._epoch()
        if raised is not None and epoch is not None and raised > epoch:
            raise PeerRecovering(f"a peer entered recovery epoch {raised} while this rank computed")
