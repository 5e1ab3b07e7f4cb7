"""The control endpoint over real HTTP on 127.0.0.1: auth, the switch protocol, metrics."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from malleus.trainer.control import ControlClient, ControlServer, load_token
from malleus.trainer.emulation import InjectionQueue
from malleus.trainer.metrics import TrainerMetrics, parse_rates
from malleus.trainer.plan_inbox import PlanInbox

TOKEN = "s3cret-token"

DESIGN_METRICS = {
    "malleus_gpu_straggling_rate": {"job", "rank", "node"},
    "malleus_gpu_compute_seconds": {"job", "rank"},
    "malleus_step_seconds": {"job"},
    "malleus_tokens_per_second": {"job"},
    "malleus_plan_generation": {"job"},
    "malleus_migration_seconds": {"job"},
    "malleus_migration_bytes": {"job"},
    "malleus_step": {"job"},
}


@pytest.fixture
def metrics() -> TrainerMetrics:
    m = TrainerMetrics(job="demo", rank=0, node=0)
    m.observe_step(7, step_seconds=1.5, tokens_per_second=2048.0, rate=1.0, compute_seconds=0.9)
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

    def status() -> dict:
        return {**metrics.snapshot(), **inbox.status()}

    srv = ControlServer(
        "127.0.0.1",
        0,
        TOKEN,
        status=status,
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
    status = client.status()
    assert status["step"] == 7 and status["current_generation"] == 1
    assert status["rates"] == {"0": 1.0, "1": 1.02, "2": 2.9}
    assert status["migration"] == {"seconds": 0.25, "bytes": 4096, "count": 1}


def test_plan_needs_the_token(server, plan_factory) -> None:
    for token in (None, "wrong"):
        code, body = ControlClient(server.url, token).post_plan(plan_factory(2))
        assert code == 401 and "token" in body["error"]
    req = urllib.request.Request(server.url + "/plan", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 401
    assert err.value.headers["WWW-Authenticate"].startswith("Bearer")
    err.value.close()
    assert server.inbox.pending_generation is None


def test_plan_protocol(server, plan_factory) -> None:
    client = ControlClient(server.url, TOKEN)
    assert client.post_plan(plan_factory(2)) == (202, {"generation": 2})
    code, body = client.post_plan(plan_factory(1))
    assert code == 409 and body["current"] == 1 and body["pending"] == 2
    bad = plan_factory(3, excluded=[9])
    code, body = client.post_plan(bad)
    assert code == 400 and body["error"] == "invalid plan"
    assert "excluded: rank 9 is beyond the world (0..3)" in body["reasons"]
    code, body = client.post_plan(b"x" * 5000)
    assert code == 413 and "limit of 4096" in body["error"]
    plan = server.inbox.take()
    assert plan is not None and plan.generation == 2


def test_inject(server, injections) -> None:
    client = ControlClient(server.url, TOKEN)
    assert client.inject(2, 3.0) == (200, {"rank": 2, "factor": 3.0})
    assert injections.drain() == {2: 3.0}
    for rank, factor in ((-1, 2.0), (1, 0.5), (True, 2.0), (1, "fast")):
        code, body = client.inject(rank, factor)  # type: ignore[arg-type]
        assert code == 400 and body["error"].startswith("invalid injection")
    assert ControlClient(server.url, None).inject(1, 2.0)[0] == 401


def test_refusals_without_coordinator_emulation_or_token(problem) -> None:
    srv = ControlServer("127.0.0.1", 0, None, status=dict, inbox=None, metrics=None, inject=None)
    with srv:
        client = ControlClient(srv.url, TOKEN)
        assert client.post_plan({})[0] == 404  # not the coordinator
        assert client.inject(0, 2.0)[0] == 404  # emulation off
        assert client.status() == {}
    srv = ControlServer(
        "127.0.0.1", 0, None, status=dict, inbox=PlanInbox(problem, 0), metrics=None, inject=None
    )
    with srv:
        code, body = ControlClient(srv.url, TOKEN).post_plan({})
        assert code == 503 and body["error"] == "no control token configured"


def test_metrics_exposition(server) -> None:
    text = ControlClient(server.url).metrics()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, labels in DESIGN_METRICS.items():
        assert name in families, name
        samples = families[name].samples
        assert samples and all(set(s.labels) == labels for s in samples), name
        assert all(s.labels["job"] == "demo" for s in samples)
    rates = {s.labels["rank"]: s for s in families["malleus_gpu_straggling_rate"].samples}
    assert rates["2"].labels["node"] == "1" and rates["2"].value == 2.9
    assert parse_rates(text) == {0: 1.0, 1: 1.02, 2: 2.9}  # rank 3 unmeasured: no series
    assert parse_rates(text, job="other") == {}
    values = {
        s.name: s.value for f in families.values() for s in f.samples if "rank" not in s.labels
    }
    assert values["malleus_step"] == 7 and values["malleus_migration_bytes"] == 4096


def test_load_token(tmp_path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    assert load_token(environ={"MALLEUS_CONTROL_TOKEN": " env "}) == "env"
    assert load_token(secret, environ={}) == "from-file"
    assert load_token(environ={"MALLEUS_CONTROL_TOKEN_FILE": str(secret)}) == "from-file"
    assert load_token(tmp_path / "missing", environ={}) is None
    assert load_token(environ={}) is None
