"""Every worker pod's metrics, scraped by a real Prometheus, on the real control plane.

A 2-node job (2 x 2 emulated GPUs) runs on the process-kubelet nodes with
``spec.metrics.source: prometheus``; the operator (the chart's ServiceAccount) plans from the
Prometheus that `MALLEUS_PROMETHEUS` names, which scrapes the worker pods on their loopback pod
IPs over HTTPS, verified against the job's own CA for the workers' stable name, with
``honor_labels: false`` and the ``pod``/``namespace``/``node`` target labels Kubernetes service
discovery would give (a static config: the PodMonitor needs the Prometheus Operator, which is
not here, so its selector and port are checked separately against the API server's pods).

What must hold: both pods are live targets; Prometheus holds one rate series for every rank,
from the pod that holds it, each naming its Kubernetes node and GPU; and Prometheus-mode
planning sees the node-1 straggler (rank 3), which it could not while only the coordinator
served ``/metrics``: it re-plans around it.

Needs ``MALLEUS_K8S_ASSETS``, helm and ``MALLEUS_PROMETHEUS``; skips without them.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from malleus.operator import tls
from malleus.operator.identity import JobRef, secret_name
from malleus.operator.monitoring import build_pod_monitor
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubelet import ProcessKubelet
from tests.cluster.operating import JobWorld, exactly, operated_namespace
from tests.jobs import cluster_job
from tests.prometheus.server import Prometheus, binary, free_port

pytestmark = pytest.mark.timeout(300)

JOB = "e2e-prom"
GPN = 2
STRAGGLER = 3  # node 1, local GPU 1: invisible to Prometheus when only the coordinator served
SCRAPE_JOB = "malleus-trainers"


def manifest(prometheus_url: str) -> dict[str, Any]:
    schedule = [{"step": 6, "rank": STRAGGLER, "factor": 4.0}]
    return cluster_job(
        JOB,
        gpusPerNode=GPN,
        stragglerPolicy={"windowSteps": 3, "cooldownSeconds": 0},
        metrics={
            "source": "prometheus",
            "scrapeIntervalSeconds": 1,
            "prometheus": {"url": prometheus_url},
        },
        emulation={
            "enabled": True,
            "layerForwardMs": 10,
            "layerBackwardMs": 20,
            "schedule": schedule,
        },
    )


@pytest.fixture(scope="module")
def setup(
    control_plane: ControlPlane,
    cluster_crd: dict[str, Any],
    nodes: list[ProcessKubelet],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[JobWorld, str, int, Path]]:
    """The operator, allowed to query one Prometheus port (the server starts once the pods
    have IPs to scrape), watching a namespace of this module's own."""
    exe = binary("MALLEUS_PROMETHEUS")
    port = free_port()
    allow = {"MALLEUS_OPERATOR_PROMETHEUS_ALLOWED_URLS": f"http://127.0.0.1:{port}"}
    with operated_namespace(control_plane, tmp_path_factory, "e2e-prom", nodes, allow) as world:
        yield world, exe, port, tmp_path_factory.mktemp("prom")


def scrape_config(world: JobWorld, pods: list[dict[str, Any]], ca_file: Path) -> dict[str, Any]:
    """What the job's PodMonitor makes of its pods, written out: HTTPS verified against the
    job's CA for the job's metrics name (in every worker's certificate), the pod's own labels
    (never the series')."""
    name = tls.metrics_name(JobRef(world.ns, JOB))
    targets = [
        {
            "targets": [f"{p['status']['podIP']}:{port_of(p)}"],
            "labels": {
                "pod": p["metadata"]["name"],
                "namespace": world.ns,
                "node": p["spec"]["nodeName"],
            },
        }
        for p in pods
    ]
    return {
        "job_name": SCRAPE_JOB,
        "scheme": "https",
        "metrics_path": "/metrics",
        "honor_labels": False,
        "tls_config": {"ca_file": str(ca_file), "server_name": name},
        "static_configs": targets,
    }


def port_of(pod: dict[str, Any], name: str = "control") -> int:
    (container,) = pod["spec"]["containers"]
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name))


def test_every_worker_pod_is_a_live_target_for_its_own_ranks_and_prometheus_mode_plans_with_all(
    setup: tuple[JobWorld, str, int, Path],
) -> None:
    world, exe, port, workdir = setup
    world.create(manifest(f"http://127.0.0.1:{port}"))

    def running() -> list[dict[str, Any]] | None:
        pods = exactly(2, world.workers(JOB))
        ok = pods and all(p["status"].get("phase") == "Running" for p in pods)
        return pods if ok and all(p["status"].get("podIP") for p in pods) else None

    pods = world.wait(running, 120, "two worker pods running", job=JOB)
    pods.sort(key=lambda p: p["metadata"]["name"])
    uid = world.job(JOB)["metadata"]["uid"]  # type: ignore[index]

    # The PodMonitor (no Prometheus Operator here to act on it): its selector picks exactly
    # the worker pods (not the store), on the port every one of them now serves.
    monitor = build_pod_monitor(None, JobRef(world.ns, JOB, uid))  # type: ignore[arg-type]
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [world.ns]}
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    listed = world.http.get(
        f"/api/v1/namespaces/{world.ns}/pods", params={"labelSelector": selector}
    ).json()["items"]
    assert sorted(p["metadata"]["name"] for p in listed) == [f"{JOB}-node-0", f"{JOB}-node-1"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is False and endpoint["path"] == "/metrics"
    ports = {port_of(p, endpoint["port"]) for p in pods}  # every pod names that port

    ca = base64.b64decode(world.secret(secret_name(JOB))["data"][tls.CA_KEY]).decode()
    (workdir / "ca.crt").write_text(ca)
    config = scrape_config(world, pods, workdir / "ca.crt")
    assert {int(t["targets"][0].rsplit(":", 1)[1]) for t in config["static_configs"]} == ports
    prom = Prometheus(exe, workdir, [config], port=port)
    try:
        # N live targets: both pods answer, verified TLS
        up = prom.wait_for(f'up{{job="{SCRAPE_JOB}"}} == 1', count=2, timeout=60)
        assert sorted(s["metric"]["pod"] for s in up) == [f"{JOB}-node-0", f"{JOB}-node-1"]

        # one series per rank, from the pod that holds it, naming its node and GPU
        query = f'malleus_gpu_straggling_rate{{malleus_job="{JOB}"}}'
        series = prom.wait_for(query, count=4, timeout=90)
        node_of = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods}
        seen = {}
        for s in series:
            m = s["metric"]
            rank = int(m["rank"])
            assert m["pod"] == f"{JOB}-node-{rank // GPN}", m  # no pod speaks for another's
            assert m["node_rank"] == str(rank // GPN) and m["gpu"] == str(rank % GPN), m
            assert m["node_name"] == node_of[m["pod"]] == m["node"], m
            seen[rank] = m
        assert sorted(seen) == [0, 1, 2, 3], series
        compute = prom.wait_for(
            f'malleus_gpu_compute_seconds{{malleus_job="{JOB}"}}', count=4, timeout=30
        )
        assert all(s["metric"].get("node_name") and s["metric"].get("gpu") for s in compute)

        # Prometheus-mode planning sees node 1's ranks: it re-plans around rank 3
        def replanned() -> dict[str, Any] | None:
            st = world.status(JOB)
            last = st.get("lastReplan") or {}
            ours = f"rank {STRAGGLER}" in str(last.get("reason"))
            fresh = (st.get("plan") or {}).get("generation", 0) > 1
            return st if ours and fresh else None

        after = world.wait(replanned, 150, f"a re-plan around rank {STRAGGLER}", job=JOB)
        assert STRAGGLER in [s["rank"] for s in after["stragglers"]], after["stragglers"]
        rates = prom.query(f"max by (rank) ({query})")
        assert {int(s["metric"]["rank"]) for s in rates} == {0, 1, 2, 3}
    except BaseException:
        print(prom.log_tail())
        raise
    finally:
        prom.stop()
