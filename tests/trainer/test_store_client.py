"""The store client that redials (trainer/store_client.py) against real store processes
(`python -m malleus.trainer store`): one is SIGKILLed, a new one starts on its port."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from malleus.trainer.store_client import RedialingStore


def _serve(port: int = 0) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "malleus.trainer",
            "store",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "store ready on 127.0.0.1:PORT"
    assert line.startswith("store ready on"), line
    return proc, int(line.rsplit(":", 1)[1])


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=30)


def test_a_lost_store_is_dialed_again_and_the_calls_go_on() -> None:
    first, port = _serve()
    second = None
    try:
        store = RedialingStore("127.0.0.1", port, timedelta(seconds=10), redial_s=30)
        prefixed = dist.PrefixStore("malleus/0/", store)
        assert prefixed.add("rec/beat/1", 1) == 1
        alarm = prefixed.clone()  # the recovery alarm's own connection
        assert alarm.add("rec/beat/1", 0) == 1
        _stop(first)
        # The store comes back empty on the same port a little later; meanwhile a call waits.
        started = threading.Event()

        def restart() -> None:
            nonlocal second
            time.sleep(0.5)
            second, _ = _serve(port)
            started.set()

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
        for p in (first, second):
            if p is not None and p.poll() is None:
                _stop(p)


def test_a_store_that_does_not_come_back_fails_the_call_after_the_redial_window() -> None:
    proc, port = _serve()
    store = RedialingStore("127.0.0.1", port, timedelta(seconds=5), redial_s=1.0)
    store.set("k", "v")
    _stop(proc)
    t0 = time.monotonic()
    with pytest.raises(dist.DistError):
        store.get("k")
    assert time.monotonic() - t0 < 10
