"""The trainer's Prometheus metrics and `parse_rates`, a reader of its exposition.

One registry per trainer object (not prometheus-client's global one), so several ranks or tests
in one process never collide. The coordinator publishes every rank's rate, since a pod is a node
holding several ranks and the controller scrapes one endpoint. Torch-free.

Prometheus conventions: what a dashboard wants as a rate is a counter (`malleus_steps_total`,
`malleus_tokens_total`, `malleus_migrations_total`, `malleus_migrated_bytes_total`) or a
histogram (`malleus_step_duration_seconds`, `malleus_migration_duration_seconds`), so no sample
is lost between two scrapes; the only gauges are states (the step, the generation in force, the
loss, the rates) and the last step's time, which the operator's trainer scrape reads from one
page (a histogram's mean needs two). The job's label is `malleus_job`, not `job`, which
Prometheus gives every target; a rank's series (its rate, its compute seconds) carry the rank,
its node's index (`node_rank`), its GPU index in that node (`gpu`, DCGM's label) and, for this
pod's own ranks, the Kubernetes node (`node_name`, from the downward API's `NODE_NAME`) an admin
cordons.

Two pages from one registry: the job's (`render(job_wide=True)`, ``GET /metrics/job``: every
rank's series, what the controller's direct scrape of the coordinator reads) and the pod's
(`render()`, ``GET /metrics``, what Prometheus scrapes on every worker pod). In a pod
(`own_node_only`) the pod's page carries only this node's ranks, each with its `node_name`, so
every series Prometheus stores names the node and GPU it measures and no pod speaks for another
pod's GPUs; outside a pod (a local run: every rank on this machine) both pages are the same.

The cost model's calibration (trainer/engine/calibrator.py), in base units: `malleus_layer_seconds`
(one layer-time unit), `malleus_cost_seconds{term}` (per micro-batch: `embedding`, `head`, `p2p`
per stage boundary, `embedding_comm` and `head_comm` with a `group_size` label; `tp_comm` per
layer with a `group_size` label; `fixed` per step;
`grad_sync_call_intra`, `grad_sync_call_inter` per gradient all-reduce call) and
`malleus_cost_seconds_per_mebibyte{term}` (`grad_sync_intra`, `grad_sync_inter`, `optimizer`);
`malleus_link_rate{node_rank}`, a node's links' slowdown (1.0 = healthy). The controller reads
them back into the planner's shape (`malleus.controller.sources.calibration_from_metrics`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from malleus.planner.calibration import BY_SIZE_TERMS, COUNT_TERMS, PER_MIB_TERMS, SCALAR_TERMS

__all__ = ["CONTENT_TYPE", "JOB_LABEL", "TrainerMetrics", "parse_rates"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_LABEL = "malleus_job"
"""The label naming the MalleusJob on every trainer series."""
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
MIGRATION_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RATE_LABELS = (JOB_LABEL, "rank", "node_rank", "gpu", "node_name")
PER_RANK = ("malleus_gpu_straggling_rate", "malleus_gpu_compute_seconds")
"""The families with one series per rank (labelled `RATE_LABELS`): the pod's page keeps its own."""


class TrainerMetrics:
    """The trainer's metrics for one trainer process (GET /status reads the loop's own
    state, not these gauges: see `trainer.services`). `gpu` is this process's GPU index in its
    node; `node_name` defaults to the `NODE_NAME` environment variable. `own_node_only`: the
    pod's page (`render()`) shows only node `node`'s ranks (a worker pod: one node)."""

    def __init__(
        self,
        job: str,
        rank: int,
        node: int,
        registry: CollectorRegistry | None = None,
        *,
        gpu: int | None = None,
        node_name: str | None = None,
        own_node_only: bool = False,
    ) -> None:
        self.job, self.rank, self.node = job, rank, node
        self.own_node_only = own_node_only
        self.gpu = gpu
        self.node_name = node_name if node_name is not None else os.environ.get("NODE_NAME", "")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r, j = self.registry, [JOB_LABEL]
        self._rate = Gauge(
            "malleus_gpu_straggling_rate",
            "Compute time per layer-shard x micro-batch over a healthy GPU's (1.0 = healthy).",
            RATE_LABELS,
            registry=r,
        )
        self._compute = Gauge(
            "malleus_gpu_compute_seconds",
            "Compute seconds of the rank's last step, communication waits excluded.",
            RATE_LABELS,
            registry=r,
        )
        self._step_seconds = Gauge(
            "malleus_step_seconds", "Wall seconds of the last training step.", j, registry=r
        )
        self._generation = Gauge(
            "malleus_plan_generation", "Generation of the plan in force.", j, registry=r
        )
        self._step = Gauge("malleus_step", "Last completed training step.", j, registry=r)
        self._loss = Gauge("malleus_loss", "Training loss of the last step.", j, registry=r)
        self._steps = Counter("malleus_steps", "Training steps completed.", j, registry=r)
        self._tokens = Counter("malleus_tokens", "Tokens trained on.", j, registry=r)
        self._step_hist = Histogram(
            "malleus_step_duration_seconds",
            "Wall seconds per training step.",
            j,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._migrations = Counter("malleus_migrations", "Migrations completed.", j, registry=r)
        self._migrated = Counter(
            "malleus_migrated_bytes", "Bytes moved by migrations.", j, registry=r
        )
        self._mig_hist = Histogram(
            "malleus_migration_duration_seconds",
            "Wall seconds per migration (a plan switch).",
            j,
            buckets=MIGRATION_BUCKETS,
            registry=r,
        )
        for g in (self._step_seconds, self._generation, self._step):
            g.labels(job).set(0)
        for c in (self._steps, self._tokens, self._step_hist):
            c.labels(job)
        for c in (self._migrations, self._migrated, self._mig_hist):
            c.labels(job)
        self._layer_seconds = Gauge(
            "malleus_layer_seconds",
            "Seconds of one layer-time unit: a layer's forward+backward, one micro-batch, a "
            "healthy full TP group (calibration).",
            j,
            registry=r,
        )
        self._cost = Gauge(
            "malleus_cost_seconds",
            "Measured cost besides layer compute: per micro-batch (embedding, head, p2p per "
            "stage boundary; embedding_comm, head_comm by group_size), tp_comm per layer by "
            "group_size, per step (fixed) or per "
            "gradient all-reduce call (grad_sync_call_intra, grad_sync_call_inter).",
            [JOB_LABEL, "term", "group_size"],
            registry=r,
        )
        self._cost_per_mib = Gauge(
            "malleus_cost_seconds_per_mebibyte",
            "Measured seconds per MiB: gradient sync inside / across nodes, optimizer per MiB "
            "of master parameters held.",
            [JOB_LABEL, "term"],
            registry=r,
        )
        self._host = Gauge(
            "malleus_calibration_host",
            "The host sharing the calibration was measured under: term=shared_cpus, the CPUs "
            "every GPU process shares (absent: none shared); term=measured_active, the GPUs "
            "serving then.",
            [JOB_LABEL, "term"],
            registry=r,
        )
        self._link_rate = Gauge(
            "malleus_link_rate",
            "A node's links' slowdown: its collectives' time over a healthy node's (1.0 = "
            "healthy).",
            [JOB_LABEL, "node_rank"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._rate_labels: dict[int, tuple[str, ...]] = {}
        self._compute_labels: dict[int, tuple[str, ...]] = {}
        self._set(self._compute, self._compute_labels, rank, node, gpu, 0.0)

    # ---- observations ----------------------------------------------------------------------
    def observe_step(
        self,
        step: int,
        step_seconds: float,
        tokens_per_second: float,
        rate: float | None,
        compute_seconds: float,
        loss: float | None = None,
    ) -> None:
        """After each step: the job's step figures and this rank's own rate and compute time."""
        j = self.job
        self._step.labels(j).set(step)
        self._step_seconds.labels(j).set(step_seconds)
        self._steps.labels(j).inc()
        if math.isfinite(step_seconds) and step_seconds >= 0:
            self._step_hist.labels(j).observe(step_seconds)
            if math.isfinite(tokens_per_second) and tokens_per_second >= 0:
                self._tokens.labels(j).inc(tokens_per_second * step_seconds)
        if loss is not None:
            self._loss.labels(j).set(loss)
        with self._lock:
            self._set(
                self._compute, self._compute_labels, self.rank, self.node, self.gpu, compute_seconds
            )
            self._set(self._rate, self._rate_labels, self.rank, self.node, self.gpu, rate)

    def observe_rates(
        self,
        rates: Mapping[int, float | None],
        nodes: Mapping[int, int],
        compute_seconds: Mapping[int, float] | None = None,
    ) -> None:
        """The coordinator publishes every rank's rate: None = not measured yet (series removed),
        NaN = measured no more (failed or unusable: the series stays, as NaN). A rank's GPU
        index is its place among the ranks `nodes` puts on its node."""
        peers: dict[int, list[int]] = {}
        for rank, node in sorted(nodes.items()):
            peers.setdefault(node, []).append(rank)
        with self._lock:
            for rank, rate in rates.items():
                node = nodes[rank]
                self._set(self._rate, self._rate_labels, rank, node, peers[node].index(rank), rate)
            for rank, secs in (compute_seconds or {}).items():
                node = nodes[rank]
                gpu = peers[node].index(rank)
                self._set(self._compute, self._compute_labels, rank, node, gpu, secs)

    def _set(
        self,
        gauge: Gauge,
        held: dict[int, tuple[str, ...]],
        rank: int,
        node: int,
        gpu: int | None,
        value: float | None,
    ) -> None:
        """One rank's series of a `PER_RANK` gauge (None = removed; `held`: its labels now)."""
        name = self.node_name if node == self.node else ""  # another pod's node: not known here
        labels = (self.job, str(rank), str(node), "" if gpu is None else str(gpu), name)
        old = held.get(rank)
        if old is not None and (old != labels or value is None):
            gauge.remove(*old)
            del held[rank]
        if value is None:
            return
        gauge.labels(*labels).set(value)  # NaN: the rank is failed / unusable
        held[rank] = labels

    def observe_calibration(
        self, calibration: Mapping[str, object], link_rates: Mapping[int, float]
    ) -> None:
        """The cost model's measured terms (layer-time units; `layer_seconds` in seconds),
        published in seconds, and every node's link rate."""
        j = self.job
        unit = float(calibration["layer_seconds"])  # type: ignore[arg-type]
        self._layer_seconds.labels(j).set(unit)
        for term in SCALAR_TERMS:  # a term a calibration predates is 0 (the model's default)
            self._cost.labels(j, term, "").set(float(calibration.get(term, 0.0)) * unit)  # type: ignore[arg-type]
        for term in BY_SIZE_TERMS:
            table = calibration.get(term) or {}
            for g, v in table.items():  # type: ignore[attr-defined]
                self._cost.labels(j, term, str(g)).set(float(v) * unit)
        for term in PER_MIB_TERMS:
            self._cost_per_mib.labels(j, term).set(float(calibration[term]) * unit)  # type: ignore[arg-type]
        for term in COUNT_TERMS:
            count = calibration.get(term)
            if count is None:
                with contextlib.suppress(KeyError):
                    self._host.remove(j, term)
            else:
                self._host.labels(j, term).set(float(count))  # type: ignore[arg-type]
        for node, rate in link_rates.items():
            self._link_rate.labels(j, str(node)).set(rate)

    def observe_plan(self, generation: int) -> None:
        self._generation.labels(self.job).set(generation)

    def observe_migration(self, seconds: float, bytes_: int) -> None:
        j = self.job
        self._migrations.labels(j).inc()
        self._migrated.labels(j).inc(max(0, bytes_))
        self._mig_hist.labels(j).observe(max(0.0, seconds))

    # ---- output ---------------------------------------------------------------------------
    def render(self, *, job_wide: bool = False) -> bytes:
        """The Prometheus text exposition (with CONTENT_TYPE): the pod's page (GET /metrics),
        or with `job_wide` the job's (GET /metrics/job: every rank this process knows of)."""
        if job_wide or not self.own_node_only:
            return generate_latest(self.registry)
        return generate_latest(_NodeView(self.registry, str(self.node)))  # type: ignore[arg-type]


class _NodeView:
    """A registry's families with the `PER_RANK` ones cut to one node's ranks."""

    def __init__(self, registry: CollectorRegistry, node: str) -> None:
        self.registry, self.node = registry, node

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name in PER_RANK:
                mine = Metric(family.name, family.documentation, family.type, family.unit)
                mine.samples = [s for s in family.samples if s.labels.get("node_rank") == self.node]
                yield mine
            else:
                yield family


def parse_rates(text: str, job: str | None = None) -> dict[int, float]:
    """Rank -> straggling rate from a /metrics page (optionally only `job`'s series)."""
    out: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "malleus_gpu_straggling_rate":
            continue
        for sample in family.samples:
            if job is not None and sample.labels.get(JOB_LABEL) != job:
                continue
            if "rank" in sample.labels and math.isfinite(sample.value):
                out[int(sample.labels["rank"])] = float(sample.value)
    return out
