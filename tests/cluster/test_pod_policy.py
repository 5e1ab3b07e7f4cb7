"""The chart's pod template policy at a real API server: every attack of
`tests/security/pod_policy_cases.py` refused by `kubectl apply` itself (the chart's
ValidatingAdmissionPolicy, its binding and params), a compliant job accepted, an edit that adds a
hostPath refused, an update that keeps the template let through (kopf's finalizer patch)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.chart import render
from tests.security.pod_policy_cases import ATTACKS, check_admission_policy, job_manifest

from .controlplane import ControlPlane

RELEASE_NAMESPACE = "policy-system"
"""The release's namespace, which the binding covers (a namespace of its own: no other test's
jobs are judged by this policy)."""


@pytest.fixture
def admission_policy(
    control_plane: ControlPlane, cluster_crd: dict[str, Any]
) -> Iterator[list[dict[str, Any]]]:
    docs = render(
        release="malleus",
        namespace=RELEASE_NAMESPACE,
        show_only="templates/admission-policy.yaml",
    )
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ConfigMap",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ], kinds
    control_plane.create_namespace(RELEASE_NAMESPACE)
    control_plane.apply(docs)
    yield docs
    for d in docs:
        if d["kind"] != "ConfigMap":
            control_plane.kubectl(
                "delete", d["kind"].lower(), d["metadata"]["name"], "--wait=false", check=False
            )


def test_the_api_server_refuses_what_the_policy_forbids(
    control_plane: ControlPlane, admission_policy: list[dict[str, Any]]
) -> None:
    def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:  # noqa: A002 (the cases' contract)
        return control_plane.kubectl(*args, stdin=input, check=False)

    # A new policy reaches the admission plugin a moment after it is created: a dry run of the
    # first attack is polled until it is refused (bounded), never the assertions themselves.
    probe = job_manifest("probe", RELEASE_NAMESPACE, ATTACKS[0].template)
    deadline = time.monotonic() + 30
    while True:
        done = kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(probe))
        if done.returncode != 0 and "ValidatingAdmissionPolicy" in done.stderr:
            break
        assert time.monotonic() < deadline, f"the policy never took effect: {done}"
        time.sleep(0.2)
    seen = check_admission_policy(kubectl, RELEASE_NAMESPACE)
    assert "compliant" in seen
