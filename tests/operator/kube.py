"""kmock's Kubernetes emulator as the operator tests' cluster, reached over real HTTP.

The operator's one API boundary, `malleus.operator.k8s.Cluster`, runs unchanged against it: the
kubernetes client makes real requests to kmock's `KubernetesEmulator` on 127.0.0.1, which stores
objects in memory, answers 409 for an existing name and 404 for a missing one, and applies
merge patches (null deletes a key). The tests read and change the stored objects directly
(`Kube.get`, `Kube.put`, `Kube.remove`) and count requests from kmock's request log.

Two things the operator relies on and kmock 0.8 does not do, added by `Emulator` (nothing else):
- label selectors on lists: kmock lists every object of the resource and namespace, while the
  operator finds a job's pods by ``malleus.io/job=<name>``;
- ``metadata.generateName``: kmock keys objects by ``metadata.name``, so a second Event (named by
  the server from ``generateName``) would collide with the first as a 409.

The emulator runs on an event loop of its own in a background thread, so tests stay synchronous
and call handlers with ``asyncio.run`` as kopf would call them on its loop.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import kmock
from kubernetes import client as kclient

from malleus.operator.k8s import Cluster

__all__ = ["KINDS", "Emulator", "Kube"]

KINDS = {
    "Pod": kmock.resource("", "v1", "pods"),
    "Service": kmock.resource("", "v1", "services"),
    "ConfigMap": kmock.resource("", "v1", "configmaps"),
    "Secret": kmock.resource("", "v1", "secrets"),
    "Event": kmock.resource("", "v1", "events"),
    "NetworkPolicy": kmock.resource("networking.k8s.io", "v1", "networkpolicies"),
    "PodDisruptionBudget": kmock.resource("policy", "v1", "poddisruptionbudgets"),
    "MalleusJob": kmock.resource("malleus.io", "v1alpha1", "malleusjobs"),
}


def _selected(obj: Mapping[str, Any], selector: str) -> bool:
    """Equality-based label selector (``a=b,c=d``): all the operator uses."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip().lstrip("="):
            return False
    return True


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus label-selected lists and server-generated names."""

    _names = itertools.count(1)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{next(self._names):05d}"
        return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [o for o in result["items"] if _selected(o, selector)]
        return result


class Kube:
    """A running `Emulator`, a `Cluster` aimed at it, and helpers to read and change its state."""

    def __init__(self) -> None:
        self.emulator = Emulator()
        for resource in KINDS.values():  # lists of a kind with no objects yet answer [], not 404
            self.emulator.resources[resource] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self.url = ""

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> Kube:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("kmock did not start within 10 s")
        cfg = kclient.Configuration()
        cfg.host = self.url
        self.cluster = Cluster(kclient.ApiClient(cfg))
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.close()
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()

    # -- state --------------------------------------------------------------------------------
    def _keys(self, kind: str) -> Iterator[tuple[Any, str | None, str]]:
        for key in list(self.emulator.objects.keys()):
            if key[0] == KINDS[kind] and not self.emulator.objects[key].deleted:
                yield key

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object (a copy), or None."""
        key = (KINDS[kind], namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return copy.deepcopy(dict(self.emulator.objects[key].raw))

    def put(self, kind: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store ``obj`` as is (created or replaced), as if someone else had written it."""
        meta = obj["metadata"]
        key = (KINDS[kind], meta["namespace"], meta["name"])
        stored = copy.deepcopy(dict(obj))
        if key in self.emulator.objects and not self.emulator.objects[key].deleted:
            self.emulator.objects[key].delete()
        if key in self.emulator.objects:
            self.emulator.objects[key].create(stored)
        else:
            self.emulator.objects[key] = stored
        return stored

    def remove(self, kind: str, namespace: str, name: str) -> None:
        """Delete behind the operator's back (no request, so no watch event)."""
        self.emulator.objects[(KINDS[kind], namespace, name)].delete()

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Every live object of ``kind``, by namespace and name."""
        found = [self.get(kind, ns, name) for _, ns, name in self._keys(kind) if ns is not None]
        return sorted(
            (o for o in found if o),
            key=lambda o: (o["metadata"]["namespace"], o["metadata"]["name"]),
        )

    def names(self, *, skip: tuple[str, ...] = ("MalleusJob", "Event")) -> list[tuple[str, str]]:
        """(kind, name) of every live object, kinds in ``skip`` aside."""
        return sorted(
            (kind, o["metadata"]["name"])
            for kind in KINDS
            if kind not in skip
            for o in self.of_kind(kind)
        )

    # -- jobs, pods, events -------------------------------------------------------------------
    def add_job(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.put("MalleusJob", body)

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        job = self.get("MalleusJob", namespace, name)
        assert job is not None, f"no MalleusJob {namespace}/{name}"
        return job

    def merge_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """What kopf does with a handler's ``patch.status``."""
        self.emulator.objects[(KINDS["MalleusJob"], namespace, name)].patch({"status": status})

    def set_pod_phase(self, namespace: str, name: str, phase: str, **status: Any) -> dict[str, Any]:
        pod = self.get("Pod", namespace, name)
        assert pod is not None, f"no pod {namespace}/{name}"
        pod["status"] = {"phase": phase, **status}
        return self.put("Pod", pod)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Posted events, oldest first."""
        return sorted(self.of_kind("Event"), key=lambda e: e["metadata"]["name"])

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events]

    def requests(self, action: str, kind: str | None = None) -> int:
        """How many ``create``/``delete``/``update``/``fetch``/``list`` requests reached kmock."""
        want = kmock.action(action)
        return sum(
            1
            for r in list(self.emulator)
            if r.action == want and (kind is None or r.resource == KINDS[kind])
        )
