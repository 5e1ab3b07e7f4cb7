"""A job's children through the `k8s.Cluster`: create what is missing, delete what is the job's.

Both directions go by name and by controller owner, never by name alone: an object of a child's
name that the job does not control may have been planted (a ``<job>-control`` Secret holding a
token someone knows, a ``<job>-config`` ConfigMap with a plan of their choosing), so it is
neither used (`k8s.NameConflict` stops the creation) nor deleted.
"""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Any

from malleus.job import ResolvedJob
from malleus.planner.plan import Plan

from . import resources, tls, workers
from .context import Context
from .settings import Settings

__all__ = ["child_kinds", "delete_children", "ensure_children", "network_policy"]


def child_kinds(settings: Settings) -> tuple[str, ...]:
    """The kinds a job owns, in deletion order (pods first: they use the rest). NetworkPolicy
    and PodDisruptionBudget only when the operator makes them (without, it may have no right
    to read them)."""
    budget = ("PodDisruptionBudget",) if settings.disruption_budgets else ()
    policy = ("NetworkPolicy",) if settings.network_policies else ()
    return ("Pod", *budget, "Service", "ConfigMap", "Secret", *policy)


def network_policy(
    settings: Settings, job: ResolvedJob, ref: resources.JobRef
) -> dict[str, Any] | None:
    """The job's NetworkPolicy as the settings ask for it (None: the operator makes none)."""
    if not settings.network_policies:
        return None
    peers = settings.control_port_peer_list()
    if settings.operator_namespace:
        peers.insert(
            0, resources.operator_peer(settings.operator_namespace, settings.operator_selector())
        )
    return resources.build_network_policy(job, ref, peers)


async def ensure_children(
    ctx: Context, job: ResolvedJob, ref: resources.JobRef, plan: Plan, *, pods: bool = True
) -> tuple[list[str], Plan]:
    """Create what is missing (idempotent by name): the job's existing objects are left
    untouched, so a Secret keeps its token and a ConfigMap its newer plan.

    Returns the names created and the plan the workers get: the existing ConfigMap's when there
    is one (a retried or resumed create must not show a plan the pods do not run). Raises
    `k8s.NameConflict` at the first name taken by an object the job does not control; what
    comes after it (the pods last) is not created. Without ``pods`` (a job created suspended:
    `admission`), everything but the pods.
    """
    created: list[str] = []
    token = secrets.token_urlsafe(32)
    certificates = tls.issue(tls.worker_names(ref, job.nodes), dt.datetime.now(dt.UTC))
    policy = network_policy(ctx.settings, job, ref)
    built = workers.build_children(
        job, ref, plan, token, policy, certificates, ctx.settings.disruption_budgets
    )
    for obj in built if pods else [o for o in built if o["kind"] != "Pod"]:
        stored, new = await ctx.cluster.create(obj)
        if new:
            created.append(f"{obj['kind']}/{obj['metadata']['name']}")
        elif obj["kind"] == "ConfigMap":
            text = (stored.get("data") or {}).get(resources.PLAN_KEY)
            if text:
                plan = Plan.from_json(text)
    return created, plan


def _names(ref: resources.JobRef, nodes: int) -> dict[str, list[str]]:
    return {
        "Pod": [resources.pod_name(ref.name, i) for i in range(nodes)],
        "Service": [resources.service_name(ref.name)],
        "ConfigMap": [resources.configmap_name(ref.name)],
        "Secret": [resources.secret_name(ref.name)],
        "NetworkPolicy": [resources.network_policy_name(ref.name)],
        "PodDisruptionBudget": [resources.disruption_budget_name(ref.name)],
    }


async def delete_children(
    ctx: Context, ref: resources.JobRef, nodes: int, kinds: tuple[str, ...] | None = None
) -> list[str]:
    """Delete what the job controls of ``kinds`` (default: all, pods first); returns
    ``kind/name`` of what was deleted.

    Pods are found by label (their count may differ from an edited spec) and by name; the rest
    by their fixed names, so the operator needs no right to list Secrets.
    """
    known = _names(ref, nodes)
    deleted: list[str] = []
    for kind in kinds or child_kinds(ctx.settings):
        found: dict[str, dict[str, Any]] = {}
        if kind == "Pod":
            for obj in await ctx.cluster.list_children(kind, ref.namespace, ref.name):
                found[obj["metadata"]["name"]] = obj
        for name in known[kind]:
            if name not in found:
                obj = await ctx.cluster.read(kind, ref.namespace, name)
                if obj is not None:
                    found[name] = obj
        for name, obj in sorted(found.items()):
            if resources.owned_by(obj, ref.uid):
                await ctx.cluster.delete(kind, ref.namespace, name)
                deleted.append(f"{kind}/{name}")
    return deleted
