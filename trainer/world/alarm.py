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

Heartbeats (liveness, the first of a rank's two signals; progress is the second,
trainer/world/progress.py). The same thread writes `rec/beat/GPU` every `beat_s(world)`
(a quarter of a second up to 1,000 ranks), sealed with the job's key: this process's nonce and
a count that only grows. A process that is gone (its pod deleted, its node lost) or stopped
(SIGSTOP stops every thread; a frozen node) stops beating, whether or not its training thread was
making progress, and no launcher may be left to write `rec/dead/GPU` for it. So every rank also
watches one peer: the next member of the membership in force, in GPU order (a ring: each rank
is watched by exactly one). When that peer's beat has not advanced for `dead_after_s(world)`
(2 s up to 1,000 ranks), the watcher writes the peer's dead mark (sealed, `hung`: the leader
then does not wait for it, and `malleus run` or the operator replace it) and raises its own
flag: its training thread leaves whatever it is in (a layer call, or a collective wait,
trainer/world/world.py `World.wait`) with `PeerSilent`, enters recovery, and its arrival
(`arrive`) stops every other rank the same way. A dead peer's peers need not be watched: the
recovery leader tells the rest by `Silence`, the same beats read for `SILENT_BEATS` beats.

Only a beat whose seal checks counts, and only when it advances (a higher count, or a nonce not
seen before: a new process for that GPU): a stranger who can write the store can neither make a
live rank look dead by replaying one of its old beats nor keep a dead one alive with a forged
one. A peer is judged only once it has been seen beating (a process not yet started is not
dead); one stopped before its first beat is caught by the hang timeout instead.

The watch costs one read of one key per beat per rank and each beat one write: with the beat
growing with the world (`STORE_BEATS_PER_S` writes a second in all), 4 ranks make 16 writes and
16 reads a second, 1,000 ranks 4,000 of each, 4,096 ranks 4,000 of each (beats of 1 s, dead
after 4 s). A rank that is slow but alive (a loaded host, a long collection) still beats: its
thread needs the interpreter for microseconds per beat, and the window is eight beats long. A
call into C that holds the interpreter longer than the window (none in the step) would make a
live rank look dead: it is then left out and replaced (slower, never wrong).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from malleus.errors import LEFT_OUT_EXIT

from .errors import DEAD_KEY, say_ending

if TYPE_CHECKING:
    from .progress import Progress
    from .sealed import Sealer

__all__ = [
    "BEAT_KEY",
    "Alarm",
    "PeerRecovering",
    "PeerSilent",
    "Silence",
    "beat",
    "beat_s",
    "dead_after_s",
    "interval_s",
]

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.05
STORE_CHECKS_PER_S = 10_000
BEAT_KEY = "rec/beat/"
MIN_BEAT_S = 0.25
STORE_BEATS_PER_S = 4_000
DEAD_BEATS = 8
"""Beats a watched peer's beat stays unchanged before it is declared dead: at least 2 s."""
SILENT_BEATS = 12
"""Beats a rank's beat stays unchanged before the recovery leader counts it silent: at least 3 s
(the leader has dead marks for the ranks their watchers declared; this is for the others)."""


class PeerRecovering(RuntimeError):
    """A peer entered recovery while this rank was computing (no collective of its failed)."""


class PeerSilent(RuntimeError):
    """The peer this rank watches stopped beating: stopped, frozen or gone."""


def interval_s(world: int) -> float:
    """Seconds between two checks of one rank, so that all ranks together stay within
    `STORE_CHECKS_PER_S` (4 ranks: 50 ms; 1,024: 100 ms; 8,192: 0.8 s)."""
    return max(MIN_INTERVAL_S, world / STORE_CHECKS_PER_S)


def beat_s(world: int) -> float:
    """Seconds between two heartbeats of one rank (up to 1,000 ranks: 0.25 s; 4,096: 1 s)."""
    return max(MIN_BEAT_S, world / STORE_BEATS_PER_S)


def dead_after_s(world: int) -> float:
    """Seconds a watched peer's beat stays unchanged before it is declared dead (`DEAD_BEATS`
    beats: 2 s up to 1,000 ranks, 4.1 s at 4,096)."""
    return DEAD_BEATS * beat_s(world)


def beat(store: Any, sealer: Sealer, rank: int, nonce: str, count: int) -> None:
    """Write `rank`'s heartbeat: its process's `nonce` and `count`, sealed."""
    sealer.put(store, f"{BEAT_KEY}{rank}", f"{nonce}:{count}")


class Silence:
    """Which ranks stopped beating, as seen from now on: a rank is silent once its sealed beat
    (`rec/beat/GPU`) has not advanced for `after` seconds of this watcher's clock (the beats
    are compared, never the ranks' clocks, so skew between hosts does not matter). A beat
    advances when its count grows or its nonce is new (a new process for that GPU); a beat
    that does not open, or an old one replayed, is no news."""

    def __init__(
        self,
        store: Any,
        after: float,
        *,
        sealer: Sealer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store, self._after, self._clock, self._sealer = store, after, clock, sealer
        self._since: dict[int, float] = {}  # rank -> when its beat last advanced (or first read)
        self._best: dict[int, dict[str, int]] = {}  # rank -> nonce -> highest count seen
        self._read_at: dict[int, float] = {}
        self.beating: set[int] = set()
        """Ranks seen beating (a beat read at least once)."""

    def silent(self, rank: int) -> bool:
        """Whether `rank` has not beaten for `after` seconds (its beat read at most every
        tenth of the window, so a watcher polling fast does not load the store)."""
        now = self._clock()
        if rank in self._read_at and now - self._read_at[rank] < self._after / 10:
            return now - self._since[rank] >= self._after
        self._read_at[rank] = now
        if self._advanced(rank, self._sealer.get(self._store, f"{BEAT_KEY}{rank}")):
            self._since[rank] = now
            return False
        since = self._since.setdefault(rank, now)
        return now - since >= self._after

    @property
    def after(self) -> float:
        """The window: seconds without an advance that make a rank silent."""
        return self._after

    def forget(self, rank: int) -> None:
        """Judge `rank` afresh from now on (it just became the one watched)."""
        self._since.pop(rank, None)
        self._read_at.pop(rank, None)

    def _advanced(self, rank: int, value: str | None) -> bool:
        if value is None:
            return False
        nonce, _, count = value.rpartition(":")
        if not count.isdigit():
            return False
        self.beating.add(rank)
        best = self._best.setdefault(rank, {})
        if nonce in best and int(count) <= best[nonce]:
            return False
        best[nonce] = int(count)
        return True


class Alarm:
    """Watches `rec/E+1/arrive` on its own connection to the job's store (`store.clone()`),
    E being the epoch of the membership in force (`epoch()`, read at every check), believing it
    only when `sealer` opens it; beats for `rank` (`rec/beat/RANK`) every `beat` seconds (None:
    no heartbeat); watches the next of `members()` after `rank` and declares it dead after
    `dead_after` seconds without a beat (see the module); and, with `progress`, declares this
    rank hung when its training thread is overdue (trainer/world/progress.py)."""

    def __init__(
        self,
        store: Any,
        every: float,
        epoch: Callable[[], int | None],
        *,
        rank: int | None = None,
        beat: float = MIN_BEAT_S,
        sealer: Sealer,
        members: Callable[[], tuple[int, ...]] | None = None,
        dead_after: float | None = None,
        progress: Progress | None = None,
    ) -> None:
        self._store, self._every, self._epoch = store.clone(), every, epoch
        self._sealer = sealer
        self._rank, self._beat = rank, beat
        self._members, self._progress = members, progress
        self._nonce, self._count = secrets.token_hex(4), 0
        after = dead_after if dead_after is not None else DEAD_BEATS * beat
        self._watch_beats = Silence(self._store, after, sealer=sealer)
        self._watched: int | None = None
        self._looked = 0.0  # when this watcher last looked at its peer
        self._declared: dict[int, int] = {}  # GPU -> the epoch at which it was declared dead
        self._raised: int | None = None  # the epoch a peer entered; None while none did
        self._silent: tuple[int, int, float] | None = None  # (epoch, peer, seconds silent)
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
            try:
                if self._rank is not None and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self._beat
                    self._count += 1
                    beat(self._store, self._sealer, self._rank, self._nonce, self._count)
                    self._watch_peer()
                self._check_progress()
                epoch = self._epoch()
                if epoch is None:
                    continue
                if self._raised is not None and self._raised <= epoch:
                    self._raised = None  # that recovery is over: this rank took part in it
                if self._raised is None and self._sealer.get(
                    self._store, f"rec/{epoch + 1}/arrive"
                ):
                    self._raised = epoch + 1
            except (RuntimeError, OSError) as e:  # the store is gone: the job is ending
                log.debug("recovery alarm stops: %s", e)
                return

    def _watch_peer(self) -> None:
        """Judge the peer this rank watches (the next member in GPU order, skipping those
        already declared dead at this epoch)."""
        epoch, members = self._epoch(), self._members() if self._members is not None else ()
        if epoch is None or self._rank not in members:
            return
        alive = [g for g in members if self._declared.get(g) != epoch]
        if len(alive) < 2:
            return
        peer = alive[(alive.index(self._rank) + 1) % len(alive)]
        now = time.monotonic()
        # A watcher that was itself away (the store lost and dialed again, this process
        # stopped) judges afresh: the peer's beats it missed say nothing of the peer.
        away = now - self._looked > 2 * self._beat
        self._looked = now
        if peer != self._watched or away:
            self._watched = peer
            self._watch_beats.forget(peer)
        if not self._watch_beats.silent(peer) or peer not in self._watch_beats.beating:
            return
        self._declared[peer] = epoch
        # Claimed, not set: a launcher that saw the process end first ("killed", "left")
        # knows more than a silence does, and its word stays.
        self._sealer.claim(self._store, f"{DEAD_KEY}{peer}", "hung")
        silent_for = self._watch_beats.after
        log.warning(
            "rank %d: rank %d has not beaten for %.1f s (stopped, frozen or gone): declared dead",
            self._rank,
            peer,
            silent_for,
        )
        self._silent = (epoch, peer, silent_for)

    def _check_progress(self) -> None:
        """This rank's training thread overdue (trainer/world/progress.py): say so, mark this
        GPU dead (sealed, `hung`) and exit, so that its peers' collectives fail at once."""
        if self._progress is None or self._rank is None:
            return
        idle = self._progress.overdue()
        if idle is None:
            return
        said = (
            f"rank {self._rank} made no progress for {idle:.1f} s inside step "
            f"{self._progress.step} (bound {self._progress.bound():.1f} s, from its own "
            "measured steps): declared hung; exiting so that the others go on without it"
        )
        try:
            self._sealer.put(self._store, f"{DEAD_KEY}{self._rank}", "hung")
        finally:
            print(f"[malleus] {said}", file=sys.stderr, flush=True)
            say_ending(LEFT_OUT_EXIT, said)
            os._exit(LEFT_OUT_EXIT)  # no cleanup: the training thread is stuck

    def check(self) -> None:
        """Raise `PeerRecovering` when a peer entered a recovery this rank is not in yet, and
        `PeerSilent` when the peer this rank watches was declared dead at the epoch in force."""
        raised, epoch = self._raised, self._epoch()
        if raised is not None and epoch is not None and raised > epoch:
            raise PeerRecovering(f"a peer entered recovery epoch {raised} while this rank computed")
        silent = self._silent
        if silent is not None and epoch is not None and silent[0] == epoch:
            raise PeerSilent(
                f"rank {silent[1]} has not beaten for {silent[2]:.1f} s (stopped, frozen or gone)"
            )
