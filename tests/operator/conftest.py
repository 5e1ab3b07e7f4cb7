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
from tests.jobs import job_body
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


@pytest.fixture
def make_job() -> Any:
    """`job_body` as a fixture (test modules cannot import conftest under importlib mode)."""
    return job_body
