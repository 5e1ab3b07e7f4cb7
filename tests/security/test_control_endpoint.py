"""Issue 25, finding "control endpoint exhaustion without a token": the trainer's control
endpoint checks the token before it reads a body, wants it for reads too, holds no thread for a
slow client, caps its connections, cuts a slow request at its deadline and logs refusals once a
minute, not once a request; the token reaches a pod as a file.

The attacks, as reproduced: 150 slow connections held 153 threads after 24 s; up to 1 MiB of
body (16 MiB drained) was read before the token check; ``GET /status`` and ``GET /plan``
answered without a token; every refused request logged a WARNING. Each test here performs one
against a real `ControlServer` on 127.0.0.1 (and over TLS where the pod's endpoint differs).
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from malleus.control import ControlClient, ControlError, ControlTLS
from malleus.operator import jobs, tls, workers
from malleus.operator.resources import JobRef
from malleus.trainer.endpoint.credentials import ServingTLS, load_token
from malleus.trainer.endpoint.intake import Limits
from malleus.trainer.endpoint.server import PRE_AUTH_DRAIN, ControlServer
from malleus.trainer.engine.services import Services, WorkerState
from tests.jobs import job_body

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMITS = Limits(max_connections=64, handlers=4, head_seconds=1.0, request_seconds=2.0)


class _Plans:
    """A coordinator's inbox that takes every plan (what it holds does not matter here)."""

    current_generation = 1
    pending_generation = None
    last_failure = None

    def offer(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 202, {"generation": 2}


def _server(limits: Limits = LIMITS, tls_context: ServingTLS | None = None) -> ControlServer:
    services = Services(WorkerState("demo", world=4, steps=10))
    services.state.update(generation=1, step=7)
    return ControlServer(
        "127.0.0.1",
        0,
        TOKEN,
        status=services.status,
        inbox=_Plans(),  # type: ignore[arg-type]
        metrics=None,
        inject=None,
        plan=lambda: {"generation": 1},
        limits=limits,
        tls=tls_context,
    )


@pytest.fixture
def server() -> Iterator[ControlServer]:
    with _server() as s:
        yield s


def _eventually(condition: Callable[[], bool], seconds: float = 2.0) -> bool:
    """Whether `condition` holds within `seconds` (the server counts a cut just after it)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _raw(server: ControlServer, data: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    """Send `data` (and nothing more) and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        started = time.monotonic()
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        return answer, time.monotonic() - started


def test_an_unauthenticated_huge_body_is_refused_before_it_is_read(server: ControlServer) -> None:
    """A 400 MiB Content-Length and a first kilobyte: the 401 comes at once, while the server
    would still be waiting for 400 MiB had it started reading."""
    head = (
        "POST /plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {400 << 20}\r\n\r\n"
    ).encode()
    for auth in (b"", b"Authorization: Bearer wrong\r\n"):
        request = head.replace(b"\r\n\r\n", b"\r\n" + auth + b"\r\n", 1) if auth else head
        answer, seconds = _raw(server, request + b"{" * 1024)
        assert answer.startswith(b"HTTP/1.0 401"), answer[:80]
        assert b"missing or wrong bearer token" in answer
        assert seconds < 1.0  # not the request's deadline: nothing waited for the body
    # a small refused body is drained (the client sees its 401, not a reset), a large one not
    assert PRE_AUTH_DRAIN <= 64 << 10
    answer, _ = _raw(server, head.replace(str(400 << 20).encode(), b"2") + b"{}")
    assert answer.startswith(b"HTTP/1.0 401")


def test_reads_need_the_token_but_health_and_metrics_do_not(server: ControlServer) -> None:
    for path in ("/status", "/plan"):
        answer = httpx.get(server.url + path)
        assert answer.status_code == 401, path
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200, path
    assert httpx.get(server.url + "/healthz").status_code == 200  # the kubelet's probe
    assert httpx.get(server.url + "/metrics").status_code == 404  # open (this rank has none)
    with ControlClient(server.url, TOKEN) as client:  # the one client sends it everywhere
        assert client.status().step == 7
    with ControlClient(server.url) as client, pytest.raises(ControlError) as e:
        client.status()
    assert e.value.code == 401


def _slow_connections(server: ControlServer, n: int, stack: ExitStack) -> list[socket.socket]:
    """`n` connections that send half a request head and then nothing (slowloris)."""
    socks = []
    for _ in range(n):
        s = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    return socks


def _closed(s: socket.socket, within: float) -> bool:
    """Whether the server closed `s` within `within` seconds (EOF, a reset, a cut TLS stream)."""
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except (OSError, ssl.SSLError):
        return True


def _server_context(certs: tls.JobCertificates, folder: Path) -> ServingTLS:
    (folder / "tls.crt").write_text(certs.servers[0].cert)
    (folder / "tls.key").write_text(certs.servers[0].key)
    return ServingTLS(folder / "tls.crt", folder / "tls.key")


def _tls_slow_connections(server: ControlServer, n: int, stack: ExitStack) -> list[socket.socket]:
    """`n` TLS connections whose handshake is done and whose head never completes."""
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    socks = []
    for _ in range(n):
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        wrapped = stack.enter_context(client.wrap_socket(raw, server_hostname="localhost"))
        wrapped.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(wrapped)
    return socks


@pytest.mark.parametrize("secure", [False, True], ids=["http", "https"])
def test_slow_clients_hold_no_thread_and_a_real_request_is_answered(
    secure: bool, tmp_path: Path
) -> None:
    """150 slowloris connections (over TLS: 75 that finished their handshake and 75 that never
    start it): the thread count stays where it was, a client with the token is answered at
    once, and every slow connection is cut once the head's deadline passes."""
    certs = tls.issue([["localhost"]], dt.datetime.now(dt.UTC)) if secure else None
    context = _server_context(certs, tmp_path) if certs is not None else None
    trust = ControlTLS(certs.ca, server_name="localhost") if certs is not None else None
    limits = Limits(max_connections=256, handlers=4, head_seconds=1.5, request_seconds=3.0)
    with _server(limits, context) as server, ExitStack() as stack:
        threads_before = threading.active_count()
        if secure:
            slow = _tls_slow_connections(server, 75, stack)
            slow += [  # a TCP connection, no TLS hello: the handshake never starts
                stack.enter_context(socket.create_connection(("127.0.0.1", server.port)))
                for _ in range(75)
            ]
        else:
            slow = _slow_connections(server, 150, stack)
        time.sleep(0.3)  # all accepted
        assert server.open_connections == len(slow)
        started = time.monotonic()
        with ControlClient(server.url, TOKEN, timeout=2.0, tls=trust) as client:
            assert client.status().step == 7
        assert time.monotonic() - started < 1.0
        # a handler thread or two at most (the pool grows on demand, up to `handlers`)
        assert threading.active_count() <= threads_before + limits.handlers
        cut = [s for s in slow if _closed(s, limits.head_seconds + 2.0)]
        assert len(cut) == len(slow)
        slow_heads = server.refusals.total[f"no request head within {limits.head_seconds:g} s"]
        assert slow_heads == len(slow)
        assert _eventually(lambda: server.open_connections == 0)


def test_connections_beyond_the_cap_are_refused_at_once() -> None:
    limits = Limits(max_connections=20, handlers=2, head_seconds=2.0, request_seconds=3.0)
    with _server(limits) as server, ExitStack() as stack:
        _slow_connections(server, 20, stack)
        time.sleep(0.3)
        started = time.monotonic()
        try:  # a 503, or a reset when the request crossed the server's close: refused either way
            answer, _ = _raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        except ConnectionResetError:
            answer = b"HTTP/1.1 503 (reset)"
        assert answer.startswith(b"HTTP/1.1 503"), answer[:60]
        assert time.monotonic() - started < 1.0  # refused fast, not queued
        assert server.refusals.total["over the connection limit"] >= 1
        time.sleep(limits.head_seconds + 0.5)  # the slow ones are cut: room again
        with ControlClient(server.url, TOKEN, timeout=2.0) as client:
            assert client.healthz() and client.status().step == 7


def test_a_slow_body_is_cut_at_the_requests_deadline(server: ControlServer) -> None:
    """A client with the token dripping its body: cut at `request_seconds`, not kept alive by
    bytes that each arrive within any read timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        started = time.monotonic()
        s.sendall(
            b"POST /plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n".encode()
        )
        closed = False
        while time.monotonic() - started < LIMITS.request_seconds + 3:
            try:
                s.sendall(b" ")
            except OSError:
                closed = True
                break
            s.settimeout(0.2)
            try:
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
        seconds = time.monotonic() - started
    assert closed and LIMITS.request_seconds - 0.3 < seconds < LIMITS.request_seconds + 2
    assert _eventually(lambda: server.refusals.total["request not complete in time"] == 1)


def test_refusals_are_logged_once_per_interval_with_counts(
    server: ControlServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="malleus.trainer.endpoint")
    for _ in range(40):
        assert httpx.post(server.url + "/plan", content=b"{}").status_code == 401
    lines = [r for r in caplog.records if r.name.startswith("malleus.trainer.endpoint")]
    assert len(lines) == 1 and "1 unauthorized" in lines[0].getMessage()  # the first, at once
    server.refusals.flush(force=True)  # what the server does at its interval (and when it stops)
    lines = [r for r in caplog.records if r.name.startswith("malleus.trainer.endpoint")]
    assert len(lines) == 2 and "39 unauthorized" in lines[1].getMessage()
    assert server.refusals.total["unauthorized"] == 40


def test_the_token_reaches_a_pod_as_a_file_not_an_environment_variable(tmp_path: Path) -> None:
    pod = workers.build_pod(jobs.resolve(job_body()), JobRef("ml", "demo", "uid-1"), 0)
    (trainer,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in trainer["env"]}
    assert "MALLEUS_CONTROL_TOKEN" not in env
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in trainer["env"])
    path = env["MALLEUS_CONTROL_TOKEN_FILE"]["value"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "control-tls"]
    assert {"key": "token", "path": "token"} in volume["secret"]["items"]
    mount = next(m for m in trainer["volumeMounts"] if m["name"] == "control-tls")
    assert path == f"{mount['mountPath']}/token" and mount["readOnly"] is True
    # the trainer reads the file first; the variable is only a fallback for a hand-made run
    secret = tmp_path / "token"
    secret.write_text("from-the-secret\n")
    both = {"MALLEUS_CONTROL_TOKEN_FILE": str(secret), "MALLEUS_CONTROL_TOKEN": "from-env"}
    assert load_token(environ=both) == "from-the-secret"
    assert load_token(environ={"MALLEUS_CONTROL_TOKEN": "from-env"}) == "from-env"
