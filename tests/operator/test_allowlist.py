"""The Prometheus allowlist: the operator fetches ``spec.metrics.prometheus.url`` from its own
pod, so only URLs the installer allowed are ever fetched (no request to an address a job's
author picked), and the settings that carry the list from the chart to the operator."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from malleus.operator import __main__ as cli
from malleus.operator import handlers
from malleus.operator.context import MEMO_KEY, Context
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.settings import Settings, url_allowed
from tests.chart import render
from tests.operator.kube import Kube

PROM = "http://prometheus-operated.monitoring.svc:9090"
EVIL = "http://169.254.169.254/latest/meta-data"


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        (PROM, True),
        (PROM + "/", True),
        ("HTTP://Prometheus-Operated.monitoring.svc:9090", True),  # scheme, host: any case
        ("http://prom.mon:80/x", False),
        ("http://prometheus-operated.monitoring.svc:9090.evil.example", False),
        ("http://prometheus-operated.monitoring.svc:90901", False),
        ("http://prometheus-operated.monitoring.svc", False),  # port 80, not 9090
        ("https://prometheus-operated.monitoring.svc:9090", False),
        ("http://user@prometheus-operated.monitoring.svc:9090", False),
        (PROM + "?x=1", False),
        (EVIL, False),
        ("file:///etc/passwd", False),
        ("not a url", False),
    ],
)
def test_a_url_is_allowed_by_origin_not_by_string_prefix(url: str, allowed: bool) -> None:
    assert url_allowed(url, [PROM]) is allowed


def test_an_entry_with_a_path_admits_only_that_path_and_below() -> None:
    entries = ["https://thanos.example:443/tenant-a", "http://prom.mon"]
    assert url_allowed("https://thanos.example/tenant-a", entries)  # default port either way
    assert url_allowed("https://thanos.example/tenant-a/api", entries)
    assert not url_allowed("https://thanos.example/tenant-ab", entries)
    assert not url_allowed("https://thanos.example/tenant-a/../tenant-b", entries)
    assert not url_allowed("https://thanos.example/", entries)
    assert url_allowed("http://prom.mon:80/anything", entries)
    assert not url_allowed(PROM, [])


def test_settings_carry_lists_and_flags_through_the_environment() -> None:
    s = Settings(prometheus_allowed_urls=(PROM, "http://b:1"), network_policies=False)
    assert Settings.from_env(s.to_env()) == s
    env = {"MALLEUS_OPERATOR_PROMETHEUS_ALLOWED_URLS": f" {PROM} ,, http://b:1"}
    assert Settings.from_env(env).prometheus_allowed_urls == (PROM, "http://b:1")
    with pytest.raises(ValueError, match="expected true or false"):
        Settings.from_env({"MALLEUS_OPERATOR_NETWORK_POLICIES": "maybe"})
    with pytest.raises(ValueError, match="JSON list of NetworkPolicyPeer"):
        Settings.from_env({"MALLEUS_OPERATOR_CONTROL_PORT_PEERS": '{"podSelector": {}}'})


def test_the_chart_passes_its_allowlist_to_the_operator() -> None:
    docs = render(f"prometheus.allowedUrls={{{PROM},http://thanos.mon:9090/t}}")
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {
        e["name"]: e["value"]
        for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    assert Settings.from_env(env).prometheus_allowed_urls == (PROM, "http://thanos.mon:9090/t")
    (dep,) = [d for d in render() if d["kind"] == "Deployment"]
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert Settings.from_env({k: v for k, v in env.items() if v}).prometheus_allowed_urls == ()


def test_the_cli_adds_allowed_urls_and_turns_policies_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import kopf as kopf_module

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf_module, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(kopf_module, "configure", lambda **kw: None)
    cli.main(["--allow-prometheus", PROM, "--no-network-policies", "--metrics-port", "0"])
    ours = calls[0]["memo"]["settings"]
    assert ours.prometheus_allowed_urls == (PROM,) and ours.network_policies is False


def _prometheus_job(make_job: Any, url: str) -> dict[str, Any]:
    return make_job(metrics={"source": "prometheus", "prometheus": {"url": url}})


def _memo(kube: Kube, *allowed: str) -> kopf.Memo:
    settings = Settings(metrics_port=0, prometheus_allowed_urls=allowed)
    return kopf.Memo({MEMO_KEY: Context(kube.cluster, settings, OperatorMetrics())})


def test_a_job_naming_a_url_off_the_list_is_refused_before_anything_exists(
    kube: Kube, make_job: Any
) -> None:
    body = _prometheus_job(make_job, EVIL)
    kube.add_job(body)
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match=r"spec\.metrics\.prometheus\.url"):
        asyncio.run(handlers.on_create(body=body, patch=patch, memo=_memo(kube, PROM)))
    st = patch["status"]
    assert st["phase"] == "Failed"
    cond, failed = st["conditions"]
    assert (cond["type"], cond["reason"], cond["status"]) == ("Ready", "InvalidSpec", "False")
    assert (failed["type"], failed["reason"], failed["status"]) == ("Failed", "InvalidSpec", "True")
    assert f"spec.metrics.prometheus.url: {EVIL!r} is not on the operator's" in cond["message"]
    assert PROM in cond["message"]  # the allowlist is named
    assert kube.names() == []  # nothing created
    assert kube.reasons() == ["InvalidSpec"]


def test_with_no_allowlist_no_job_may_use_prometheus(kube: Kube, make_job: Any) -> None:
    body = _prometheus_job(make_job, PROM)
    kube.add_job(body)
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match=r"allowed: none"):
        asyncio.run(handlers.on_create(body=body, patch=patch, memo=_memo(kube)))


def test_a_job_naming_an_allowed_url_is_created(kube: Kube, make_job: Any) -> None:
    body = _prometheus_job(make_job, PROM + "/")
    kube.add_job(body)
    patch = kopf.Patch()
    asyncio.run(handlers.on_create(body=body, patch=patch, memo=_memo(kube, PROM)))
    assert patch["status"]["phase"] == "Pending"
    assert len(kube.of_kind("Pod")) == 3  # two workers and the store


class _Stopped:
    """kopf's DaemonStopped: turns true once the daemon has waited ``waits`` times."""

    def __init__(self, waits: int) -> None:
        self.left = waits

    def __bool__(self) -> bool:
        return self.left <= 0

    async def wait(self, timeout: float | None = None) -> None:
        self.left -= 1


def test_the_daemon_pauses_while_the_live_url_is_off_the_list(
    kube: Kube, make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``metrics`` changes apply live, so the daemon checks the live spec too: an edited URL
    that is not allowed never reaches the decision loop (one event, no fetch)."""
    ran: list[Any] = []

    async def run_job(*args: Any, **kwargs: Any) -> None:
        ran.append(args)

    monkeypatch.setattr(handlers.daemon, "run_job", run_job)
    body = _prometheus_job(make_job, EVIL)
    kube.add_job(body)
    memo = _memo(kube, PROM)
    asyncio.run(handlers.job_daemon(body=body, stopped=_Stopped(3), memo=memo))
    assert ran == []
    assert kube.reasons() == ["InvalidSpec"]
    assert "decision loop paused: spec.metrics.prometheus.url" in kube.events[0]["message"]
    # fixed in the live spec: the loop starts
    body["spec"]["metrics"]["prometheus"]["url"] = PROM
    asyncio.run(handlers.job_daemon(body=body, stopped=_Stopped(3), memo=memo))
    assert len(ran) == 1
