"""The operator's rate sources: the controller's HTTP and Prometheus ones, pointed at a job.

The decision loop's ports (`malleus.controller`) already read the coordinator's ``/metrics``
(`TrainerScrapeSource`) or PromQL over the trainers' and DCGM's series (`PrometheusSource`).
The operator only aims them: at node 0 through the headless Service, or at the Prometheus of
``spec.metrics.prometheus`` with selectors for this job's pods, reading each rank's rate from
the series its own pod published. `TrackingSource` keeps the last
observation for the status (step, tokens/s) and ends the loop when the job is over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from malleus.control import MAX_RESPONSE_BYTES, ControlTLS
from malleus.controller.ports import Observation, RateSource
from malleus.controller.prometheus import (
    PrometheusSource,
    default_queries,
    own_rank_series,
    pod_gpu_rank,
    worker_pod_regex,
)
from malleus.controller.sources import TrainerScrapeSource
from malleus.job import ResolvedJob

from . import resources

__all__ = [
    "CREDENTIALS_LABEL",
    "PrometheusAuthError",
    "TrackingSource",
    "prometheus_credentials",
    "rate_source",
]


CREDENTIALS_LABEL = "malleus.io/prometheus-credentials"
"""The label (value ``"true"``) a Secret must carry before the operator reads it for a job's
``spec.metrics.prometheus``. The operator can read every Secret of a watched namespace, a job
author need not be able to (the chart's ``malleus-edit`` cannot): without the Secret owner's
consent, a job naming any Secret would have the operator read it on the author's behalf and
send it as a bearer token (a confused deputy)."""


class PrometheusAuthError(RuntimeError):
    """A Secret or ConfigMap that spec.metrics.prometheus names is missing, lacks the key, or
    (a Secret) does not carry `CREDENTIALS_LABEL`."""


class _Reader(Protocol):
    async def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None: ...


async def prometheus_credentials(
    cluster: _Reader, namespace: str, job: ResolvedJob
) -> tuple[str | None, str | None]:
    """(bearer token, CA bundle PEM) that ``spec.metrics.prometheus`` names, read by name from
    the job's own namespace; (None, None) when it names neither."""
    prom = job.spec.metrics.prometheus
    if prom is None:
        return None, None
    token = ca = None
    if (ref := prom.bearer_token_secret) is not None:
        await _check_consent(
            cluster, namespace, ref.name, "spec.metrics.prometheus.bearerTokenSecret"
        )
        token = await cluster.read_secret_value(namespace, ref.name, ref.key)
        if not token:
            raise PrometheusAuthError(f"Secret {namespace}/{ref.name} has no key {ref.key!r}")
        token = token.strip()
    tls_spec = prom.tls
    if tls_spec is not None and (ref := tls_spec.ca_secret) is not None:
        await _check_consent(cluster, namespace, ref.name, "spec.metrics.prometheus.tls.caSecret")
        ca = await cluster.read_secret_value(namespace, ref.name, ref.key)
        if not ca:
            raise PrometheusAuthError(f"Secret {namespace}/{ref.name} has no key {ref.key!r}")
    elif tls_spec is not None and (ref := tls_spec.ca_config_map) is not None:
        cm = await cluster.read("ConfigMap", namespace, ref.name) or {}
        ca = (cm.get("data") or {}).get(ref.key)
        if not ca:
            raise PrometheusAuthError(f"ConfigMap {namespace}/{ref.name} has no key {ref.key!r}")
    return token, ca


async def _check_consent(cluster: _Reader, namespace: str, name: str, field: str) -> None:
    """PrometheusAuthError unless Secret ``name`` exists and carries `CREDENTIALS_LABEL`."""
    secret = await cluster.read("Secret", namespace, name)
    if secret is None:
        raise PrometheusAuthError(f"{field}: Secret {namespace}/{name} does not exist")
    labels = (secret.get("metadata") or {}).get("labels") or {}
    if labels.get(CREDENTIALS_LABEL) != "true":
        raise PrometheusAuthError(
            f"{field}: Secret {namespace}/{name} is not labelled {CREDENTIALS_LABEL}=true; "
            "the operator reads only Secrets their owners mark for it (kubectl -n "
            f"{namespace} label secret {name} {CREDENTIALS_LABEL}=true)"
        )


class TrackingSource:
    """A RateSource that remembers what it returned and stops when ``ended()``."""

    def __init__(self, inner: RateSource, ended: Callable[[], bool] = lambda: False) -> None:
        self.inner = inner
        self.ended = ended
        self.latest: Observation | None = None

    async def read(self) -> Observation | None:
        if self.ended():
            return None
        obs = await self.inner.read()
        if obs is None or self.ended():
            return None
        self.latest = obs
        return obs


def rate_source(
    job: ResolvedJob,
    ref: resources.JobRef,
    coordinator_url: str,
    *,
    timeout: float,
    tls: ControlTLS | None = None,
    prometheus_auth: tuple[str | None, str | None] = (None, None),
    coordinator_node: int = 0,
    token: str | None = None,
    max_bytes: int = MAX_RESPONSE_BYTES,
) -> RateSource:
    """The source ``spec.metrics`` asks for: the coordinator's /metrics (verified with
    `tls`, the job's CA; `token`, the job's control token), or Prometheus (with
    `prometheus_auth`, from `prometheus_credentials`), reading the step and generation from
    the coordinator's pod (``coordinator_node``: node 0's until a failure moves the
    coordinator) and each rank's rate from the pod of exactly its node's name in the job's
    namespace. Every answer is read under `max_bytes`."""
    metrics = job.spec.metrics
    interval = float(metrics.scrape_interval_seconds)
    prom = metrics.prometheus
    if metrics.source == "prometheus" and prom is not None and prom.url:
        queries = default_queries(
            ref.name,
            namespace=ref.namespace,
            pod_regex=worker_pod_regex(ref.name),
            coordinator_pod=resources.pod_name(ref.name, coordinator_node),
            sm_clock_metric=prom.dcgm.sm_clock_metric,
            clock_reasons_metric=prom.dcgm.clock_event_reasons_metric,
        )
        return PrometheusSource(
            prom.url,
            queries,
            rank_of=pod_gpu_rank(job.spec.gpus_per_node, job=ref.name, namespace=ref.namespace),
            keep=own_rank_series(job.spec.gpus_per_node, job=ref.name, namespace=ref.namespace),
            interval=interval,
            timeout=timeout,
            bearer_token=prometheus_auth[0],
            ca_pem=prometheus_auth[1],
            max_bytes=max_bytes,
        )
    return TrainerScrapeSource(
        coordinator_url,
        token,
        job=ref.name,
        world=job.world,
        gpus_per_node=job.gpus_per_node,
        interval=interval,
        timeout=timeout,
        tls=tls,
        max_bytes=max_bytes,
    )
