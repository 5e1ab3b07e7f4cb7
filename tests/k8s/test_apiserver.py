"""The API server harness itself: its kubeconfig serves real clients, and stop() leaves nothing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

from tests.k8s.apiserver import ApiServer, ApiServerError, assets_dir, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


def test_kubernetes_client_uses_the_kubeconfig(
    k8s_apiserver: ApiServer, malleus_crd: dict[str, Any], k8s_namespace: str
) -> None:
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.config.new_client_from_config(config_file=str(k8s_apiserver.kubeconfig))
    try:
        crds = kubernetes.client.ApiextensionsV1Api(api).list_custom_resource_definition()
        assert "malleusjobs.malleus.io" in {c.metadata.name for c in crds.items}
        objects = kubernetes.client.CustomObjectsApi(api)
        body = yaml.safe_load(EXAMPLE.read_text())
        made = objects.create_namespaced_custom_object(
            "malleus.io", "v1alpha1", k8s_namespace, "malleusjobs", body
        )
        assert made["spec"]["stragglerPolicy"]["threshold"] == 1.2
    finally:
        api.close()


def test_env_points_children_at_the_server(k8s_apiserver: ApiServer) -> None:
    env = k8s_apiserver.env()
    assert env["KUBECONFIG"] == str(k8s_apiserver.kubeconfig)
    config = yaml.safe_load(k8s_apiserver.kubeconfig.read_text())
    assert config["clusters"][0]["cluster"]["server"] == k8s_apiserver.url


def test_stop_ends_both_processes(tmp_path: Path) -> None:
    assets = assets_dir()
    if assets is None:
        pytest.skip("MALLEUS_K8S_ASSETS is unset")
    server = ApiServer(assets, tmp_path)
    with server:
        processes = [p.popen for p in server._processes]
        url = server.url
        assert len(processes) == 2 and all(p.poll() is None for p in processes)
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/livez", verify=False, timeout=2.0)
    with pytest.raises(ApiServerError, match="not running"):
        _ = server.client


def test_wait_until_fails_at_the_deadline_or_when_a_process_dies() -> None:
    never: Callable[[], None] = lambda: None  # noqa: E731
    with pytest.raises(ApiServerError, match="not ready after"):
        wait_until(never, timeout=0.2, what="nothing")
    with pytest.raises(ApiServerError, match="it died"):
        wait_until(never, timeout=30, what="nothing", alive=lambda: "it died")
