"""The trainers' own HTTP endpoint as RateSource and PlanSink (DESIGN §4.4).

`TrainerScrapeSource` reads the coordinator's `GET /metrics` (it publishes every rank's rate);
`HttpPlanSink` posts plans to `POST /plan` and polls `GET /status` for the switch. Plain urllib
in a worker thread: the local runner has no aiohttp, and the controller must not import the
trainer package (imports run operator -> controller -> planner; the trainer only shares the
Plan contract). The exposition text is parsed by prometheus-client's own parser.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from malleus.planner.plan import Plan

from .ports import Ack, AckTimeout, Observation, PlanRejected

__all__ = [
    "HttpPlanSink",
    "TrainerScrapeSource",
    "ack_from_status",
    "observation_from_metrics",
]

RATE_METRIC = "malleus_gpu_straggling_rate"


def _sample_value(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def observation_from_metrics(text: str, job: str | None = None) -> Observation | None:
    """An Observation from a /metrics page (only `job`'s series if given).

    None when the page has no step yet. A rate series with a NaN value means an unusable rank;
    a rank with no series has no sample (the trainer removes the series of a rank not measured).
    A step time of 0 is the gauge's initial value: not measured.
    """
    from prometheus_client.parser import text_string_to_metric_families

    rates: dict[int, float | None] = {}
    scalars: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if job is not None and sample.labels.get("job", job) != job:
                continue
            if sample.name == RATE_METRIC and "rank" in sample.labels:
                rates[int(sample.labels["rank"])] = _sample_value(sample.value)
            elif sample.name in ("malleus_step", "malleus_step_seconds", "malleus_plan_generation"):
                scalars[sample.name] = sample.value
    if "malleus_step" not in scalars:
        return None
    seconds = scalars.get("malleus_step_seconds")
    return Observation(
        step=int(scalars["malleus_step"]),
        step_seconds=seconds if seconds and math.isfinite(seconds) and seconds > 0 else None,
        rates=rates,
        generation=int(scalars.get("malleus_plan_generation", 0)),
    )


def ack_from_status(status: Mapping[str, Any], generation: int) -> Ack | None:
    """An Ack if the trainer's /status shows `generation` (or newer) in force, else None.

    Raises PlanRejected when the trainer reports that applying this generation failed.
    Reads the metrics snapshot's keys (`plan_generation`, `step`, `migration.{seconds,bytes}`)
    and the plan inbox's (`current_generation`, `last_error`), whichever are present.
    """
    current = status.get("current_generation", status.get("plan_generation"))
    if current is None:
        current = status.get("generation", -1)
    error = status.get("last_error")
    if isinstance(error, str) and error.startswith(f"generation {generation}:"):
        raise PlanRejected(500, error)
    if int(current) < generation:
        return None
    migration = status.get("migration") or {}
    return Ack(
        generation=int(current),
        step=int(status.get("step") or 0),
        migration_seconds=migration.get("seconds", status.get("migration_seconds")),
        migration_bytes=migration.get("bytes", status.get("migration_bytes")),
    )


class _Http:
    """Blocking urllib calls, run in a worker thread so the event loop keeps running."""

    def __init__(self, base_url: str, token: str | None, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base_url + path, data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read()

    async def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        return await asyncio.to_thread(self._call, method, path, body)


class TrainerScrapeSource:
    """RateSource over the coordinator's /metrics: polls until a new step appears."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        job: str | None = None,
        interval: float = 5.0,
        timeout: float = 10.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._http = _Http(url, token, timeout)
        self.job = job
        self.interval = interval
        self._sleep = sleep
        self._last_step = -1

    async def read(self) -> Observation | None:
        while True:
            code, raw = await self._http.call("GET", "/metrics")
            if code != 200:
                raise RuntimeError(f"GET /metrics answered {code}: {raw[:200]!r}")
            obs = observation_from_metrics(raw.decode(), self.job)
            if obs is not None and obs.step > self._last_step:
                self._last_step = obs.step
                return obs
            await self._sleep(self.interval)


class HttpPlanSink:
    """PlanSink over the coordinator's POST /plan and GET /status."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        poll_seconds: float = 0.5,
        timeout: float = 10.0,
    ) -> None:
        self._http = _Http(url, token, timeout)
        self.poll_seconds = poll_seconds

    async def publish(self, plan: Plan) -> int:
        code, raw = await self._http.call("POST", "/plan", plan.model_dump_json().encode())
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"error": raw.decode(errors="replace")}
        if code in (200, 201, 202):
            return int(body.get("generation", plan.generation))
        reasons = body.get("reasons") or []
        raise PlanRejected(code, "; ".join([str(body.get("error", "")), *map(str, reasons)]))

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            code, raw = await self._http.call("GET", "/status")
            if code == 200:
                ack = ack_from_status(json.loads(raw), generation)
                if ack is not None:
                    return ack
            if loop.time() >= deadline:
                raise AckTimeout(f"generation {generation} not in force after {timeout:g} s")
            await asyncio.sleep(min(self.poll_seconds, max(0.0, deadline - loop.time())))
