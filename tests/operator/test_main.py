"""The operator process: its command line, settings, metrics, and no torch anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from malleus.job import Phase
from malleus.operator import __main__ as cli
from malleus.operator import metrics, settings

OPERATOR_MODULES = sorted(
    p.stem for p in (Path(__file__).resolve().parents[2] / "operator").glob("*.py")
)


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
    """The operator image has no torch (docs/images.md)."""
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
    ours = kw["memo"]["settings"]  # handed to the startup handler, not kept in a global
    assert ours.ack_timeout_seconds == 12.0
    assert ours.metrics_port == 0
    calls.clear()
    cli.main(["--liveness", ""])
    assert calls[0]["clusterwide"] is True and calls[0]["liveness_endpoint"] is None


def test_operator_metrics_are_exposed() -> None:
    m = metrics.OperatorMetrics()
    m.phases.set("ml", "a", Phase.RUNNING)
    m.phases.set("ml", "b", Phase.RUNNING)
    m.phases.set("ml", "c", Phase.FAILED)
    m.phases.forget("ml", "c")
    m.replans.labels(namespace="ml", job="a").inc()
    m.planning_seconds.observe(0.3)
    text = generate_latest(m.registry).decode()
    assert 'malleus_operator_jobs{phase="Running"} 2.0' in text
    assert 'malleus_operator_jobs{phase="Failed"} 0.0' in text
    # one gauge per phase the CRD knows, and no other
    shown = {
        line.split('"')[1]
        for line in text.splitlines()
        if line.startswith("malleus_operator_jobs{")
    }
    assert shown == {p.value for p in Phase}
    assert 'malleus_operator_replans_total{job="a",namespace="ml"}' in text
    assert "malleus_operator_planning_seconds_bucket" in text
    assert "# TYPE malleus_operator_pod_failures_total counter" in text
    assert "# TYPE malleus_operator_replan_failures_total counter" in text
    # a second operator in the same process counts on its own
    assert (
        'malleus_operator_jobs{phase="Running"} 0.0'
        in generate_latest(metrics.OperatorMetrics().registry).decode()
    )
