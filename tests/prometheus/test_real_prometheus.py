"""PrometheusSource against a real Prometheus scraping real trainer control servers and DCGM.

Two trainer "pods" (the trainer's own ControlServer and TrainerMetrics, one per node of a
2 x 4 job) and a DCGM-exporter-shaped page are scraped every second, with the labels Kubernetes
service discovery would attach. Node 0's GPUs are scraped as NVIDIA's GPU Operator does
(`honor_labels: false`: the workload's pod becomes `exported_pod`), node 1's with
`honor_labels: true` (`pod` kept); a GPU of the same pod name in another namespace is a decoy.
The controller's queries must find each rank's rate from the pod that holds it, and corroborate
the slow GPUs with their clocks; over HTTPS (Prometheus' own TLS) with the CA bundle, and through
a proxy that requires a bearer token.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from malleus.control import ControlStatus
from malleus.controller.ports import Observation
from malleus.controller.prometheus import (
    PrometheusError,
    PrometheusSource,
    default_queries,
    own_rank_series,
    pod_gpu_rank,
)
from malleus.operator import tls
from malleus.trainer.endpoint.metrics import TrainerMetrics
from malleus.trainer.endpoint.server import ControlServer

from .server import Prometheus, binary, serve_text

JOB, NS, GPN = "mj", "ml", 4
PODS = [f"{JOB}-node-{i}" for i in range(2)]
RATES = {0: 1.0, 1: 1.0, 2: 1.8, 3: 1.0, 4: 1.0, 5: 2.4, 6: 1.0, 7: 1.0}
TOKEN = "prom-reader-token"


def dcgm_page(pod: str, namespace: str, clocks: dict[int, float], reasons: dict[int, int]) -> str:
    """dcgm-exporter's exposition for one node (its Kubernetes mapping on: pod/namespace/gpu)."""
    lines = ["# TYPE DCGM_FI_DEV_SM_CLOCK gauge"]
    common = f'Hostname="gpu-host",container="trainer",namespace="{namespace}",pod="{pod}"'
    for gpu, mhz in clocks.items():
        lines.append(f'DCGM_FI_DEV_SM_CLOCK{{gpu="{gpu}",UUID="GPU-{pod}-{gpu}",{common}}} {mhz}')
    lines.append("# TYPE DCGM_FI_DEV_CLOCKS_EVENT_REASONS gauge")
    for gpu, mask in reasons.items():
        lines.append(
            f'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{gpu="{gpu}",UUID="GPU-{pod}-{gpu}",{common}}} {mask}'
        )
    return "\n".join(lines) + "\n"


class Trainer:
    """One worker pod's coordinator endpoint; it publishes every rank's rate, as trainers do."""

    def __init__(self, node: int, rates: dict[int, float]) -> None:
        self.metrics = TrainerMetrics(
            JOB, rank=node * GPN, node=node, gpu=0, node_name=f"gpu-host-{node}"
        )
        self.metrics.observe_plan(3)
        self.metrics.observe_rates(rates, {r: r // GPN for r in rates})
        self.metrics.observe_step(41, 2.0, 4096.0, rates[node * GPN], 1.5, loss=3.25)
        self.server = ControlServer(
            "127.0.0.1",
            0,
            None,
            status=lambda: ControlStatus(),
            inbox=None,
            metrics=self.metrics,
            inject=None,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


def pod_target(address: str, pod: str, namespace: str) -> dict[str, Any]:
    """A static target with the labels a PodMonitor's service discovery would give it."""
    return {"targets": [address], "labels": {"pod": pod, "namespace": namespace}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, str]]:
    exe = binary("MALLEUS_PROMETHEUS")
    # node 1 also claims rank 2 is fine (1.0): only node 0, which holds rank 2, is believed
    trainers = [Trainer(0, RATES), Trainer(1, {**RATES, 2: 1.0})]
    pages = {
        "/operator-style": lambda: dcgm_page(
            PODS[0], NS, {0: 1980, 1: 1980, 2: 1100, 3: 1980}, {2: 0x40 | 0x1}
        ).encode(),
        "/honor-style": lambda: dcgm_page(
            PODS[1], NS, {0: 1980, 1: 1410, 2: 1980, 3: 1980}, {1: 0x4}
        ).encode(),
        "/decoy": lambda: dcgm_page(PODS[1], "other-team", {3: 300}, {3: 0x8}).encode(),
    }
    certs = tls.issue([["localhost"]], dt.datetime.now(dt.UTC))
    for t in trainers:
        t.server.start()
    with serve_text(pages) as dcgm:
        exporter = pod_target(dcgm, "nvidia-dcgm-exporter-x7k2p", "gpu-operator")
        scrape = [
            {"job_name": f"trainer-{i}", "static_configs": [pod_target(t.address, PODS[i], NS)]}
            for i, t in enumerate(trainers)
        ] + [
            {
                "job_name": "dcgm-operator",
                "metrics_path": "/operator-style",
                "honor_labels": False,
                "static_configs": [exporter],
            },
            {
                "job_name": "dcgm-honor",
                "metrics_path": "/honor-style",
                "honor_labels": True,
                "static_configs": [exporter],
            },
            {
                "job_name": "dcgm-decoy",
                "metrics_path": "/decoy",
                "honor_labels": True,
                "static_configs": [exporter],
            },
        ]
        prom = Prometheus(
            exe,
            tmp_path_factory.mktemp("prom"),
            scrape,
            tls=(certs.servers[0].cert, certs.servers[0].key),
            ca_pem=certs.ca,
        )
        try:
            # every target scraped once: the trainers' step, both DCGM styles, the decoy
            prom.wait_for("malleus_step", count=2)
            prom.wait_for("DCGM_FI_DEV_SM_CLOCK", count=9)
            yield prom, certs.ca
        finally:
            prom.stop()
            for t in trainers:
                t.server.stop()


def source(url: str, **kw: Any) -> PrometheusSource:
    queries = default_queries(JOB, namespace=NS, pod_regex=f"{JOB}-node-[0-9]+")
    return PrometheusSource(
        url,
        queries,
        rank_of=pod_gpu_rank(GPN, r"-node-(\d+)$"),
        keep=own_rank_series(GPN, r"-node-(\d+)$"),
        interval=0.2,
        timeout=5.0,
        **kw,
    )


def read(src: PrometheusSource) -> Observation | None:
    return asyncio.run(asyncio.wait_for(src.read(), 15))


def test_the_series_carry_the_conventional_labels(stack: tuple[Prometheus, str]) -> None:
    prom, _ = stack
    operator_style = prom.query('DCGM_FI_DEV_SM_CLOCK{job="dcgm-operator",gpu="2"}')
    assert [s["metric"]["exported_pod"] for s in operator_style] == [PODS[0]]
    assert operator_style[0]["metric"]["pod"] == "nvidia-dcgm-exporter-x7k2p"
    rate = prom.query(
        f'malleus_gpu_straggling_rate{{malleus_job="{JOB}",rank="5",pod="{PODS[1]}"}}'
    )
    labels = rate[0]["metric"]
    assert (labels["job"], labels["node_rank"], labels["gpu"], labels["node_name"]) == (
        "trainer-1",
        "1",
        "1",
        "gpu-host-1",
    )
    assert prom.query(f'malleus_loss{{malleus_job="{JOB}"}}')[0]["value"][1] == "3.25"


def test_rates_and_dcgm_corroboration_over_https(stack: tuple[Prometheus, str]) -> None:
    prom, ca = stack
    obs = read(source(prom.url, ca_pem=ca))
    assert obs is not None
    assert (obs.step, obs.step_seconds, obs.generation) == (41, 2.0, 3)
    # rank 2 from node 0 (node 1's claim about it is not believed), rank 5 from node 1
    assert obs.rates == RATES
    assert obs.evidence == {
        2: "SM clock 1100 MHz, 56% of the job's fastest; throttled: hw_thermal_slowdown",
        5: "SM clock 1410 MHz, 71% of the job's fastest; throttled: sw_power_cap",
    }  # the other namespace's GPU at 300 MHz is not the job's
    with pytest.raises(PrometheusError, match="CERTIFICATE_VERIFY_FAILED"):
        read(source(prom.url))  # the system trust store does not know this CA


@pytest.fixture
def token_proxy(stack: tuple[Prometheus, str]) -> Iterator[str]:
    """An HTTP proxy that requires the bearer token (as kube-rbac-proxy does) before Prometheus."""
    prom, ca = stack
    upstream = ssl.create_default_context(cadata=ca)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.send_error(401)
                return
            with urllib.request.urlopen(prom.url + self.path, timeout=5, context=upstream) as r:
                body = r.read()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_bearer_token(token_proxy: str) -> None:
    obs = read(source(token_proxy, bearer_token=TOKEN))
    assert obs is not None and obs.rates == RATES and set(obs.evidence) == {2, 5}
    with pytest.raises(PrometheusError, match="HTTP 401"):
        read(source(token_proxy, bearer_token="wrong"))
