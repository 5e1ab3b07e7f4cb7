"""The trainer's control endpoint: health, status, metrics, plans, stop, injections.

The stdlib's HTTP request handler behind `intake.Intake` (one selector thread takes connections
in and reads their heads; a fixed pool of threads handles complete requests), so the training
loop never blocks on a client, a crowd of slow clients holds no thread, and the pod needs no
web framework. ``GET /healthz`` (the kubelet's), ``GET /metrics`` (Prometheus': in a pod, this
pod's own ranks) and ``GET /metrics/job`` (every rank's series, what the controller's direct
scrape reads; Prometheus has no job's credential and the job's NetworkPolicy says who reaches
the port) are open; everything
else, the reads ``GET /status`` and ``GET /plan`` included, needs ``Authorization: Bearer
<token>`` from the job's Secret, and with no token configured it is refused, never open by
default. The token is checked on the request head, before any body byte is read: a refused
request's body is read only up to `PRE_AUTH_DRAIN` (so that a small one sees its 401 rather
than a reset), never more. Refusals are logged at most once a minute, with counts.
`GET /status` serves a `malleus.control.ControlStatus`; the clients of that module are the
one way to talk to this server.

In a pod the endpoint serves HTTPS with the job's certificate (`credentials.load_tls`: the
operator's per-job CA signed it for the workers' stable DNS names) on the pod IP, so the
token never crosses the pod network in clear; local runs serve plain HTTP on 127.0.0.1, where
nothing but this machine can listen in. Every write body is judged here before anything acts
on it: bounded in size (413) and nesting, strict JSON (no NaN), and an answer within the
request's deadline, a 400 naming the field, never a traceback or a dead handler thread.

The routing, the authorization and the plumbing live here; judging a write body (strict JSON,
nesting, an injection's fields) is trainer/endpoint/body.py.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from malleus.control import JOB_METRICS_PATH, ControlStatus
from malleus.trainer.switching.plan_inbox import PlanInbox

from .body import MAX_DEPTH, MAX_FACTOR, Refused, parse_body, parse_injection
from .credentials import ServingTLS
from .intake import Connection, Intake, Limits, RefusalLog
from .metrics import CONTENT_TYPE, TrainerMetrics

__all__ = ["DEFAULT_PORT", "MAX_DEPTH", "MAX_FACTOR", "PRE_AUTH_DRAIN", "ControlServer", "Limits"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 8040
_MAX_BODY = 1 << 20  # a 64-GPU plan is a few KB; anything near this is a mistake or an attack
_DRAIN_LIMIT = 16 << 20  # read and discard an authorized oversize body up to this, for its 413
PRE_AUTH_DRAIN = 64 << 10
"""Body bytes a refused request (no or a wrong token, no such endpoint) may have read and
discarded, so its answer arrives instead of a reset; a larger one is not read at all."""
_OPEN = frozenset({"/healthz", "/metrics", JOB_METRICS_PATH})
"""What answers without a token: the kubelet's probe and the metrics pages."""
_WRITES = {"/plan": "plan", "/stop": "stop request", "/inject": "injection"}


class _Handler(BaseHTTPRequestHandler):
    """One request, on a handler thread of the intake, over a `intake.Connection`."""

    server: ControlServer  # type: ignore[assignment]  # ours, not a socketserver
    request: Connection
    server_version = "malleus-trainer"

    # ---- plumbing ------------------------------------------------------------------------
    def setup(self) -> None:
        self.connection = self.request.sock
        self.rfile = io.BufferedReader(self.request)
        self.wfile = self.request  # type: ignore[assignment]  # writes straight through

    def finish(self) -> None:
        if not self.wfile.closed:
            with contextlib.suppress(OSError):
                self.wfile.flush()

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

    def _refuse(self, code: int, message: str, reason: str, **extra: Any) -> None:
        """Answer without reading the body (beyond `PRE_AUTH_DRAIN`), counted in the refusal
        log under `reason`, and close."""
        length = self.headers.get("Content-Length", "0")
        if length.isdigit() and 0 < int(length) <= PRE_AUTH_DRAIN:
            self._discard(int(length))
        self.close_connection = True
        self.server.refusals.note(reason, self.client_address[0])
        headers = {"WWW-Authenticate": 'Bearer realm="malleus"'} if code == 401 else None
        self._json(code, {"error": message, **extra}, headers)

    def _authorized(self) -> bool:
        """Whether the request carries the token; if not, it has been answered (401, or 503
        with no token configured)."""
        token = self.server.token
        if token is None:
            self._refuse(503, "no control token configured", "no token configured")
            return False
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return True
        self._refuse(401, "missing or wrong bearer token", "unauthorized")
        return False

    # ---- GET -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        c = self.server
        path = self._path
        if path not in _OPEN and not self._authorized():
            return
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/status" and c.status is None:  # a pod's metrics-only endpoint
            self._error(404, "this rank is not the coordinator: it serves /metrics only")
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
        elif path == JOB_METRICS_PATH and c.metrics is not None:
            self._send(200, c.metrics.render(job_wide=True), CONTENT_TYPE)
        elif path == "/plan" and c.plan is not None:  # the plan in force (recovery plans too)
            plan = c.plan()
            if plan is None:
                self._error(404, "no plan in force yet")
            else:
                self._json(200, plan)
        elif path in _WRITES:
            self._error(405, "use POST", allowed=["POST"])
        else:
            self._error(404, f"no such endpoint: {path}")

    # ---- POST ------------------------------------------------------------------------------
    def do_POST(self) -> None:
        c = self.server
        path = self._path
        # Everything a head tells is judged before the body is read: an unknown endpoint or a
        # missing token costs the client its answer, never our reading its body.
        missing = {
            "/plan": None
            if c.inbox is not None
            else "this rank is not the coordinator; post plans to rank 0",
            "/stop": None
            if c.stop_request is not None
            else "this rank is not the coordinator; post stop to rank 0",
            "/inject": None
            if c.inject is not None
            else "emulation is off: slowdowns cannot be injected",
        }.get(path, f"no such endpoint: {path}")
        if missing is not None:
            self._refuse(404, missing, "no such endpoint")
            return
        if not self._authorized():
            return
        body = self._body(c.max_body)
        if body is None:
            return
        what = _WRITES[path]
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
        c = self.server
        if path == "/plan":
            assert c.inbox is not None
            return c.inbox.offer(req)
        if path == "/stop":
            assert c.stop_request is not None
            return c.stop_request(req)
        assert c.inject is not None and c.status is not None
        rank, factor = parse_injection(req, c.status().world)
        try:
            c.inject(rank, factor)
        except ValueError as e:  # the clock's own refusal (it checks the factor too)
            raise Refused("factor", str(e)) from e
        log.info("injected slowdown %.3g on rank %d", factor, rank)
        return 200, {"rank": rank, "factor": factor}

    def _body(self, limit: int) -> bytes | None:
        """The body of an authorized write (its client holds the token), or None when it was
        answered instead (411, 400, 413)."""
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

    status: returns the `ControlStatus` served at /status (its ``world`` bounds injections);
    None = a pod's metrics-only endpoint (``/status`` 404, so the operator's search for the
    coordinator passes it by).
    inbox: the plan inbox (coordinator only; None = 404). metrics: served at /metrics.
    inject: `(rank, factor)` callback, only when emulation is on. stop: a parsed `POST /stop`
    body -> (code, answer) (coordinator only: stop at the next step boundary, by default with
    a checkpoint). plan: the plan in force as JSON data, served at `GET /plan`. token: the
    bearer token every call but ``/healthz`` and ``/metrics`` needs
    (`credentials.load_token()`); None = those refused with 503. tls: serve HTTPS with this
    context (`credentials.load_tls()`); None = plain HTTP. limits: connections, handler
    threads, deadlines (`intake.Limits`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        *,
        status: Callable[[], ControlStatus] | None,
        inbox: PlanInbox | None,
        metrics: TrainerMetrics | None,
        inject: Callable[[int, float], None] | None,
        stop: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]] | None = None,
        max_body: int = _MAX_BODY,
        tls: ServingTLS | None = None,
        plan: Callable[[], dict[str, Any] | None] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.host, self._port = host, port
        self.token = token or None
        self.status, self.inbox, self.metrics, self.inject = status, inbox, metrics, inject
        self.stop_request = stop
        self.plan = plan  # GET /plan: the plan in force as JSON data (None: 405 as before)
        self.max_body = max_body
        self.tls = tls
        self.limits = limits or Limits()
        self.refusals = RefusalLog(log, self.limits.log_seconds)
        """Refused requests, counted by reason (``total``) and logged once per interval."""
        self._listener: socket.socket | None = None
        self._intake: Intake | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when constructed with port 0 and started)."""
        if self._listener is not None:
            return int(self._listener.getsockname()[1])
        return self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        """Connections held now (waiting for their head, queued or being handled)."""
        return self._intake.open_connections if self._intake is not None else 0

    def _handle(
        self, sock: socket.socket, address: tuple[str, int], head: bytes, deadline: float
    ) -> None:
        connection = Connection(sock, head, deadline)
        _Handler(connection, address, self)  # type: ignore[arg-type]
        if connection.timed_out:  # the handler gave up on it (http.server swallows the error)
            self.refusals.note("request not complete in time", address[0])

    def start(self) -> ControlServer:
        if self._listener is not None:
            return self
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.create_server((self.host, self._port), family=family, backlog=1024)
        intake = Intake(
            listener, self._handle, tls=self.tls, limits=self.limits, refusals=self.refusals
        )
        self._listener, self._intake = listener, intake
        self._thread = threading.Thread(target=intake.run, name="malleus-control", daemon=True)
        self._thread.start()
        if self.token is None:
            log.warning("no control token configured: everything but health and metrics refused")
        log.info("control server listening on %s", self.url)
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        assert self._intake is not None
        self._intake.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        listener.close()
        self._intake = None

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
