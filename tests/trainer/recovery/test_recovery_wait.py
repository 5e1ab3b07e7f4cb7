"""The recovery leader's wait (trainer/recovery/wait.py) against a real c10d store, on the
test's clock: the store's keys appear when the clock passes the times a scenario gives. Values
are sealed with the job's key (trainer/world/sealed.py); planted ones change nothing."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch.distributed as dist

from malleus.trainer.recovery.wait import (
    JOIN_WINDOW_S,
    QUIET_MIN_S,
    announce,
    gather,
    mark_released,
    quiet_after_timeout_s,
)
from malleus.trainer.world import alarm
from malleus.trainer.world.errors import DEAD_KEY
from malleus.trainer.world.sealed import Sealer

PREFIX = "rec/1/"
PREVIOUS = (0, 1, 2, 3)


class Scenario:
    """A clock that only `sleep` moves, and store writes due at given times."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.seal = Sealer.fresh()
        self.now = 0.0
        self._due: list[tuple[float, Callable[[], None]]] = []

    def at(self, t: float, action: Callable[[], None]) -> None:
        self._due.append((t, action))
        self._run()

    def arrive(self, t: float, gpu: int, *, timeout: bool, released_after: float | None) -> None:
        body = json.dumps({"gpu": gpu, "timeout": timeout})
        self.at(t, lambda: announce(self.store, self.seal, PREFIX, gpu, body))
        if released_after is not None:
            self.at(t + released_after, lambda: mark_released(self.store, self.seal, PREFIX, gpu))

    def beat(self, gpu: int, every: float, until: float) -> None:
        t, count = 0.0, 0
        while t < until:
            count += 1
            self.at(t, lambda n=count: alarm.beat(self.store, self.seal, gpu, "n", n))
            t += every

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self._run()

    def _run(self) -> None:
        for item in [d for d in self._due if d[0] <= self.now]:
            self._due.remove(item)
            item[1]()

    def gather(self):
        silence = alarm.Silence(self.store, 3.0, sealer=self.seal, clock=self.clock)
        return gather(
            self.store, self.seal, PREFIX, PREVIOUS, silence, clock=self.clock, sleep=self.sleep
        )


def test_every_member_arrived_no_wait() -> None:
    s = Scenario()
    for g in PREVIOUS:
        s.arrive(0.0, g, timeout=False, released_after=None)
    got = s.gather()
    assert list(got.arrivals) == [0, 1, 2, 3] and s.now == 0.0


def test_a_hang_is_decided_a_short_quiet_after_every_arrival_let_go() -> None:
    s = Scenario()
    for g, released in ((0, 0.04), (1, 0.10), (2, 0.08)):
        s.arrive(0.0, g, timeout=True, released_after=released)
    got = s.gather()
    quiet = quiet_after_timeout_s(len(PREVIOUS))
    assert quiet == pytest.approx(QUIET_MIN_S)
    assert list(got.arrivals) == [0, 1, 2] and got.dead == [] and got.silent == []
    # counted from the last release (0.10 s), not from the first arrival, and far from 2 s
    assert 0.10 + quiet < s.now <= 0.10 + quiet + 0.05


def test_an_arrival_still_letting_go_holds_the_decision() -> None:
    s = Scenario()
    s.arrive(0.0, 0, timeout=True, released_after=0.0)
    s.arrive(0.0, 1, timeout=True, released_after=0.0)
    s.arrive(0.0, 2, timeout=True, released_after=0.9)  # a busy host: its collection is slow
    got = s.gather()
    assert list(got.arrivals) == [0, 1, 2]
    assert s.now > 0.9 + quiet_after_timeout_s(4)


def test_a_survivor_failing_on_a_released_peer_is_waited_for() -> None:
    s = Scenario()
    s.arrive(0.0, 0, timeout=True, released_after=0.05)
    s.arrive(0.0, 1, timeout=True, released_after=0.05)
    # rank 2 was blocked on rank 0 (not on the hung one): it fails when 0 lets go, a little later
    s.arrive(0.12, 2, timeout=False, released_after=0.05)
    got = s.gather()
    assert list(got.arrivals) == [0, 1, 2] and s.now > 0.17


def test_an_arrival_that_never_lets_go_is_known_dead_or_waited_out() -> None:
    s = Scenario()
    s.arrive(0.0, 0, timeout=True, released_after=0.0)
    s.arrive(0.0, 1, timeout=True, released_after=None)  # died while releasing
    s.arrive(0.0, 2, timeout=True, released_after=0.0)
    s.at(0.5, lambda: s.seal.put(s.store, DEAD_KEY + "1", "killed"))
    got = s.gather()
    # the hung rank 3 is neither dead nor silent yet; rank 1's mark ends the wait for it
    assert got.dead == [1] and 0.5 <= s.now < 0.5 + quiet_after_timeout_s(4)

    s = Scenario()  # the others still beat (alive, not arrived): only the join window ends it
    s.arrive(0.0, 0, timeout=True, released_after=None)
    for g in (1, 2, 3):
        s.beat(g, 0.5, until=10.0)
    got = s.gather()
    assert s.now > JOIN_WINDOW_S and list(got.arrivals) == [0]


def test_without_a_timeout_the_missing_rank_is_waited_for_until_silent() -> None:
    s = Scenario()  # a pod deleted: its peers failed on a closed socket, nobody marks it
    for g in (0, 1, 2):
        s.arrive(0.0, g, timeout=False, released_after=0.0)
        s.beat(g, 0.5, until=10.0)
    got = s.gather()
    assert got.silent == [3] and 3.0 <= s.now < JOIN_WINDOW_S


def test_the_quiet_grows_with_the_alarm_interval() -> None:
    assert quiet_after_timeout_s(1024) == pytest.approx(2 * alarm.interval_s(1024))
    assert quiet_after_timeout_s(8192) == pytest.approx(1.6384)


def test_planted_arrivals_dead_marks_and_releases_change_nothing() -> None:
    """A stranger who can write the store plants an arrival of the hung rank, dead marks of
    the others and releases: none opens, so the leader waits exactly as without them (the
    hung rank is still missing, nobody is taken for dead, the quiet still waits for the real
    releases), and a mark sealed for another GPU is not one either."""
    s = Scenario()
    forged = json.dumps({"gpu": 3, "timeout": False})
    s.at(0.0, lambda: s.store.set(PREFIX + "alive/3", forged))
    s.at(0.0, lambda: s.store.set(DEAD_KEY + "2", "killed"))
    s.at(0.0, lambda: s.store.set(DEAD_KEY + "1", s.seal.seal(DEAD_KEY + "0", "killed")))
    s.at(0.0, lambda: s.store.set(PREFIX + "released/2", "1"))
    # a slot of the order of arrivals counted and filled by the stranger: it holds no real
    # arrival back (those take the slots after it) and adds nobody
    s.at(0.0, lambda: s.store.add(PREFIX + "arrivals", 1))
    s.at(0.0, lambda: s.store.set(PREFIX + "arrival/1", "3"))
    s.arrive(0.0, 0, timeout=True, released_after=0.0)
    s.arrive(0.0, 1, timeout=True, released_after=0.0)
    s.arrive(0.0, 2, timeout=True, released_after=0.3)
    got = s.gather()
    assert list(got.arrivals) == [0, 1, 2] and got.dead == [] and got.silent == []
    assert s.now >= 0.3 + quiet_after_timeout_s(4)  # waited for rank 2's real release
    assert s.seal.forged >= 4
