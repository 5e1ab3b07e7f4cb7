"""The trainer's control endpoint (DESIGN §4.4): health, status, metrics, plans, stop, injections.

A stdlib `ThreadingHTTPServer` in a daemon thread, so the training loop never blocks on a
client and the pod needs no web framework. Reads are open (the kubelet and Prometheus need no
token); every write (`POST /plan`, `POST /inject`) needs `Authorization: Bearer <token>` from
the job's Secret, and with no token configured writes are refused, never open by default.
`GET /status` serves a `malleus.job.control.ControlStatus`; the clients of that module are the
one way to talk to this server.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from malleus.job.control import ControlStatus

from .metrics import CONTENT_TYPE, TrainerMetrics
from .plan_inbox import PlanInbox

__all__ = [
    "DEFAULT_PORT",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "ControlServer",
    "load_token",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 8040
TOKEN_ENV = "MALLEUS_CONTROL_TOKEN"
TOKEN_FILE_ENV = "MALLEUS_CONTROL_TOKEN_FILE"
_MAX_BODY = 1 << 20  # a 64-GPU plan is a few KB; anything near this is a mistake or an attack
_DRAIN_LIMIT = 16 << 20  # read and discard an oversize body up to this, so the 413 arrives


def load_token(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The control token: `$MALLEUS_CONTROL_TOKEN`, else the file at `path` or
    `$MALLEUS_CONTROL_TOKEN_FILE` (a Secret mount); surrounding whitespace stripped.

    None when nothing is configured or the file is missing (logged): the server then refuses
    every write, which is the safe failure.
    """
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV, "").strip()
    if token:
        return token
    file = path if path is not None else env.get(TOKEN_FILE_ENV)
    if not file:
        return None
    try:
        token = Path(file).read_text(encoding="utf-8").strip()
    except OSError as e:
        log.warning("control token file %s unreadable (%s); writes will be refused", file, e)
        return None
    return token or None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    control: ControlServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # seconds a slow client may hold a handler thread
    server_version = "malleus-trainer"

    # ---- plumbing ------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base name)
        log.debug("%s %s", self.address_string(), format % args)

    def _send(
        self, code: int, body: bytes, ctype: str, headers: Mapping[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj: Any, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(obj, default=str).encode() + b"\n"
        self._send(code, body, "application/json", headers)

    def _error(self, code: int, message: str, **extra: Any) -> None:
        self._json(code, {"error": message, **extra})

    @property
    def _path(self) -> str:
        return urlsplit(self.path).path.rstrip("/") or "/"

    # ---- GET -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        c = self.server.control
        path = self._path
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/status":
            try:
                status = c.status()
            except Exception:
                log.exception("status() failed")
                self._error(500, "status unavailable")
                return
            self._json(200, status.model_dump(mode="json"))
        elif path == "/metrics" and c.metrics is not None:
            self._send(200, c.metrics.render(), CONTENT_TYPE)
        elif path in ("/plan", "/stop", "/inject"):
            self._error(405, "use POST", allowed=["POST"])
        else:
            self._error(404, f"no such endpoint: {path}")

    # ---- POST ------------------------------------------------------------------------------
    def do_POST(self) -> None:
        c = self.server.control
        path = self._path
        # Read the body before any answer: a socket closed on unread data is reset by the
        # kernel, and the client would see "connection reset" instead of our 401 or 404.
        body = self._body(c.max_body)
        if body is None:
            return
        if path == "/plan":
            if c.inbox is None:
                self._error(404, "this rank is not the coordinator; post plans to rank 0")
                return
        elif path == "/stop":
            if c.stop_request is None:
                self._error(404, "this rank is not the coordinator; post stop to rank 0")
                return
        elif path == "/inject":
            if c.inject is None:
                self._error(404, "emulation is off: slowdowns cannot be injected")
                return
        else:
            self._error(404, f"no such endpoint: {path}")
            return
        if not self._authorized(c.token):
            return
        if path == "/plan":
            assert c.inbox is not None
            code, answer = c.inbox.offer(body)
            self._json(code, answer)
        elif path == "/stop":
            assert c.stop_request is not None
            code, answer = c.stop_request(body)
            self._json(code, answer)
        else:
            self._inject(body)

    def _authorized(self, token: str | None) -> bool:
        if token is None:
            self._error(503, "no control token configured")
            return False
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return True
        log.warning(
            "refused unauthorized %s %s from %s", self.command, self._path, self.client_address[0]
        )
        self._json(
            401,
            {"error": "missing or wrong bearer token"},
            {"WWW-Authenticate": 'Bearer realm="malleus"'},
        )
        return False

    def _body(self, limit: int) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._error(411, "send a Content-Length; chunked bodies are not accepted")
            self.close_connection = True
            return None
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if length < 0:
                raise ValueError
        except ValueError:
            self._error(400, "bad Content-Length")
            self.close_connection = True
            return None
        if length > limit:
            if length <= _DRAIN_LIMIT:  # unread data would make the kernel reset the socket
                self._discard(length)
            self._error(413, f"body of {length} bytes exceeds the limit of {limit}")
            self.close_connection = True
            return None
        return self.rfile.read(length)

    def _discard(self, length: int) -> None:
        try:
            while length > 0:
                chunk = self.rfile.read(min(length, 1 << 16))
                if not chunk:
                    return
                length -= len(chunk)
        except OSError:
            pass

    def _inject(self, body: bytes) -> None:
        c = self.server.control
        assert c.inject is not None
        try:
            req = json.loads(body)
            if not isinstance(req, dict) or set(req) != {"rank", "factor"}:
                raise ValueError('expected exactly {"rank": <int>, "factor": <number>}')
            rank, factor = req["rank"], req["factor"]
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise ValueError(f"rank: {rank!r}; need an integer >= 0")
            if (
                not isinstance(factor, (int, float))
                or isinstance(factor, bool)
                or not math.isfinite(factor)
                or factor < 1.0
            ):
                raise ValueError(f"factor: {factor!r}; need a finite number >= 1.0 (1.0 = healthy)")
            c.inject(rank, float(factor))
        except ValueError as e:  # json errors are ValueErrors; so are the callback's refusals
            self._error(400, f"invalid injection: {e}")
            return
        log.info("injected slowdown %.3g on rank %d", factor, rank)
        self._json(200, {"rank": rank, "factor": float(factor)})


class ControlServer:
    """The HTTP control endpoint of one trainer process.

    status: returns the `ControlStatus` served at /status. inbox: the plan inbox (coordinator only; None = 404).
    metrics: served at /metrics. inject: `(rank, factor)` callback, only when emulation is on.
    stop: `POST /stop` body -> (code, answer) (coordinator only: stop at the next step boundary,
    by default with a checkpoint).
    token: bearer token for writes (`load_token()`); None = writes refused with 503.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        *,
        status: Callable[[], ControlStatus],
        inbox: PlanInbox | None,
        metrics: TrainerMetrics | None,
        inject: Callable[[int, float], None] | None,
        stop: Callable[[bytes], tuple[int, dict[str, Any]]] | None = None,
        max_body: int = _MAX_BODY,
    ) -> None:
        self.host, self._port = host, port
        self.token = token or None
        self.status, self.inbox, self.metrics, self.inject = status, inbox, metrics, inject
        self.stop_request = stop
        self.max_body = max_body
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when constructed with port 0 and started)."""
        return self._httpd.server_address[1] if self._httpd is not None else self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> ControlServer:
        if self._httpd is not None:
            return self
        httpd = _Server((self.host, self._port), _Handler)
        httpd.control = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="malleus-control",
            daemon=True,
        )
        self._thread.start()
        if self.token is None:
            log.warning("no control token configured: POST /plan and /inject will be refused")
        log.info("control server listening on %s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
