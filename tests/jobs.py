"""The MalleusJob bodies tests start from: one small job, as kopf hands it over or as a user
applies it, and the small job the end-to-end tests run on the real control plane. Every test
module that needs a job body builds it here, so the job the tests mean by "the default job" is
declared once."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["cluster_job", "job_body", "manifest"]

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


def cluster_job(name: str, nodes: int = 2, **spec: Any) -> dict[str, Any]:
    """A MalleusJob as a user applies it on the real control plane (tests/cluster, tests/e2e):
    ``nodes`` x 2 GPUs, the tiny preset with 4 layers, tp 2, 1000 steps (far more than any test
    needs: the job still trains at the end), one worker per node; ``spec`` entries replace the
    top-level fields (the pod template's anti-affinity is added to a template given here)."""
    body: dict[str, Any] = {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": name},
        "spec": {
            "image": "malleus:e2e",
            "nodes": nodes,
            "gpusPerNode": 2,
            "model": {"preset": "tiny", "layers": 4},
            "training": {
                "globalBatchSize": 4,
                "microBatchSize": 1,
                "steps": 1000,
                "learningRate": 0.003,
            },
            "parallelism": {"tp": 2},
        },
    }
    body["spec"].update(copy.deepcopy(spec))
    # one worker per node: the operator asks for it on GPUs only, and emulated pods (or GPUs
    # the process kubelets have plenty of) would fit anywhere
    term = {
        "labelSelector": {
            "matchLabels": {"malleus.io/job": name, "app.kubernetes.io/component": "worker"}
        },
        "topologyKey": "kubernetes.io/hostname",
    }
    template = body["spec"].setdefault("podTemplate", {}).setdefault("spec", {})
    template["affinity"] = {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    }
    return body
