"""Rates from Prometheus (PromQL over the trainers' metrics and NVIDIA DCGM's), as a RateSource.

For clusters where Prometheus already scrapes the trainer pods and the DCGM exporter: the
operator then reads one API instead of every pod. The straggling rate stays the trainers'
measurement; DCGM only *corroborates* it (an SM clock well below the job's fastest GPU, or a
thermal/power clock-event reason), reported as evidence on the StragglerDetected event so a
person sees why a GPU is slow. It does not change the decision: a GPU can be slow with full
clocks (a bad NVLink, a noisy neighbour), and a throttled GPU shows in its rate anyway.

Labels: the trainers name their job in `malleus_job` (not `job`, Prometheus' own target label).
DCGM-exporter series name the workload pod in `pod`/`namespace`; scraped with
`honorLabels: false`, as NVIDIA's GPU Operator does, those clash with the target's own labels
(the exporter's pod) and Prometheus renames them `exported_pod`/`exported_namespace`. The DCGM
queries match either style, and the workload pod is `exported_pod` where it exists.

Ownership: every worker pod publishes its own ranks' figures (the trainers' pod page; an older
or misbehaving pod may publish more), and Prometheus stamps each series with the `pod` and
`namespace` it scraped it from. A rate is read from the pod that holds its
rank only (`own_rank_series`): a pod cannot speak for GPUs that are not its own. Pod names are
matched exactly (with the job's name: ``<job>-node-<n>``, ``n`` without leading zeros, so
``train-node-01`` is nobody) and, with the namespace, a series from another namespace is
nobody's either; the query already selects both, this is the second check. Series without a
`pod` label are dropped, with a warning. Steps are believed only forward and plausibly
(`steps.StepGuard`).

Auth and TLS: a bearer token (`Authorization: Bearer`) and a CA bundle (PEM) for the server's
certificate, as Thanos, OpenShift's and managed Prometheus need. Redirects are never followed
(one would carry the token to wherever it points, past the operator's URL allowlist), and every
answer is read under a byte cap and one deadline per query (`malleus.control.capped`).
Everything but `PrometheusSource._query` is a pure function of JSON; tests/prometheus runs the
whole against a real Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from malleus.control.capped import (
    IDENTITY,
    MAX_RESPONSE_BYTES,
    CappedReadError,
    read_answer_async,
)

from .ports import Observation
from .sources import CALIBRATION_METRICS, calibration_from_samples
from .steps import StepGuard

__all__ = [
    "CLOCK_EVENT_REASONS",
    "THROTTLE_MASK",
    "PromQueries",
    "PrometheusError",
    "PrometheusSource",
    "dcgm_evidence",
    "decode_clock_reasons",
    "default_queries",
    "observation_from_results",
    "own_rank_series",
    "parse_vector",
    "pod_gpu_rank",
    "query_url",
    "worker_pod_regex",
]

CLOCK_EVENT_REASONS: Mapping[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""NVML clock event (throttle) reason bits, as DCGM_FI_DEV_CLOCKS_EVENT_REASONS reports them."""
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""The reasons that mean the GPU is being slowed down (power, thermal, hardware)."""

Sample = tuple[dict[str, str], float]

log = logging.getLogger(__name__)


def _quote(value: str) -> str:
    """A PromQL string literal (Go escaping: backslash and double quote)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


JOB_LABEL = "malleus_job"


def _scope(pod_regex: str, namespace: str | None, prefix: str = "") -> str:
    """Matchers for the job's pods (and namespace), on `pod` or, with `prefix`, `exported_pod`."""
    matchers = [f"{prefix}pod=~{_quote(pod_regex)}"]
    if namespace:
        matchers.append(f"{prefix}namespace={_quote(namespace)}")
    return ",".join(matchers)


@dataclass(frozen=True)
class PromQueries:
    """The PromQL of one observation; `sm_clock` / `clock_reasons` None = no DCGM."""

    rates: str
    step: str
    step_seconds: str
    generation: str
    sm_clock: str | None = None
    clock_reasons: str | None = None
    calibration: str | None = None
    """The coordinator's calibration series (the cost model's measured terms, link rates)."""


def default_queries(
    job: str,
    *,
    namespace: str | None = None,
    pod_regex: str | None = None,
    coordinator_pod: str | None = None,
    sm_clock_metric: str | None = "DCGM_FI_DEV_SM_CLOCK",
    clock_reasons_metric: str | None = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
) -> PromQueries:
    """Queries for MalleusJob `job`; every series (the trainers' and DCGM's) selected by the
    job's pods (`pod_regex`, default `<job>-.*`) and, when given, `namespace`.

    The `malleus_job` label alone is the trainers' own claim, which any pod can make: `pod`
    and `namespace` are the target labels Prometheus attaches from service discovery (with
    `honor_labels: false` a series cannot set them itself), so another team's pod cannot feed
    this job's rates. DCGM's `exported_pod` is the exporter's claim (any scraped pod could make
    it): it only corroborates, as evidence on an event, and never steers a decision.

    `coordinator_pod`: the pod whose trainers own the step and the plan generation; when given,
    those figures are read from it alone, so that another of the job's pods (a compromised
    worker) cannot inflate them through `max()`."""

    regex = pod_regex or re.escape(job) + "-.*"
    trainer = "{" + f"{JOB_LABEL}={_quote(job)}," + _scope(regex, namespace) + "}"
    dcgm_styles = (
        "{" + _scope(regex, namespace) + "}",
        "{" + _scope(regex, namespace, "exported_") + "}",
    )

    owner = trainer
    if coordinator_pod is not None:
        owner = "{" + f"{JOB_LABEL}={_quote(job)}," + f"pod={_quote(coordinator_pod)}"
        owner += f",namespace={_quote(namespace)}}}" if namespace else "}"

    def dcgm(metric: str | None) -> str | None:
        return " or ".join(f"{metric}{sel}" for sel in dcgm_styles) if metric else None

    return PromQueries(
        rates=f"max by (rank, pod, namespace) (malleus_gpu_straggling_rate{trainer})",
        step=f"max(malleus_step{owner})",
        step_seconds=f"max(malleus_step_seconds{owner})",
        generation=f"max(malleus_plan_generation{owner})",
        sm_clock=dcgm(sm_clock_metric),
        clock_reasons=dcgm(clock_reasons_metric),
        calibration="{" + f'__name__=~"{"|".join(CALIBRATION_METRICS)}",' + owner[1:],
    )


def query_url(base_url: str, promql: str) -> str:
    """The instant-query URL of the Prometheus HTTP API."""
    return f"{base_url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": promql})


def parse_vector(payload: Mapping[str, Any]) -> list[Sample]:
    """(labels, value) of an instant-vector (or scalar) answer; raises on an error answer."""
    if payload.get("status") != "success":
        raise RuntimeError(
            f"Prometheus query failed: {payload.get('errorType', '?')}: {payload.get('error', '')}"
        )
    data = payload.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return [({}, float(result[1]))]
    if kind != "vector":
        raise RuntimeError(f"expected an instant vector, got {kind!r}")
    return [(dict(item.get("metric", {})), float(item["value"][1])) for item in result]


def decode_clock_reasons(mask: int) -> list[str]:
    """Names of the set reason bits."""
    return [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]


def worker_pod_regex(job: str) -> str:
    """The PromQL regex of `job`'s worker pods, exactly: ``<job>-node-<n>``, ``n`` without
    leading zeros (PromQL regexes are anchored)."""
    return re.escape(job) + "-node-(0|[1-9][0-9]*)"


def _node_of(pattern: str, job: str | None) -> Callable[[str], int | None]:
    """node(pod name): the worker's node index, or None when the name is not one of the job's
    (with `job`: exactly ``<job>-node-<n>``; else `pattern`'s group); never a number written
    with leading zeros, so ``x-node-01`` is not node 1."""
    rx = re.compile(worker_pod_regex(job) if job is not None else pattern)

    def node(pod: str) -> int | None:
        m = rx.fullmatch(pod) if job is not None else rx.search(pod)
        if m is None:
            return None
        digits = m.group(1)
        if not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
            return None
        return int(digits)

    return node


def pod_gpu_rank(
    gpus_per_node: int,
    pattern: str = r"-(\d+)$",
    *,
    job: str | None = None,
    namespace: str | None = None,
) -> Callable[[Mapping[str, str]], int | None]:
    """rank_of(labels) for DCGM series: node index from the workload pod's name (`exported_pod`
    where Prometheus renamed it, else `pod`; exactly ``<job>-node-<n>`` with `job`, else
    `pattern`'s trailing number), GPU index from the `gpu` label (one worker pod per node).
    With `namespace`, the workload's namespace (`exported_namespace` beside an
    `exported_pod`) must be it."""
    node_of = _node_of(pattern, job)

    def rank_of(labels: Mapping[str, str]) -> int | None:
        exported = "exported_pod" in labels
        pod = labels.get("exported_pod") if exported else labels.get("pod")
        where = labels.get("exported_namespace" if exported else "namespace")
        if namespace is not None and where != namespace:
            return None
        node = node_of(pod or "")
        gpu = labels.get("gpu")
        if node is None or gpu is None or not gpu.isdigit():
            return None
        return node * gpus_per_node + int(gpu)

    return rank_of


def own_rank_series(
    gpus_per_node: int,
    pattern: str = r"-(\d+)$",
    *,
    job: str | None = None,
    namespace: str | None = None,
) -> Callable[[Mapping[str, str]], bool]:
    """keep(labels) for rate series: true when the series' `pod` (node index from the pod name:
    exactly ``<job>-node-<n>`` with `job`, else `pattern`'s trailing number; one worker pod per
    node) holds its `rank`, and, with `namespace`, the series' `namespace` is it."""
    node_of = _node_of(pattern, job)

    def keep(labels: Mapping[str, str]) -> bool:
        if namespace is not None and labels.get("namespace") != namespace:
            return False
        node = node_of(labels.get("pod", ""))
        rank = labels.get("rank", "")
        return node is not None and rank.isdigit() and int(rank) // gpus_per_node == node

    return keep


def dcgm_evidence(
    sm_clock: list[Sample],
    clock_reasons: list[Sample],
    rank_of: Callable[[Mapping[str, str]], int | None],
    *,
    clock_drop: float = 0.1,
) -> dict[int, str]:
    """rank -> why DCGM thinks it is slow: SM clock `clock_drop` or more below the job's fastest
    GPU, and/or throttle reasons set."""
    notes: dict[int, list[str]] = {}
    clocks = {r: v for labels, v in sm_clock if (r := rank_of(labels)) is not None}
    peak = max(clocks.values(), default=0.0)
    for rank, mhz in clocks.items():
        if peak > 0 and mhz < (1 - clock_drop) * peak:
            notes.setdefault(rank, []).append(
                f"SM clock {mhz:.0f} MHz, {mhz / peak:.0%} of the job's fastest"
            )
    for labels, value in clock_reasons:
        rank = rank_of(labels)
        if rank is None or not math.isfinite(value):
            continue
        throttle = int(value) & THROTTLE_MASK
        if throttle:
            notes.setdefault(rank, []).append(
                "throttled: " + ", ".join(decode_clock_reasons(throttle))
            )
    return {r: "; ".join(v) for r, v in sorted(notes.items())}


def observation_from_results(
    rates: list[Sample],
    step: list[Sample],
    step_seconds: list[Sample],
    generation: list[Sample],
    evidence: Mapping[int, str] | None = None,
    keep: Callable[[Mapping[str, str]], bool] | None = None,
    calibration: list[Sample] | None = None,
) -> Observation | None:
    """An Observation from the answers of the queries; None when no step has been reported.
    `keep` (e.g. `own_rank_series`) drops the rate series it refuses; `calibration`: the
    answer of the calibration query."""
    if not step or not math.isfinite(step[0][1]):
        return None
    seconds = step_seconds[0][1] if step_seconds else math.nan
    cal, links = calibration_from_samples(
        (labels.get("__name__", ""), labels, value) for labels, value in calibration or ()
    )
    out: dict[int, float | None] = {}
    for labels, value in rates:
        if labels.get("rank", "").isdigit() and (keep is None or keep(labels)):
            out[int(labels["rank"])] = value if math.isfinite(value) else None
    return Observation(
        step=int(step[0][1]),
        step_seconds=seconds if math.isfinite(seconds) and seconds > 0 else None,
        rates=out,
        generation=int(generation[0][1]) if generation else 0,
        evidence=dict(evidence or {}),
        calibration=cal,
        link_rates=links,
    )


class PrometheusError(RuntimeError):
    """A query that got no usable answer: unreachable, refused (the HTTP status), redirected
    (never followed), too large or too slow (`malleus.control.capped`)."""


class PrometheusSource:
    """RateSource over the Prometheus HTTP API; polls until a new, plausible step appears."""

    def __init__(
        self,
        url: str,
        queries: PromQueries,
        *,
        rank_of: Callable[[Mapping[str, str]], int | None] | None = None,
        keep: Callable[[Mapping[str, str]], bool] | None = None,
        interval: float = 5.0,
        timeout: float = 10.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        bearer_token: str | None = None,
        ca_pem: str | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        """`bearer_token` is sent on every query, to `url` only (no redirect is followed);
        `ca_pem` (PEM certificates) replaces the system's trust store for an https `url`;
        `timeout` bounds each whole query and `max_bytes` each answer."""
        self.url = url
        self._headers = {**IDENTITY}
        if bearer_token:
            self._headers["Authorization"] = f"Bearer {bearer_token}"
        self._ssl = (
            ssl.create_default_context(cadata=ca_pem) if ca_pem else ssl.create_default_context()
        )
        self.queries = queries
        self.rank_of = rank_of
        self.keep = keep
        self._warned = False
        self.interval = interval
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._sleep = sleep
        self._steps = StepGuard(what=f"Prometheus {url}")

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            verify=self._ssl, timeout=httpx.Timeout(self.timeout), follow_redirects=False
        )

    async def _query(self, http: httpx.AsyncClient, promql: str) -> list[Sample]:
        url = query_url(self.url, promql)
        try:
            request = http.build_request("GET", url, headers=self._headers)
            answer = await read_answer_async(
                http, request, max_bytes=self.max_bytes, seconds=self.timeout
            )
        except (httpx.HTTPError, CappedReadError) as e:
            raise PrometheusError(f"{self.url}: {type(e).__name__}: {e}") from e
        code = answer.status_code
        if 300 <= code < 400:
            where = answer.headers.get("Location", "?")
            raise PrometheusError(
                f"{self.url}: HTTP {code} to {where}: redirects are not followed (set "
                "spec.metrics.prometheus.url to where the server answers)"
            )
        try:
            payload = answer.json()
        except ValueError:
            payload = None
        if code != 200 and not (isinstance(payload, dict) and payload.get("status") == "error"):
            raise PrometheusError(f"{self.url}: HTTP {code}: {answer.text[:200]}")
        if not isinstance(payload, dict):
            raise PrometheusError(f"{self.url}: HTTP {code}: not a JSON object")
        return parse_vector(payload)

    async def _observe(self) -> Observation | None:
        q = self.queries
        async with self._client() as http:
            rates, step, seconds, generation = await asyncio.gather(
                self._query(http, q.rates),
                self._query(http, q.step),
                self._query(http, q.step_seconds),
                self._query(http, q.generation),
            )
            evidence: dict[int, str] = {}
            if self.rank_of is not None and (q.sm_clock or q.clock_reasons):
                clocks = await self._query(http, q.sm_clock) if q.sm_clock else []
                reasons = await self._query(http, q.clock_reasons) if q.clock_reasons else []
                evidence = dcgm_evidence(clocks, reasons, self.rank_of)
            cal = await self._query(http, q.calibration) if q.calibration else None
        refused = sorted({m.get("pod", "?") for m, _ in rates if self.keep and not self.keep(m)})
        if refused and not self._warned:
            self._warned = True
            log.warning("rate series from pods that do not hold their rank dropped: %s", refused)
        return observation_from_results(rates, step, seconds, generation, evidence, self.keep, cal)

    async def read(self) -> Observation | None:
        while True:
            obs = await self._observe()
            if obs is not None and self._steps.accept(obs.step):
                return obs
            await self._sleep(self.interval)
