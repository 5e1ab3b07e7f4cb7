"""Sealed values of the job's rendezvous store: a value followed by its HMAC, torch-free.

The job's store (a torch TCPStore) has no authentication: whoever can reach it can write any
key. The values the trainers decide membership, admission and recovery by are therefore sealed
with a key only the job's own processes hold (`store_key`, derived from the job's secret) and
believed only when the seal checks (`open_sealed`). The trainers' side (which keys, what a
reader does with a forgery) is trainer/world/sealed.py; this module is the primitive, here
because the torch-free runner (`malleus run` marks dead GPUs through its store process's stdin,
malleus/runner/store_server.py) seals the same way and may not import the trainer.

A sealed value is ``VALUE~MAC``: the value's bytes, a ``~`` and the 64 hex digits of
HMAC-SHA256(key, len(name) ":" name value). The store key's `name` is bound into the MAC, so a
sealed value copied under another key (a dead mark of GPU 1 under GPU 2, a decision of epoch 3
under epoch 4) does not open; names carry their epoch or nonce where they have one. The form is
text when the value is (the runner writes it on a ``set KEY VALUE`` line).

The key is never the secret itself: HMAC(secret, "malleus store v1"), so the control token
(which guards the trainers' endpoint) never meets the store, and a key read off one job's
processes opens nothing of another's.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["KEY_BYTES", "MAC_HEX", "open_sealed", "seal", "store_key"]

KEY_BYTES = 32
MAC_HEX = 64
"""Hex digits of a seal (HMAC-SHA256)."""
_SEP = b"~"
_CONTEXT = b"malleus store v1"


def store_key(secret: str | bytes) -> bytes:
    """The key values of the job's store are sealed with: HMAC-SHA256(`secret`, "malleus store
    v1"), `secret` being the job's control token (or any secret every process of the job
    holds). Empty secrets are refused: a key everyone can compute seals nothing."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw.strip():
        raise ValueError("the store key needs a non-empty secret")
    return hmac.new(raw, _CONTEXT, hashlib.sha256).digest()


def _mac(key: bytes, name: str, value: bytes) -> bytes:
    named = name.encode()
    message = str(len(named)).encode() + b":" + named + value
    return hmac.new(key, message, hashlib.sha256).hexdigest().encode()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def seal(key: bytes, name: str, value: str | bytes) -> bytes:
    """`value` sealed for the store key `name`: ``value~MAC``."""
    raw = _bytes(value)
    return raw + _SEP + _mac(key, name, raw)


def open_sealed(key: bytes, name: str, sealed: str | bytes) -> bytes | None:
    """The value `sealed` holds when its MAC is `key`'s over (`name`, value); None for anything
    else (no seal, a wrong one, a value sealed under another name or with another key). The
    comparison takes the same time whatever the bytes (`hmac.compare_digest`)."""
    raw = _bytes(sealed)
    if len(raw) < MAC_HEX + 1 or raw[-MAC_HEX - 1 : -MAC_HEX] != _SEP:
        return None
    value, mac = raw[: -MAC_HEX - 1], raw[-MAC_HEX:]
    if not hmac.compare_digest(mac, _mac(key, name, value)):
        return None
    return value
