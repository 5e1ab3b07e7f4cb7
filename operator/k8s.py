"""The one module that calls the Kubernetes API (kopf's own watching and patching aside).

A `Cluster` holds one API client; the operator makes it at startup (`Cluster.connect`) and
hands it to the handlers and the daemons through kopf's memo, so nothing here is process-wide
and a test points a `Cluster` of its own at whatever API server it runs. Calls take and return
plain dicts (the JSON the API server speaks), not the kubernetes package's generated models:
the dicts are what the pure builders produce, what tests assert on, and what stays valid against
partial emulations of the core API (kmock) that the generated models would reject.

A `Cluster` targets any cluster: in-cluster service-account credentials, or a kubeconfig file
and context (the tests point it at a real API server, or at kmock). Calls run the synchronous
kubernetes client in a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from malleus.job import API_GROUP, PLURAL, VERSION

from . import resources

__all__ = ["ApiError", "Cluster", "NameConflict"]

_KINDS = {
    "Pod": ("core", "pod", "v1"),
    "Service": ("core", "service", "v1"),
    "ConfigMap": ("core", "config_map", "v1"),
    "Secret": ("core", "secret", "v1"),
    "Event": ("core", "event", "v1"),
    "NetworkPolicy": ("networking", "network_policy", "networking.k8s.io/v1"),
    "PodDisruptionBudget": ("policy", "pod_disruption_budget", "policy/v1"),
}
"""Kinds the operator manages -> (API group client, the client's method suffix, apiVersion)."""

_MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    """An API call failed for a reason other than "already exists" / "not found"."""

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(f"Kubernetes API error {status} {reason}: {body[:500]}")


class StaleRead(RuntimeError):
    """A conditional write found the object changed since it was read (409 Conflict)."""


class NameConflict(RuntimeError):
    """An object of a child's kind and name exists and is not controlled by the same owner.

    Never adopted: a planted ``<job>-control`` Secret would hand the trainers a token someone
    knows, a planted ``<job>-config`` ConfigMap the plan they run. The caller reports it and
    retries once the impostor is gone.
    """

    def __init__(self, kind: str, namespace: str, name: str, owner: str) -> None:
        self.kind = kind
        self.namespace = namespace
        self.name = name
        self.owner = owner
        super().__init__(
            f"{kind}/{name} already exists in {namespace} and is not this job's ({owner}); "
            "it is left untouched: delete or rename it"
        )


def _decode(response: Any) -> dict[str, Any]:
    data = response.data
    decoded: dict[str, Any] = json.loads(data) if data else {}
    return decoded


def _error(e: ApiException) -> ApiError:
    return ApiError(int(e.status or 0), str(e.reason), str(e.body or ""))


async def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, _preload_content=False, **kwargs)


class Cluster:
    """The API calls the operator makes, on one API client."""

    def __init__(self, api: kclient.ApiClient) -> None:
        self.api = api
        self._core = kclient.CoreV1Api(api)
        self._custom = kclient.CustomObjectsApi(api)
        self._groups = {
            "core": self._core,
            "networking": kclient.NetworkingV1Api(api),
            "policy": kclient.PolicyV1Api(api),
        }

    @classmethod
    def connect(cls, kubeconfig: str | None = None, context: str | None = None) -> Cluster:
        """A kubeconfig (and context), else in-cluster credentials, else the default file."""
        cfg = kclient.Configuration()
        if kubeconfig is not None:
            kconfig.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=cfg
            )
        else:
            try:
                kconfig.load_incluster_config(client_configuration=cfg)
            except kconfig.ConfigException:
                kconfig.load_kube_config(context=context, client_configuration=cfg)
        return cls(kclient.ApiClient(configuration=cfg))

    def close(self) -> None:
        """Release the client's connection pool."""
        self.api.close()

    def _method(self, verb: str, kind: str) -> Any:
        try:
            group, suffix, _ = _KINDS[kind]
        except KeyError:
            raise ValueError(f"k8s: unsupported kind {kind!r}; known: {sorted(_KINDS)}") from None
        return getattr(self._groups[group], f"{verb}_namespaced_{suffix}")

    # ---- generic core objects ---------------------------------------------------------------

    async def create(self, obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create ``obj``; if one of that name exists, return it untouched. -> (object, created).

        Idempotent by name, so a restarted operator (or a retried handler) never duplicates a
        pod and never replaces a Secret's token or a ConfigMap's newer plan. But only an
        existing object with the same controller as ``obj`` (the same owner uid) is returned:
        any other raises `NameConflict` and is left as it is.
        """
        kind = obj["kind"]
        ns = obj["metadata"]["namespace"]
        try:
            return _decode(await _run(self._method("create", kind), ns, dict(obj))), True
        except ApiException as e:
            if e.status != 409 or "name" not in obj["metadata"]:
                raise _error(e) from None
        existing = await self.read(kind, ns, obj["metadata"]["name"])
        if existing is None:  # deleted in between: try once more
            try:
                return _decode(await _run(self._method("create", kind), ns, dict(obj))), True
            except ApiException as e:
                raise _error(e) from None
        ours, theirs = resources.controller_of(obj), resources.controller_of(existing)
        if (ours or {}).get("uid") != (theirs or {}).get("uid"):
            name = obj["metadata"]["name"]
            raise NameConflict(kind, ns, name, resources.describe_owner(existing))
        return existing, False

    async def create_custom(
        self, obj: Mapping[str, Any], plural: str
    ) -> tuple[dict[str, Any], bool]:
        """`create` for a namespaced custom object (a coscheduler's PodGroup), by its
        ``apiVersion`` and ``plural``: an existing one of that name is returned when the same
        owner controls it, else `NameConflict`. `ApiError` 404: the API (its CRD) is not served.
        """
        group, _, version = str(obj["apiVersion"]).partition("/")
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        custom = self._custom
        try:
            made = await _run(
                custom.create_namespaced_custom_object, group, version, ns, plural, dict(obj)
            )
            return _decode(made), True
        except ApiException as e:
            if e.status != 409:
                raise _error(e) from None
        try:
            existing = _decode(
                await _run(custom.get_namespaced_custom_object, group, version, ns, plural, name)
            )
        except ApiException as e:
            raise _error(e) from None
        ours, theirs = resources.controller_of(obj), resources.controller_of(existing)
        if (ours or {}).get("uid") != (theirs or {}).get("uid"):
            raise NameConflict(str(obj["kind"]), ns, name, resources.describe_owner(existing))
        return existing, False

    async def read_custom(
        self, api_version: str, plural: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """A namespaced custom object (a Kueue Workload), or None when it does not exist.
        `ApiError` otherwise (404 of a served API is None; an API not served is also a 404,
        which the callers tell apart by creating first)."""
        group, _, version = api_version.partition("/")
        try:
            return _decode(
                await _run(
                    self._custom.get_namespaced_custom_object,
                    group,
                    version,
                    namespace,
                    plural,
                    name,
                )
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise _error(e) from None

    async def read_cluster_custom(
        self, api_version: str, plural: str, name: str
    ) -> dict[str, Any] | None:
        """A cluster-scoped custom object (a Kueue WorkloadPriorityClass), or None (404)."""
        group, _, version = api_version.partition("/")
        try:
            return _decode(
                await _run(self._custom.get_cluster_custom_object, group, version, plural, name)
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise _error(e) from None

    async def patch_custom_status(
        self, api_version: str, plural: str, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of a custom object's ``status`` subresource (a Kueue Workload's:
        the quota an evicted job's Workload gives back)."""
        group, _, version = api_version.partition("/")
        try:
            return _decode(
                await _run(
                    self._custom.patch_namespaced_custom_object_status,
                    group,
                    version,
                    namespace,
                    plural,
                    name,
                    dict(body),
                    _content_type=_MERGE_PATCH,
                )
            )
        except ApiException as e:
            raise _error(e) from None

    async def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return _decode(await _run(self._method("read", kind), name, namespace))
        except ApiException as e:
            if e.status == 404:
                return None
            raise _error(e) from None

    async def list_children(self, kind: str, namespace: str, job: str) -> list[dict[str, Any]]:
        """Objects of ``kind`` labelled as children of ``job``."""
        try:
            result = _decode(
                await _run(
                    self._method("list", kind),
                    namespace,
                    label_selector=f"{resources.JOB_LABEL}={job}",
                )
            )
        except ApiException as e:
            raise _error(e) from None
        items: list[dict[str, Any]] = result.get("items") or []
        for item in items:  # list items omit these; callers feed them back to builders and tests
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", _KINDS[kind][2])
        return items

    async def delete(
        self, kind: str, namespace: str, name: str, *, grace_period_seconds: int | None = None
    ) -> bool:
        """Delete (background propagation; ``grace_period_seconds=0`` forces a pod whose
        kubelet will never confirm); False when it was already gone."""
        options: dict[str, Any] = {"propagationPolicy": "Background"}
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        try:
            await _run(self._method("delete", kind), name, namespace, body=options)
        except ApiException as e:
            if e.status == 404:
                return False
            raise _error(e) from None
        return True

    async def patch(
        self, kind: str, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of a core object (e.g. the plan ConfigMap's ``data``)."""
        try:
            return _decode(
                await _run(
                    self._method("patch", kind),
                    name,
                    namespace,
                    dict(body),
                    _content_type=_MERGE_PATCH,
                )
            )
        except ApiException as e:
            raise _error(e) from None

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """A Secret's value, base64-decoded; None when the Secret or key is missing."""
        secret = await self.read("Secret", namespace, name)
        if secret is None:
            return None
        if key in (secret.get("stringData") or {}):
            return str(secret["stringData"][key])
        raw = (secret.get("data") or {}).get(key)
        return None if raw is None else base64.b64decode(raw).decode()

    # ---- the MalleusJob itself --------------------------------------------------------------

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The MalleusJob (with status), or None when it is gone."""
        try:
            return _decode(
                await _run(
                    self._custom.get_namespaced_custom_object,
                    API_GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    name,
                )
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise _error(e) from None

    async def patch_job_status(
        self,
        namespace: str,
        name: str,
        status: Mapping[str, Any],
        *,
        resource_version: str | None = None,
    ) -> None:
        """Merge ``status`` into the job's ``.status`` (status subresource); a gone job is ignored.

        Lists (conditions, stragglers, pipelines) are replaced whole by a merge patch, so
        callers send complete lists (see `status.merge_conditions`). With ``resource_version``
        the patch applies only to that version of the job, else `StaleRead` (409): a decision
        made from an older read (two pod events racing to the same transition) is made again.
        """
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            await _run(
                self._custom.patch_namespaced_custom_object_status,
                API_GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                body,
                _content_type=_MERGE_PATCH,
            )
        except ApiException as e:
            if e.status == 404:
                return
            if e.status == 409 and resource_version is not None:
                message = f"{namespace}/{name} changed since version {resource_version}"
                raise StaleRead(message) from None
            raise _error(e) from None

    async def post_event(
        self, ref: resources.JobRef, type_: str, reason: str, message: str
    ) -> None:
        """Post an Event on the job; failures are swallowed (events are best effort)."""
        event = resources.build_event(ref, type_, reason, message, dt.datetime.now(dt.UTC))
        with contextlib.suppress(ApiException, OSError):
            await _run(self._core.create_namespaced_event, ref.namespace, event)
