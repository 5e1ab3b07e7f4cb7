"""Issue 25, finding "one job can OOM the shared operator": every answer the operator reads from
a trainer or from Prometheus is capped in bytes and bounded by one deadline per request.

The attack, as reproduced: a job's coordinator runs its author's image and holds the job's TLS
key, so a certificate check passes, and a 400 MiB ``/status`` took the operator's client from 50
to 1,254 MiB in 9.9 s despite its 5 s timeout (httpx times each read, not the transfer). Here a
real HTTP server on 127.0.0.1 streams such answers (fast, announced or not, and dripped one
byte at a time); the clients must give up with a `ControlError` (`PrometheusError` for the
Prometheus source) within their deadline, having read no more than their cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from malleus.control import AsyncControlClient, ControlClient, ControlError
from malleus.controller.prometheus import PrometheusError, PrometheusSource, default_queries
from malleus.controller.sources import TrainerScrapeSource

CAP = 1 << 20  # the clients' cap in these tests (the default is 16 MiB)
HUGE = 400 << 20  # what the hostile server offers
DEADLINE = 1.5  # the clients' deadline in these tests
SLACK = 1.5  # scheduling on a loaded machine


class Hostile:
    """A raw HTTP server on 127.0.0.1 answering every request with ``answer(conn)``, one
    thread per connection, counting the body bytes it managed to send."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.answer = answer
        self.sent = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            self.answer(conn)

    def stream(self, conn: socket.socket, total: int, chunk: int, pause: float) -> None:
        """Send `total` bytes of JSON-ish body in `chunk`s, `pause` s apart, until the client
        hangs up."""
        block = b"[" + b"0," * (chunk // 2)
        sent = 0
        while sent < total and not self._stop.is_set():
            piece = block[: min(chunk, total - sent)]
            conn.sendall(piece)
            sent += len(piece)
            self.sent += len(piece)
            if pause:
                time.sleep(pause)

    def __enter__(self) -> Hostile:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()


def _head(length: int | None) -> bytes:
    sized = f"Content-Length: {length}\r\n" if length is not None else ""
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{sized}Connection: close\r\n\r\n"
    ).encode()


@pytest.fixture(params=["announced", "unannounced"])
def huge(request: pytest.FixtureRequest) -> Iterator[Hostile]:
    """400 MiB as fast as the loopback takes it, with or without a Content-Length."""
    announced = request.param == "announced"

    def answer(conn: socket.socket) -> None:
        conn.sendall(_head(HUGE if announced else None))
        server.stream(conn, HUGE, 1 << 16, 0.0)

    with Hostile(answer) as server:
        yield server


@pytest.fixture
def drip() -> Iterator[Hostile]:
    """A small answer, one byte every 0.2 s: each read arrives well within any read timeout."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(_head(None))
        server.stream(conn, 10_000, 1, 0.2)

    with Hostile(answer) as server:
        yield server


def _timed(call: Callable[[], object]) -> tuple[Exception, float, int]:
    """(the exception `call` raised, seconds it took, peak bytes Python allocated meanwhile)."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        call()
    except Exception as e:  # the test inspects it
        caught = e
    else:
        pytest.fail("the call returned: an unbounded answer was accepted")
    finally:
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return caught, elapsed, peak


@pytest.mark.parametrize("path", ["status", "plan", "metrics_text"])
def test_a_400_mib_answer_is_cut_at_the_cap_by_the_blocking_client(
    huge: Hostile, path: str
) -> None:
    with ControlClient(huge.url, "t", timeout=DEADLINE, max_bytes=CAP) as client:
        error, seconds, peak = _timed(getattr(client, path))
    assert isinstance(error, ControlError), error
    assert "cap" in str(error) and f"{CAP}-byte" in str(error)
    assert seconds < DEADLINE + SLACK
    assert peak < 8 * CAP, f"{peak} bytes allocated for a {CAP}-byte cap"


def test_a_400_mib_answer_is_cut_at_the_cap_by_the_async_client(huge: Hostile) -> None:
    async def status() -> None:
        async with AsyncControlClient(huge.url, "t", timeout=DEADLINE, max_bytes=CAP) as c:
            await c.status()

    error, seconds, peak = _timed(lambda: asyncio.run(status()))
    assert isinstance(error, ControlError) and "cap" in str(error), error
    assert seconds < DEADLINE + SLACK
    assert peak < 8 * CAP
    assert huge.sent < HUGE // 4  # the client hung up long before the end


def test_the_operators_sources_and_sinks_are_capped_too(huge: Hostile) -> None:
    """What the operator builds reads through the same client: the /metrics source, and the
    default cap when none is given (16 MiB, far below 400)."""

    async def scrape() -> None:
        await TrainerScrapeSource(huge.url, "t", timeout=DEADLINE, max_bytes=CAP).read()

    error, seconds, _ = _timed(lambda: asyncio.run(scrape()))
    assert isinstance(error, ControlError) and "cap" in str(error), error
    assert seconds < DEADLINE + SLACK
    with ControlClient(huge.url, "t", timeout=10.0) as client:
        error, seconds, peak = _timed(client.status)
    assert isinstance(error, ControlError) and f"{16 << 20}-byte cap" in str(error), error
    assert peak < 8 * (16 << 20)


def test_a_dripping_answer_is_cut_at_the_overall_deadline(drip: Hostile) -> None:
    """Each byte arrives 0.2 s after the last, far within the per-read timeout: only a deadline
    for the whole request ends it."""
    with ControlClient(drip.url, "t", timeout=DEADLINE) as client:
        error, seconds, _ = _timed(client.status)
    assert isinstance(error, ControlError) and f"within {DEADLINE:g} s" in str(error), error
    assert DEADLINE - 0.1 < seconds < DEADLINE + SLACK

    async def status() -> None:
        async with AsyncControlClient(drip.url, "t", timeout=DEADLINE) as c:
            await c.status()

    error, seconds, _ = _timed(lambda: asyncio.run(status()))
    assert isinstance(error, ControlError) and f"within {DEADLINE:g} s" in str(error), error
    assert DEADLINE - 0.1 < seconds < DEADLINE + SLACK


def test_prometheus_answers_are_capped_and_bounded_as_well(huge: Hostile, drip: Hostile) -> None:
    queries = default_queries("mj", namespace="ml", sm_clock_metric=None, clock_reasons_metric=None)

    def read(url: str) -> None:
        source = PrometheusSource(url, queries, timeout=DEADLINE, max_bytes=CAP)
        asyncio.run(source.read())

    for server, words in ((huge, "cap"), (drip, f"within {DEADLINE:g} s")):
        error, seconds, peak = _timed(lambda s=server: read(s.url))
        assert isinstance(error, PrometheusError) and words in str(error), error
        assert seconds < DEADLINE + SLACK
        assert peak < 16 * CAP  # four queries at once, each under the cap


def test_a_compressed_answer_is_refused_not_inflated() -> None:
    """A gzip bomb passes any cap on the wire: the clients ask for and read identity only."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: 20\r\nConnection: close\r\n\r\n" + b"\x1f\x8b" + b"\0" * 18
        )

    with (
        Hostile(answer) as server,
        ControlClient(server.url, "t", timeout=DEADLINE) as client,
        pytest.raises(ControlError, match="encoded as 'gzip'"),
    ):
        client.status()
