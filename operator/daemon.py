"""Per-job daemon: the shared decision loop (`malleus.controller.Controller`) aimed at one job.

kopf runs one `run_job` per active MalleusJob. It waits until the workers run, finds the plan in
force (the ConfigMap, reconciled with what the coordinator's ``GET /status`` reports it runs and
holds pending, so an operator restart neither loses a generation nor re-posts an old one),
writes it into the status at once (a restart mid-re-plan must not leave the job `Replanning` on
the old generation), then runs the Controller with

- a RateSource reading the coordinator's /metrics through the headless Service, or Prometheus;
- the controller's `HttpPlanSink` posting to the coordinator's ``POST /plan`` with the job's
  Secret token, wrapped to keep the plan ConfigMap current (`planstore`): every plan the
  controller adopts, acknowledged or caught up with, is recorded there;

and hands every observation and decision event to a `reporter.JobReporter`. The status is
written through the cluster (kopf applies a daemon's ``patch`` only when it exits). The daemon
writes ``phase`` only while the job is Running or Replanning, so it never overrides a Failed or
Succeeded set by the pod watcher.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from malleus.controller.events import DecisionEvent, Migrated
from malleus.controller.loop import Controller
from malleus.controller.planning import Planner, default_planner
from malleus.controller.ports import Observation, RateSource
from malleus.controller.sources import HttpPlanSink
from malleus.errors import BadInput
from malleus.job import MalleusJobStatus, Phase, ResolvedJob
from malleus.job.control import AsyncControlClient, ControlError, ControlStatus, ControlTLS
from malleus.planner.plan import Plan

from . import jobs, planstore, resources, sources, status, tls
from .context import Context
from .k8s import ApiError
from .reporter import JobReporter
from .trainers import Endpoints

__all__ = ["SPEC_CHANGED", "StopFlag", "believed_rates", "effective_job", "run_job"]

log = logging.getLogger(__name__)

SPEC_CHANGED = "spec-changed"
"""`run_job`'s result when the spec changed under it: the caller restarts it on the new spec."""

_LIVE = frozenset({Phase.RUNNING, Phase.REPLANNING})


class StopFlag(Protocol):
    """kopf's ``stopped`` (a `kopf.DaemonStopped`): truthy once stopping; ``wait`` sleeps."""

    def __bool__(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Awaitable[Any]: ...


def _phase(body: Mapping[str, Any]) -> Phase | None:
    return status.phase_of(body.get("status"))


def _generation(body: Mapping[str, Any]) -> int:
    return int((body.get("metadata") or {}).get("generation") or 0)


class _ObservingSource(sources.TrackingSource):
    """Tracks observations and hands each to the reporter (status) before the controller."""

    def __init__(self, inner: RateSource, ended: Callable[[], bool], reporter: JobReporter) -> None:
        super().__init__(inner, ended)
        self.reporter = reporter

    async def read(self) -> Observation | None:
        obs = await super().read()
        if obs is not None:
            try:
                await self.reporter.on_observation(obs)
            except Exception:  # status is best effort; the decision loop must go on
                log.exception("status update failed")
        return obs


async def effective_job(
    ctx: Context, ref: resources.JobRef, body: Mapping[str, Any]
) -> ResolvedJob:
    """The job as its pods run it (``job.json`` in the ConfigMap), with the live policy.

    The layout-defining fields (nodes, model, batch, tp) cannot change under running pods, so
    they come from the manifest the pods were started with; ``stragglerPolicy`` and ``metrics``
    only steer the operator and are taken from the live spec, so editing them takes effect.
    """
    live = jobs.resolve(body)
    cm = await ctx.cluster.read("ConfigMap", ref.namespace, resources.configmap_name(ref.name))
    text = ((cm or {}).get("data") or {}).get(resources.JOB_KEY)
    if not text:
        return live
    try:
        started = jobs.resolve(json.loads(text))
    except (ValueError, BadInput) as e:
        log.warning(
            "%s/%s: %s in the ConfigMap is unreadable (%s)",
            ref.namespace,
            ref.name,
            resources.JOB_KEY,
            e,
        )
        return live
    spec = started.spec.model_copy(
        update={"straggler_policy": live.spec.straggler_policy, "metrics": live.spec.metrics}
    )
    return ResolvedJob.of(started.job.model_copy(update={"spec": spec}))


def believed_rates(body: Mapping[str, Any]) -> dict[int, float | None]:
    """The stragglers' rates the status last showed (a restarted daemon starts from them, so
    it does not "detect" the stragglers the plan in force already works around)."""
    listed = (body.get("status") or {}).get("stragglers") or []
    try:
        shown = MalleusJobStatus.model_validate({"stragglers": listed})
    except ValidationError:
        return {}
    return {s.rank: s.rate for s in shown.stragglers}


async def _wait_running(
    body: Mapping[str, Any],
    stopped: StopFlag,
    poll: float,
    resync: Callable[[], Awaitable[Any]] | None = None,
) -> bool:
    """Wait until the workers run; False when the job ended or the daemon is stopping.

    While the job stays Pending, ``resync`` (the pod watcher's phase computation) runs after
    every poll: a pod event can race the create handler's status (pods already Running while
    the job has no phase yet, so the event changes nothing), and nothing else would move the
    job to Running then. Not before the first poll, so it rarely doubles a pod event's work.
    """
    waited = False
    while not stopped:
        phase = _phase(body)
        if phase in status.TERMINAL_PHASES:
            return False
        if phase in _LIVE:
            return True
        if waited and phase == Phase.PENDING and resync is not None:
            try:
                await resync()
            except Exception:  # best effort: the next poll (or a pod event) tries again
                log.exception("re-syncing the pods of a pending job failed")
        await stopped.wait(poll)
        waited = True
    return False


async def _plan_in_force(
    ctx: Context,
    ref: resources.JobRef,
    job: ResolvedJob,
    client: AsyncControlClient,
) -> tuple[Plan, Plan | None]:
    """(plan in force, plan the trainers may still take): the ConfigMap reconciled with the
    coordinator, else a fresh one (the status holds only a summary)."""
    try:
        running: ControlStatus | None = await client.status()
    except ControlError as e:
        log.info("%s/%s: coordinator status unreadable: %s", ref.namespace, ref.name, e)
        running = None
    plan, pending = await planstore.resume_plan(ctx.cluster, ref, running)
    if plan is None:
        plan, _ = await jobs.initial_plan(job)
    return plan, pending


async def _coordinator_url(
    endpoints: Endpoints, ref: resources.JobRef, stopped: StopFlag, poll: float
) -> str | None:
    """The coordinator's base URL once it is known; None when the daemon is stopping first."""
    while True:
        try:
            return await endpoints.url(0)
        except (ConnectionError, ApiError) as e:
            log.info("%s/%s: coordinator not reachable yet: %s", ref.namespace, ref.name, e)
            await stopped.wait(poll)
            if stopped:
                return None


async def _credentials(ctx: Context, ref: resources.JobRef) -> tuple[str | None, ControlTLS | None]:
    """The job Secret's token, and how to verify the coordinator over HTTPS: the job's CA, for
    node 0's stable DNS name whatever address the endpoint template reaches it at."""
    name = resources.secret_name(ref.name)
    token = await ctx.cluster.read_secret_value(ref.namespace, name, resources.TOKEN_KEY)
    ca = await ctx.cluster.read_secret_value(ref.namespace, name, tls.CA_KEY)
    trust = ControlTLS(ca, server_name=resources.coordinator_host(ref)) if ca else None
    return token, trust


async def run_job(
    ctx: Context,
    body: Mapping[str, Any],
    stopped: StopFlag,
    *,
    planner: Planner = default_planner,
    poll_seconds: float = 2.0,
    resync: Callable[[], Awaitable[Any]] | None = None,
) -> str | None:
    """Run the decision loop for the job in ``body`` (kopf's live view) until it ends.

    ``resync`` re-derives the phase from the pods while the job is Pending (see
    `_wait_running`). Returns None when the job ended or the daemon was stopped, `SPEC_CHANGED`
    when the spec's generation moved (the caller restarts the daemon, which then reads the new
    policy).
    """
    ref = resources.JobRef.from_body(body)
    if not await _wait_running(body, stopped, poll_seconds, resync):
        return None
    try:
        job = await effective_job(ctx, ref, body)
    except BadInput as e:
        log.warning("%s/%s: not running the controller: %s", ref.namespace, ref.name, e)
        return None
    settings = ctx.settings
    endpoints = Endpoints(ctx.cluster, ref, job.spec.control_port, settings.endpoint_template)
    url = await _coordinator_url(endpoints, ref, stopped, poll_seconds)
    if url is None:
        return None
    token, trust = await _credentials(ctx, ref)
    timeout = settings.http_timeout_seconds
    async with AsyncControlClient(url, token, timeout=timeout, tls=trust) as client:
        plan, pending = await _plan_in_force(ctx, ref, job, client)
    rates = believed_rates(body)
    reporter = JobReporter(ctx, ref, job, body)
    try:
        await reporter.resumed(plan, pending is not None)
    except Exception:  # status is best effort; the decision loop must go on
        log.exception("status update failed")
    start_generation = _generation(body)

    def ended() -> bool:
        return (
            bool(stopped)
            or _phase(body) in status.TERMINAL_PHASES
            or _generation(body) != start_generation
        )

    prom_auth = await sources.prometheus_credentials(ctx.cluster, ref.namespace, job)
    source = _ObservingSource(
        sources.rate_source(job, ref, url, timeout=timeout, tls=trust, prometheus_auth=prom_auth),
        ended,
        reporter,
    )
    plan_sink = planstore.ConfigMapPlanSink(
        ctx.cluster, ref, HttpPlanSink(url, token, timeout=timeout, tls=trust)
    )

    async def on_event(event: DecisionEvent) -> None:
        if isinstance(event.data, Migrated):
            try:
                await plan_sink.record_applied(event.data.plan)
            except Exception:  # the next restart reconciles from the pending record
                log.exception("recording plan generation %d failed", event.data.generation)
        await reporter.on_event(event)

    controller = Controller(
        source,
        plan_sink,
        initial_plan=plan,
        problem_builder=job.problem,
        policy=job.policy,
        planner=planner,
        on_event=on_event,
        initial_rates=rates,
        pending_plan=pending,
        ack_timeout_seconds=settings.ack_timeout_seconds,
        read_retry_seconds=float(job.spec.metrics.scrape_interval_seconds),
    )
    stop = asyncio.Event()

    async def watch() -> None:
        while not ended():
            await stopped.wait(min(poll_seconds, 1.0))
        stop.set()

    watcher = asyncio.ensure_future(watch())
    try:
        await controller.run(stop)
    finally:
        watcher.cancel()
        controller.close()
    return SPEC_CHANGED if _generation(body) != start_generation and not stopped else None
