"""What a rank believes of the job's store: sealed values only (an HMAC with the job's key).

The store (a torch TCPStore) has no authentication: another pod of the namespace where the
NetworkPolicy is loose, or anything on the host of a local run, can write its keys. A value
that decides membership, admission or recovery is written sealed (`Sealer.put`: the value and
an HMAC over the key's name and the value, malleus/control/sealed.py) and read through
`Sealer.get`, which returns it only when the seal checks.

Keys sealed (the name, epoch or nonce inside it bound into the MAC):

- `rec/dead/GPU`: a launcher saw GPU's process end (trainer/launch/spawn.py, `malleus run`'s
  supervisor through its store process, malleus/runner/store_server.py). Believed, it makes
  the recovery leader stop waiting for that GPU and the survivors stop waiting for its decision.
- `rec/E/alive/GPU` (a survivor's arrival: the step, whether it holds the last world vector,
  its plan's generation), `rec/E/arrival/K` (the order of arrivals), `rec/E/plan/GEN` and
  `rec/E/vec/STEP` (posted once per recovery), `rec/E/arrive` (a peer entered recovery: the
  alarm stops computing ranks,
  trainer/world/alarm.py), `rec/E/released/GPU` (it let go of its groups: the leader of a hang
  stops waiting), `rec/E/leader` (who decides), `rec/E/decision` (members, step, vector, plan).
- `join/GPU/K` (a replacement asks in, with its nonce), `rec/E/joiners` (whom the coordinator
  admits), `join/GPU/admit/NONCE` (the admission: epoch, members, step, plan).
- `rec/beat/GPU`, heartbeats: the process's nonce and a growing count (trainer/world/alarm.py).
  A watcher declares a peer dead when its beat stops advancing: a forged beat would keep a
  stopped rank alive, so only one that opens and advances (a higher count, a new nonce) counts,
  and a replayed old one is no news.

Keys left unsealed, and why:

- `join/GPU/n`, the count of requests: a forged bump can hide a real request (the replacement
  waits out its timeout and is started again); what it points to is sealed. `rec/E/arrivals`,
  the count of arrivals: a forged bump adds a slot that never opens, which the leader tries
  again at each poll without holding back the real ones (trainer/recovery/wait.py).
- `joined/GPU` (the start's barrier) and torch's own `pg/` keys: the process group's
  rendezvous, read by torch itself; a forged `joined/` only sends a rank into torch's
  rendezvous sooner, where it waits for the real peers.
- `rec/fault/GPU` (fault injection's time of death, a figure of the recovery record) and the
  launcher's note `malleus/note/doing` (quoted in an error message): no decision reads them;
  the first reader drops what does not parse, the second quotes at most 500 characters with
  undecodable bytes replaced.

What a reader does with a forgery: treats the key as absent and logs once per key (`Sealer`).
It never raises: the job's honest ranks must not be stopped by a value a stranger wrote (the
same forgery would stop every rank at once), and never believes it: a genuine writer's value,
when it comes, overwrites the forgery and is read at the next poll. A leader claim that does
not open is replaced atomically (trainer/recovery/protocol.py), so planting claims for future
epochs cannot keep a recovery leaderless.

What the seal does not stop: a writer can still delete or overwrite keys (stall a recovery,
hide a request, make the leader decide without a rank that then exits and is replaced, fail the
job); it can replay a sealed value under its own name (a live rank's old heartbeat, again and
again, so that its watcher declares it dead: it is left out and replaced; a GPU's dead mark
after its replacement was admitted: the replacement is then taken for dead at the next recovery
and replaced once more). Keeping strangers off the store is the NetworkPolicy's job and the loopback bind's.

The key: `MALLEUS_STORE_KEY` (hex; `spawn_local` draws a random one per launch for its
children), else derived from the job's control token (the file `MALLEUS_CONTROL_TOKEN_FILE`,
the job Secret's in a pod and `WORKDIR/control-token` in `malleus run`; else
`MALLEUS_CONTROL_TOKEN`). A fault-tolerant rank with none refuses to start
(trainer/launch/distributed.py): never a job that believes its store unsealed.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from malleus.control.sealed import KEY_BYTES, open_sealed, seal, store_key

__all__ = [
    "STORE_KEY_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "Sealer",
    "job_store_key",
]

log = logging.getLogger(__name__)

STORE_KEY_ENV = "MALLEUS_STORE_KEY"
"""The store key itself, hex (`spawn_local`'s children; a job started by hand)."""
TOKEN_FILE_ENV = "MALLEUS_CONTROL_TOKEN_FILE"
"""The job's control token as a file (trainer/endpoint/credentials.py reads the same)."""
TOKEN_ENV = "MALLEUS_CONTROL_TOKEN"


def job_store_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """This process's store key from its environment (see the module), None when it has none.
    A malformed `MALLEUS_STORE_KEY` is a ValueError, not a fallback."""
    env = os.environ if environ is None else environ
    given = env.get(STORE_KEY_ENV, "").strip()
    if given:
        try:
            key = bytes.fromhex(given)
        except ValueError:
            raise ValueError(f"{STORE_KEY_ENV} is not hex") from None
        if len(key) < 16:
            raise ValueError(f"{STORE_KEY_ENV} holds {len(key)} bytes; at least 16 are needed")
        return key
    file = env.get(TOKEN_FILE_ENV, "").strip()
    if file:
        try:
            token = Path(file).read_text(encoding="utf-8").strip()
        except OSError as e:
            log.warning("control token file %s unreadable (%s)", file, e)
        else:
            if token:
                return store_key(token)
    token = env.get(TOKEN_ENV, "").strip()
    return store_key(token) if token else None


class Sealer:
    """Seals what this rank writes to the job's store and opens what it reads (see the module).

    `name` is the key as this rank's store (the job's `PrefixStore`) names it. Forgeries read
    are counted (`forged`) and logged once per key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a store key of at least 16 bytes is needed")
        self._key = bytes(key)
        self._warned: set[str] = set()
        self.forged = 0
        """How many reads found a value whose seal did not check (tests, logs)."""

    @classmethod
    def fresh(cls) -> Sealer:
        """A random key, for one launch's processes (`spawn_local`)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @property
    def hex(self) -> str:
        """The key in hex, for `STORE_KEY_ENV` of the processes that must share it."""
        return self._key.hex()

    def seal(self, name: str, value: str | bytes) -> bytes:
        return seal(self._key, name, value)

    def open(self, name: str, raw: str | bytes) -> str | None:
        """The value `raw` holds when sealed by this job for `name`, else None (logged once)."""
        value = open_sealed(self._key, name, raw)
        if value is None:
            self._forgery(name)
            return None
        try:
            return value.decode()
        except UnicodeDecodeError:  # sealed by this job: never happens; refused all the same
            self._forgery(name)
            return None

    def _forgery(self, name: str) -> None:
        self.forged += 1
        if name not in self._warned:
            self._warned.add(name)
            log.warning(
                "the job's store holds a value at %r that this job did not seal: ignored "
                "(someone else can write the store; check who can reach it)",
                name,
            )

    # ---- on a store ----------------------------------------------------------------------------
    def put(self, store: Any, name: str, value: str) -> None:
        """Set `name` to `value`, sealed."""
        store.set(name, self.seal(name, value))

    def get(self, store: Any, name: str) -> str | None:
        """The value at `name` when there and sealed by this job; None otherwise."""
        if not store.check([name]):
            return None
        return self.open(name, store.get(name))

    def claim(self, store: Any, name: str, value: str, tries: int = 8) -> str | None:
        """`compare_set(name, "", value)` sealed: the value that holds `name` afterwards, the
        first genuine claim's. A value there that does not open (planted before any claim) is
        replaced atomically by this one, so strangers cannot keep the key taken; None when a
        stranger overwrote it `tries` times running (the caller treats the key as lost)."""
        sealed = self.seal(name, value)
        expected: bytes = b""
        for _ in range(tries):
            raw = bytes(store.compare_set(name, expected, sealed))
            held = self.open(name, raw)
            if held is not None:
                return held
            expected = raw  # a forgery holds it: replace exactly that one
        return None
