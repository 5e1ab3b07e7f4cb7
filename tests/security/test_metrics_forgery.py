"""Issue 25, finding "rates spoofable" (the metrics side) and "credentials": a series from
outside the job cannot steer it, and the Prometheus client never hands its token on.

The attacks, as reproduced: worker pods carried ``prometheus.io/scrape``, and the common
annotation-driven scrape job keeps a series' own labels (``honor_labels: true``), so any scraped
pod of any namespace could claim ``pod="train-node-0"``: simulated, rates ``{0: 1000}`` and
step 10^9, after which the decision loop ignored every real observation for good; a pod named
``train-node-01`` counted as node 1; the PodMonitor skipped TLS verification; the Prometheus
client followed a redirect to another host with the bearer token.

Here: the worker pods carry no scrape annotation and the job's PodMonitor verifies its CA (and,
with a real Prometheus when ``MALLEUS_PROMETHEUS`` is set, an impostor endpoint is not scraped);
the operator's Prometheus source, against a Prometheus answering forged series, believes only
the job's own pods in its own namespace, by exact name; a forged step 10^9 is ignored, by the
source and by the decision loop; a redirect is refused and the token never reaches its target.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from malleus.control import ControlStatus
from malleus.controller import Controller, ManualClock, SimulatedJob
from malleus.controller.events import StragglerDetected
from malleus.controller.ports import Observation
from malleus.controller.prometheus import PrometheusError, PrometheusSource, default_queries
from malleus.controller.steps import StepGuard
from malleus.job import ResolvedJob, StragglerPolicy
from malleus.operator import failures, jobs, monitoring, tls, trainers, workers
from malleus.operator.resources import JobRef
from malleus.operator.settings import Settings
from malleus.operator.sources import rate_source
from malleus.planner import uniform_plan
from tests.jobs import job_body

JOB, NS, GPN = "train", "ml", 4
REF = JobRef(NS, JOB, "uid-1234")
TOKEN = "prom-reader-token"
CHART = Path(__file__).resolve().parents[2] / "helm/malleus-operator"


def _job(**spec: Any) -> ResolvedJob:
    return jobs.resolve(job_body(JOB, NS, **spec))


# ---- no way in but the verified PodMonitor ---------------------------------------------------


def test_worker_pods_carry_no_scrape_annotations() -> None:
    for index in range(2):
        pod = workers.build_pod(_job(), REF, index)
        annotations = pod["metadata"].get("annotations") or {}
        assert not [k for k in annotations if k.startswith("prometheus.io/")], annotations


def test_the_jobs_pod_monitor_verifies_the_jobs_ca_and_honors_no_labels() -> None:
    monitor = monitoring.build_pod_monitor(_job(), REF, interval="30s", labels={"release": "kps"})
    assert (monitor["kind"], monitor["metadata"]["namespace"]) == ("PodMonitor", NS)
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"  # deleted with the job
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is False and endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": f"{JOB}-control", "key": "ca.crt"}},
        "serverName": f"{JOB}.{NS}.svc",  # the metrics name every worker's certificate carries
        "insecureSkipVerify": False,
    }
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    assert monitor["spec"]["selector"]["matchLabels"]["malleus.io/job"] == JOB
    # and nothing in the chart skips verification any more
    for template in (CHART / "templates").glob("*.yaml"):
        assert "insecureSkipVerify: true" not in template.read_text(), template.name


class _Cluster:
    """What `monitoring.ensure_pod_monitor` calls on the cluster."""

    def __init__(self) -> None:
        self.created: list[tuple[dict[str, Any], str]] = []
        self.events: list[str] = []

    async def create_custom(self, obj: dict[str, Any], plural: str) -> tuple[dict[str, Any], bool]:
        self.created.append((obj, plural))
        return obj, True

    async def post_event(self, ref: JobRef, type_: str, reason: str, message: str) -> None:
        self.events.append(reason)


def test_the_operator_makes_the_monitor_only_when_asked() -> None:
    class Ctx:
        def __init__(self, settings: Settings) -> None:
            self.settings, self.cluster = settings, _Cluster()

    off, on = Ctx(Settings()), Ctx(Settings(pod_monitors=True, pod_monitor_labels="release=kps"))
    assert not asyncio.run(monitoring.ensure_pod_monitor(off, _job(), REF))  # type: ignore[arg-type]
    assert off.cluster.created == []
    assert asyncio.run(monitoring.ensure_pod_monitor(on, _job(), REF))  # type: ignore[arg-type]
    ((made, plural),) = on.cluster.created
    assert plural == "podmonitors" and made["metadata"]["labels"]["release"] == "kps"


def test_a_real_prometheus_scrapes_the_job_but_not_an_impostor(tmp_path: Path) -> None:
    """The PodMonitor's TLS settings as Prometheus applies them (its scrape config): the job's
    endpoint, serving the job's certificate, is scraped; an impostor serving the same names
    under another CA, as a party on the pod network would, is not."""
    exe = os.environ.get("MALLEUS_PROMETHEUS")
    if not exe:
        pytest.skip("MALLEUS_PROMETHEUS is not set (scripts/prometheus-bin.sh provides it)")
    from malleus.trainer.endpoint.credentials import ServingTLS
    from malleus.trainer.endpoint.metrics import TrainerMetrics
    from malleus.trainer.endpoint.server import ControlServer
    from tests.prometheus.server import Prometheus

    now = dt.datetime.now(dt.UTC)
    servers = []
    for who in ("job", "impostor"):  # the same names, each under a CA of its own
        certs = tls.issue_for_job(REF, 2, now)
        (tmp_path / f"{who}.crt").write_text(certs.servers[0].cert)
        (tmp_path / f"{who}.key").write_text(certs.servers[0].key)
        (tmp_path / f"{who}-ca.crt").write_text(certs.ca)
        metrics = TrainerMetrics(JOB, rank=0, node=0)
        metrics.observe_step(41 if who == "job" else 10**9, 1.0, 1.0, 1.0, 1.0)
        servers.append(
            ControlServer(
                "127.0.0.1",
                0,
                "t",
                status=lambda: ControlStatus(),
                inbox=None,
                metrics=metrics,
                inject=None,
                tls=ServingTLS(tmp_path / f"{who}.crt", tmp_path / f"{who}.key"),
            ).start()
        )
    (endpoint,) = monitoring.build_pod_monitor(_job(), REF)["spec"]["podMetricsEndpoints"]
    scrape = [
        {
            "job_name": f"pod-{i}",
            "scheme": endpoint["scheme"],
            "honor_labels": endpoint["honorLabels"],
            "tls_config": {
                "ca_file": str(tmp_path / "job-ca.crt"),  # the job Secret's ca.crt
                "server_name": endpoint["tlsConfig"]["serverName"],
                "insecure_skip_verify": endpoint["tlsConfig"]["insecureSkipVerify"],
            },
            "static_configs": [
                {
                    "targets": [f"127.0.0.1:{server.port}"],
                    "labels": {"pod": f"{JOB}-node-{i}", "namespace": NS},
                }
            ],
        }
        for i, server in enumerate(servers)
    ]
    prom = Prometheus(exe, tmp_path, scrape)
    try:
        up = {s["metric"]["job"]: s["value"][1] for s in prom.wait_for("up", count=2)}
        assert up == {"pod-0": "1", "pod-1": "0"}, prom.log_tail()
        steps = prom.wait_for(f'malleus_step{{malleus_job="{JOB}"}}')
        assert [(s["metric"]["pod"], s["value"][1]) for s in steps] == [(f"{JOB}-node-0", "41")]
    finally:
        prom.stop()
        for server in servers:
            server.stop()


# ---- a Prometheus that answers forged series -------------------------------------------------


def _vector(*samples: tuple[dict[str, str], float]) -> dict[str, Any]:
    result = [{"metric": m, "value": [0, str(v)]} for m, v in samples]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def _rate(pod: str, rank: int, value: float, namespace: str = NS) -> tuple[dict[str, str], float]:
    labels = {"pod": pod, "namespace": namespace, "rank": str(rank), "malleus_job": JOB}
    return labels, value


class FakePrometheus:
    """The Prometheus HTTP API over `answer(promql) -> payload`, recording what it was sent."""

    def __init__(self, answer: Callable[[str], tuple[int, dict[str, Any], dict[str, str]]]) -> None:
        self.requests: list[tuple[str, str | None]] = []  # (query, Authorization header)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                promql = query.get("query", [""])[0]
                outer.requests.append((promql, self.headers.get("Authorization")))
                code, payload, headers = answer(promql)
                body = json.dumps(payload).encode()
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def forged() -> Iterator[FakePrometheus]:
    """The job's two pods report every rank healthy (1.0) except rank 5 (2.0, its own node's);
    forgers claim rank 0 at 1000 from another namespace under node 0's name, from
    ``train-node-01`` and ``x-train-node-1`` (node 1 by a loose parse), and from node 1 about
    node 0's rank (a worker speaking for another's GPU); steps come from `steps`."""
    steps = iter([41, 10**9, 42, 43, 44, 45])

    def answer(promql: str) -> tuple[int, dict[str, Any], dict[str, str]]:
        if "malleus_gpu_straggling_rate" in promql:
            real = [_rate(f"{JOB}-node-{r // GPN}", r, 2.0 if r == 5 else 1.0) for r in range(8)]
            fake = [
                _rate(f"{JOB}-node-0", 0, 1000.0, namespace="other-team"),
                _rate(f"{JOB}-node-01", 4, 1000.0),
                _rate(f"x-{JOB}-node-1", 5, 1000.0),
                _rate(f"{JOB}-node-1", 1, 1000.0),
            ]
            return 200, _vector(*fake, *real), {}
        if "malleus_step_seconds" in promql:
            return 200, _vector(({}, 2.0)), {}
        if "malleus_step" in promql:
            return 200, _vector(({}, float(next(steps)))), {}
        if "malleus_plan_generation" in promql:
            return 200, _vector(({}, 1.0)), {}
        return 200, _vector(), {}  # DCGM, calibration: none

    server = FakePrometheus(answer)
    yield server
    server.close()


def _operators_source(url: str, token: str | None = None) -> Any:
    """The operator's own Prometheus source for the job (`operator.sources.rate_source`)."""
    job = _job(metrics={"source": "prometheus", "prometheus": {"url": url}})
    source = rate_source(job, REF, "https://unused", timeout=2.0, prometheus_auth=(token, None))
    assert isinstance(source, PrometheusSource)
    source.interval = 0.01
    return source


def test_forged_series_from_outside_the_job_are_not_believed(forged: FakePrometheus) -> None:
    source = _operators_source(forged.url)
    obs = asyncio.run(source.read())
    assert obs is not None and obs.step == 41
    assert obs.rates == {r: (2.0 if r == 5 else 1.0) for r in range(8)}  # no 1000 anywhere
    # the query itself asks for the exact names (PromQL regexes are anchored)
    assert f'pod=~"{JOB}-node-(0|[1-9][0-9]*)"' in source.queries.rates
    assert f'namespace="{NS}"' in source.queries.rates


def test_the_operator_matches_worker_pod_names_exactly() -> None:
    """A pod named ``train-node-01`` (even one claiming the job as its controller, which
    whoever creates pods in the namespace can write) is not node 1: not a coordinator to ask,
    not node 1's failure."""

    def pod(name: str, phase: str = "Running", code: int = 0) -> dict[str, Any]:
        owner = {"kind": "MalleusJob", "name": JOB, "uid": "uid-1234", "controller": True}
        terminated = {"terminated": {"exitCode": code}} if code else {"running": {}}
        return {
            "metadata": {"name": name, "uid": f"uid-{name}", "ownerReferences": [owner]},
            "status": {"phase": phase, "containerStatuses": [{"state": terminated}]},
        }

    pods = [pod(f"{JOB}-node-0"), pod(f"{JOB}-node-01"), pod(f"{JOB}-node-1x")]
    assert trainers.running_nodes(pods, JOB, "uid-1234") == [0]
    assert failures.pod_failure(pod(f"{JOB}-node-01", "Failed", 1), JOB) is None
    assert failures.pod_failure(pod(f"{JOB}-node-1", "Failed", 1), JOB) is not None


def test_a_forged_step_does_not_make_real_observations_old(forged: FakePrometheus) -> None:
    """Step 41, a forged 10^9, then 42, 43: the source skips the forgery with a warning and
    goes on (it used to wait for a step beyond 10^9 for good)."""
    source = _operators_source(forged.url)

    async def three() -> list[int]:
        return [(await source.read()).step for _ in range(3)]

    assert asyncio.run(three()) == [41, 42, 43]


def test_the_decision_loop_survives_a_forged_step_and_still_acts() -> None:
    """The loop behind any source: a straggler from step 10 on, and at step 5 one observation
    claiming step 10^9 and rank 0 at 1000. The forgery is ignored; the real straggler is
    detected and planned around, and the loop's step is the trainers'."""
    job = _job()
    clock = ManualClock()
    plan = uniform_plan(job.problem({}, None))
    assert plan is not None
    sim = SimulatedJob(
        job.problem,
        plan,
        lambda step: {r: (4.0 if r == 6 and step >= 10 else 1.0) for r in range(8)},
        clock=clock,
        steps=40,
        seconds_per_unit=1.0,
    )

    class Forging:
        async def read(self) -> Observation | None:
            obs = await sim.read()
            if obs is not None and obs.step == 5:
                return Observation(10**9, 1.0, {0: 1000.0}, obs.generation)
            return obs

    events: list[Any] = []
    controller = Controller(
        Forging(),
        sim,
        initial_plan=plan,
        problem_builder=job.problem,
        policy=StragglerPolicy(cooldown_seconds=30),
        clock=clock,
        on_event=events.append,
        planner_grace_seconds=0.0,
    )
    asyncio.run(controller.run())
    controller.close()
    detected = [e.data for e in events if isinstance(e.data, StragglerDetected)]
    assert detected and all(0 not in d.shift.ranks for d in detected)
    assert 6 in detected[0].shift.ranks and detected[0].shift.step >= 10
    assert controller.last_step < 10**9 and controller.last_step >= 39


def test_the_step_bound_follows_a_real_jump_after_a_few_observations() -> None:
    """Not a trap for the trainers themselves: a restart from an older checkpoint (or a long
    gap) is believed once three observations in a row agree on it."""
    now = [0.0]
    guard = StepGuard(clock=lambda: now[0])
    assert guard.accept(100) and guard.accept(101)
    assert not guard.accept(10**9)  # ahead by more than 1000 + 100/s: ignored
    assert guard.accept(102)  # the real ones go on
    assert not guard.accept(20) and not guard.accept(21)  # behind: doubted...
    assert guard.accept(22) and guard.moved and guard.last == 22  # ...then followed
    now[0] += 3600.0
    assert guard.accept(22 + 300_000)  # an hour later, far ahead is plausible


# ---- the Prometheus client: no redirects, the token to the configured server only ------------


def test_a_redirect_is_refused_and_the_token_never_reaches_its_target() -> None:
    elsewhere = FakePrometheus(lambda promql: (200, _vector(({}, 1.0)), {}))

    def redirect(promql: str) -> tuple[int, dict[str, Any], dict[str, str]]:
        target = f"{elsewhere.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        return 302, {}, {"Location": target}

    prometheus = FakePrometheus(redirect)
    try:
        queries = default_queries(JOB, namespace=NS)
        source = PrometheusSource(prometheus.url, queries, timeout=2.0, bearer_token=TOKEN)
        with pytest.raises(PrometheusError, match="redirects are not followed"):
            asyncio.run(source.read())
        assert prometheus.requests and all(a == f"Bearer {TOKEN}" for _, a in prometheus.requests)
        assert elsewhere.requests == []  # not even asked, let alone with the token
    finally:
        prometheus.close()
        elsewhere.close()


def test_the_chart_documents_no_scrape_annotation_route() -> None:
    """values.yaml's monitoring switch is the per-job, verified PodMonitor."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["podMonitor"]["enabled"] is False  # opt-in, as before
    assert not (CHART / "templates/podmonitor.yaml").exists()  # no chart-wide, unverified one
