"""The control endpoint over real HTTP on 127.0.0.1: auth, the switch protocol, metrics."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from malleus.control import ControlClient, ControlError, PlanConflict
from malleus.errors import BadInput
from malleus.planner.plan import Plan
from malleus.trainer.endpoint.credentials import load_token
from malleus.trainer.endpoint.metrics import TrainerMetrics, parse_rates
from malleus.trainer.endpoint.server import ControlServer
from malleus.trainer.engine.services import Services, WorkerState
from malleus.trainer.measure.emulation import InjectionQueue
from malleus.trainer.switching.plan_inbox import PlanInbox

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

RATE_LABELS = {"malleus_job", "rank", "node_rank", "gpu", "node_name"}
DESIGN_METRICS = {
    "malleus_gpu_straggling_rate": RATE_LABELS,
    "malleus_gpu_compute_seconds": RATE_LABELS,
    "malleus_step_seconds": {"malleus_job"},
    "malleus_plan_generation": {"malleus_job"},
    "malleus_step": {"malleus_job"},
    "malleus_loss": {"malleus_job"},
    "malleus_steps": {"malleus_job"},
    "malleus_tokens": {"malleus_job"},
    "malleus_migrations": {"malleus_job"},
    "malleus_migrated_bytes": {"malleus_job"},
}


@pytest.fixture
def metrics() -> TrainerMetrics:
    m = TrainerMetrics(job="demo", rank=0, node=0, gpu=0, node_name="gpu-a")
    m.observe_step(
        7, step_seconds=1.5, tokens_per_second=2048.0, rate=1.0, compute_seconds=0.9, loss=2.5
    )
    m.observe_rates({0: 1.0, 1: 1.02, 2: 2.9, 3: None}, nodes={0: 0, 1: 0, 2: 1, 3: 1})
    m.observe_plan(1)
    m.observe_migration(0.25, 4096)
    return m


@pytest.fixture
def injections() -> InjectionQueue:
    return InjectionQueue()


@pytest.fixture
def server(problem, metrics, injections) -> Iterator[ControlServer]:
    inbox = PlanInbox(problem, current_generation=1)
    services = Services(WorkerState("demo", world=4, steps=10), inbox=inbox)
    services.state.update(generation=1, step=7, rates={0: 1.0, 2: 2.9})
    srv = ControlServer(
        "127.0.0.1",
        0,
        TOKEN,
        status=services.status,
        inbox=inbox,
        metrics=metrics,
        inject=injections.put,
        max_body=4096,
    )
    with srv:
        yield srv


def test_health_and_status(server) -> None:
    client = ControlClient(server.url, TOKEN)
    assert server.port > 0 and client.healthz()
    assert httpx.get(server.url + "/status").status_code == 401  # reads need the token too
    body = httpx.get(server.url + "/status", headers=AUTH).json()  # JSON keys are strings
    assert body["step"] == 7 and body["generation"] == 1 and body["steps"] == 10
    assert body["rates"] == {"0": 1.0, "2": 2.9}
    assert client.status().rates == {0: 1.0, 2: 2.9}


def test_plan_needs_the_token(server, plan_factory) -> None:
    for token in (None, "wrong"):
        with pytest.raises(ControlError) as err:
            ControlClient(server.url, token).post_plan(Plan.model_validate(plan_factory(2)))
        assert err.value.code == 401 and "token" in str(err.value)
    answer = httpx.post(server.url + "/plan", content=b"{}")
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert server.inbox.pending_generation is None


def test_plan_protocol(server, plan_factory) -> None:
    client = ControlClient(server.url, TOKEN)
    assert client.post_plan(Plan.model_validate(plan_factory(2))) == 2
    with pytest.raises(PlanConflict) as conflict:
        client.post_plan(Plan.model_validate(plan_factory(1)))
    assert (conflict.value.generation, conflict.value.newest) == (1, 2)
    with pytest.raises(BadInput) as bad:
        client.post_plan(Plan.model_validate(plan_factory(3, excluded=[9])))
    assert "excluded: rank 9 is beyond the world (0..3)" in map(str, bad.value.faults)
    answer = httpx.post(server.url + "/plan", content=b"x" * 5000, headers=AUTH)
    assert answer.status_code == 413 and "limit of 4096" in answer.json()["error"]
    plan = server.inbox.take()
    assert plan is not None and plan.generation == 2


def test_inject(server, injections) -> None:
    client = ControlClient(server.url, TOKEN)
    client.inject(2, 3.0)
    assert injections.drain() == {2: 3.0}
    for rank, factor in ((-1, 2.0), (1, 0.5), (True, 2.0), (1, "fast")):
        body = {"rank": rank, "factor": factor}
        answer = httpx.post(server.url + "/inject", json=body, headers=AUTH)
        assert answer.status_code == 400
        assert answer.json()["error"].startswith("invalid injection")
    with pytest.raises(ControlError) as err:
        ControlClient(server.url, None).inject(1, 2.0)
    assert err.value.code == 401


def test_refusals_without_coordinator_emulation_or_token(server, problem, plan_factory) -> None:
    plan = Plan.model_validate(plan_factory(2))
    status = server.status  # the served rank's ControlStatus
    srv = ControlServer("127.0.0.1", 0, None, status=status, inbox=None, metrics=None, inject=None)
    with srv:
        client = ControlClient(srv.url, TOKEN)
        calls = (lambda: client.post_plan(plan), lambda: client.inject(0, 2.0), client.metrics_text)
        for call in calls:  # not the coordinator, emulation off, no metrics
            with pytest.raises(ControlError) as err:
                call()
            assert err.value.code == 404
        with pytest.raises(ControlError, match="no control token configured") as err:
            client.status()  # with no token configured, nothing but health and metrics
        assert err.value.code == 503
    srv = ControlServer(
        "127.0.0.1", 0, None, status=status, inbox=PlanInbox(problem, 0), metrics=None, inject=None
    )
    with srv:
        with pytest.raises(ControlError, match="no control token configured") as err:
            ControlClient(srv.url, TOKEN).post_plan(plan)
        assert err.value.code == 503


def test_a_pods_page_holds_its_own_ranks_and_the_job_page_every_rank() -> None:
    """In a pod (node 1 of 2 x 2) ``/metrics`` is what Prometheus scrapes: this node's ranks
    only, each with its Kubernetes node and GPU; ``/metrics/job`` keeps every rank for the
    controller's direct scrape. A metrics-only endpoint (this pod's first rank while another
    coordinates) answers both and refuses ``/status``, so no one takes it for the coordinator."""
    m = TrainerMetrics("demo", rank=2, node=1, gpu=0, node_name="gpu-b", own_node_only=True)
    m.observe_step(7, 1.5, 2048.0, rate=2.9, compute_seconds=0.8)
    nodes = {0: 0, 1: 0, 2: 1, 3: 1}
    m.observe_rates({0: 1.0, 1: 1.1, 2: 2.9, 3: 1.2}, nodes, {0: 0.5, 1: 0.6, 2: 0.8, 3: 0.7})
    srv = ControlServer("127.0.0.1", 0, TOKEN, status=None, inbox=None, metrics=m, inject=None)
    with srv:
        client = ControlClient(srv.url, TOKEN)
        pod, job = client.metrics_text(), client.metrics_text(job_wide=True)
        status = httpx.get(srv.url + "/status", headers=AUTH)
        assert status.status_code == 404 and "not the coordinator" in status.text
        with pytest.raises(ControlError):
            client.status()
        assert httpx.post(srv.url + "/plan", headers=AUTH, json={}).status_code == 404
    assert parse_rates(pod) == {2: 2.9, 3: 1.2}
    assert parse_rates(job) == {0: 1.0, 1: 1.1, 2: 2.9, 3: 1.2}
    for name in ("malleus_gpu_straggling_rate", "malleus_gpu_compute_seconds"):
        (family,) = [f for f in text_string_to_metric_families(pod) if f.name == name]
        got = {
            s.labels["rank"]: (s.labels["node_rank"], s.labels["gpu"], s.labels["node_name"])
            for s in family.samples
        }
        assert got == {"2": ("1", "0", "gpu-b"), "3": ("1", "1", "gpu-b")}, name
    steps = [f for f in text_string_to_metric_families(pod) if f.name == "malleus_step"]
    assert steps[0].samples[0].value == 7  # the job's figures are on every page


def test_metrics_exposition(server) -> None:
    text = ControlClient(server.url).metrics_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, labels in DESIGN_METRICS.items():
        assert name in families, name
        samples = families[name].samples
        assert samples and all(set(s.labels) == labels for s in samples), name
        assert all(s.labels["malleus_job"] == "demo" for s in samples)
    rates = {s.labels["rank"]: s for s in families["malleus_gpu_straggling_rate"].samples}
    assert rates["2"].labels["node_rank"] == "1" and rates["2"].value == 2.9
    # GPU index within its node; the Kubernetes node name only for this pod's own node
    assert (rates["2"].labels["gpu"], rates["2"].labels["node_name"]) == ("0", "")
    assert (rates["1"].labels["gpu"], rates["1"].labels["node_name"]) == ("1", "gpu-a")
    assert parse_rates(text) == {0: 1.0, 1: 1.02, 2: 2.9}  # rank 3 unmeasured: no series
    assert parse_rates(text, job="other") == {}
    values = {
        s.name: s.value for f in families.values() for s in f.samples if "rank" not in s.labels
    }
    assert values["malleus_step"] == 7
    for gone in (
        "malleus_tokens_per_second",
        "malleus_migration_seconds",
        "malleus_migration_bytes",
    ):
        assert gone not in families, f"{gone}: a last-step gauge (a counter or histogram has it)"
    assert values["malleus_loss"] == 2.5 and values["malleus_steps_total"] == 1
    assert values["malleus_tokens_total"] == pytest.approx(2048.0 * 1.5)
    assert values["malleus_migrated_bytes_total"] == 4096
    step_hist = families["malleus_step_duration_seconds"]
    assert step_hist.type == "histogram"
    counts = {s.labels.get("le"): s.value for s in step_hist.samples if s.name.endswith("_bucket")}
    assert (counts["1.0"], counts["2.5"]) == (0, 1)  # the 1.5 s step


def test_load_token(tmp_path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    assert load_token(environ={"MALLEUS_CONTROL_TOKEN": " env "}) == "env"
    assert load_token(secret, environ={}) == "from-file"
    assert load_token(environ={"MALLEUS_CONTROL_TOKEN_FILE": str(secret)}) == "from-file"
    both = {"MALLEUS_CONTROL_TOKEN_FILE": str(secret), "MALLEUS_CONTROL_TOKEN": "env"}
    assert load_token(environ=both) == "from-file"  # the Secret's file first, env a fallback
    assert load_token(tmp_path / "missing", environ={}) is None
    assert load_token(environ={}) is None
