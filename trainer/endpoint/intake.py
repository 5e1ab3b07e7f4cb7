"""The control endpoint's door: connections taken in without a thread each, then a fixed pool.

A thread per connection, as the stdlib's ``ThreadingHTTPServer`` has it, lets anyone who can
reach the port hold a thread and its stack for as long as they keep a connection half-sent (150
slow connections held 153 threads). Here one thread (`Intake.run`) accepts every connection,
completes its TLS handshake and reads its request head, all non-blocking in one selector; a
connection reaches one of `Limits.handlers` handler threads only with a complete head, so slow
clients cost a socket and a small buffer, never a thread, and a legitimate request is answered
while they wait. Bounds, all in `Limits`:

- at most `max_connections` connections at once (waiting for their head, queued or being
  handled); beyond it a new one is closed at once (plain HTTP: with a 503 first);
- a head must be complete within `head_seconds` of the accept and within `max_head` bytes;
- the whole request, body and answer included, within `request_seconds` of the accept: the
  handler's reads and writes go through `Connection`, which times each one out at that
  deadline, so a slow body or a client that does not read its answer is cut off;
- refusals are logged by `RefusalLog`: one WARNING line per `log_seconds` with the counts by
  reason, never one line per refused request (a flood must not become a log flood).
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .credentials import ServingTLS

__all__ = ["Connection", "Intake", "Limits", "RefusalLog"]

log = logging.getLogger(__name__)

_READ = 1 << 16


@dataclass(frozen=True)
class Limits:
    """What one control endpoint grants its clients (see the module)."""

    max_connections: int = 256
    """Connections open at once (waiting for their head, queued or being handled)."""
    handlers: int = 8
    """Threads handling complete requests."""
    head_seconds: float = 5.0
    """Seconds from the accept (TLS handshake included) to a complete request head."""
    request_seconds: float = 10.0
    """Seconds from the accept to the last byte of the answer."""
    max_head: int = 16 << 10
    """Bytes of request line and headers."""
    log_seconds: float = 60.0
    """At most one refusal line per this many seconds (`RefusalLog`)."""


class RefusalLog:
    """Refused requests counted by reason and logged as one WARNING line per interval.

    The first refusal is logged at once; later ones are counted and written (with the last
    peer) when `flush` finds the interval over, which the intake loop asks several times a
    second, and at `flush(force=True)` when the server stops.
    """

    def __init__(
        self,
        logger: logging.Logger,
        seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.seconds, self.clock = logger, seconds, clock
        self.counts: Counter[str] = Counter()
        """Refusals since the last line, by reason."""
        self.total: Counter[str] = Counter()
        """Every refusal so far, by reason."""
        self._last_peer = ""
        self._logged_at: float | None = None
        self._lock = threading.Lock()

    def note(self, reason: str, peer: str) -> None:
        with self._lock:
            self.counts[reason] += 1
            self.total[reason] += 1
            self._last_peer = peer
        self.flush()

    def flush(self, *, force: bool = False) -> None:
        with self._lock:
            now = self.clock()
            due = self._logged_at is None or now - self._logged_at >= self.seconds
            if not self.counts or not (due or force):
                return
            counts, self.counts = self.counts, Counter()
            self._logged_at, peer = now, self._last_peer
        what = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
        self.logger.warning(
            "control endpoint refused %d request(s) (%s); the last from %s; at most one such "
            "line per %g s",
            sum(counts.values()),
            what,
            peer,
            self.seconds,
        )


class Connection(io.RawIOBase):
    """A handled connection as the handler's file: the head the intake read first, then the
    socket, every read and write timed out at `deadline` (`time.monotonic`)."""

    def __init__(self, sock: socket.socket, head: bytes, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline
        self._head = memoryview(head)
        self.timed_out = False
        """Whether a read or a write ran into the deadline (the handler then gave up)."""

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("the request's deadline passed")
            self.sock.settimeout(left)
            return self.sock.recv_into(buffer)
        except TimeoutError:
            self.timed_out = True
            raise

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        # An answer to a request read just in time may still go out just past the deadline.
        self.sock.settimeout(max(0.1, self.deadline - time.monotonic()))
        try:
            self.sock.sendall(data)
        except TimeoutError:
            self.timed_out = True
            raise
        return len(data)


@dataclass
class _Waiting:
    """A connection whose head is not complete yet."""

    sock: socket.socket
    peer: str
    address: tuple[str, int]
    accepted: float
    handshaking: bool
    head: bytearray


Handle = Callable[[socket.socket, tuple[str, int], bytes, float], None]
"""handle(sock, client address, what was read of the request, deadline): one request (a
`Connection` over the socket; one that ran into its deadline is the handler's to count)."""
_Job = tuple[socket.socket, tuple[str, int], bytes, float]


def _complete(head: bytearray) -> bool:
    return b"\r\n\r\n" in head or b"\n\n" in head


class Intake:
    """Accepts on `listener`, reads heads and hands complete requests to `handle` on a pool.

    `tls`: wrap every connection (the handshake runs here, non-blocking, under the head's
    deadline). `run` serves until `stop`; the caller owns and closes `listener`.
    """

    def __init__(
        self,
        listener: socket.socket,
        handle: Handle,
        *,
        tls: ServingTLS | None = None,
        limits: Limits | None = None,
        refusals: RefusalLog | None = None,
    ) -> None:
        self.listener, self.handle, self.tls = listener, handle, tls
        self.limits = limits or Limits()
        self.refusals = refusals or RefusalLog(log, self.limits.log_seconds)
        self._open = 0
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._waiting: dict[int, _Waiting] = {}

    @property
    def open_connections(self) -> int:
        """Connections counted against `Limits.max_connections` now."""
        with self._lock:
            return self._open

    # ---- the selector thread --------------------------------------------------------------
    def run(self) -> None:
        sel = selectors.DefaultSelector()
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                try:
                    self._turn(sel)
                except Exception:  # a bug must cost a connection at most, never the endpoint
                    log.exception("control endpoint: intake turn failed")
        finally:
            for w in list(self._waiting.values()):
                self._drop(sel, w)
            sel.close()
            self.refusals.flush(force=True)
            for _ in self._workers:
                self._jobs.put(None)  # wakes and ends a worker
            self._wake_r.close()
            self._wake_w.close()

    def _turn(self, sel: selectors.BaseSelector) -> None:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is self.listener:
                self._accept(sel)
            elif key.fileobj is self._wake_r:
                self._wake_r.recv(64)
            elif (w := self._waiting.get(key.fd)) is not None:
                self._progress(sel, w)
        self._expire(sel)
        self.refusals.flush()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # then let the waiting connections have a turn
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: the next turn tries again
                log.debug("accept failed: %s", e)
                return
            peer = str(address[0])
            with self._lock:
                full = self._open >= self.limits.max_connections
                if not full:
                    self._open += 1
            if full:
                self._refuse(sock, peer, "over the connection limit", 503)
                continue
            sock.setblocking(False)
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(
                        sock, server_side=True, do_handshake_on_connect=False
                    )
                except (OSError, ValueError) as e:
                    log.debug("TLS wrap of a connection from %s failed: %s", peer, e)
                    sock.close()
                    self._release()
                    continue
            w = _Waiting(sock, peer, address, time.monotonic(), self.tls is not None, bytearray())
            self._waiting[sock.fileno()] = w
            sel.register(sock, selectors.EVENT_READ)

    def _progress(self, sel: selectors.BaseSelector, w: _Waiting) -> None:
        """Advance `w`'s handshake, then read what its head has sent."""
        try:
            if w.handshaking:
                w.sock.do_handshake()  # type: ignore[attr-defined]
                w.handshaking = False
            while True:
                data = w.sock.recv(_READ)
                if not data:  # closed before its head was complete
                    self._drop(sel, w)
                    return
                w.head += data
                if _complete(w.head):
                    sel.unregister(w.sock)
                    del self._waiting[w.sock.fileno()]
                    deadline = w.accepted + self.limits.request_seconds
                    self._dispatch(w.sock, w.address, bytes(w.head), deadline)
                    return
                if len(w.head) > self.limits.max_head:
                    self.refusals.note("request head too large", w.peer)
                    self._drop(sel, w)
                    return
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            sel.modify(w.sock, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            sel.modify(w.sock, selectors.EVENT_WRITE)
        except (OSError, ssl.SSLError) as e:  # a failed handshake, a reset: nothing to answer
            log.debug("control connection from %s failed: %s", w.peer, e)
            self._drop(sel, w)

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for w in [w for w in self._waiting.values() if now - w.accepted > self.limits.head_seconds]:
            self.refusals.note(f"no request head within {self.limits.head_seconds:g} s", w.peer)
            self._drop(sel, w)

    def _drop(self, sel: selectors.BaseSelector, w: _Waiting) -> None:
        self._waiting.pop(w.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(w.sock)
        _close(w.sock)
        self._release()

    def _refuse(self, sock: socket.socket, peer: str, reason: str, code: int) -> None:
        """Close a connection not taken in; plain HTTP gets a short answer first."""
        self.refusals.note(reason, peer)
        if self.tls is None:
            answer = f"HTTP/1.1 {code} Refused\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            try:
                sock.setblocking(False)
                sock.send(answer.encode())
            except OSError:
                pass
        _close(sock)

    def _release(self) -> None:
        with self._lock:
            self._open -= 1

    # ---- the handler threads ----------------------------------------------------------------
    def _dispatch(
        self, sock: socket.socket, address: tuple[str, int], head: bytes, deadline: float
    ) -> None:
        with self._lock:
            start = self._idle == 0 and len(self._workers) < self.limits.handlers
        if start:
            worker = threading.Thread(
                target=self._work, name=f"malleus-control-{len(self._workers)}", daemon=True
            )
            self._workers.append(worker)
            worker.start()
        self._jobs.put((sock, address, head, deadline))

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
            if job is None:
                return
            sock, address, head, deadline = job
            try:
                sock.setblocking(True)
                self.handle(sock, address, head, deadline)
            except Exception as e:  # a reset, a bug: the client's answer is lost, the thread not
                log.debug("control request from %s failed: %r", address[0], e, exc_info=True)
            finally:
                _linger_close(sock)
                self._release()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _linger_close(sock: socket.socket, seconds: float = 0.2, most: int = 1 << 16) -> None:
    """Close after the answer: our side first, then a short drain of what the client still
    sends (an unread byte at close makes the kernel reset the connection, and the client could
    lose the answer: a 401 to a body that was never read)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_WR)  # the raw socket's: TLS keeps its state
        end = time.monotonic() + seconds
        while most > 0 and (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            data = socket.socket.recv(sock, min(most, _READ))  # raw bytes: discarded unread
            if not data:
                break
            most -= len(data)
    except OSError:
        pass
    _close(sock)
