"""Fixtures for tests on the real control plane (`tests.cluster.controlplane`).

One control plane for the whole session (its start time is printed at the end of the run) and
two process-kubelet nodes shared by the tests that only need somewhere to run pods; a test that
breaks a node (loses it) makes a node of its own. Tests isolate themselves with a namespace of
their own (``namespace``). Everything skips, with the reason, when ``MALLEUS_K8S_ASSETS`` lacks
the binaries.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart import render
from tests.cluster.controlplane import ControlPlane, assets_dir, wait_until
from tests.cluster.kubelet import ProcessKubelet
from tests.cluster.kueue import Kueue, kueue_assets

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "malleusjob.yaml"
SHARED_NODES = ("node-1", "node-2")
_TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler, up and serving."""
    assets, reason = assets_dir()
    if assets is None:
        pytest.skip(reason)
    with ControlPlane(assets, tmp_path_factory.mktemp("control-plane")) as cluster:
        _TIMINGS["control plane started in"] = cluster.start_seconds
        for phase, seconds in cluster.phases.items():
            _TIMINGS[f"  {phase} ready after"] = seconds
        yield cluster


def node_ready(cluster: ControlPlane, name: str) -> bool | None:
    """True once the node is Ready and carries no not-ready/unreachable taint (schedulable)."""
    response = cluster.http().get(f"/api/v1/nodes/{name}")
    if response.status_code != 200:
        return None
    node = response.json()
    conditions = {c["type"]: c["status"] for c in node["status"].get("conditions") or []}
    taints = {t["key"] for t in node["spec"].get("taints") or []}
    blocked = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"} & taints
    return True if conditions.get("Ready") == "True" and not blocked else None


@pytest.fixture(scope="session")
def nodes(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ProcessKubelet]]:
    """Two Ready nodes (8 ``nvidia.com/gpu`` each) whose kubelets run pods as processes."""
    workdir = tmp_path_factory.mktemp("kubelets")
    kubelets = [
        ProcessKubelet(
            control_plane, name, workdir / name, index=i + 1,
            labels={"nvidia.com/gpu.product": "emulated"},
        )
        for i, name in enumerate(SHARED_NODES)
    ]  # fmt: skip
    try:
        for kubelet in kubelets:
            kubelet.start()
        for kubelet in kubelets:
            wait_until(
                lambda k=kubelet: node_ready(control_plane, k.name),
                30,
                f"node {kubelet.name} Ready",
                alive=lambda k=kubelet: k.check() or control_plane.dead(),
            )
        yield kubelets
    finally:
        for kubelet in kubelets:
            kubelet.stop()
    errors = [e for k in kubelets for e in k.errors]
    assert not errors, "the kubelets met errors:\n" + "\n".join(errors)


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount), deleted afterwards."""
    name = control_plane.create_namespace(f"t-{uuid.uuid4().hex[:8]}")
    yield name
    control_plane.http().delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
def job_namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace for MalleusJobs alone (no pods: its ServiceAccount is not waited for),
    deleted afterwards."""
    name = f"j-{uuid.uuid4().hex[:8]}"
    made = control_plane.http().post("/api/v1/namespaces", json={"metadata": {"name": name}})
    assert made.status_code == 201, made.text
    yield name
    control_plane.http().delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="session")
def cluster_crd(control_plane: ControlPlane) -> dict[str, Any]:
    """crds/malleusjob.yaml applied and Established on the real API server; the CRD as the
    server stored it (with its status)."""
    return AdminApi(control_plane).apply_crd(yaml.safe_load(CRD_FILE.read_text()))


class AdminApi:
    """The real API server as admin (``system:masters``), with what the CRD-level tests read:
    ``client`` (an ``httpx.Client``), ``url``, ``kubeconfig``, ``env()`` and `apply_crd`."""

    def __init__(self, cluster: ControlPlane) -> None:
        self.cluster = cluster
        self.client = cluster.http()
        self.url = cluster.url
        self.kubeconfig = cluster.admin

    def env(self) -> dict[str, str]:
        return self.cluster.env()

    def list(
        self,
        plural: str,
        namespace: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """A core (``/api/v1``) collection of ``namespace``, optionally selected."""
        params = {"labelSelector": label_selector, "fieldSelector": field_selector}
        got = self.client.get(
            f"/api/v1/namespaces/{namespace}/{plural}",
            params={k: v for k, v in params.items() if v},
        )
        assert got.status_code == 200, got.text
        return list(got.json()["items"])

    def delete(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        """Delete a core object; its last body (a pod bound to no node goes at once)."""
        got = self.client.delete(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        assert got.status_code in (200, 202), got.text
        return dict(got.json())

    def set_pod_phase(
        self, namespace: str, name: str, phase: str, reason: str | None = None
    ) -> dict[str, Any]:
        """Write a pod's phase (and reason) as its kubelet would; its new body."""
        status: dict[str, Any] = {"phase": phase, **({"reason": reason} if reason else {})}
        got = self.client.patch(
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert got.status_code == 200, got.text
        return dict(got.json())

    def apply_crd(self, crd: dict[str, Any]) -> dict[str, Any]:
        """Apply ``crd`` (server side) and wait until it is Established; the stored CRD."""
        self.cluster.apply([crd])
        return self.cluster.wait_established(crd["metadata"]["name"])


@pytest.fixture(scope="session")
def admin_api(control_plane: ControlPlane, cluster_crd: dict[str, Any]) -> AdminApi:
    """The real API server, as admin, with the MalleusJob CRD applied (`AdminApi`)."""
    return AdminApi(control_plane)


def apply_chart_rbac(
    control_plane: ControlPlane, watch: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The chart's ServiceAccount, ClusterRoles, Roles and bindings (``helm template`` of release
    ``rel`` in ``malleus-system``, watching ``watch`` too), applied for real; skips without helm."""
    sets = ["watchNamespaces={" + ",".join(watch) + "}"] if watch else []
    kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    docs = [d for d in render(*sets) if d["kind"] in kinds]
    control_plane.create_namespace("malleus-system")
    for ns in watch:
        control_plane.create_namespace(ns)
    control_plane.apply(docs)
    return docs


@pytest.fixture(scope="session")
def kueue(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kueue]:
    """Kueue's manager with its CRDs and webhooks (`tests.cluster.kueue`), for the session;
    skips, saying why, without Kueue in the assets folder or a mount namespace."""
    manifests, reason = kueue_assets(control_plane.assets)
    if manifests is None:
        pytest.skip(reason)
    with Kueue(control_plane, manifests, tmp_path_factory.mktemp("kueue")) as manager:
        _TIMINGS["Kueue started in"] = manager.start_seconds
        yield manager


@pytest.fixture(scope="session")
def chart_rbac(control_plane: ControlPlane, cluster_crd: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart's ServiceAccount, ClusterRoles, Roles and bindings, applied for real."""
    return apply_chart_rbac(control_plane)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for what, seconds in _TIMINGS.items():
        terminalreporter.write_line(f"tests/cluster: {what} {seconds:.1f} s")
