"""The recovery alarm (trainer/alarm.py) on a real TCPStore: a computing rank learns that a peer
entered recovery within a few polls, and only of an epoch it is not part of yet."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from malleus.trainer.alarm import Alarm, PeerRecovering, interval_s


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
    alarm = Alarm(client, 0.02, lambda: epoch[0]).start()
    try:
        time.sleep(0.1)
        alarm.check()  # nobody recovering: no alarm
        client.set("rec/2/arrive", "1")  # an epoch beyond the next one is not this rank's
        time.sleep(0.1)
        alarm.check()
        client.add("rec/1/arrive", 1)  # a survivor entered recovery epoch 1
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
