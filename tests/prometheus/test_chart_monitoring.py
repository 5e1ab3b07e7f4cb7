"""The chart's monitoring objects: the operator's PodMonitors, PrometheusRule and the Grafana
dashboard.

The dashboard's PromQL is parsed by Prometheus' own `promtool` (as recording rules); the chart
is rendered with helm (MALLEUS_HELM) when it is available.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .test_rules import ROOT, RULES, promtool

CHART = ROOT / "helm/malleus-operator"
DASHBOARD = CHART / "dashboards/malleus.json"


def exprs(dashboard: dict[str, Any]) -> dict[str, str]:
    return {
        f"{p['title']}/{t['refId']}": t["expr"] for p in dashboard["panels"] for t in p["targets"]
    }


def test_the_dashboard_covers_the_figures_and_its_promql_parses(tmp_path: Path) -> None:
    board = json.loads(DASHBOARD.read_text())
    queries = exprs(board)
    kinds = {p["title"]: p["type"] for p in board["panels"]}
    assert kinds["Per-GPU straggling rate"] == "heatmap"
    joined = "\n".join(queries.values())
    for metric in (
        "malleus_gpu_straggling_rate",
        "malleus_tokens_total",
        "malleus_plan_generation",
        "malleus_migrations_total",
        "malleus_step_duration_seconds_bucket",
    ):
        assert metric in joined, metric
    rules = [
        {"record": f"dashboard:q{i}", "expr": q.replace("$__rate_interval", "5m")}
        for i, q in enumerate(queries.values())
    ]
    (tmp_path / "dashboard.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    result = promtool("check", "rules", str(tmp_path / "dashboard.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def render(*sets: str) -> list[dict[str, Any]]:
    exe = os.environ.get("MALLEUS_HELM")
    if not exe:
        pytest.skip("MALLEUS_HELM is not set (scripts/helm-bin.sh provides helm)")
    args = [exe, "template", "rel", str(CHART), "--set", "watchNamespaces={ml}"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_monitoring_objects_are_off_by_default_and_render_when_asked() -> None:
    kinds = {"PodMonitor", "PrometheusRule", "ServiceMonitor"}
    assert not [d for d in render() if d["kind"] in kinds]
    docs = {
        d["kind"]: d
        for d in render(
            "metrics.podMonitor.enabled=true",
            "metrics.prometheusRule.enabled=true",
            "metrics.grafanaDashboard.enabled=true",
        )
    }
    # No chart-wide PodMonitor (one monitor cannot trust every job's CA): the operator makes
    # one per job (tests/security/test_metrics_forgery.py), and may.
    assert "PodMonitor" not in docs
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MALLEUS_OPERATOR_POD_MONITORS"] == "true"
    assert env["MALLEUS_OPERATOR_POD_MONITOR_INTERVAL"] == "15s"
    rules = [
        r
        for d in render("metrics.podMonitor.enabled=true")
        if d["kind"] == "Role"
        for r in d["rules"]
    ]
    assert {
        "apiGroups": ["monitoring.coreos.com"],
        "resources": ["podmonitors"],
        "verbs": ["create", "get"],
    } in rules
    assert docs["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
    dashboard = docs["ConfigMap"]["data"]["malleus.json"]
    assert json.loads(dashboard) == json.loads(DASHBOARD.read_text())
