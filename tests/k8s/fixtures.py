"""pytest fixtures for the real API server (load with ``pytest_plugins = ["tests.k8s.fixtures"]``).

One API server per test session (it starts in about 2 s, but etcd plus the CRD handlers are not
free); tests isolate themselves with a namespace of their own (``k8s_namespace``). Tests skip
with the reason when ``MALLEUS_K8S_ASSETS`` is unset; a set but broken folder is an error.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests.k8s.apiserver import ASSETS_ENV, ApiServer, assets_dir

if TYPE_CHECKING:
    from tests.k8s.proxy import ClusterProxy

__all__ = ["CRD_FILE", "k8s_apiserver", "k8s_cluster", "k8s_namespace", "malleus_crd"]

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "malleusjob.yaml"


@pytest.fixture(scope="session")
def k8s_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A running etcd + apiextensions-apiserver, stopped at the end of the session."""
    assets = assets_dir()
    if assets is None:
        pytest.skip(
            f"{ASSETS_ENV} is unset: point it at a folder with etcd and apiextensions-apiserver "
            f"(scripts/k8s-assets.sh DEST unpacks them from shared/k8s/bin)"
        )
    with ApiServer(assets, tmp_path_factory.mktemp("apiserver")) as server:
        yield server


@pytest.fixture(scope="session")
def k8s_cluster(
    k8s_apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterProxy]:
    """The real API server plus an emulated core API behind one plain-HTTP proxy.

    Point kopf, kubectl and the kubernetes client at ``.kubeconfig`` (or ``.env()``); read and
    drive core objects (pods, events, ...) through ``.core``. Request ``malleus_crd`` too when a
    test needs MalleusJobs. Core objects persist for the session: isolate with ``k8s_namespace``.
    """
    from tests.k8s.proxy import ClusterProxy  # aiohttp only where a test asks for a cluster

    with ClusterProxy(k8s_apiserver, tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def malleus_crd(k8s_apiserver: ApiServer) -> dict[str, Any]:
    """crds/malleusjob.yaml installed and Established; returns the CRD as the server stored it."""
    return k8s_apiserver.apply_crd(yaml.safe_load(CRD_FILE.read_text()))


@pytest.fixture
def k8s_namespace() -> str:
    """A fresh namespace name (this server has no Namespace objects; names alone isolate)."""
    return f"t-{uuid.uuid4().hex[:10]}"
