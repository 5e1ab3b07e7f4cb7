"""`World`: the job's process group as one object, made once per process and handed around.

One process is one rank, and what it knows of the job's process group lives here rather than
in module globals (the habit of Megatron's `parallel_state`, which this code avoids): the
membership in force (trainer/world/membership.py: who is in, at which epoch, who coordinates),
the client of the rendezvous store that outlives any rank (None: failures are fatal), the bound
on every collective (the hang timeout), the deadline of the step in progress, and the recovery
alarm (trainer/world/alarm.py). A rank's start makes it (trainer/cli.py: `World(size)`, then
trainer/launch/distributed.py `init_distributed` installs the first membership, the store and
the alarm), the Trainer and its parts hold it, and a recovery re-forming the group installs the
next membership into the same object (trainer/recovery/).
A process with no process group (a unit test, a single rank) makes `World(size)` and installs
nothing: GPU ids are then process-group ranks and GPU 0 coordinates.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

from .alarm import MIN_BEAT_S, SILENT_BEATS, Alarm, Silence, beat_s, dead_after_s, interval_s
from .membership import Membership
from .progress import Progress
from .sealed import Sealer

__all__ = [
    "DEFAULT_HANG_TIMEOUT_S",
    "HANG_MAX_S",
    "HANG_MIN_S",
    "HANG_STEPS",
    "STEP_FLOOR",
    "World",
    "sized_hang_timeout",
]

DEFAULT_HANG_TIMEOUT_S = 600.0
"""The collectives' bound until the step time is measured (spec.failurePolicy unset)."""
HANG_STEPS, HANG_MIN_S, HANG_MAX_S = 10, 30.0, 600.0
"""Unset `hangTimeoutSeconds`: 10 measured steps, clamped to [30, 600] s."""
STEP_FLOOR = 0.5
"""Inside a step a collective's timeout is at least this share of the hang timeout."""
WAIT_SLICE = timedelta(seconds=0.05)
"""How long a collective wait blocks before it looks at the alarm again (`World.wait`)."""


def sized_hang_timeout(step_seconds: float) -> float:
    return min(HANG_MAX_S, max(HANG_MIN_S, HANG_STEPS * step_seconds))


class World:
    """The job's GPUs `0..size-1` as this process sees them (see the module)."""

    def __init__(self, size: int) -> None:
        self.size = size
        """GPUs in the job (the plan's ranks), whoever of them is in the process group now."""
        self._current: Membership | None = None
        self._store: Any = None  # the rendezvous store client (None: failures are fatal)
        self._timeout_s = DEFAULT_HANG_TIMEOUT_S
        self._step_start: float | None = None  # monotonic start of the step in progress
        self._bounds: dict[int, tuple[Any, float]] = {}  # id(group) -> (group, its timeout)
        self._alarm: Alarm | None = None
        self._held: list[Any] = []  # store connections kept alive (`hold`)
        self._sealer: Sealer | None = None
        self._abandoned: list[Any] = []  # collectives left pending by `wait` (the alarm rang)
        self._graves: list[tuple[list[Any], list[Any]]] = []  # (groups, their pending works)
        self._p2p: concurrent.futures.ThreadPoolExecutor | None = None  # waits for `wait_p2p`
        self._p2p_abandoned: list[concurrent.futures.Future[None]] = []
        self.progress = Progress(lambda: self._timeout_s)
        """This rank's progress marks (trainer/world/progress.py), judged by its alarm."""

    # ---- the membership ---------------------------------------------------------------------
    def install(self, membership: Membership, rendezvous: Any = None) -> None:
        """Record the process group just formed (and, the first time, the store to recover by)."""
        self._current = membership
        if rendezvous is not None:
            self._store = rendezvous

    @property
    def current(self) -> Membership | None:
        """The membership in force; None before any was installed."""
        return self._current

    @property
    def store(self) -> Any:
        """The rendezvous store that outlives any rank, or None when failures are not survivable."""
        return self._store

    @property
    def sealer(self) -> Sealer:
        """Seals what this process writes to the job's store and opens what it reads
        (trainer/world/sealed.py); set with the store (`seal_with`), before any recovery."""
        if self._sealer is None:
            raise RuntimeError("no store key: the job's store values cannot be sealed or read")
        return self._sealer

    def seal_with(self, sealer: Sealer) -> None:
        self._sealer = sealer

    def pg(self, gpu: int) -> int:
        """GPU id -> process-group rank under the membership in force (the identity before any)."""
        return gpu if self._current is None else self._current.pg(gpu)

    def coordinator(self) -> int:
        """The coordinator's GPU id: the lowest member (0 before any membership is installed)."""
        return 0 if self._current is None else self._current.coordinator

    def hold(self, connection: Any) -> None:
        """Keep `connection` alive as long as this World: a store written in Python
        (trainer/world/store_client.py) and handed to C++ (a PrefixStore over it, a process
        group) keeps only its C++ half alive on its own, and its methods are gone without it."""
        self._held.append(connection)

    # ---- the bound on collectives -----------------------------------------------------------
    @property
    def collective_timeout_s(self) -> float:
        """The bound on every collective of a fault-tolerant job: the hang timeout."""
        return self._timeout_s

    def set_collective_timeout(self, seconds: float, groups: Iterable[Any] = ()) -> None:
        """Bound every later collective by `seconds`: the default group's and `groups`'
        timeouts change in place (no collective; `dist.new_group` is given it too,
        trainer/parallel/groups.py)."""
        self._timeout_s = float(seconds)
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout

        if not dist.is_initialized():
            return
        limit = timedelta(seconds=self._timeout_s)
        for group in (None, *groups):
            if group is None or not _rank_not_in_group(group):
                _set_pg_timeout(limit, group)

    @contextlib.contextmanager
    def step_deadline(self, step: int | None = None) -> Iterator[None]:
        """Inside: every collective passed through `bound` times out at one deadline, the hang
        timeout after the step started, rather than the hang timeout after it was entered.

        Why: the ranks leave the previous step's world all-reduce within milliseconds of each
        other, so this deadline is common to the job, and when a rank hangs every survivor
        blocked on it fails at once. With a timeout counted from each collective's entry, the
        survivor that entered its collective with the hung rank last (the other replica's
        gradient sync, entered a backward pass after the hung rank's TP partner got stuck in its
        forward) would be waited for that much longer, and nobody else can wake it: the hung
        rank's end of that connection never closes. A collective entered late in a slow step
        keeps at least `STEP_FLOOR` of the timeout, so a slow step is not taken for a hang any
        sooner than before. On the way out the groups get the plain bound back (switches,
        checkpoints)."""
        self._step_start = time.monotonic()
        try:
            with self.progress.in_step(step):
                yield
            for group, seconds in list(self._bounds.values()):
                if seconds != self._timeout_s:
                    self._set(group, self._timeout_s)
        finally:
            # Holds no group past the step: a failed step's groups must lose their last
            # reference for their sockets to close (trainer/recovery/groups.py `release_groups`).
            self._step_start = None
            self._bounds.clear()

    def bound(self, group: Any = None) -> None:
        """Before a collective of the step on `group` (None: the job's group): its timeout ends
        at the step's deadline (`step_deadline`; outside one, nothing changes). Costs a clock
        read; the group's timeout is set (a call into the backend) only when it is 20 ms or
        more off."""
        if self._step_start is None or self._store is None:
            return
        elapsed = time.monotonic() - self._step_start
        left = max(self._timeout_s - elapsed, self._timeout_s * STEP_FLOOR)
        known = self._bounds.get(id(group))  # held while in here, so an id is never reused
        if known is None or abs(known[1] - left) >= 0.02:
            self._set(group, left)

    def _set(self, group: Any, seconds: float) -> None:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        try:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        except (RuntimeError, ValueError, AssertionError):  # a group already torn down
            return
        self._bounds[id(group)] = (group, seconds)

    def wait(self, work: Any, timeout_s: float | None = None) -> None:
        """Wait for a collective posted with `async_op=True`, looking at the alarm every
        `WAIT_SLICE`: a peer declared dead (its heartbeat stopped) or a peer in recovery ends
        the wait with the alarm's error (`check_alarm`) rather than the hang timeout; the
        collective's own failure (a peer's socket closed, its timeout) is raised as it comes.
        While waiting this rank's progress is not judged (trainer/world/progress.py). With no
        alarm (failures fatal) or on a GPU, the plain `work.wait()`. `timeout_s`: a bound of the
        caller's below the group's (a switch's `migrationTimeoutSeconds`): TimeoutError past it."""
        import torch

        if self._alarm is None or torch.cuda.is_available():
            if timeout_s is None:
                work.wait()
            elif not work.wait(timedelta(seconds=timeout_s)):
                raise TimeoutError(f"no completion within {timeout_s:g} s")
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.progress.outside():
            while True:
                try:
                    work.wait(WAIT_SLICE)
                    return
                except RuntimeError:
                    if work.is_completed():  # done meanwhile, or failed: its own verdict
                        work.wait()
                        return
                try:
                    self._alarm.check()
                    _check_deadline(deadline, timeout_s)
                except (RuntimeError, TimeoutError):
                    self._abandoned.append(work)  # still pending on a peer that will not answer
                    raise

    def wait_p2p(self, works: Iterable[Any], timeout_s: float | None = None) -> None:
        """Wait for point-to-point `works` like `wait` does for a collective. A gloo send or
        receive cannot be waited for in slices (a wait that times out breaks the whole group)
        nor polled (it completes only in its wait), so a thread of this World waits for them
        and this one waits for that thread in slices, looking at the alarm between two; when
        the alarm rings (or `timeout_s` passes), the thread is left to its wait (it ends with
        the group's timeout) and the next waits get a new one."""
        works = list(works)
        import torch

        if self._alarm is None or not works or torch.cuda.is_available():
            limit = None if timeout_s is None else timedelta(seconds=timeout_s)
            for work in works:
                if limit is None:
                    work.wait()
                elif not work.wait(limit):
                    raise TimeoutError(f"no completion within {timeout_s:g} s")
            return
        if self._p2p is None:
            self._p2p = concurrent.futures.ThreadPoolExecutor(1, "malleus-p2p")
        done = self._p2p.submit(_wait_all, works)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.progress.outside():
            while True:
                try:
                    done.result(WAIT_SLICE.total_seconds())
                    return
                except concurrent.futures.TimeoutError:
                    pass
                try:
                    self._alarm.check()
                    _check_deadline(deadline, timeout_s)
                except (RuntimeError, TimeoutError):
                    self._p2p_abandoned.append(done)
                    self._p2p.shutdown(wait=False)  # its thread is stuck in the wait
                    self._p2p = None
                    raise

    def abandon(self, works: Iterable[Any]) -> None:
        """Collectives posted by a step that failed before waiting for them: kept with those
        `wait` left pending, so that `bury` keeps their groups until they end."""
        self._abandoned.extend(works)

    def bury(self, groups: list[Any]) -> bool:
        """Keep `groups` (every process group of a failed epoch) alive while collectives that
        `wait` left pending on them are not done: tearing such a group down waits for them, that
        is, for the hang timeout when the peer they wait on is stopped. True when there were
        such collectives (the caller then must not tear the groups down, only forget them);
        groups buried earlier whose collectives are done by now are let go."""
        self._graves = [(g, w) for g, w in self._graves if not all(x.is_completed() for x in w)]
        pending = [w for w in self._abandoned if not w.is_completed()]
        pending += [_Waited(f) for f in self._p2p_abandoned if not f.done()]
        self._abandoned, self._p2p_abandoned = [], []
        if pending:
            self._graves.append((list(groups), pending))
        return bool(pending)

    # ---- the recovery alarm -----------------------------------------------------------------
    def start_alarm(self, store: Any, rank: int) -> None:
        """Watch the job's store, beat for `rank`, watch the next member's beat and judge this
        rank's progress from now on (once per World)."""
        if self._alarm is None:
            self._alarm = Alarm(
                store,
                interval_s(self.size),
                self._epoch,
                rank=rank,
                beat=beat_s(self.size),
                sealer=self.sealer,
                members=self._members,
                dead_after=dead_after_s(self.size),
                progress=self.progress,
            ).start()
            atexit.register(self._alarm.close)

    def _members(self) -> tuple[int, ...]:
        m = self._current
        return tuple(range(self.size)) if m is None else m.members

    def _epoch(self) -> int | None:
        m = self._current
        return None if m is None else m.epoch

    @property
    def watched(self) -> bool:
        """Whether the recovery alarm runs (failures survivable: heartbeats, `wait` in slices)."""
        return self._alarm is not None

    def check_alarm(self) -> None:
        """`Alarm.check`: raise `PeerRecovering` when a peer entered a recovery this rank is
        not in yet; nothing when no alarm runs (failures are not survivable)."""
        if self._alarm is not None:
            self._alarm.check()

    def close(self) -> None:
        """Stop the alarm's thread now (it is stopped at exit anyway: `Alarm.close`)."""
        if self._alarm is not None:
            self._alarm.close()

    def silence(self, store: Any) -> Silence:
        """A `Silence` over the job's store, its window `SILENT_BEATS` of this process's beats."""
        beat = self._alarm.beat if self._alarm is not None else MIN_BEAT_S
        return Silence(store, SILENT_BEATS * beat, sealer=self.sealer)


def _check_deadline(deadline: float | None, timeout_s: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"no completion within {timeout_s:g} s")


def _wait_all(works: list[Any]) -> None:
    for work in works:
        work.wait()


class _Waited:
    """A `wait_p2p` left pending, seen as a work (`is_completed`) by `World.bury`."""

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def is_completed(self) -> bool:
        return self._future.done()
