"""The trainers' own HTTP endpoint as RateSource and PlanSink.

`TrainerScrapeSource` reads the coordinator's `GET /metrics/job` (it publishes every rank's rate,
and its series tell "not measured yet" from "failed", which `/status` does not need to);
`HttpPlanSink` posts plans to `POST /plan` and polls `GET /status` for the switch. Both go
through `malleus.control.AsyncControlClient`, the one client of the control API; the
exposition text is parsed by prometheus-client's own parser.

The coordinator speaks for every rank: each rank's figure is its own slot of a collective
(`trainer/engine/trainer.py`), so no rank can write another's. What the page claims is still checked
against the layout: a series for a rank outside the job, with a rank that is not a number, or
whose ``node_rank`` label is not the node that holds that rank is dropped, not believed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping

from malleus.control import (
    MAX_RESPONSE_BYTES,
    AsyncControlClient,
    ControlError,
    ControlStatus,
    ControlTLS,
    PlanConflict,
)
from malleus.errors import BadInput
from malleus.planner.calibration import BY_SIZE_TERMS, COUNT_TERMS, PER_MIB_TERMS, SCALAR_TERMS
from malleus.planner.plan import Plan

from .ports import Ack, AckTimeout, GenerationConflict, Observation, PlanRejected
from .steps import StepGuard

__all__ = [
    "HttpPlanSink",
    "TrainerScrapeSource",
    "ack_from_status",
    "calibration_from_metrics",
    "calibration_from_samples",
    "observation_from_metrics",
]

RATE_METRIC = "malleus_gpu_straggling_rate"
CALIBRATION_METRICS = (
    "malleus_layer_seconds",
    "malleus_cost_seconds",
    "malleus_cost_seconds_per_mebibyte",
    "malleus_link_rate",
    "malleus_calibration_host",
)
"""The trainers' calibration series (trainer/endpoint/metrics.py)."""
JOB_LABEL = "malleus_job"  # the trainers' label naming the job (`job` is Prometheus' own)


def _sample_value(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def _rank(labels: dict[str, str], world: int | None, gpus_per_node: int | None) -> int | None:
    """The rank a rate series is for, or None when its labels contradict the job's layout."""
    text = labels.get("rank", "")
    if not text.isdigit():
        return None
    rank = int(text)
    if world is not None and rank >= world:
        return None
    node = labels.get("node_rank")
    if gpus_per_node is not None and node is not None and node != str(rank // gpus_per_node):
        return None
    return rank


def observation_from_metrics(
    text: str,
    job: str | None = None,
    *,
    world: int | None = None,
    gpus_per_node: int | None = None,
) -> Observation | None:
    """An Observation from a /metrics page (only `job`'s series if given).

    None when the page has no step yet. A rate series with a NaN value means an unusable rank;
    a rank with no series has no sample (the trainer removes the series of a rank not measured).
    A step time of 0 is the gauge's initial value: not measured. With `world` and
    `gpus_per_node`, rate series whose rank or node does not fit the job are dropped.
    """
    from prometheus_client.parser import text_string_to_metric_families

    rates: dict[int, float | None] = {}
    scalars: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if job is not None and sample.labels.get(JOB_LABEL, job) != job:
                continue
            if sample.name == RATE_METRIC:
                rank = _rank(sample.labels, world, gpus_per_node)
                if rank is not None:
                    rates[rank] = _sample_value(sample.value)
            elif sample.name in ("malleus_step", "malleus_step_seconds", "malleus_plan_generation"):
                scalars[sample.name] = sample.value
    if "malleus_step" not in scalars:
        return None
    seconds = scalars.get("malleus_step_seconds")
    calibration, links = calibration_from_metrics(text, job)
    if world is not None and gpus_per_node:
        links = {n: v for n, v in links.items() if n < world // gpus_per_node}
    return Observation(
        step=int(scalars["malleus_step"]),
        step_seconds=seconds if seconds and math.isfinite(seconds) and seconds > 0 else None,
        rates=rates,
        generation=int(scalars.get("malleus_plan_generation", 0)),
        calibration=calibration,
        link_rates=links,
    )


def calibration_from_metrics(
    text: str, job: str | None = None
) -> tuple[dict[str, object] | None, dict[int, float]]:
    """The calibration (the planner's shape, layer-time units) and per-node link rates from a
    /metrics page (trainer/endpoint/metrics.py writes them in seconds); None for the calibration when
    the page has none (not measured yet). Negative or non-finite figures are dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    return calibration_from_samples(
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in CALIBRATION_METRICS
        and (job is None or sample.labels.get(JOB_LABEL) == job)
    )


def calibration_from_samples(
    samples: Iterable[tuple[str, Mapping[str, str], float]],
) -> tuple[dict[str, object] | None, dict[int, float]]:
    """The same from (metric name, labels, value) samples (a scrape, or a PromQL answer)."""
    unit: float | None = None
    scalars: dict[str, float] = {}
    by_size: dict[str, dict[int, float]] = {term: {} for term in BY_SIZE_TERMS}
    links: dict[int, float] = {}
    counts: dict[str, int] = {}
    for name, labels, value in samples:
        v = float(value)
        if not math.isfinite(v) or v < 0:
            continue
        if name == "malleus_layer_seconds":
            unit = v
        elif name == "malleus_cost_seconds":
            term = labels.get("term", "")
            if term in by_size and labels.get("group_size", "").isdigit():
                by_size[term][int(labels["group_size"])] = v
            elif term in SCALAR_TERMS:
                scalars[term] = v
        elif name == "malleus_cost_seconds_per_mebibyte" and labels.get("term") in PER_MIB_TERMS:
            scalars[labels["term"]] = v
        elif name == "malleus_calibration_host" and labels.get("term") in COUNT_TERMS:
            if v >= 1 and v == int(v):
                counts[labels["term"]] = int(v)
        elif name == "malleus_link_rate" and labels.get("node_rank", "").isdigit():
            links[int(labels["node_rank"])] = max(1.0, v)
    if not unit or unit <= 0:
        return None, links
    calibration: dict[str, object] = {"layer_seconds": unit}
    for term in (*SCALAR_TERMS, *PER_MIB_TERMS):
        calibration[term] = scalars.get(term, 0.0) / unit
    for term, table in by_size.items():
        calibration[term] = {g: v / unit for g, v in sorted(table.items())}
    if len(counts) == len(COUNT_TERMS):  # both or neither (the problem refuses one alone)
        calibration.update(counts)
    return calibration, links


def ack_from_status(status: ControlStatus, generation: int) -> Ack | None:
    """An Ack if the trainers' status shows `generation` (or newer) in force, else None.

    Raises PlanRejected when the trainers report that applying this generation failed. The
    migration figures are the last switch's when it is the switch to the generation in force.
    """
    failure = status.last_failure
    if failure is not None and failure.generation == generation:
        raise PlanRejected(500, f"generation {generation}: {failure.reason}")
    if status.generation < generation:
        return None
    m = status.last_migration
    if m is not None and m.generation == status.generation:
        return Ack(status.generation, m.step, m.seconds, float(m.bytes))
    return Ack(status.generation, status.step, None, None)


class TrainerScrapeSource:
    """RateSource over the coordinator's /metrics/job (every rank's series): polls until a new step appears. `world` and
    `gpus_per_node` (the job's) drop rate series that do not fit the layout."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        job: str | None = None,
        world: int | None = None,
        gpus_per_node: int | None = None,
        interval: float = 5.0,
        timeout: float = 10.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        tls: ControlTLS | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.client = AsyncControlClient(url, token, timeout=timeout, tls=tls, max_bytes=max_bytes)
        self.job = job
        self.world, self.gpus_per_node = world, gpus_per_node
        self.interval = interval
        self._sleep = sleep
        self._steps = StepGuard(what=f"{url}/metrics/job")

    async def read(self) -> Observation | None:
        while True:
            text = await self.client.metrics_text(job_wide=True)
            obs = observation_from_metrics(
                text, self.job, world=self.world, gpus_per_node=self.gpus_per_node
            )
            if obs is not None and self._steps.accept(obs.step):
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
        tls: ControlTLS | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.client = AsyncControlClient(url, token, timeout=timeout, tls=tls, max_bytes=max_bytes)
        self.poll_seconds = poll_seconds

    async def publish(self, plan: Plan) -> int:
        """POST /plan; a refusal (400, 401, 409, ...) is PlanRejected (a 409 the
        GenerationConflict that carries the trainers' generations), silence a ControlError."""
        try:
            return await self.client.post_plan(plan)
        except PlanConflict as e:
            raise GenerationConflict(e.generation, e.newest, str(e)) from e
        except BadInput as e:
            raise PlanRejected(400, "; ".join(map(str, e.faults))) from e
        except ControlError as e:
            if e.code is None:
                raise
            raise PlanRejected(e.code, str(e)) from e

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        """Poll /status until `generation` is in force; an endpoint that does not answer for a
        moment (a busy pod) is polled again until the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        unreachable: ControlError | None = None
        while True:
            try:
                ack = ack_from_status(await self.client.status(), generation)
            except ControlError as e:
                ack, unreachable = None, e
            if ack is not None:
                return ack
            if loop.time() >= deadline:
                why = f" (last error: {unreachable})" if unreachable is not None else ""
                raise AckTimeout(f"generation {generation} not in force after {timeout:g} s{why}")
            await asyncio.sleep(min(self.poll_seconds, max(0.0, deadline - loop.time())))
