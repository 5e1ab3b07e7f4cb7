"""The operator's PlanSink: the controller's HTTP sink, plus the plan ConfigMap as memory.

`HttpPlanSink` (controller) posts to the coordinator's ``POST /plan`` with the job's token and
polls ``GET /status`` for the switch. Around it, the ConfigMap is written on both sides of the
POST: ``pending-plan.json`` before (an operator that crashes after the trainers took a plan but
before the acknowledgement must not lose its layout), ``plan.json`` once the trainers run it
(the pending key is then removed). `resume_plan` reconciles the two after a restart with the
generation the coordinator reports.
"""

from __future__ import annotations

import logging
from typing import Any

from malleus.controller.ports import Ack, PlanSink
from malleus.planner.plan import Plan

from . import k8s, resources

__all__ = ["PENDING_KEY", "PLAN_KEY", "ConfigMapPlanSink", "resume_plan"]

log = logging.getLogger(__name__)

PLAN_KEY = "plan.json"
PENDING_KEY = "pending-plan.json"


async def _patch_data(ref: resources.JobRef, data: dict[str, Any]) -> None:
    await k8s.patch("ConfigMap", ref.namespace, resources.configmap_name(ref.name), {"data": data})


class ConfigMapPlanSink:
    """Records plans in the job's ConfigMap around an inner sink that reaches the trainers."""

    def __init__(self, ref: resources.JobRef, inner: PlanSink) -> None:
        self.ref = ref
        self.inner = inner
        self._pending: dict[int, Plan] = {}

    async def publish(self, plan: Plan) -> int:
        await _patch_data(self.ref, {PENDING_KEY: plan.to_json()})
        generation = await self.inner.publish(plan)
        self._pending[generation] = plan.model_copy(update={"generation": generation})
        return generation

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        ack = await self.inner.wait_applied(generation, timeout)
        plan = self._pending.pop(generation, None)
        data: dict[str, Any] = {PENDING_KEY: None}  # null deletes the key in a merge patch
        if plan is not None:
            data[PLAN_KEY] = plan.to_json()
        await _patch_data(self.ref, data)
        return ack


async def resume_plan(ref: resources.JobRef, running_generation: int | None) -> Plan | None:
    """The plan in force after an operator restart, from the ConfigMap and the coordinator.

    ``plan.json`` is the last acknowledged plan; a ``pending-plan.json`` that the coordinator
    already runs (``running_generation`` from its /status) is promoted, one it does not run
    is dropped (the controller will plan again if the rates still call for it).
    """
    cm = await k8s.read("ConfigMap", ref.namespace, resources.configmap_name(ref.name))
    if cm is None:
        return None
    data = cm.get("data") or {}
    plan = Plan.from_json(data[PLAN_KEY]) if data.get(PLAN_KEY) else None
    pending = Plan.from_json(data[PENDING_KEY]) if data.get(PENDING_KEY) else None
    if pending is not None:
        update: dict[str, Any] = {PENDING_KEY: None}
        if running_generation is not None and running_generation >= pending.generation:
            log.info(
                "%s/%s: trainers run pending plan %d", ref.namespace, ref.name, pending.generation
            )
            plan = pending
            update[PLAN_KEY] = pending.to_json()
        await _patch_data(ref, update)
    return plan
