"""What one recovery costs the job's store, counted on the rank that pays it.

`Tally` is a `dist.Store` that passes every call to the store it wraps and counts it: calls by
operation and by kind of key (the key with its numbers written `#`: `rec/#/alive/#`), bytes
written and read. `recover` (trainer/recovery/protocol.py) runs over one, so that everything
the recovery does through the store is counted, torch's own rendezvous of the next process
group included (gloo's `pg/` keys go through it: `form_group` is handed the tally). The counts
go into the recovery's record on each rank (`store`, `Ledger.recoveries`), which
`bench/recovery_cost.py` reads to say how the protocol grows with the world.

Round trips: every call is one, except a `set`, which the job's store client confirms with a
`check` (trainer/world/store_client.py `_set_confirmed`): two. The alarm's polling and the
heartbeats run on their own connection (trainer/world/alarm.py) and are not counted here: they
are the steady price of detection, not of a recovery.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Tally", "key_kind"]

_NUMBER = re.compile(r"\d+")


def key_kind(key: str) -> str:
    """`key` with every run of digits written `#`: one kind per key family (`rec/#/alive/#`)."""
    return _NUMBER.sub("#", key)


def _size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    return len(bytes(value)) if value is not None else 0


class Tally(dist.Store):
    """`store`, with every call counted (see the module). Keep a reference to it for as long as
    a process group formed over it lives (C++ holds only its C++ half: the `World` `hold`s it)."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self._store = store
        self.calls: Counter[str] = Counter()
        """Operation -> how many calls (`set`, `get`, `check`, `add`, `compare_set`, ...)."""
        self.keys: Counter[str] = Counter()
        """`op key-kind` -> how many calls (`get rec/#/alive/#`)."""
        self.written = 0
        """Bytes of values sent (`set`, `compare_set`'s desired value)."""
        self.read = 0
        """Bytes of values received (`get`, `compare_set`'s answer)."""

    def _count(self, op: str, keys: list[str]) -> None:
        self.calls[op] += 1
        for kind in {key_kind(key) for key in keys}:  # a call on many keys of a kind: once
            self.keys[f"{op} {kind}"] += 1

    def summary(self) -> dict[str, Any]:
        """The counts as JSON: calls, round trips, bytes written and read, calls per key kind."""
        return {
            "calls": dict(self.calls),
            "round_trips": sum(self.calls.values()) + self.calls["set"],
            "bytes_written": self.written,
            "bytes_read": self.read,
            "keys": dict(self.keys),
        }

    # ---- the dist.Store calls (as trainer/world/store_client.py serves them) ------------------
    def set(self, key: str, value: Any) -> None:
        self._count("set", [key])
        self.written += _size(value)
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get", [key])
        got = self._store.get(key)
        self.read += _size(got)
        return got

    def add(self, key: str, amount: int) -> int:
        self._count("add", [key])
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        self._count("check", list(keys))
        return self._store.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set", [key])
        self.written += _size(desired)
        got = self._store.compare_set(key, expected, desired)
        self.read += _size(got)
        return got

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait", list(keys))
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key", [key])
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys", [])
        return self._store.num_keys()

    deleteKey = delete_key  # what C++ calls (torch's trampoline uses the C++ names for these)
    getNumKeys = num_keys

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def clone(self) -> Any:
        return self._store.clone()
