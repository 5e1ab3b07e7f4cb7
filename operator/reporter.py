"""A job's decision loop as Kubernetes sees it: events, status patches and metrics.

`JobReporter` gets every observation (step, tokens/s) before the controller does, the
controller's smoothed rates after each observation it judges (`on_rates`, called before any
decision on them) and every decision event the controller emits, and writes them through the
`k8s.Cluster`: status patches (typed `MalleusJobStatus`es, dumped by `status.dump`) and
Kubernetes events. The stragglers it shows are the controller's own windows, not a second
smoothing of the raw observations: that one would count the warm-up steps the controller
skips, so a re-plan could be written while the status still showed no straggler, and a
warm-up's slow first steps would show healthy GPUs as stragglers. Re-plans are described by
the events alone.

`JobReporter.on_trainers` gets the coordinator's ``GET /status`` answers (``Ready=True`` once
every rank trains: `readiness`): the GPUs the trainers
leave out (``status.gpusOut``, the ``Degraded`` condition) and their latest recovery
(``status.lastRecovery`` and one ``Recovered`` event per recovery epoch, kept in the status so
that a restarted operator does not post it again).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from malleus.control import ControlStatus, RecoveryRecord
from malleus.controller.events import (
    DecisionEvent,
    EventKind,
    Migrated,
    Planned,
    ReplanFailed,
    Replanned,
)
from malleus.controller.ports import Observation
from malleus.job import LastReplan, MalleusJobStatus, Phase, ResolvedJob
from malleus.job.status import LastRecovery
from malleus.notation import size
from malleus.planner.plan import Plan

from . import failures, readiness, resources, status
from .context import Context

__all__ = ["EVENT_REASONS", "JobReporter"]

EVENT_REASONS = {
    EventKind.STRAGGLER_DETECTED: "StragglerDetected",
    EventKind.REPLAN_SKIPPED: "ReplanSkipped",
    EventKind.REPLANNED: "Replanned",
    EventKind.MIGRATED: "Migrated",
    EventKind.REPLAN_FAILED: "ReplanFailed",
}
"""Decision events posted as Kubernetes events (Planned is only in the status and metrics)."""

_LIVE = frozenset({Phase.RUNNING, Phase.REPLANNING})


class JobReporter:
    """Decision events and observations -> Kubernetes events, status patches and metrics."""

    def __init__(
        self,
        ctx: Context,
        ref: resources.JobRef,
        job: ResolvedJob,
        body: Mapping[str, Any],
    ) -> None:
        self.ctx = ctx
        self.ref = ref
        self.job = job
        self.body = body  # kopf's live view: the latest status
        self._last: dict[str, Any] = {}

    async def _patch(self, patch: MalleusJobStatus) -> None:
        await self.ctx.cluster.patch_job_status(
            self.ref.namespace, self.ref.name, status.dump(patch)
        )
        if patch.phase is not None:
            self.ctx.metrics.phases.set(self.ref.namespace, self.ref.name, patch.phase)

    def _phase(self, phase: Phase) -> Phase | None:
        """``phase`` unless the job left Running/Replanning or is in it already (then None)."""
        current = status.phase_of(self.body.get("status"))
        return phase if current in _LIVE and current != phase else None

    async def resumed(self, plan: Plan, pending: bool) -> None:
        """A (re)started daemon found `plan` in force: show it, and leave Replanning unless a
        re-plan is still under way (`pending`: the trainers may yet take a published plan).

        Without this a restart between a publish and its acknowledgement left the status on the
        old generation, and Replanning, for as long as the rates did not call for a new plan."""
        shown = ((self.body.get("status") or {}).get("plan") or {}).get("generation")
        patch = MalleusJobStatus(phase=None if pending else self._phase(Phase.RUNNING))
        if shown != plan.generation:
            patch.plan = status.plan_status(plan)
        if patch.plan is not None or patch.phase is not None:
            await self._patch(patch)

    async def on_observation(self, obs: Observation) -> None:
        """After each new step: step and tokens/s (if changed)."""
        patch = MalleusJobStatus(step=max(0, obs.step))
        if obs.step_seconds:
            patch.tokens_per_second = round(self.job.tokens_per_step / obs.step_seconds, 3)
        await self._report(patch)

    async def on_rates(self, step: int, rates: Mapping[int, float | None]) -> None:
        """The controller's smoothed rates at ``step``: stragglers and the Straggling condition
        (if changed). Nothing while no rank has a window's quorum yet: not knowing is not
        "no straggler", and a restarted daemon's controller believes what the status shows."""
        if not rates:
            return
        patch = status.stragglers(rates, self.job.policy, self.job.gpus_per_node)
        if status.dump(patch)["stragglers"] != self._last.get("stragglers"):
            # The conditions list is replaced whole by a merge patch: start from the stored one
            # (the pod watcher may have just written Ready), not from this daemon's view.
            fresh = await self.ctx.cluster.get_job(self.ref.namespace, self.ref.name)
            stored = ((fresh or self.body).get("status") or {}).get("conditions")
            patch.conditions = status.merge_conditions(
                stored,
                status.straggling_condition(
                    rates, self.job.policy, self.ref.generation, status.now()
                ),
            )
        await self._report(patch)

    async def _report(self, patch: MalleusJobStatus) -> None:
        """Write ``patch`` if anything in it changed."""
        shown = status.dump(patch)
        if shown == {k: self._last.get(k) for k in shown}:
            return
        self._last.update(shown)
        await self._patch(patch)

    async def on_trainers(self, answer: ControlStatus) -> None:
        """The coordinator's ``/status``: GPUs out (and ``Degraded``), and a new recovery."""
        fresh = await self.ctx.cluster.get_job(self.ref.namespace, self.ref.name) or self.body
        stored = fresh.get("status") or {}
        records = MalleusJobStatus.model_validate(
            {"failures": stored.get("failures") or []}
        ).failures
        out = failures.gpus_out(records or [], answer.out, self.job.gpus_per_node)
        patch = MalleusJobStatus()
        if [o.model_dump(mode="json", by_alias=True) for o in out] != (stored.get("gpusOut") or []):
            patch.gpus_out = out
            patch.conditions = status.merge_conditions(
                stored.get("conditions"),
                failures.degraded_condition(records or [], out, self.ref.generation, status.now()),
            )
        ready = readiness.ready_when_training(
            patch.conditions or stored.get("conditions"),
            answer,
            self.job.world,
            self.ref.generation,
            status.now(),
        )
        if ready is not None and status.phase_of(stored) in _LIVE:
            patch.conditions = status.merge_conditions(
                patch.conditions or stored.get("conditions"), ready
            )
        rec = answer.last_recovery
        seen = int((stored.get("lastRecovery") or {}).get("epoch") or 0)
        if rec is not None and rec.epoch > seen:
            patch.last_recovery = _last_recovery(rec)
            await self.ctx.cluster.post_event(
                self.ref, "Normal", "Recovered", recovered_message(rec)
            )
        if patch.gpus_out is not None or patch.last_recovery is not None or patch.conditions:
            await self._patch(patch)

    async def on_event(self, event: DecisionEvent) -> None:
        """One decision event: post it, count it, and update the status it concerns."""
        ctx, ns, name = self.ctx, self.ref.namespace, self.ref.name
        reason = EVENT_REASONS.get(event.kind)
        if reason is not None:
            await ctx.cluster.post_event(self.ref, event.type, reason, event.message)
        data = event.data
        if isinstance(data, Planned):
            ctx.metrics.planning_seconds.observe(data.decision.planning_seconds)
        elif isinstance(data, Replanned):
            await self._patch(
                MalleusJobStatus(phase=self._phase(Phase.REPLANNING), message=event.message[:1024])
            )
        elif isinstance(data, Migrated):
            ctx.metrics.replans.labels(namespace=ns, job=name).inc()
            await self._migrated(event.message, event.time, data)
        elif isinstance(data, ReplanFailed):
            ctx.metrics.replan_failures.labels(namespace=ns, job=name).inc()
            phase = self._phase(Phase.RUNNING)
            if phase is not None:
                await self._patch(MalleusJobStatus(phase=phase))

    async def _migrated(self, message: str, at: float, data: Migrated) -> None:
        """The trainers run a new plan: ``plan``, ``lastReplan``, back to Running."""
        last = LastReplan(
            time=dt.datetime.fromtimestamp(at, dt.UTC).replace(microsecond=0),
            reason=data.reason,
            generation=data.generation,
            planning_seconds=round(data.planning_seconds, 4),
            migration_seconds=None if data.seconds is None else round(data.seconds, 4),
            migration_bytes=None if data.bytes is None else int(data.bytes),
        )
        patch = status.replan_status(data.plan, last)
        patch.phase = self._phase(Phase.RUNNING)
        patch.message = message[:1024]
        await self._patch(patch)


def _last_recovery(rec: RecoveryRecord) -> LastRecovery:
    return LastRecovery(
        epoch=rec.epoch,
        time=status.now(),
        failed=sorted(rec.failed),
        step=rec.step,
        steps_lost=rec.steps_lost,
        seconds=round(rec.seconds, 3),
        bytes_restored=rec.bytes_restored,
        mode=rec.mode,
        generation=rec.generation,
    )


def recovered_message(rec: RecoveryRecord) -> str:
    """The ``Recovered`` event: which GPUs, how long, how many steps lost, from where."""
    lost = ", ".join(f"{g} ({why})" for g, why in sorted(rec.failed.items())) or "none"
    return (
        f"recovery {rec.epoch}: the job went on without GPU(s) {lost} in {rec.seconds:.1f} s, "
        f"{rec.steps_lost} step(s) lost, {size(rec.bytes_restored)} restored from "
        f"{'surviving replicas' if rec.mode == 'replicas' else 'the checkpoint'}; training "
        f"resumed at step {rec.step} on plan generation {rec.generation}"
    )
