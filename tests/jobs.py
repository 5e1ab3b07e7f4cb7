"""The MalleusJob bodies tests start from: one small job, as kopf hands it over or as a user
applies it. Every test module that needs a job body builds it here, so the job the tests mean
by "the default job" is declared once."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["job_body", "manifest"]

_SERVER_FIELDS = ("uid", "generation", "resourceVersion", "creationTimestamp", "managedFields")
"""The metadata the API server writes: `job_body` carries the first three (as kopf hands a job
over); an object read back from the server carries them all. A create refuses a
``resourceVersion``; the others are the server's to write, so a body sent with them is not what
a user applies."""


def job_body(
    name: str = "demo",
    namespace: str = "ml",
    *,
    uid: str = "uid-1234",
    generation: int = 1,
    status: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A MalleusJob as kopf hands it over: 2 nodes x 4 GPUs, tp 2, the tiny preset; ``spec``
    entries replace the defaults' top-level fields."""
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
    base.update(copy.deepcopy(spec))
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


def manifest(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a user would apply it: without the fields the API server sets
    (`_SERVER_FIELDS`); every test that sends a job body it built or read back goes through
    here, not through a list of keys of its own."""
    out = copy.deepcopy(body)
    for key in _SERVER_FIELDS:
        out["metadata"].pop(key, None)
    return out
