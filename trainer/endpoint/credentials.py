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
import ssl
from collections.abc import Mapping
from pathlib import Path

# The token's names live with the store's seal, whose key is derived from the same token.
from malleus.trainer.world.sealed import TOKEN_ENV, TOKEN_FILE_ENV

__all__ = [
    "POD_IP_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
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


def load_tls(environ: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """The server context from `$MALLEUS_CONTROL_TLS_CERT` and `$MALLEUS_CONTROL_TLS_KEY`.

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
        return server_context(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise RuntimeError(f"control TLS: cannot load {cert} with {key}: {e}") from e


def control_host(environ: Mapping[str, str] | None = None) -> str:
    """Where the endpoint listens: the pod IP in a cluster, else 127.0.0.1 (local runs)."""
    env = os.environ if environ is None else environ
    return env.get(POD_IP_ENV, "").strip() or "127.0.0.1"
