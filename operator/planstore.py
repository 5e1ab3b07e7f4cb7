"""The plan ConfigMap as the operator's memory, around the controller's own HTTP plan sink.

The controller's `HttpPlanSink` posts to the coordinator's ``POST /plan`` and waits for the
switch; this module only records plans in the job's ConfigMap on both sides of the POST:
``pending-plan.json`` before (an operator that crashes after the trainers took a plan but
before the acknowledgement must not lose its layout), ``plan.json`` once the trainers run it
(the pending key is then removed). `resume_plan` reconciles the two after a restart with the
generation the coordinator reports.
"""

from __future__ import annotations

import logging
from typing import Any

from malleus.controller.ports import Ack, PlanSink
from malleus.planner.plan import Plan

from . import resources
from .k8s import Cluster

__all__ = ["PENDING_KEY", "ConfigMapPlanSink", "resume_plan"]

log = logging.getLogger(__name__)

PENDING_KEY = "pending-plan.json"
"""ConfigMap key of a plan posted to the trainers and not yet acknowledged."""


async def _patch_data(cluster: Cluster, ref: resources.JobRef, data: dict[str, Any]) -> None:
    name = resources.configmap_name(ref.name)
    await cluster.patch("ConfigMap", ref.namespace, name, {"data": data})


class ConfigMapPlanSink:
    """Records plans in the job's ConfigMap around an inner sink that reaches the trainers."""

    def __init__(self, cluster: Cluster, ref: resources.JobRef, inner: PlanSink) -> None:
        self.cluster = cluster
        self.ref = ref
        self.inner = inner
        self._pending: dict[int, Plan] = {}

    async def publish(self, plan: Plan) -> int:
        await _patch_data(self.cluster, self.ref, {PENDING_KEY: plan.to_json()})
        generation = await self.inner.publish(plan)
        self._pending[generation] = plan.model_copy(update={"generation": generation})
        return generation

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        ack = await self.inner.wait_applied(generation, timeout)
        plan = self._pending.pop(generation, None)
        data: dict[str, Any] = {PENDING_KEY: None}  # null deletes the key in a merge patch
        if plan is not None:
            data[resources.PLAN_KEY] = plan.to_json()
        await _patch_data(self.cluster, self.ref, data)
        return ack


async def resume_plan(
    cluster: Cluster, ref: resources.JobRef, running_generation: int | None
) -> Plan | None:
    """The plan in force after an operator restart, from the ConfigMap and the coordinator.

    ``plan.json`` is the last acknowledged plan; a ``pending-plan.json`` that the coordinator
    already runs (``running_generation`` from its /status) is promoted, one it does not run
    is dropped (the controller will plan again if the rates still call for it).
    """
    cm = await cluster.read("ConfigMap", ref.namespace, resources.configmap_name(ref.name))
    if cm is None:
        return None
    data = cm.get("data") or {}
    plan = Plan.from_json(data[resources.PLAN_KEY]) if data.get(resources.PLAN_KEY) else None
    pending = Plan.from_json(data[PENDING_KEY]) if data.get(PENDING_KEY) else None
    if pending is not None:
        update: dict[str, Any] = {PENDING_KEY: None}
        if running_generation is not None and running_generation >= pending.generation:
            log.info(
                "%s/%s: trainers run pending plan %d", ref.namespace, ref.name, pending.generation
            )
            plan = pending
            update[resources.PLAN_KEY] = pending.to_json()
        await _patch_data(cluster, ref, update)
    return plan
