"""A client of the job's rendezvous store that dials it again when the store process is lost.

The store (a torch TCPStore no rank hosts: the runner's child, or the job's store pod under
`restartPolicy: Always`) comes back empty on the same address after a crash. A plain TCPStore
client is dead from then on, so the survivors' next recovery failed on its first store call and
every rank exited. `RedialingStore` is a `dist.Store` (so `PrefixStore`, process groups and
`clone()` take it like the TCPStore it wraps) that, when a call fails on the connection
(`DistNetworkError`), dials the address again for up to `REDIAL_S` and retries the call once.

What the lost keys meant: nothing the running job needs. Everything a recovery writes lives under
the next epoch's prefix (`rec/E+1/`, written fresh), the heartbeats are counts compared for
change (a count that starts again at 0 has changed), and the initial rendezvous is over. A
launcher's dead mark written before the loss is gone: the leader then tells that GPU by its
silence instead (trainer/world/alarm.py). A call that fails for any other reason (a key not there in
time) is the caller's to handle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from malleus.trainer.world.errors import first_line

__all__ = ["REDIAL_S", "RedialingStore"]

log = logging.getLogger(__name__)

REDIAL_S = 60.0
"""How long a call waits for a lost store to listen again before it fails (the store restarts
in a second or two: a runner's child, or a pod's container restarted by its kubelet)."""


class RedialingStore(dist.Store):
    """A TCPStore client of `host:port` (`timeout`: its own calls' timeout) that redials."""

    def __init__(
        self, host: str, port: int, timeout: timedelta, *, redial_s: float = REDIAL_S
    ) -> None:
        super().__init__()
        self.host, self.port, self._timeout, self._redial_s = host, port, timeout, redial_s
        self._lock = threading.Lock()
        self._client = self._dial(timeout)
        self.redials = 0
        """How many times the store was found lost and dialed again (tests, logs)."""
        # A store handed to C++ (a PrefixStore over it, a process group) holds only the C++ half
        # of this Python object: were its last Python reference dropped (a caller keeping just
        # the PrefixStore), its methods would be gone ("Not implemented"). So whoever dials one
        # keeps it (the launch hands it to the process's World, trainer/world/world.py `hold`),
        # and a client keeps its clones (the alarm's, made through a PrefixStore's `clone`).
        self._clones: list[RedialingStore] = []

    def _dial(self, timeout: timedelta) -> dist.TCPStore:
        client = dist.TCPStore(self.host, self.port, None, False, timeout=timeout)
        client.set_timeout(self._timeout)
        return client

    def _call(self, fn: Callable[[dist.TCPStore], Any]) -> Any:
        """`fn(client)`; on a lost connection, once more on a client dialed again."""
        client = self._client
        try:
            return fn(client)
        except dist.DistNetworkError as e:
            self._redial(client, e)
        return fn(self._client)

    def _redial(self, broken: dist.TCPStore, error: BaseException) -> None:
        with self._lock:
            if self._client is not broken:  # another thread of this process redialed already
                return
            log.warning(
                "the job's store at %s:%d was lost (%s); dialing it again for up to %.0f s",
                self.host,
                self.port,
                first_line(error),
                self._redial_s,
            )
            t0 = time.monotonic()
            self._client = self._dial(timedelta(seconds=self._redial_s))
            self.redials += 1
            log.warning(
                "the job's store at %s:%d is back after %.1f s (its keys were lost)",
                self.host,
                self.port,
                time.monotonic() - t0,
            )

    # ---- the dist.Store calls the trainers, PrefixStore and process groups make --------------
    def set(self, key: str, value: Any) -> None:
        self._call(lambda c: _set_confirmed(c, key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda c: c.get(key))

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda c: c.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda c: c.check(keys))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(lambda c: c.compare_set(key, expected, desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(lambda c: c.wait(keys) if timeout is None else c.wait(keys, timeout))

    def delete_key(self, key: str) -> bool:
        return self._call(lambda c: c.delete_key(key))

    def num_keys(self) -> int:
        return self._call(lambda c: c.num_keys())

    # What C++ (a PrefixStore over this store) calls for those two: torch's trampoline looks
    # them up under their C++ names (the others under their Python ones).
    deleteKey = delete_key
    getNumKeys = num_keys

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._call(lambda c: c.set_timeout(timeout))

    def clone(self) -> RedialingStore:
        """A second client of the same store (its own connection: the recovery alarm's), kept
        as long as this one."""
        clone = RedialingStore(self.host, self.port, self._timeout, redial_s=self._redial_s)
        self._clones.append(clone)
        return clone


def _set_confirmed(client: dist.TCPStore, key: str, value: Any) -> None:
    """Set, then check: the store does not answer a set, and one sent on a connection the lost
    store closed can vanish unnoticed (the first write to a closed socket succeeds); the check
    is answered, so this returns only once the store holds the key, or raises on the lost
    connection (then `_call` redials and sets again)."""
    client.set(key, value)
    client.check([key])
