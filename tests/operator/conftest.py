"""Fixtures of the operator tests: a kmock cluster, a `Context` aimed at it, MalleusJob bodies.

Every test gets a fresh emulator (`tests.operator.kube.Kube`) and a fresh `Context` (the API
client, settings and metrics the handlers find in kopf's memo), so no test resets anything
process-wide.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from malleus.operator.context import MEMO_KEY, Context
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.settings import Settings
from tests.operator.kube import Kube


@pytest.fixture
def kube() -> Iterator[Kube]:
    """A kmock Kubernetes emulator on 127.0.0.1, stopped after the test."""
    with Kube() as k:
        yield k


@pytest.fixture
def ctx(kube: Kube) -> Context:
    """The operator's context on the emulator: real `k8s.Cluster`, fresh settings and metrics."""
    return Context(
        cluster=kube.cluster, settings=Settings(metrics_port=0), metrics=OperatorMetrics()
    )


@pytest.fixture
def memo(ctx: Context) -> kopf.Memo:
    """kopf's memo as the startup handler leaves it."""
    return kopf.Memo({MEMO_KEY: ctx})


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
