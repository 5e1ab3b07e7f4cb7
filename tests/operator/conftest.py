"""An in-memory cluster standing in for `malleus.operator.k8s`, the operator's one API boundary.

`FakeCluster` implements the same coroutine functions with the same semantics (create is
idempotent by name and answers "already exists" with the stored object, read/delete of a
missing object give None/False, merge patches with null deleting a key) and records every
call, so handler tests assert on what was created, patched and posted, not on mocks' calls.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from malleus.operator import k8s, metrics, resources
from malleus.operator.settings import Settings, set_current

Key = tuple[str, str, str]  # (kind, namespace, name)


def merge_patch(target: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch (null deletes, objects merge, everything else replaces)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class FakeCluster:
    """Objects by (kind, namespace, name), MalleusJobs included, plus posted events."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.calls: list[tuple[str, Any]] = []
        self._rv = itertools.count(1)

    # -- helpers for tests -------------------------------------------------------------------
    def add_job(self, body: Mapping[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        stored = copy.deepcopy(dict(body))
        self.objects[("MalleusJob", meta["namespace"], meta["name"])] = stored
        return stored

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[("MalleusJob", namespace, name)]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for (k, _, _), o in sorted(self.objects.items()) if k == kind]

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events]

    def set_pod_phase(self, namespace: str, name: str, phase: str, **status: Any) -> dict[str, Any]:
        pod = self.objects[("Pod", namespace, name)]
        pod["status"] = {"phase": phase, **status}
        return pod

    # -- the k8s.py surface ------------------------------------------------------------------
    async def create(self, obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        self.calls.append(("create", obj))
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        if key in self.objects:
            return copy.deepcopy(self.objects[key]), False
        stored = copy.deepcopy(dict(obj))
        stored["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[key] = stored
        return copy.deepcopy(stored), True

    async def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list_children(self, kind: str, namespace: str, job: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self.objects.items())
            if k == kind
            and ns == namespace
            and (o["metadata"].get("labels") or {}).get(resources.JOB_LABEL) == job
        ]

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.calls.append(("delete", (kind, namespace, name)))
        return self.objects.pop((kind, namespace, name), None) is not None

    async def patch(
        self, kind: str, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        self.calls.append(("patch", (kind, namespace, name, copy.deepcopy(dict(body)))))
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            raise k8s.ApiError(404, "NotFound", f"{kind} {namespace}/{name}")
        return copy.deepcopy(merge_patch(obj, body))

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        import base64

        secret = self.objects.get(("Secret", namespace, name))
        if secret is None or key not in (secret.get("data") or {}):
            return None
        return base64.b64decode(secret["data"][key]).decode()

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.read("MalleusJob", namespace, name)

    async def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.calls.append(("patch_job_status", (namespace, name, copy.deepcopy(dict(status)))))
        job = self.objects.get(("MalleusJob", namespace, name))
        if job is not None:
            merge_patch(job.setdefault("status", {}), status)

    async def post_event(
        self, ref: resources.JobRef, type_: str, reason: str, message: str
    ) -> None:
        import datetime as dt

        self.events.append(
            resources.build_event(ref, type_, reason, message, dt.datetime.now(dt.UTC))
        )


K8S_FUNCTIONS = (
    "create",
    "read",
    "list_children",
    "delete",
    "patch",
    "read_secret_value",
    "get_job",
    "patch_job_status",
    "post_event",
)


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
    """Replace every API-calling function of `k8s` with the in-memory cluster's."""
    fake = FakeCluster()
    for name in K8S_FUNCTIONS:
        assert hasattr(k8s, name), f"k8s.{name} is gone: update the fake"
        monkeypatch.setattr(k8s, name, getattr(fake, name))
    monkeypatch.setattr(k8s, "configure", lambda *a, **k: None)
    return fake


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    """Settings and the phase tracker are process-wide: reset them around every test."""
    set_current(Settings(metrics_port=0))
    yield
    set_current(None)
    for key in list(metrics.PHASES._phases):
        metrics.PHASES.forget(*key)


def job_body(
    name: str = "demo",
    namespace: str = "ml",
    *,
    uid: str = "uid-1234",
    generation: int = 1,
    status: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A MalleusJob as kopf hands it over: 2 nodes x 4 GPUs, tp 2, the tiny preset."""
    base: dict[str, Any] = {
        "image": "ghcr.io/example/malleus-trainer:0.1.0",
        "nodes": 2,
        "gpusPerNode": 4,
        "model": {"preset": "tiny"},
        "training": {
            "globalBatchSize": 16,
            "microBatchSize": 2,
            "steps": 100,
            "learningRate": 0.001,
        },
        "parallelism": {"tp": 2},
    }
    base.update(spec)
    body: dict[str, Any] = {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "generation": generation,
            "resourceVersion": "1",
        },
        "spec": base,
    }
    if status is not None:
        body["status"] = status
    return body


@pytest.fixture
def make_job() -> Any:
    """`job_body` as a fixture (test modules cannot import conftest under importlib mode)."""
    return job_body
