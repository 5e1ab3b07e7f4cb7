"""The store client that redials (trainer/world/store_client.py) against real store processes
(`python -m malleus.trainer store`, started as the runner starts it): one is SIGKILLed, a new
one starts on its port."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from malleus.runner.store_server import StoreServer
from malleus.trainer.world.store_client import RedialingStore


def _serve(tmp_path: Path, port: int = 0) -> StoreServer:
    server = StoreServer(sys.executable, tmp_path / f"store-{port}.log")
    server.start(port=port)
    return server


def _kill(server: StoreServer) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    server.stop()


def test_a_lost_store_is_dialed_again_and_the_calls_go_on(tmp_path: Path) -> None:
    first = _serve(tmp_path)
    port = first.port
    second: StoreServer | None = None
    started, done = threading.Event(), threading.Event()
    try:
        store = RedialingStore("127.0.0.1", port, timedelta(seconds=10), redial_s=30)
        prefixed = dist.PrefixStore("malleus/0/", store)
        assert prefixed.add("rec/beat/1", 1) == 1
        alarm = prefixed.clone()  # the recovery alarm's own connection
        assert alarm.add("rec/beat/1", 0) == 1
        _kill(first)

        # The store comes back empty on the same port a little later; meanwhile a call waits.
        def restart() -> None:
            nonlocal second
            time.sleep(0.5)
            second = _serve(tmp_path, port)
            started.set()
            done.wait(60)  # the server's parent-death signal follows this thread: keep it

        threading.Thread(target=restart, daemon=True).start()
        assert prefixed.add("rec/beat/1", 1) == 1  # the count starts again: its keys were lost
        assert started.is_set() and store.redials == 1
        assert prefixed.compare_set("rec/1/leader", "", "2") == b"2"
        prefixed.set("rec/1/alive/2", "x")
        assert prefixed.check(["rec/1/alive/2"]) and prefixed.get("rec/1/alive/2") == b"x"
        assert alarm.check(["rec/1/alive/2"])  # the clone redialed on its own
        # every call a PrefixStore forwards reaches the store (torch looks some up by C++ name)
        prefixed.wait(["rec/1/alive/2"])
        prefixed.wait(["rec/1/alive/2"], timedelta(seconds=1))
        assert prefixed.num_keys() >= 3
        assert prefixed.delete_key("rec/1/alive/2") and not prefixed.check(["rec/1/alive/2"])
        # A key that is not there in time is the caller's error, not a lost store.
        prefixed.set_timeout(timedelta(seconds=0.2))
        with pytest.raises(dist.DistStoreError):
            prefixed.get("never")
        assert store.redials == 1
    finally:
        done.set()
        for server in (first, second):
            if server is not None:
                server.stop()


def test_a_store_that_does_not_come_back_fails_the_call_after_the_redial_window(
    tmp_path: Path,
) -> None:
    server = _serve(tmp_path)
    store = RedialingStore("127.0.0.1", server.port, timedelta(seconds=5), redial_s=1.0)
    store.set("k", "v")
    _kill(server)
    t0 = time.monotonic()
    with pytest.raises(dist.DistError):
        store.get("k")
    assert time.monotonic() - t0 < 10
