"""The recovery alarm (trainer/world/alarm.py) on a real TCPStore: a computing rank learns that a peer
entered recovery within a few polls, only of an epoch it is not part of yet, and only from a
value sealed with the job's key (trainer/world/sealed.py): a planted one raises nothing."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from malleus.trainer.world.alarm import (
    BEAT_KEY,
    SILENT_BEATS,
    Alarm,
    PeerRecovering,
    Silence,
    beat,
    beat_s,
    dead_after_s,
    interval_s,
)
from malleus.trainer.world.sealed import Sealer

SEAL = Sealer.fresh()


def _raises_within(alarm: Alarm, seconds: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            alarm.check()
        except PeerRecovering:
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError(f"no alarm within {seconds} s")


def test_a_peer_arriving_at_the_next_epoch_raises_and_the_epoch_after_clears_it() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    client = dist.PrefixStore("malleus/0/", dist.TCPStore("127.0.0.1", server.port, 1, False))
    epoch = [0]
    alarm = Alarm(client, 0.02, lambda: epoch[0], sealer=SEAL).start()
    try:
        time.sleep(0.1)
        alarm.check()  # nobody recovering: no alarm
        SEAL.put(client, "rec/2/arrive", "1")  # an epoch beyond the next one is not this rank's
        time.sleep(0.1)
        alarm.check()
        client.set("rec/1/arrive", "1")  # planted by a stranger: not sealed
        client.set("rec/1/arrive", SEAL.seal("rec/2/arrive", "1"))  # sealed for another epoch
        time.sleep(0.2)
        alarm.check()  # no spurious recovery
        assert alarm._sealer.forged >= 2
        SEAL.put(client, "rec/1/arrive", "1")  # a survivor entered recovery epoch 1
        assert _raises_within(alarm, 2.0) < 1.0
        epoch[0] = 1  # this rank recovered with it: re-formed at epoch 1
        time.sleep(0.1)
        assert _raises_within(alarm, 2.0) < 1.0  # rec/2/arrive was there all along
        epoch[0] = 2
        time.sleep(0.1)
        alarm.check()  # over
    finally:
        alarm.close()


def test_the_poll_interval_keeps_the_store_load_bounded_at_any_world() -> None:
    assert interval_s(4) == pytest.approx(0.05)
    for world in (4, 1024, 8192, 65536):
        assert world / interval_s(world) <= 10_000 + 1e-6


def _store() -> object:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    client = dist.PrefixStore("malleus/0/", dist.TCPStore("127.0.0.1", server.port, 1, False))
    return server, client


def test_a_worlds_alarm_follows_the_membership_it_installs() -> None:
    """`World.start_alarm`: the alarm reads the epoch of the World's membership in force, so a
    recovery that installs the next one into the same World is over for it."""
    from malleus.trainer.world.membership import Membership
    from malleus.trainer.world.world import World

    server, client = _store()
    world = World(4)
    world.install(Membership.full(4), client)
    world.seal_with(SEAL)
    world.start_alarm(client, 1)
    try:
        world.check_alarm()  # nobody recovering
        SEAL.put(client, "rec/1/arrive", "1")  # a survivor entered recovery epoch 1
        deadline = time.monotonic() + 2.0
        with pytest.raises(PeerRecovering):
            while time.monotonic() < deadline:
                world.check_alarm()
                time.sleep(0.005)
        world.install(Membership(1, (0, 1, 2)))  # this rank re-formed with them
        world.check_alarm()  # that recovery is over for it
    finally:
        world.close()
    del server


def test_a_beating_rank_is_never_silent_and_a_stopped_one_is_after_the_window() -> None:
    server, client = _store()
    now = [0.0]
    quiet = Silence(client, 3.0, sealer=SEAL, clock=lambda: now[0])
    alarm = Alarm(client, 0.01, lambda: 0, rank=5, beat=0.01, sealer=SEAL).start()

    def count() -> int:
        got = SEAL.get(client, f"{BEAT_KEY}5")
        return int(got.rpartition(":")[2]) if got is not None else 0

    try:
        seen = 0
        for _ in range(5):  # it beats: its count moves between two reads however long apart
            # a beat since silent() last read the count, however late a loaded machine runs
            # the alarm's thread (no sleep that hopes it beat meanwhile)
            deadline = time.monotonic() + 60
            while count() <= seen and time.monotonic() < deadline:
                time.sleep(0.005)
            now[0] += 10.0
            assert not quiet.silent(5)
            seen = count()  # at least what silent() read
        assert count() >= 5
    finally:
        alarm.close()
    assert not quiet.silent(5)  # first read after it stopped: the count has changed since
    now[0] += 2.9
    assert not quiet.silent(5)  # unchanged for less than the window
    now[0] += 0.2
    assert quiet.silent(5)
    # A rank that never beat is silent after the window too (a pod deleted before it started)
    assert not quiet.silent(7)
    now[0] += 3.1
    assert quiet.silent(7)
    del server


def test_survivors_stop_waiting_for_a_silent_leader_that_never_decided() -> None:
    from malleus.trainer.recovery.protocol import DECISION_WAIT_S, _await_decision
    from malleus.trainer.world.world import World

    server, client = _store()
    beat(client, SEAL, 2, "n", 1)  # the leader beat once, then died with no launcher to say so
    world = World(4)
    world.seal_with(SEAL)
    t0 = time.monotonic()
    assert _await_decision(client, SEAL, "rec/1/", 2, world.silence(client), 0.02) is None
    took = time.monotonic() - t0
    assert SILENT_BEATS * beat_s(4) <= took < DECISION_WAIT_S / 4
    # A decision written before it went silent is still taken; a planted one never
    client.set("rec/1/decision", '{"members": [0]}')
    assert _await_decision(client, SEAL, "rec/1/", 2, world.silence(client), 0.02) is None
    SEAL.put(client, "rec/1/decision", '{"members": [0, 1]}')
    got = _await_decision(client, SEAL, "rec/1/", 2, world.silence(client), 0.02)
    assert got == {"members": [0, 1]}
    del server


def test_heartbeats_keep_the_store_load_bounded_at_any_world() -> None:
    for world in (4, 1024, 8192, 65536):
        assert world / beat_s(world) <= 4_000 + 1e-6
        assert SILENT_BEATS * beat_s(world) >= 3.0
        assert dead_after_s(world) >= 2.0
    assert dead_after_s(4) == dead_after_s(1000) == pytest.approx(2.0)


def test_the_next_rank_is_declared_dead_when_its_sealed_beat_stops_advancing() -> None:
    """The ring watch (`Alarm` with `members`): rank 0 watches rank 1. While rank 1 beats,
    nothing; once its beats stop, rank 0 writes its sealed dead mark and raises `PeerSilent`
    within the window, whatever a stranger writes meanwhile: unsealed beats that count up, or
    rank 1's last genuine beat written again and again (a replay is no news)."""
    from malleus.trainer.world.alarm import PeerSilent
    from malleus.trainer.world.errors import DEAD_KEY

    server, client = _store()
    window = 0.6
    alarm = Alarm(
        client,
        0.01,
        lambda: 0,
        rank=0,
        beat=0.02,
        sealer=SEAL,
        members=lambda: (0, 1),
        dead_after=window,
    ).start()
    try:
        count = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * window:  # rank 1 beats: never declared
            count += 1
            beat(client, SEAL, 1, "r1", count)
            alarm.check()
            time.sleep(0.02)
        assert SEAL.get(client, f"{DEAD_KEY}1") is None
        last = SEAL.seal(f"{BEAT_KEY}1", f"r1:{count}")
        stopped = time.monotonic()
        n = 0
        with pytest.raises(PeerSilent, match="rank 1 has not beaten"):
            while time.monotonic() - stopped < 20 * window:
                n += 1
                client.set(f"{BEAT_KEY}1", f"r1:{count + n}")  # forged: not sealed
                client.set(f"{BEAT_KEY}1", last)  # replayed: sealed, but old
                alarm.check()
                time.sleep(0.01)
        took = time.monotonic() - stopped
        assert window <= took < 10 * window, took
        assert SEAL.get(client, f"{DEAD_KEY}1") == "hung"
    finally:
        alarm.close()
    del server


def test_a_peer_never_seen_beating_is_not_declared() -> None:
    """A process not started yet (no beat) is not dead: the hang timeout covers it."""
    from malleus.trainer.world.errors import DEAD_KEY

    server, client = _store()
    alarm = Alarm(
        client,
        0.01,
        lambda: 0,
        rank=0,
        beat=0.02,
        sealer=SEAL,
        members=lambda: (0, 1),
        dead_after=0.2,
    ).start()
    try:
        time.sleep(1.0)  # five windows
        alarm.check()
        assert SEAL.get(client, f"{DEAD_KEY}1") is None
    finally:
        alarm.close()
    del server
