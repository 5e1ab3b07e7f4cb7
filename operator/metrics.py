"""The operator's own Prometheus metrics, served on their own port (not kopf's liveness port).

- ``malleus_operator_replans_total{namespace,job}``: plans the trainers acknowledged;
- ``malleus_operator_replan_failures_total{namespace,job}``: planning/publishing failures;
- ``malleus_operator_planning_seconds``: planner wall time (initial plans and re-plans);
- ``malleus_operator_jobs{phase}``: jobs this operator sees, by phase (computed at scrape time
  from `PhaseTracker`, so a deleted job never leaves a stale count behind);
- ``malleus_operator_pod_failures_total{namespace,job}``.

One `OperatorMetrics` per operator, on a registry of its own (not prometheus-client's global
one): the operator makes it at startup and hands it to the handlers through kopf's memo, so
tests make fresh ones and other libraries never collide with these names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from malleus.job import Phase

__all__ = ["OperatorMetrics", "PhaseTracker"]


class PhaseTracker(Collector):
    """Last known phase per job, exported as a gauge per phase when scraped."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], Phase] = {}
        self._lock = threading.Lock()

    def set(self, namespace: str, job: str, phase: Phase | None) -> None:
        with self._lock:
            if phase:
                self._phases[(namespace, job)] = Phase(phase)
            else:
                self._phases.pop((namespace, job), None)

    def forget(self, namespace: str, job: str) -> None:
        self.set(namespace, job, None)

    def counts(self) -> dict[Phase, int]:
        with self._lock:
            values = list(self._phases.values())
        counts = dict.fromkeys(Phase, 0)
        for phase in values:
            counts[phase] += 1
        return counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "malleus_operator_jobs",
            "MalleusJobs seen by this operator, by phase.",
            labels=["phase"],
        )
        for phase, count in self.counts().items():
            family.add_metric([phase.value], count)
        yield family


class OperatorMetrics:
    """The operator's counters, histogram and phase gauge, on one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.replans = Counter(
            "malleus_operator_replans",
            "Re-plans applied by the trainers (acknowledged).",
            ["namespace", "job"],
            registry=self.registry,
        )
        self.replan_failures = Counter(
            "malleus_operator_replan_failures",
            "Re-plans that failed (planning, validation, publishing or acknowledgement).",
            ["namespace", "job"],
            registry=self.registry,
        )
        self.pod_failures = Counter(
            "malleus_operator_pod_failures",
            "Worker pods seen failed.",
            ["namespace", "job"],
            registry=self.registry,
        )
        self.planning_seconds = Histogram(
            "malleus_operator_planning_seconds",
            "Wall seconds of one planner run.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.phases = PhaseTracker()
        self.registry.register(self.phases)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread (0 = off)."""
        if port:
            start_http_server(port, addr=addr, registry=self.registry)
