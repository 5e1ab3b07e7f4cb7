"""The plan ConfigMap as the operator's memory, around the controller's own HTTP plan sink.

The controller's `HttpPlanSink` posts to the coordinator's ``POST /plan`` and waits for the
switch; this module only records plans in the job's ConfigMap on both sides of the POST:
``pending-plan.json`` before (an operator that crashes after the trainers took a plan but
before the acknowledgement must not lose its layout), ``plan.json`` once the trainers run it
(the pending key is then removed). The records also answer the controller's `PlanRecords`
lookups, so that a controller that finds the trainers on a generation it did not see applied
re-plans from the real layout. `resume_plan` reconciles the two after a restart with what the
coordinator's ``/status`` says it runs and holds pending.

The trainers also move the counter themselves: a recovery from failed GPUs goes on under a plan
of theirs, one generation up. The sink's ``fetch`` (the coordinator's ``GET /plan``) finds that
plan when the controller catches up with it, and `record_plan` keeps it as ``plan.json``, so a
restarted operator neither re-uses that generation nor re-plans from the layout before it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from malleus.control import ControlStatus
from malleus.controller.ports import Ack, PlanRejected, PlanSink
from malleus.planner.plan import Plan

from . import resources
from .k8s import Cluster

__all__ = ["PENDING_KEY", "ConfigMapPlanSink", "record_plan", "resume_plan"]

log = logging.getLogger(__name__)

PENDING_KEY = "pending-plan.json"
"""ConfigMap key of a plan posted to the trainers and not yet acknowledged."""


async def _patch_data(cluster: Cluster, ref: resources.JobRef, data: dict[str, Any]) -> None:
    name = resources.configmap_name(ref.name)
    await cluster.patch("ConfigMap", ref.namespace, name, {"data": data})


async def _records(cluster: Cluster, ref: resources.JobRef) -> tuple[Plan | None, Plan | None]:
    """(``plan.json``, ``pending-plan.json``) of the job's ConfigMap; None where absent."""
    cm = await cluster.read("ConfigMap", ref.namespace, resources.configmap_name(ref.name))
    data = (cm or {}).get("data") or {}
    plan = Plan.from_json(data[resources.PLAN_KEY]) if data.get(resources.PLAN_KEY) else None
    pending = Plan.from_json(data[PENDING_KEY]) if data.get(PENDING_KEY) else None
    return plan, pending


async def record_plan(cluster: Cluster, ref: resources.JobRef, plan: Plan) -> None:
    """``plan`` (the trainers' own, after a recovery) is in force: it becomes ``plan.json``."""
    await _patch_data(cluster, ref, {resources.PLAN_KEY: plan.to_json()})


class ConfigMapPlanSink:
    """Records plans in the job's ConfigMap around an inner sink that reaches the trainers."""

    def __init__(
        self,
        cluster: Cluster,
        ref: resources.JobRef,
        inner: PlanSink,
        fetch: Callable[[], Awaitable[Plan | None]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.ref = ref
        self.inner = inner
        self.fetch = fetch
        """The trainers' plan in force (``GET /plan``), for generations they made themselves."""
        self._pending: dict[int, Plan] = {}
        self._recorded = -1  # the newest generation this sink wrote as plan.json

    async def publish(self, plan: Plan) -> int:
        await _patch_data(self.cluster, self.ref, {PENDING_KEY: plan.to_json()})
        try:
            generation = await self.inner.publish(plan)
        except PlanRejected:  # refused for certain: it is pending nowhere (silence might not be)
            await _patch_data(self.cluster, self.ref, {PENDING_KEY: None})
            raise
        self._pending[generation] = plan.model_copy(update={"generation": generation})
        return generation

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        ack = await self.inner.wait_applied(generation, timeout)
        plan = self._pending.pop(generation, None)
        if plan is not None:
            await self.record_applied(plan)
        else:
            await _patch_data(self.cluster, self.ref, {PENDING_KEY: None})
        return ack

    async def record_applied(self, plan: Plan) -> None:
        """``plan`` is in force: it becomes ``plan.json`` and the pending record goes (once per
        generation, however the controller learnt of the switch)."""
        if plan.generation <= self._recorded:
            return
        # null deletes the key in a merge patch
        await _patch_data(
            self.cluster, self.ref, {PENDING_KEY: None, resources.PLAN_KEY: plan.to_json()}
        )
        self._recorded = plan.generation

    async def recorded_plan(self, generation: int) -> Plan | None:
        """The plan of ``generation`` this sink published, or found in the ConfigMap."""
        if generation in self._pending:
            return self._pending[generation]
        for plan in await _records(self.cluster, self.ref):
            if plan is not None and plan.generation == generation:
                return plan
        theirs = await self.fetch() if self.fetch is not None else None
        if theirs is not None and theirs.generation == generation:
            await self.record_applied(theirs)
            return theirs
        return None


async def resume_plan(
    cluster: Cluster, ref: resources.JobRef, running: ControlStatus | None
) -> tuple[Plan | None, Plan | None]:
    """(plan in force, plan still pending) after an operator restart, from the ConfigMap and
    the coordinator's ``/status`` (``running``; None when it did not answer).

    ``plan.json`` is the last acknowledged plan. A ``pending-plan.json`` that the coordinator
    already runs is promoted; one it holds pending (posted just before the restart, not yet
    taken at a step boundary) stays pending, for the controller to adopt once the trainers take
    it; one it does not know is dropped. With no answer it stays pending too: the trainers may
    well take it, and a controller that waits in vain for it only gets a 409 to resync from.
    """
    plan, pending = await _records(cluster, ref)
    if pending is None:
        return plan, None
    if running is not None and running.generation >= pending.generation:
        log.info("%s/%s: trainers run pending plan %d", ref.namespace, ref.name, pending.generation)
        await _patch_data(cluster, ref, {PENDING_KEY: None, resources.PLAN_KEY: pending.to_json()})
        return pending, None
    if running is None or running.pending_generation == pending.generation:
        return plan, pending
    log.info(
        "%s/%s: dropping pending plan %d, which the trainers do not hold",
        ref.namespace,
        ref.name,
        pending.generation,
    )
    await _patch_data(cluster, ref, {PENDING_KEY: None})
    return plan, None
