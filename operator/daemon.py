"""Per-job daemon: the shared decision loop (`malleus.controller.Controller`) aimed at one job.

kopf runs one `run_job` per active MalleusJob. It waits until the workers run, finds the plan in
force (the ConfigMap, reconciled with what the coordinator reports, so an operator restart
neither loses a generation nor re-posts an old one), then runs the Controller with

- a RateSource reading the coordinator's /metrics through the headless Service, or Prometheus;
- a PlanSink posting to the coordinator's ``POST /plan`` with the job's Secret token and keeping
  the plan ConfigMap current;

and turns every decision event into a Kubernetes event, a status update and a metric. The
status is written through `k8s.patch_job_status` (kopf applies a daemon's ``patch`` only when it
exits). The daemon writes ``phase`` only while the job is Running or Replanning, so it never
overrides a Failed or Succeeded set by the pod watcher.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from malleus.controller.events import DecisionEvent, EventKind
from malleus.controller.loop import Controller
from malleus.controller.planning import Planner, default_planner
from malleus.controller.policy import StragglerPolicy
from malleus.controller.problem import build_problem
from malleus.controller.sources import HttpPlanSink
from malleus.jobspec import MalleusJob
from malleus.planner.plan import Plan

from . import jobs, k8s, metrics, resources, sink, sources, status, trainers
from .settings import Settings

__all__ = [
    "SPEC_CHANGED",
    "JobReporter",
    "StopFlag",
    "believed_rates",
    "effective_job",
    "run_job",
]

log = logging.getLogger(__name__)

SPEC_CHANGED = "spec-changed"
"""`run_job`'s result when the spec changed under it: the caller restarts it on the new spec."""

_EVENT_REASONS = {
    EventKind.STRAGGLER_DETECTED: "StragglerDetected",
    EventKind.REPLAN_SKIPPED: "ReplanSkipped",
    EventKind.REPLANNED: "Replanned",
    EventKind.MIGRATED: "Migrated",
    EventKind.REPLAN_FAILED: "ReplanFailed",
}
"""Decision events posted as Kubernetes events (Planned is only in the status and metrics)."""


class StopFlag(Protocol):
    """kopf's ``stopped`` (a `kopf.DaemonStopped`): truthy once stopping; ``wait`` sleeps."""

    def __bool__(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Awaitable[Any]: ...


def _phase(body: Mapping[str, Any]) -> str | None:
    return status.phase_of(body.get("status"))


def _generation(body: Mapping[str, Any]) -> int:
    return int((body.get("metadata") or {}).get("generation") or 0)


class JobReporter:
    """Decision events and observations -> Kubernetes events, status patches and metrics."""

    def __init__(
        self,
        ref: resources.JobRef,
        job: MalleusJob,
        policy: StragglerPolicy,
        body: Mapping[str, Any],
    ) -> None:
        self.ref = ref
        self.job = job
        self.policy = policy
        self.body = body  # kopf's live view: the latest status
        self.controller: Controller | None = None
        self.tokens_per_step = job.spec.training.global_batch_size * _sequence(job)
        self._last: dict[str, Any] = {}

    async def _patch(self, patch: dict[str, Any]) -> None:
        await k8s.patch_job_status(self.ref.namespace, self.ref.name, patch)
        if "phase" in patch:
            metrics.PHASES.set(self.ref.namespace, self.ref.name, patch["phase"])

    def _phase_update(self, phase: str) -> dict[str, Any]:
        """``{"phase": phase}`` unless the job left Running/Replanning (then nothing)."""
        current = _phase(self.body)
        if current in ("Running", "Replanning") and current != phase:
            return {"phase": phase}
        return {}

    async def on_observation(self, obs_step: int, step_seconds: float | None) -> None:
        """After each new step: step, tokens/s, stragglers and their condition (if changed)."""
        patch: dict[str, Any] = {"step": max(0, obs_step)}
        if step_seconds:
            patch["tokensPerSecond"] = round(self.tokens_per_step / step_seconds, 3)
        await self._report(patch)

    async def _report(self, patch: dict[str, Any]) -> None:
        """Write ``patch`` plus the stragglers as the detector sees them now, if anything changed.

        An observation reaches the status before the controller feeds it to the detector, so
        the stragglers are refreshed again when a decision event shows the detector moved.
        """
        c = self.controller
        smoothed = c.detector.smoothed() if c is not None else {}
        patch = dict(patch)
        patch.update(
            status.straggler_status(smoothed, self.policy.threshold, self.job.spec.gpus_per_node)
        )
        changed_stragglers = patch["stragglers"] != self._last.get("stragglers")
        if changed_stragglers:
            # The conditions list is replaced whole by a merge patch: start from the stored one
            # (the pod watcher may have just written Ready), not from this daemon's view.
            fresh = await k8s.get_job(self.ref.namespace, self.ref.name)
            conds = ((fresh or self.body).get("status") or {}).get("conditions")
            patch["conditions"] = status.merge_conditions(
                conds,
                status.straggling_condition(
                    smoothed, self.policy.threshold, self.ref.generation, status.now()
                ),
            )
        if patch == {k: self._last.get(k) for k in patch}:
            return
        self._last.update(patch)
        await self._patch(patch)

    async def on_event(self, event: DecisionEvent) -> None:
        """One decision event: post it, count it, and update the status it concerns."""
        reason = _EVENT_REASONS.get(event.kind)
        if reason is not None:
            await k8s.post_event(self.ref, event.type, reason, event.message)
        if event.kind is EventKind.STRAGGLER_DETECTED:
            await self._report({})  # the shift's observation, which the status has not seen
        ns, name = self.ref.namespace, self.ref.name
        if event.kind is EventKind.PLANNED:
            seconds = (event.data.get("decision") or {}).get("planning_seconds")
            if isinstance(seconds, (int, float)):
                metrics.PLANNING_SECONDS.observe(seconds)
        elif event.kind is EventKind.REPLANNED:
            await self._patch({**self._phase_update("Replanning"), "message": event.message[:1024]})
        elif event.kind is EventKind.MIGRATED:
            metrics.REPLANS.labels(namespace=ns, job=name).inc()
            c = self.controller
            if c is not None:
                last = c.last_replan or {}
                when = last.get("time")
                at = (
                    dt.datetime.fromtimestamp(when, dt.UTC)
                    if isinstance(when, (int, float))
                    else status.now()
                )
                patch = status.replan_status(
                    c.plan,
                    reason=str(last.get("reason") or event.message),
                    at=at,
                    planning_seconds=last.get("planning_seconds"),
                    migration_seconds=last.get("migration_seconds"),
                    migration_bytes=_int_or_none(last.get("migration_bytes")),
                )
                await self._patch(
                    {**patch, **self._phase_update("Running"), "message": event.message[:1024]}
                )
        elif event.kind is EventKind.REPLAN_FAILED:
            metrics.REPLAN_FAILURES.labels(namespace=ns, job=name).inc()
            update = self._phase_update("Running")
            if update:
                await self._patch(update)


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) else None


def _sequence(job: MalleusJob) -> int:
    from malleus.jobspec import resolve_model

    try:
        return resolve_model(job.spec.model).sequence
    except Exception:
        return 0


class _ObservingSource(sources.TrackingSource):
    """Tracks observations and hands each to the reporter (status) before the controller."""

    def __init__(self, inner: Any, ended: Any, reporter: JobReporter) -> None:
        super().__init__(inner, ended)
        self.reporter = reporter

    async def read(self) -> Any:
        obs = await super().read()
        if obs is not None:
            try:
                await self.reporter.on_observation(obs.step, obs.step_seconds)
            except Exception:  # status is best effort; the decision loop must go on
                log.exception("status update failed")
        return obs


async def effective_job(ref: resources.JobRef, body: Mapping[str, Any]) -> MalleusJob:
    """The job as its pods run it (``job.json`` in the ConfigMap), with the live policy.

    The layout-defining fields (nodes, model, batch, tp) cannot change under running pods, so
    they come from the manifest the pods were started with; ``stragglerPolicy`` and ``metrics``
    only steer the operator and are taken from the live spec, so editing them takes effect.
    """
    live = jobs.parse_job(body)
    cm = await k8s.read("ConfigMap", ref.namespace, resources.configmap_name(ref.name))
    text = ((cm or {}).get("data") or {}).get("job.json")
    if not text:
        return live
    try:
        started = jobs.parse_job(json.loads(text))
    except (ValueError, jobs.InvalidSpec) as e:
        log.warning(
            "%s/%s: job.json in the ConfigMap is unreadable (%s)", ref.namespace, ref.name, e
        )
        return live
    spec = started.spec.model_copy(
        update={"straggler_policy": live.spec.straggler_policy, "metrics": live.spec.metrics}
    )
    return started.model_copy(update={"spec": spec})


def believed_rates(body: Mapping[str, Any]) -> dict[int, float | None]:
    """The stragglers' rates the status last showed (a restarted daemon starts from them, so
    it does not "detect" the stragglers the plan in force already works around)."""
    out: dict[int, float | None] = {}
    for entry in (body.get("status") or {}).get("stragglers") or []:
        if isinstance(entry, Mapping) and isinstance(entry.get("rank"), int):
            rate = entry.get("rate")
            out[entry["rank"]] = float(rate) if isinstance(rate, (int, float)) else None
    return out


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
        if phase in ("Running", "Replanning"):
            return True
        if waited and phase == "Pending" and resync is not None:
            try:
                await resync()
            except Exception:  # best effort: the next poll (or a pod event) tries again
                log.exception("re-syncing the pods of a pending job failed")
        await stopped.wait(poll)
        waited = True
    return False


async def _plan_in_force(
    ref: resources.JobRef, body: Mapping[str, Any], job: MalleusJob, url: str, timeout: float
) -> Plan:
    """ConfigMap (reconciled with the coordinator), else the status's plan, else a fresh one."""
    running = await trainers.read_status(url, timeout)
    running_generation = None
    if running is not None:
        g = running.get("current_generation", running.get("plan_generation"))
        running_generation = int(g) if g is not None else None
    plan = await sink.resume_plan(ref, running_generation)
    if plan is None:
        plan = status.plan_from_status((body.get("status") or {}).get("plan"))
    if plan is None:
        plan, _ = await jobs.initial_plan(job)
    return plan


async def run_job(
    body: Mapping[str, Any],
    stopped: StopFlag,
    settings: Settings,
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
        job = await effective_job(ref, body)
    except jobs.InvalidSpec as e:
        log.warning("%s/%s: not running the controller: %s", ref.namespace, ref.name, e)
        return None
    policy = StragglerPolicy.from_job(job)
    endpoints = trainers.Endpoints(ref, job.spec.control_port, settings.endpoint_template)
    while True:
        try:
            url = await endpoints.url(0)
            break
        except (ConnectionError, k8s.ApiError) as e:
            log.info("%s/%s: coordinator not reachable yet: %s", ref.namespace, ref.name, e)
            if stopped or await _stopped_within(stopped, poll_seconds):
                return None
    token = await k8s.read_secret_value(
        ref.namespace, resources.secret_name(ref.name), resources.TOKEN_KEY
    )
    timeout = settings.http_timeout_seconds
    plan = await _plan_in_force(ref, body, job, url, timeout)
    reporter = JobReporter(ref, job, policy, body)
    start_generation = _generation(body)

    def ended() -> bool:
        return (
            bool(stopped)
            or _phase(body) in status.TERMINAL_PHASES
            or _generation(body) != start_generation
        )

    source = _ObservingSource(sources.rate_source(job, ref, url, timeout=timeout), ended, reporter)
    plan_sink = sink.ConfigMapPlanSink(ref, HttpPlanSink(url, token, timeout=timeout))
    controller = Controller(
        source,
        plan_sink,
        initial_plan=plan,
        problem_builder=lambda rates, current: build_problem(job, rates, current),
        policy=policy,
        planner=planner,
        on_event=reporter.on_event,
        initial_rates=believed_rates(body),
        ack_timeout_seconds=settings.ack_timeout_seconds,
        read_retry_seconds=float(job.spec.metrics.scrape_interval_seconds),
    )
    reporter.controller = controller
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
    return SPEC_CHANGED if _generation(body) != start_generation and not stopped else None


async def _stopped_within(stopped: StopFlag, seconds: float) -> bool:
    await stopped.wait(seconds)
    return bool(stopped)
