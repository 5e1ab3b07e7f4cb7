"""What a trainer's control endpoint listens with: its address, its TLS identity, its token.

All from the environment the pod spec (or `malleus run`) sets, so the loop's code never sees a
credential: in a pod the endpoint listens on the pod IP (downward API) and serves the job
Secret's certificate, and the token is a file of the Secret's volume
(``$MALLEUS_CONTROL_TOKEN_FILE``), not an environment variable (which every process of the pod
inherits and `kubectl describe`-style tooling shows); locally it listens on 127.0.0.1 in plain
HTTP, where nothing but this machine can listen in, and the token comes from a file only the
user can read. ``$MALLEUS_CONTROL_TOKEN`` stays a fallback for a trainer started by hand.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The token's names live with the store's seal, whose key is derived from the same token.
from malleus.trainer.world.sealed import TOKEN_ENV, TOKEN_FILE_ENV

__all__ = [
    "POD_IP_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "ServingTLS",
    "control_host",
    "load_tls",
    "load_token",
    "server_context",
]

log = logging.getLogger(__name__)

TLS_CERT_ENV = "MALLEUS_CONTROL_TLS_CERT"
"""Path of the server certificate (PEM), the job Secret's ``tls.crt`` mounted in the pod."""
TLS_KEY_ENV = "MALLEUS_CONTROL_TLS_KEY"
"""Path of its private key (PEM), the Secret's ``tls.key``."""
POD_IP_ENV = "POD_IP"
"""The pod's IP (downward API ``status.podIP``): where the endpoint listens in a cluster."""


def load_token(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The control token: the file at `path` or `$MALLEUS_CONTROL_TOKEN_FILE` (a Secret
    mount), else `$MALLEUS_CONTROL_TOKEN`; surrounding whitespace stripped.

    None when nothing is configured or the file is unreadable (logged) and no variable is
    set: the server then refuses everything but health and metrics, the safe failure.
    """
    env = os.environ if environ is None else environ
    file = path if path is not None else env.get(TOKEN_FILE_ENV)
    if file:
        try:
            token = Path(file).read_text(encoding="utf-8").strip()
        except OSError as e:
            log.warning("control token file %s unreadable (%s)", file, e)
        else:
            if token:
                return token
    return env.get(TOKEN_ENV, "").strip() or None


def server_context(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> ssl.SSLContext:
    """A TLS 1.2+ server context serving `cert` (PEM chain) with `key`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


class ServingTLS:
    """The endpoint's TLS identity, read again from its files when they change.

    The operator renews a job's certificates while it runs and the kubelet swaps the Secret
    volume's files (atomically: a symlink to a new folder); each new connection looks at the
    files (two ``stat`` calls) and a changed pair is loaded into a new context, used from that
    connection on. A pair that does not load (half written, a key that does not match) is
    logged and the previous identity kept until the files change again.
    """

    def __init__(self, cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> None:
        self.cert, self.key = Path(cert), Path(key)
        self._lock = threading.Lock()
        self._seen = self._signature()
        self._context = server_context(self.cert, self.key)  # raises: the first must load

    def _signature(self) -> tuple[tuple[int, int, int], ...] | None:
        try:
            return tuple(
                (st.st_ino, st.st_mtime_ns, st.st_size)
                for st in (self.cert.stat(), self.key.stat())
            )
        except OSError:
            return None

    def context(self) -> ssl.SSLContext:
        """The context for the next connection: the files' current pair when it loads."""
        seen = self._signature()
        with self._lock:
            if seen is not None and seen != self._seen:
                try:
                    self._context = server_context(self.cert, self.key)
                except (OSError, ssl.SSLError) as e:
                    log.warning("control TLS: %s with %s does not load (%s); keeping the "
                                "previous certificate", self.cert, self.key, e)  # fmt: skip
                else:
                    log.info("control TLS: certificate %s reloaded", self.cert)
                self._seen = seen
            return self._context

    def wrap_socket(self, sock: socket.socket, **kwargs: Any) -> ssl.SSLSocket:
        """`ssl.SSLContext.wrap_socket` with `context`."""
        return self.context().wrap_socket(sock, **kwargs)


def load_tls(environ: Mapping[str, str] | None = None) -> ServingTLS | None:
    """The endpoint's identity from `$MALLEUS_CONTROL_TLS_CERT` and `$MALLEUS_CONTROL_TLS_KEY`.

    None when neither is set (local runs: plain HTTP on loopback). Only one of them, or files
    that do not load, is a RuntimeError: a pod meant to serve TLS must not fall back to clear.
    """
    env = os.environ if environ is None else environ
    cert, key = env.get(TLS_CERT_ENV, ""), env.get(TLS_KEY_ENV, "")
    if not cert and not key:
        return None
    if not cert or not key:
        missing = TLS_CERT_ENV if not cert else TLS_KEY_ENV
        raise RuntimeError(f"control TLS: {missing} is not set (both or neither)")
    try:
        return ServingTLS(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise RuntimeError(f"control TLS: cannot load {cert} with {key}: {e}") from e


def control_host(environ: Mapping[str, str] | None = None) -> str:
    """Where the endpoint listens: the pod IP in a cluster, else 127.0.0.1 (local runs)."""
    env = os.environ if environ is None else environ
    return env.get(POD_IP_ENV, "").strip() or "127.0.0.1"
