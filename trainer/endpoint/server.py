"""The trainer's control endpoint (DESIGN §4.4): health, status, metrics, plans, stop, injections.

A stdlib `ThreadingHTTPServer` in a daemon thread, so the training loop never blocks on a
client and the pod needs no web framework. Reads are open (the kubelet and Prometheus need no
token); every write (`POST /plan`, `/stop`, `/inject`) needs `Authorization: Bearer <token>`
from the job's Secret, and with no token configured writes are refused, never open by default.
`GET /status` serves a `malleus.control.ControlStatus`; the clients of that module are the
one way to talk to this server.

In a pod the endpoint serves HTTPS with the job's certificate (`credentials.load_tls`: the
operator's per-job CA signed it for the workers' stable DNS names) on the pod IP, so the
token never crosses the pod network in clear; local runs serve plain HTTP on 127.0.0.1, where
nothing but this machine can listen in. Every write body is judged here before anything acts
on it: bounded in size (413) and nesting, strict JSON (no NaN), and an answer within the
handler's timeout, a 400 naming the field, never a traceback or a dead handler thread.

The routing, the authorization and the plumbing live here; judging a write body (strict JSON,
nesting, an injection's fields) is trainer/endpoint/body.py.
"""

from __future__ import annotations

import hmac
import json
import logging
import ssl
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socket import socket
from typing import Any
from urllib.parse import urlsplit

from malleus.control import ControlStatus
from malleus.trainer.switching.plan_inbox import PlanInbox

from .body import MAX_DEPTH, MAX_FACTOR, Refused, parse_body, parse_injection
from .metrics import CONTENT_TYPE, TrainerMetrics

__all__ = ["DEFAULT_PORT", "MAX_DEPTH", "MAX_FACTOR", "ControlServer"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 8040
_MAX_BODY = 1 << 20  # a 64-GPU plan is a few KB; anything near this is a mistake or an attack
_DRAIN_LIMIT = 16 << 20  # read and discard an oversize body up to this, so the 413 arrives


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: 5 by default, which resets a crowd
    control: ControlServer
    tls: ssl.SSLContext | None = None

    def get_request(self) -> tuple[socket, Any]:
        """Wrap without the handshake: it runs in the handler's thread, under its timeout,
        so a client that never finishes one cannot stall the accept loop."""
        sock, address = super().get_request()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A refused handshake or a reset connection: the client's problem, not a traceback.
        log.debug("control connection from %s failed", client_address[0], exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # seconds a slow client may hold a handler thread
    server_version = "malleus-trainer"

    # ---- plumbing ------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()  # sets the timeout the handshake runs under
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

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
        elif path == "/plan" and c.plan is not None:  # the plan in force (recovery plans too)
            plan = c.plan()
            if plan is None:
                self._error(404, "no plan in force yet")
            else:
                self._json(200, plan)
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
        what = {"/plan": "plan", "/stop": "stop request", "/inject": "injection"}[path]
        try:
            code, answer = self._write(path, parse_body(body))
        except Refused as e:
            code, answer = (
                400,
                {
                    "error": f"invalid {what}: {e}",
                    "faults": [{"path": e.path, "message": e.message}],
                },
            )
        except Exception:  # a bug must cost one answer, never the handler thread
            log.exception("POST %s failed", path)
            code, answer = 500, {"error": f"the {what} could not be handled"}
        self._json(code, answer)

    def _write(self, path: str, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Hand a parsed, authorized write to its owner; (code, answer)."""
        c = self.server.control
        if path == "/plan":
            assert c.inbox is not None
            return c.inbox.offer(req)
        if path == "/stop":
            assert c.stop_request is not None
            return c.stop_request(req)
        assert c.inject is not None
        rank, factor = parse_injection(req, c.status().world)
        try:
            c.inject(rank, factor)
        except ValueError as e:  # the clock's own refusal (it checks the factor too)
            raise Refused("factor", str(e)) from e
        log.info("injected slowdown %.3g on rank %d", factor, rank)
        return 200, {"rank": rank, "factor": factor}

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


class ControlServer:
    """The HTTP(S) control endpoint of one trainer process.

    status: returns the `ControlStatus` served at /status (its ``world`` bounds injections).
    inbox: the plan inbox (coordinator only; None = 404). metrics: served at /metrics.
    inject: `(rank, factor)` callback, only when emulation is on. stop: a parsed `POST /stop`
    body -> (code, answer) (coordinator only: stop at the next step boundary, by default with
    a checkpoint). plan: the plan in force as JSON data, served at `GET /plan`. token: bearer token for writes (`credentials.load_token()`); None = writes refused with
    503. tls: serve HTTPS with this context (`credentials.load_tls()`); None = plain HTTP.
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
        stop: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]] | None = None,
        max_body: int = _MAX_BODY,
        tls: ssl.SSLContext | None = None,
        plan: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        self.host, self._port = host, port
        self.token = token or None
        self.status, self.inbox, self.metrics, self.inject = status, inbox, metrics, inject
        self.stop_request = stop
        self.plan = plan  # GET /plan: the plan in force as JSON data (None: 405 as before)
        self.max_body = max_body
        self.tls = tls
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when constructed with port 0 and started)."""
        return self._httpd.server_address[1] if self._httpd is not None else self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    def start(self) -> ControlServer:
        if self._httpd is not None:
            return self
        httpd = _Server((self.host, self._port), _Handler)
        httpd.control, httpd.tls = self, self.tls
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
        log.info("control server listening on %s", self.url)
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
