"""The chart's alerting rules, checked and unit-tested by Prometheus' own `promtool`."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .server import binary

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm/malleus-operator/files/prometheus-rules.yaml"


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    exe = binary("MALLEUS_PROMTOOL")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 3 rules found" in result.stdout


def test_promtool_unit_tests_the_straggler_and_stuck_alerts() -> None:
    here = Path(__file__).parent
    result = promtool("test", "rules", "rules_test.yaml", cwd=here)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
