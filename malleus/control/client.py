"""The trainers' control API: the typed `/status` body and the one client.

Rank 0's control endpoint (``trainer/endpoint/server.py``) serves `ControlStatus` at ``GET /status``
and takes plans, stop requests and injections; the controller's sources and sinks, the local
runner and the operator read and write it only through `ControlClient` (blocking) or
`AsyncControlClient` (asyncio), so no reader guesses keys and every failure arrives as one of
three exceptions:

- `BadInput` (400): the trainers refused what was sent; ``faults`` hold their reasons;
- `PlanConflict` (409): a plan's generation is not newer than the trainers'; it carries the
  generation in force so the caller can resynchronise;
- `ControlError`: nothing answered, or an answer the contract does not allow.

Over HTTPS (a trainer in a pod serves the job's certificate) a client trusts only what its
`ControlTLS` names: the job's own CA, never the system's store and never no verification.

Every call sends the bearer token when the client has one (the endpoint wants it for everything
but ``/healthz`` and ``/metrics``), and every answer is read under a byte cap (``max_bytes``,
`MAX_RESPONSE_BYTES` by default) and one deadline for the whole request (``timeout``), never
whole and never for as long as the server likes (`malleus.control.capped`): a coordinator runs
the job author's image, and a 400 MiB ``/status`` must cost its reader a `ControlError`, not
its memory. Redirects are never followed.

Torch-free and in `malleus.control` so that the trainer serves the very model its readers
parse.

Layout: this module holds the clients, their exceptions and `ControlTLS`; the models of the
``/status`` body (`ControlStatus` and its records) are `malleus.control.status`'s. Import
either from `malleus.control`.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Self

import httpx
from pydantic import ValidationError

from malleus.errors import BadInput, Fault
from malleus.planner.plan import Plan

from .capped import (
    IDENTITY,
    MAX_RESPONSE_BYTES,
    Answer,
    CappedReadError,
    read_answer,
    read_answer_async,
)
from .status import ControlStatus

__all__ = [
    "JOB_METRICS_PATH",
    "MAX_RESPONSE_BYTES",
    "AsyncControlClient",
    "ControlClient",
    "ControlError",
    "ControlTLS",
    "PlanConflict",
]

JOB_METRICS_PATH = "/metrics/job"
"""The job's metrics page: every rank's series as the serving rank knows them (the coordinator
knows all). ``/metrics`` is the pod's own: in a pod, only that pod's ranks (what Prometheus
scrapes, one target per worker pod)."""


class ControlError(RuntimeError):
    """The endpoint could not be reached, or answered outside the contract.

    ``code`` is the HTTP status (None when nothing answered); ``url`` the endpoint called.
    """

    def __init__(self, url: str, message: str, code: int | None = None) -> None:
        self.url, self.code = url, code
        super().__init__(f"{url}: {message}" if code is None else f"{url}: HTTP {code}: {message}")


class PlanConflict(ControlError):
    """``POST /plan`` answered 409: the plan's generation is not newer than the trainers'.

    ``generation`` is the generation in force on the trainers; ``newest`` the highest they
    know (in force, being applied or pending), which a new plan's generation must exceed.
    """

    def __init__(self, url: str, message: str, generation: int, newest: int) -> None:
        super().__init__(url, message, 409)
        self.generation, self.newest = generation, newest


@dataclass(frozen=True)
class ControlTLS:
    """How a client verifies an HTTPS control endpoint: against the job's CA alone.

    ``ca``: the CA certificate as PEM text (what the job's Secret holds under ``ca.crt``) or a
    file holding it. ``server_name``: the name the server's certificate must carry when it is
    not the URL's host, e.g. the pod's stable DNS name while the URL reaches it by IP or
    through a port-forward; the certificate is then checked for that name (and it is sent as
    the TLS server name), so a reachable address is never mistaken for the right server.
    """

    ca: str | os.PathLike[str]
    server_name: str | None = None

    @cached_property
    def context(self) -> ssl.SSLContext:
        """A client context trusting only ``ca``, checking the host name (TLS 1.2+)."""
        if isinstance(self.ca, str) and "-----BEGIN" in self.ca:
            ctx = ssl.create_default_context(cadata=self.ca)
        else:
            ctx = ssl.create_default_context(cafile=os.fspath(self.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def _decode(response: Answer) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"error": response.text.strip()}


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return str(body)[:200]


_WHAT = {"/plan": "plan", "/stop": "stop request", "/inject": "injection"}
"""What a 400 answer to each write refused, for the first line of its `BadInput`."""


def _bad_input(url: str, path: str, body: Any) -> BadInput:
    """A 400 answer as `BadInput`: the server's faults, else its one error message."""
    faults: list[Fault] = []
    if isinstance(body, dict) and isinstance(body.get("faults"), list):
        faults = [
            Fault(str(f.get("path", "")), str(f.get("message", "")))
            for f in body["faults"]
            if isinstance(f, dict)
        ]
    return BadInput(faults or [Fault("", _message(body))], url, what=_WHAT.get(path, "request"))


class _Calls:
    """What both clients share: URLs, headers, and reading each answer into the contract."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout: float,
        tls: ControlTLS | None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token or None
        self.timeout = timeout
        """Seconds one whole request may take (connect, send, headers and body)."""
        self.max_bytes = max_bytes
        """The largest answer read; a larger one is a `ControlError`."""
        # Control endpoints are pod-to-pod or localhost: an environment proxy would be wrong.
        # Without `tls` an https URL is verified against the system's CAs, which never sign
        # a job's certificate: such a client is refused, it does not fall back to trusting.
        self._options: dict[str, Any] = {
            "base_url": self.base_url,
            "timeout": httpx.Timeout(timeout),
            "trust_env": False,
            "follow_redirects": False,
        }
        if tls is not None:
            self._options["verify"] = tls.context
        self._extensions: dict[str, Any] = (
            {"sni_hostname": tls.server_name} if tls is not None and tls.server_name else {}
        )

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _build(
        self, http: httpx.Client | httpx.AsyncClient, method: str, path: str, body: bytes | None
    ) -> httpx.Request:
        headers = {**IDENTITY, **(_JSON if body is not None else {}), **self._auth()}
        return http.build_request(
            method,
            self._url(path),
            content=body,
            headers=headers,
            extensions=self._extensions,
        )

    def _expect(self, response: Answer, path: str, code: int) -> None:
        """Nothing when the answer is `code`; otherwise the exception the answer means."""
        if response.status_code == code:
            return
        url, body = self._url(path), _decode(response)
        if response.status_code == 400:
            raise _bad_input(url, path, body)
        raise ControlError(url, _message(body), response.status_code)

    def _status(self, response: Answer) -> ControlStatus:
        self._expect(response, "/status", 200)
        try:
            return ControlStatus.model_validate_json(response.content)
        except ValidationError as e:
            raise ControlError(self._url("/status"), f"not a ControlStatus: {e}", 200) from e

    def _plan(self, response: Answer) -> Plan | None:
        if response.status_code == 404:
            return None
        self._expect(response, "/plan", 200)
        try:
            return Plan.model_validate_json(response.content)
        except ValidationError as e:
            raise ControlError(self._url("/plan"), f"not a Plan: {e}", 200) from e

    def _accepted(self, response: Answer) -> int:
        url = self._url("/plan")
        if response.status_code == 409:
            body = _decode(response)
            try:
                generation, newest = int(body["generation"]), int(body["newest"])
            except (KeyError, TypeError, ValueError) as e:
                raise ControlError(url, f"409 without generations: {body!r}", 409) from e
            raise PlanConflict(url, _message(body), generation, newest)
        self._expect(response, "/plan", 202)
        body = _decode(response)
        try:
            return int(body["generation"])
        except (KeyError, TypeError, ValueError) as e:
            raise ControlError(url, f"202 without a generation: {body!r}", 202) from e

    def _unreachable(self, path: str, error: httpx.HTTPError | CappedReadError) -> ControlError:
        if isinstance(error, CappedReadError):
            return ControlError(self._url(path), str(error), error.code)
        return ControlError(self._url(path), f"{type(error).__name__}: {error}")


def _plan_body(plan: Plan) -> bytes:
    return plan.model_dump_json().encode()


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


_JSON = {"Content-Type": "application/json"}


class ControlClient(_Calls):
    """Blocking client of one control endpoint (``http(s)://host:port``); a context manager.

    Sends ``Authorization: Bearer <token>`` on every call; `tls` says whom to trust over
    HTTPS; ``timeout`` bounds each whole request (checked after every read: it ends within
    one read of it) and ``max_bytes`` each answer.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 5.0,
        tls: ControlTLS | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        super().__init__(base_url, token, timeout, tls, max_bytes)
        self._http = httpx.Client(**self._options)

    def _call(self, method: str, path: str, body: bytes | None = None) -> Answer:
        try:
            request = self._build(self._http, method, path, body)
            return read_answer(self._http, request, max_bytes=self.max_bytes, seconds=self.timeout)
        except (httpx.HTTPError, CappedReadError) as e:
            raise self._unreachable(path, e) from e

    def healthz(self) -> bool:
        """Whether the endpoint answers ``GET /healthz`` with 200 (False when unreachable)."""
        try:
            return self._call("GET", "/healthz").status_code == 200
        except ControlError:
            return False

    def status(self) -> ControlStatus:
        return self._status(self._call("GET", "/status"))

    def plan(self) -> Plan | None:
        """The plan in force on the trainers (``GET /plan``); None before the first."""
        return self._plan(self._call("GET", "/plan"))

    def metrics_text(self, *, job_wide: bool = False) -> str:
        """The Prometheus exposition of ``GET /metrics`` (the pod's), or with `job_wide` of
        ``GET /metrics/job`` (every rank's)."""
        path = JOB_METRICS_PATH if job_wide else "/metrics"
        response = self._call("GET", path)
        self._expect(response, path, 200)
        return response.text

    def post_plan(self, plan: Plan) -> int:
        """Hand `plan` to the coordinator; the accepted generation (applied at a step boundary)."""
        return self._accepted(self._call("POST", "/plan", _plan_body(plan)))

    def stop(self, checkpoint: bool = True) -> None:
        """Stop at the next step boundary, after writing a checkpoint when `checkpoint`."""
        body = _json({"checkpoint": checkpoint})
        self._expect(self._call("POST", "/stop", body), "/stop", 202)

    def inject(self, rank: int, factor: float) -> None:
        """Slow `rank` down by `factor` from the next step on (emulated clock only)."""
        body = _json({"rank": rank, "factor": factor})
        self._expect(self._call("POST", "/inject", body), "/inject", 200)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncControlClient(_Calls):
    """The same calls as `ControlClient`, for asyncio code; usable as ``async with``. Each
    request is cancelled at ``timeout``."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 5.0,
        tls: ControlTLS | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        super().__init__(base_url, token, timeout, tls, max_bytes)
        self._http = httpx.AsyncClient(**self._options)

    async def _call(self, method: str, path: str, body: bytes | None = None) -> Answer:
        try:
            request = self._build(self._http, method, path, body)
            return await read_answer_async(
                self._http, request, max_bytes=self.max_bytes, seconds=self.timeout
            )
        except (httpx.HTTPError, CappedReadError) as e:
            raise self._unreachable(path, e) from e

    async def healthz(self) -> bool:
        """Whether the endpoint answers ``GET /healthz`` with 200 (False when unreachable)."""
        try:
            return (await self._call("GET", "/healthz")).status_code == 200
        except ControlError:
            return False

    async def status(self) -> ControlStatus:
        return self._status(await self._call("GET", "/status"))

    async def plan(self) -> Plan | None:
        """The plan in force on the trainers (``GET /plan``); None before the first."""
        return self._plan(await self._call("GET", "/plan"))

    async def metrics_text(self, *, job_wide: bool = False) -> str:
        """The Prometheus exposition of ``GET /metrics`` (the pod's), or with `job_wide` of
        ``GET /metrics/job`` (every rank's)."""
        path = JOB_METRICS_PATH if job_wide else "/metrics"
        response = await self._call("GET", path)
        self._expect(response, path, 200)
        return response.text

    async def post_plan(self, plan: Plan) -> int:
        """Hand `plan` to the coordinator; the accepted generation (applied at a step boundary)."""
        return self._accepted(await self._call("POST", "/plan", _plan_body(plan)))

    async def stop(self, checkpoint: bool = True) -> None:
        """Stop at the next step boundary, after writing a checkpoint when `checkpoint`."""
        body = _json({"checkpoint": checkpoint})
        self._expect(await self._call("POST", "/stop", body), "/stop", 202)

    async def inject(self, rank: int, factor: float) -> None:
        """Slow `rank` down by `factor` from the next step on (emulated clock only)."""
        body = _json({"rank": rank, "factor": factor})
        self._expect(await self._call("POST", "/inject", body), "/inject", 200)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
