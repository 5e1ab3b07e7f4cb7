"""The trainer's Prometheus metrics (DESIGN §4.4) and `parse_rates`, a reader of its exposition.

One registry per trainer object (not prometheus-client's global one), so several ranks or tests
in one process never collide. The coordinator publishes every rank's rate, since a pod is a node
holding several ranks and the controller scrapes one endpoint. Torch-free.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["CONTENT_TYPE", "TrainerMetrics", "parse_rates"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TrainerMetrics:
    """The metrics of DESIGN §4.4 for one trainer process (GET /status reads the loop's own
    state, not these gauges: see `trainer.services`)."""

    def __init__(
        self, job: str, rank: int, node: int, registry: CollectorRegistry | None = None
    ) -> None:
        self.job, self.rank, self.node = job, rank, node
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._rate = Gauge(
            "malleus_gpu_straggling_rate",
            "Compute time per layer-shard x micro-batch over a healthy GPU's (1.0 = healthy).",
            ["job", "rank", "node"],
            registry=r,
        )
        self._compute = Gauge(
            "malleus_gpu_compute_seconds",
            "Compute seconds of the rank's last step, communication waits excluded.",
            ["job", "rank"],
            registry=r,
        )
        self._step_seconds = Gauge(
            "malleus_step_seconds", "Wall seconds of the last training step.", ["job"], registry=r
        )
        self._tps = Gauge(
            "malleus_tokens_per_second", "Tokens per second of the last step.", ["job"], registry=r
        )
        self._generation = Gauge(
            "malleus_plan_generation", "Generation of the plan in force.", ["job"], registry=r
        )
        self._mig_seconds = Gauge(
            "malleus_migration_seconds", "Wall seconds of the last migration.", ["job"], registry=r
        )
        self._mig_bytes = Gauge(
            "malleus_migration_bytes", "Bytes moved by the last migration.", ["job"], registry=r
        )
        self._step = Gauge("malleus_step", "Last completed training step.", ["job"], registry=r)
        self._migrations = Counter(
            "malleus_migrations", "Migrations completed.", ["job"], registry=r
        )
        for g in (
            self._step_seconds,
            self._tps,
            self._generation,
            self._mig_seconds,
            self._mig_bytes,
            self._step,
        ):
            g.labels(job=job).set(0)
        self._migrations.labels(job=job)
        self._compute.labels(job=job, rank=str(rank)).set(0)
        self._lock = threading.Lock()
        self._rate_labels: dict[int, tuple[str, str, str]] = {}

    # ---- observations ----------------------------------------------------------------------
    def observe_step(
        self,
        step: int,
        step_seconds: float,
        tokens_per_second: float,
        rate: float | None,
        compute_seconds: float,
    ) -> None:
        """After each step: the job's step figures and this rank's own rate and compute time."""
        j = self.job
        self._step.labels(job=j).set(step)
        self._step_seconds.labels(job=j).set(step_seconds)
        self._tps.labels(job=j).set(tokens_per_second)
        self._compute.labels(job=j, rank=str(self.rank)).set(compute_seconds)
        with self._lock:
            self._set_rate(self.rank, self.node, rate)

    def observe_rates(
        self,
        rates: Mapping[int, float | None],
        nodes: Mapping[int, int],
        compute_seconds: Mapping[int, float] | None = None,
    ) -> None:
        """The coordinator publishes every rank's rate: None = not measured yet (series removed),
        NaN = measured no more (failed or unusable: the series stays, as NaN)."""
        with self._lock:
            for rank, rate in rates.items():
                self._set_rate(rank, nodes[rank], rate)
            for rank, secs in (compute_seconds or {}).items():
                self._compute.labels(job=self.job, rank=str(rank)).set(secs)

    def _set_rate(self, rank: int, node: int, rate: float | None) -> None:
        labels = (self.job, str(rank), str(node))
        old = self._rate_labels.get(rank)
        if old is not None and (old != labels or rate is None):
            self._rate.remove(*old)
            del self._rate_labels[rank]
        if rate is None:
            return
        self._rate.labels(*labels).set(rate)  # NaN: the rank is failed / unusable
        self._rate_labels[rank] = labels

    def observe_plan(self, generation: int) -> None:
        self._generation.labels(job=self.job).set(generation)

    def observe_migration(self, seconds: float, bytes_: int) -> None:
        j = self.job
        self._mig_seconds.labels(job=j).set(seconds)
        self._mig_bytes.labels(job=j).set(bytes_)
        self._migrations.labels(job=j).inc()

    # ---- output ---------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition (served at GET /metrics with CONTENT_TYPE)."""
        return generate_latest(self.registry)


def parse_rates(text: str, job: str | None = None) -> dict[int, float]:
    """Rank -> straggling rate from a /metrics page (optionally only `job`'s series)."""
    out: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "malleus_gpu_straggling_rate":
            continue
        for sample in family.samples:
            if job is not None and sample.labels.get("job") != job:
                continue
            if "rank" in sample.labels and math.isfinite(sample.value):
                out[int(sample.labels["rank"])] = float(sample.value)
    return out
