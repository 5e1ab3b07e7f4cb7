"""The operator's own Prometheus metrics, served on their own port (not kopf's liveness port).

- ``malleus_operator_replans_total{namespace,job}``: plans the trainers acknowledged;
- ``malleus_operator_replan_failures_total{namespace,job}``: planning/publishing failures;
- ``malleus_operator_planning_seconds``: planner wall time (initial plans and re-plans);
- ``malleus_operator_jobs{phase}``: jobs this operator sees, by phase (computed at scrape time
  from `PHASES`, so a deleted job never leaves a stale count behind);
- ``malleus_operator_pod_failures_total{namespace,job}``.

A dedicated registry (not prometheus-client's global one) keeps tests and other libraries from
colliding with these names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "PHASES",
    "PLANNING_SECONDS",
    "POD_FAILURES",
    "REGISTRY",
    "REPLANS",
    "REPLAN_FAILURES",
    "PhaseTracker",
    "serve",
]

REGISTRY = CollectorRegistry(auto_describe=True)

REPLANS = Counter(
    "malleus_operator_replans",
    "Re-plans applied by the trainers (acknowledged).",
    ["namespace", "job"],
    registry=REGISTRY,
)
REPLAN_FAILURES = Counter(
    "malleus_operator_replan_failures",
    "Re-plans that failed (planning, validation, publishing or acknowledgement).",
    ["namespace", "job"],
    registry=REGISTRY,
)
POD_FAILURES = Counter(
    "malleus_operator_pod_failures",
    "Worker pods seen failed.",
    ["namespace", "job"],
    registry=REGISTRY,
)
PLANNING_SECONDS = Histogram(
    "malleus_operator_planning_seconds",
    "Wall seconds of one planner run.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)

_ALL_PHASES = ("Pending", "Planning", "Running", "Replanning", "Succeeded", "Failed")


class PhaseTracker(Collector):
    """Last known phase per job, exported as a gauge per phase when scraped."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def set(self, namespace: str, job: str, phase: str | None) -> None:
        with self._lock:
            if phase:
                self._phases[(namespace, job)] = phase
            else:
                self._phases.pop((namespace, job), None)

    def forget(self, namespace: str, job: str) -> None:
        self.set(namespace, job, None)

    def counts(self) -> dict[str, int]:
        with self._lock:
            values = list(self._phases.values())
        counts = dict.fromkeys(_ALL_PHASES, 0)
        for phase in values:
            counts[phase] = counts.get(phase, 0) + 1
        return counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "malleus_operator_jobs",
            "MalleusJobs seen by this operator, by phase.",
            labels=["phase"],
        )
        for phase, count in self.counts().items():
            family.add_metric([phase], count)
        yield family


PHASES = PhaseTracker()
REGISTRY.register(PHASES)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` of `REGISTRY` on ``addr:port`` in a daemon thread (0 = off)."""
    if port:
        start_http_server(port, addr=addr, registry=REGISTRY)
