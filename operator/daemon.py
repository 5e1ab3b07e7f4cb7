"""Per-job daemon: the shared decision loop (`malleus.controller.Controller`) aimed at one job.

kopf runs one `run_job` per active MalleusJob. It waits until the workers run, finds the plan in
force (the ConfigMap, reconciled with what the coordinator's ``GET /status`` reports it runs and
holds pending, so an operator restart neither loses a generation nor re-posts an old one),
writes it into the status at once (a restart mid-re-plan must not leave the job `Replanning` on
the old generation), then runs the Controller with

- a RateSource reading the coordinator's /metrics through the headless Service, or Prometheus;
  the coordinator is the lowest GPU still in the job, found among the running pods' ranks
  (`trainers.Endpoints.coordinator`) and followed: every scrape interval its ``/status`` goes
  to the reporter (the GPUs out, a recovery's ``Recovered`` event), and when it stops
  answering and another rank does, the loop ends with `COORDINATOR_MOVED` (kopf restarts the
  daemon, which resumes from the ConfigMap and that rank's status as after a restart);
- the controller's `HttpPlanSink` posting to the coordinator's ``POST /plan`` with the job's
  Secret token, wrapped to keep the plan ConfigMap current (`planstore`): every plan the
  controller adopts, acknowledged or caught up with, is recorded there;

and hands every observation, the controller's smoothed rates and every decision event to a
`reporter.JobReporter`. It also renews the job's TLS certificates when they are due
(`children.renew_certificates`: at its start, which covers a job that queued for long, and
every `renewal_check_seconds` while it runs), and then ends with `CERTIFICATES_RENEWED` so
that its restart trusts the new CA. The status is written through the cluster (kopf applies a
daemon's ``patch`` only when it exits). The daemon writes ``phase`` only while the job is
Running or Replanning, so it never overrides a Failed or Succeeded set by the pod watcher.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from malleus.control import AsyncControlClient, ControlError, ControlStatus
from malleus.controller.events import DecisionEvent, Migrated
from malleus.controller.loop import Controller
from malleus.controller.planning import Planner
from malleus.controller.ports import Observation, RateSource
from malleus.controller.sources import HttpPlanSink
from malleus.errors import BadInput
from malleus.job import MalleusJobStatus, Phase, ResolvedJob
from malleus.planner.plan import Plan

from . import children, jobs, planstore, resources, sources, status, tls
from .context import Context
from .k8s import ApiError
from .reporter import JobReporter
from .trainers import Coordinator, Endpoints, fetch_plan

__all__ = [
    "CERTIFICATES_RENEWED",
    "COORDINATOR_MOVED",
    "SPEC_CHANGED",
    "StopFlag",
    "believed_rates",
    "effective_job",
    "run_job",
]

log = logging.getLogger(__name__)

SPEC_CHANGED = "spec-changed"
"""`run_job`'s result when the spec changed under it: the caller restarts it on the new spec."""
COORDINATOR_MOVED = "coordinator-moved"
"""`run_job`'s result when another rank became the coordinator: the caller restarts it."""
CERTIFICATES_RENEWED = "certificates-renewed"
"""`run_job`'s result when it renewed the job's certificates: the caller restarts it, and the
restart reads the new CA bundle."""
MISSES_BEFORE_MOVING = 2
"""Unanswered ``/status`` polls of the coordinator before another rank is looked for."""

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
    running: ControlStatus | None,
) -> tuple[Plan, Plan | None]:
    """(plan in force, plan the trainers may still take): the ConfigMap reconciled with the
    coordinator's ``running`` status, else a fresh one (the status holds only a summary).

    A generation the trainers made themselves (a recovery, while the operator was away) is
    read from them (``GET /plan``) and recorded: neither lost nor numbered again."""
    plan, pending = await planstore.resume_plan(ctx.cluster, ref, running)
    if plan is None:
        planner = ctx.planner(f"{ref.namespace}/{ref.name}")
        plan, _ = await jobs.initial_plan(job, planner, ctx.limits)
    ahead = running is not None and running.generation > plan.generation
    if ahead and (pending is None or pending.generation != running.generation):
        theirs = await fetch_plan(client)
        if theirs is not None and theirs.generation == running.generation:
            log.info(
                "%s/%s: trainers run their plan %d", ref.namespace, ref.name, theirs.generation
            )
            await planstore.record_plan(ctx.cluster, ref, theirs)
            plan = theirs
    return plan, pending


async def _find_coordinator(
    endpoints: Endpoints, ref: resources.JobRef, stopped: StopFlag, poll: float, timeout: float
) -> Coordinator | None:
    """The coordinator once one answers; None when the daemon is stopping first."""
    while True:
        try:
            return await endpoints.coordinator(timeout)
        except (ConnectionError, ApiError) as e:
            log.info("%s/%s: coordinator not reachable yet: %s", ref.namespace, ref.name, e)
            await stopped.wait(poll)
            if stopped:
                return None


async def _follow(
    endpoints: Endpoints,
    coordinator: Coordinator,
    reporter: JobReporter,
    ended: Callable[[], bool],
    stopped: StopFlag,
    interval: float,
    timeout: float,
    tick: float = 1.0,
) -> bool:
    """Poll the coordinator's ``/status`` into the reporter every ``interval`` seconds until
    ``ended()`` (looked at every ``tick``); True when another rank took over as coordinator
    (the caller restarts the loop there)."""
    misses = 0
    loop = asyncio.get_running_loop()
    due = loop.time() + interval
    async with endpoints.client(coordinator.url, coordinator.tls, timeout) as c:
        while not ended():
            await stopped.wait(min(tick, interval))
            if ended():
                return False
            if loop.time() < due:
                continue
            due = loop.time() + interval
            try:
                answer = await c.status()
            except ControlError:
                misses += 1
                if misses < MISSES_BEFORE_MOVING:
                    continue
                try:
                    found = await endpoints.coordinator(timeout)
                except (ConnectionError, ApiError):
                    continue
                if found.url != coordinator.url:
                    log.info("coordinator moved to node %d rank %d", found.node, found.local_rank)
                    return True
                continue
            misses = 0
            try:
                await reporter.on_trainers(answer)
            except Exception:  # status is best effort; the decision loop must go on
                log.exception("status update from the trainers failed")
    return False


def renewal_check_seconds(validity_seconds: float) -> float:
    """How often a running job's certificates are checked for renewal: a fiftieth of their
    lifetime (at most hourly), so one check at least falls well inside the last third."""
    return max(1.0, min(3600.0, validity_seconds / 50))


async def _token(ctx: Context, ref: resources.JobRef) -> tuple[str | None, str | None]:
    """The job Secret's token and CA (the coordinator is verified for its own stable DNS
    name, whatever address the endpoint template reaches it at)."""
    name = resources.secret_name(ref.name)
    token = await ctx.cluster.read_secret_value(ref.namespace, name, resources.TOKEN_KEY)
    ca = await ctx.cluster.read_secret_value(ref.namespace, name, tls.CA_KEY)
    return token, ca


async def run_job(
    ctx: Context,
    body: Mapping[str, Any],
    stopped: StopFlag,
    *,
    planner: Planner | None = None,
    poll_seconds: float = 2.0,
    resync: Callable[[], Awaitable[Any]] | None = None,
) -> str | None:
    """Run the decision loop for the job in ``body`` (kopf's live view) until it ends.

    ``planner`` None: the job's share of the operator's planner processes (`Context.planner`).
    ``resync`` re-derives the phase from the pods while the job is Pending (see
    `_wait_running`). Returns None when the job ended or the daemon was stopped, `SPEC_CHANGED`
    when the spec's generation moved (the caller restarts the daemon, which then reads the new
    policy).
    """
    ref = resources.JobRef.from_body(body)
    if not await _wait_running(body, stopped, poll_seconds, resync):
        return None
    try:
        # The operator's planning limits, clamped where the initial plan clamps them.
        job, _ = jobs.limited(await effective_job(ctx, ref, body), ctx.limits)
    except BadInput as e:
        log.warning("%s/%s: not running the controller: %s", ref.namespace, ref.name, e)
        return None
    settings = ctx.settings
    await children.renew_certificates(ctx, ref, job.nodes)  # before the CA is read
    token, ca = await _token(ctx, ref)
    endpoints = Endpoints(
        ctx.cluster,
        ref,
        job.spec.control_port,
        settings.endpoint_template,
        gpus_per_node=job.gpus_per_node,
        ca=ca,
        token=token,
        max_bytes=settings.max_response_bytes,
    )
    timeout = settings.http_timeout_seconds
    coordinator = await _find_coordinator(endpoints, ref, stopped, poll_seconds, timeout)
    if coordinator is None:
        return None
    url, trust = coordinator.url, coordinator.tls
    async with endpoints.client(url, trust, timeout) as client:
        plan, pending = await _plan_in_force(ctx, ref, job, client, coordinator.status)
    rates = believed_rates(body)
    reporter = JobReporter(ctx, ref, job, body)
    try:
        await reporter.resumed(plan, pending is not None)
        await reporter.on_trainers(coordinator.status)
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
        sources.rate_source(
            job,
            ref,
            url,
            timeout=timeout,
            tls=trust,
            prometheus_auth=prom_auth,
            coordinator_node=coordinator.node,
            token=token,
            max_bytes=settings.max_response_bytes,
        ),
        ended,
        reporter,
    )

    async def trainers_plan() -> Plan | None:
        async with endpoints.client(url, trust, timeout) as client:
            return await fetch_plan(client)

    sink = HttpPlanSink(
        url, token, timeout=timeout, tls=trust, max_bytes=settings.max_response_bytes
    )
    plan_sink = planstore.ConfigMapPlanSink(ctx.cluster, ref, sink, trainers_plan)

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
        planner=planner or ctx.planner(f"{ref.namespace}/{ref.name}"),
        on_event=on_event,
        on_rates=reporter.on_rates,
        initial_rates=rates,
        pending_plan=pending,
        ack_timeout_seconds=settings.ack_timeout_seconds,
        read_retry_seconds=float(job.spec.metrics.scrape_interval_seconds),
    )
    stop = asyncio.Event()
    moved = False

    async def watch() -> None:
        nonlocal moved
        interval = float(job.spec.metrics.scrape_interval_seconds)
        tick = min(poll_seconds, 1.0)
        moved = await _follow(
            endpoints, coordinator, reporter, ended, stopped, interval, timeout, tick
        )
        stop.set()

    renewed = False

    async def renew() -> None:
        nonlocal renewed
        every = renewal_check_seconds(settings.certificate_validity_seconds)
        while not ended():
            await stopped.wait(every)
            if ended():
                return
            try:
                renewed = await children.renew_certificates(ctx, ref, job.nodes)
            except ApiError as e:  # tried again at the next check, long before expiry
                log.warning(
                    "%s/%s: renewing TLS certificates failed: %s", ref.namespace, ref.name, e
                )
            if renewed:
                stop.set()
                return

    watcher = asyncio.ensure_future(watch())
    renewer = asyncio.ensure_future(renew())
    try:
        await controller.run(stop)
    finally:
        watcher.cancel()
        renewer.cancel()
        controller.close()
    if renewed and not stopped:
        return CERTIFICATES_RENEWED
    if moved and not stopped:
        return COORDINATOR_MOVED
    return SPEC_CHANGED if _generation(body) != start_generation and not stopped else None
