"""The operator process: its command line, settings, metrics, and no torch anywhere."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from prometheus_client import generate_latest

from malleus.operator import __main__ as cli
from malleus.operator import metrics, settings

OPERATOR_MODULES = [
    "__main__",
    "daemon",
    "handlers",
    "jobs",
    "k8s",
    "metrics",
    "resources",
    "settings",
    "sink",
    "sources",
    "status",
    "trainers",
]


def test_help_runs_without_a_cluster() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "malleus.operator", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "--liveness" in out and "--metrics-port" in out and "--namespace" in out


def test_no_operator_module_imports_torch() -> None:
    """The operator image has no torch (DESIGN §3)."""
    imports = "; ".join(f"import malleus.operator.{m}" for m in OPERATOR_MODULES)
    code = f"import sys; {imports}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_settings_from_the_environment_round_trip() -> None:
    s = settings.Settings(metrics_port=9100, endpoint_template="http://{pod_ip}:{port}")
    assert settings.Settings.from_env(s.to_env()) == s
    env = {"MALLEUS_OPERATOR_ACK_TIMEOUT_SECONDS": "30", "MALLEUS_OPERATOR_METRICS_PORT": ""}
    got = settings.Settings.from_env(env)
    assert got.ack_timeout_seconds == 30.0 and got.metrics_port == 8081


def test_main_runs_kopf_standalone_with_the_given_namespaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kopf

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: None)
    assert (
        cli.main(["-n", "ml", "-n", "research", "--metrics-port", "0", "--ack-timeout", "12"]) == 0
    )
    (kw,) = calls
    assert kw["standalone"] is True
    assert kw["clusterwide"] is False and list(kw["namespaces"]) == ["ml", "research"]
    assert kw["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert settings.current().ack_timeout_seconds == 12.0
    assert settings.current().metrics_port == 0
    calls.clear()
    cli.main(["--liveness", ""])
    assert calls[0]["clusterwide"] is True and calls[0]["liveness_endpoint"] is None


def test_operator_metrics_are_exposed() -> None:
    metrics.PHASES.set("ml", "a", "Running")
    metrics.PHASES.set("ml", "b", "Running")
    metrics.PHASES.set("ml", "c", "Failed")
    metrics.PHASES.forget("ml", "c")
    metrics.REPLANS.labels(namespace="ml", job="a").inc()
    metrics.PLANNING_SECONDS.observe(0.3)
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'malleus_operator_jobs{phase="Running"} 2.0' in text
    assert 'malleus_operator_jobs{phase="Failed"} 0.0' in text
    assert 'malleus_operator_replans_total{job="a",namespace="ml"}' in text
    assert "malleus_operator_planning_seconds_bucket" in text
    assert "# TYPE malleus_operator_pod_failures_total counter" in text
    assert "# TYPE malleus_operator_replan_failures_total counter" in text
