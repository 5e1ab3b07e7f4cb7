"""The recovery alarm: a rank busy computing learns that a peer entered recovery, and stops.

A rank that dies breaks at once only the collectives its peers are blocked in with it; a rank
computing its share of the step (another pipeline's layers, say) would find out at its next
collective with a broken peer, often the gradient sync at the end of the step, so the whole
job waits out the rest of a step that is going to be redone anyway. Each survivor that enters
recovery epoch E+1 counts itself in at `rec/E+1/arrive` (trainer/recovery.py); this thread
watches for that key on its own connection to the job's store and raises a flag, and the
step's layer calls (trainer/parallel/pipeline.py `LayerTimer`) check the flag before each
layer and raise `PeerRecovering`, which the step loop treats like any failed collective
(trainer/worker.py `as_failure`): the step commits or is redone by the same rule.

Polling is the price: one `check` of one key per interval per rank. The interval grows with
the world (`interval_s`) so that the store serves at most ~10,000 checks a second whatever the
job's size; a flag read costs a global lookup, nothing else.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import membership

__all__ = ["Alarm", "PeerRecovering", "check", "interval_s", "start"]

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.05
STORE_CHECKS_PER_S = 10_000


class PeerRecovering(RuntimeError):
    """A peer entered recovery while this rank was computing (no collective of its failed)."""


def interval_s(world: int) -> float:
    """Seconds between two checks of one rank, so that all ranks together stay within
    `STORE_CHECKS_PER_S` (4 ranks: 50 ms; 1,024: 100 ms; 8,192: 0.8 s)."""
    return max(MIN_INTERVAL_S, world / STORE_CHECKS_PER_S)


class Alarm:
    """Watches `rec/E+1/arrive` on its own connection to the job's store (`store.clone()`),
    E being the epoch of the membership in force (`epoch()`, read at every check)."""

    def __init__(self, store: Any, every: float, epoch: Callable[[], int | None]) -> None:
        self._store, self._every, self._epoch = store.clone(), every, epoch
        self._raised: int | None = None  # the epoch a peer entered; None while none did
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="malleus-alarm", daemon=True)

    def start(self) -> Alarm:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop and join the thread. Needed before the interpreter finalizes: a daemon thread
        caught inside the store's C++ call then is ended by pthread_exit, which aborts the
        process ("terminate called without an active exception")."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _watch(self) -> None:
        while not self._done.wait(self._every):
            epoch = self._epoch()
            if epoch is None:
                continue
            if self._raised is not None and self._raised <= epoch:
                self._raised = None  # that recovery is over: this rank took part in it
            try:
                if self._raised is None and self._store.check([f"rec/{epoch + 1}/arrive"]):
                    self._raised = epoch + 1
            except (RuntimeError, OSError) as e:  # the store is gone: the job is ending
                log.debug("recovery alarm stops: %s", e)
                return

    def check(self) -> None:
        """Raise `PeerRecovering` when a peer entered a recovery this rank is not in yet."""
        raised, epoch = self._raised, self._epoch()
        if raised is not None and epoch is not None and raised > epoch:
            raise PeerRecovering(f"a peer entered recovery epoch {raised} while this rank computed")


def _epoch() -> int | None:
    m = membership.current()
    return None if m is None else m.epoch


_alarm: Alarm | None = None  # one process is one rank: the alarm is process-wide


def start(store: Any, world: int) -> None:
    """Watch the job's store from now on (once per process)."""
    global _alarm
    if _alarm is None:
        _alarm = Alarm(store, interval_s(world), _epoch).start()
        atexit.register(_alarm.close)


def check() -> None:
    """`Alarm.check` of this process's alarm; nothing when failures are not survivable."""
    if _alarm is not None:
        _alarm.check()
