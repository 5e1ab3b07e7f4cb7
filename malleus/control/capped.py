"""Reading an HTTP answer under a byte cap and one deadline for the whole request.

httpx's timeout bounds each read, not the transfer: a server that streams 400 MiB fast, or
drips a byte every few seconds, holds its caller (and its memory) for as long as it likes. A
trainer's coordinator runs the job author's image and holds the job's TLS key, so a certificate
check does not make its answers safe to read whole; neither is a Prometheus the operator only
reaches. Every answer the operator, the controller and the runner read from a trainer
(`malleus.control.client`) or from Prometheus (`malleus.controller.prometheus`) is read here:

- streamed, and refused as soon as it passes ``max_bytes`` (or announces more in its
  ``Content-Length``), so memory stays at the cap whatever the server sends;
- under one deadline for the whole request (connect, headers, body): the asyncio reader is
  cancelled at it; the blocking reader checks it after every read, each read bounded by the
  client's own timeout, so it ends within one read timeout of it;
- asked for and read as ``identity``: a compressed answer would be a 1000x bomb past the cap,
  so any ``Content-Encoding`` is refused.

Redirects are never followed (httpx's default, stated again by each caller): a redirect would
carry the bearer token to wherever the server points.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = [
    "IDENTITY",
    "MAX_RESPONSE_BYTES",
    "Answer",
    "CappedReadError",
    "read_answer",
    "read_answer_async",
]

MAX_RESPONSE_BYTES = 16 << 20
"""The largest answer read by default: the ``/metrics`` page of a 65,536-GPU job (about 200
bytes a rank) and the Prometheus answer to its rates query fit; a hostile answer costs at most
this much memory per request."""
IDENTITY = {"Accept-Encoding": "identity"}
"""The header every capped request carries: no compressed answers."""


class CappedReadError(Exception):
    """An answer refused while reading it: larger than the cap, past the deadline, or encoded.

    ``code``: the HTTP status when the head arrived (None when it did not); ``received``: the
    body bytes read before giving up.
    """

    def __init__(self, message: str, code: int | None = None, received: int = 0) -> None:
        super().__init__(message)
        self.code, self.received = code, received


@dataclass(frozen=True)
class Answer:
    """A whole, capped answer: its status, headers and body."""

    status_code: int
    headers: httpx.Headers
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class _Body:
    """The body as it arrives, refused past `limit` bytes."""

    def __init__(self, response: httpx.Response, limit: int) -> None:
        self.code, self.limit = response.status_code, limit
        self.parts: list[bytes] = []
        self.size = 0
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise CappedReadError(
                f"answer encoded as {encoding!r}; only identity is read", self.code
            )
        length = response.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > limit:
            raise CappedReadError(self._too_large(f"announces {int(length)} bytes"), self.code)

    def _too_large(self, what: str) -> str:
        return f"answer {what}, more than the {self.limit}-byte cap"

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise CappedReadError(self._too_large("is larger"), self.code, self.size)
        self.parts.append(chunk)

    def answer(self, response: httpx.Response) -> Answer:
        return Answer(response.status_code, response.headers, b"".join(self.parts))


def _late(seconds: float, body: _Body | None) -> CappedReadError:
    code, size = (body.code, body.size) if body is not None else (None, 0)
    return CappedReadError(f"no complete answer within {seconds:g} s", code, size)


def read_answer(
    http: httpx.Client, request: httpx.Request, *, max_bytes: int, seconds: float
) -> Answer:
    """Send `request` and read its answer whole, within `max_bytes` and about `seconds`.

    Blocking: the deadline is checked after every read, and the request's own timeouts should
    not exceed `seconds` (then the call ends within one read timeout of the deadline).
    `httpx.HTTPError` passes through; the cap and the deadline raise `CappedReadError`.
    """
    deadline = time.monotonic() + seconds
    body: _Body | None = None
    response = http.send(request, stream=True, follow_redirects=False)
    try:
        body = _Body(response, max_bytes)
        for chunk in response.iter_raw():
            body.add(chunk)
            if time.monotonic() > deadline:
                raise _late(seconds, body)
        if time.monotonic() > deadline:
            raise _late(seconds, body)
        return body.answer(response)
    finally:
        response.close()


async def read_answer_async(
    http: httpx.AsyncClient, request: httpx.Request, *, max_bytes: int, seconds: float
) -> Answer:
    """The same for asyncio: the whole request is cancelled at `seconds`."""
    body: _Body | None = None
    try:
        async with asyncio.timeout(seconds):
            response = await http.send(request, stream=True, follow_redirects=False)
            try:
                body = _Body(response, max_bytes)
                async for chunk in response.aiter_raw():
                    body.add(chunk)
                return body.answer(response)
            finally:
                await response.aclose()
    except TimeoutError:
        raise _late(seconds, body) from None
