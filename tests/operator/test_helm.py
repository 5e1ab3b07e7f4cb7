"""The Helm chart: lint, render, validate every object, least-privilege RBAC, a hardened Deployment.

helm is found through ``MALLEUS_HELM`` (a path), then PATH, then ``.cache/bin/helm`` (where
``scripts/helm-bin.sh .cache/bin`` puts it); tests that need it skip with how to get it.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.chart import CHART, ROOT, helm, is_user_role, of_kind, operator_rules, render

ALLOWED_VERBS: dict[tuple[str, str], set[str]] = {
    # what malleus.operator (kopf + k8s.py) calls, and nothing more
    ("malleus.io", "malleusjobs"): {"get", "list", "watch", "patch"},
    ("malleus.io", "malleusjobs/status"): {"get", "patch"},
    ("", "pods"): {"create", "get", "list", "watch", "delete"},
    ("", "services"): {"create", "get", "delete"},
    ("", "secrets"): {"create", "get", "patch", "delete"},  # patch: certificate renewal
    ("", "configmaps"): {"create", "get", "patch", "delete"},
    ("", "events"): {"create"},
    ("networking.k8s.io", "networkpolicies"): {"create", "get", "delete"},
    ("policy", "poddisruptionbudgets"): {"create", "get", "delete"},
    ("kueue.x-k8s.io", "workloads"): {"create", "get"},  # operator/kueue.py (rbac.kueue)
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
    ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}
CLUSTER_SCOPED = {
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("", "namespaces"),
    ("kueue.x-k8s.io", "workloadpriorityclasses"),
}
MODES = [
    (),
    ("watchNamespaces={ml,research}",),
    ("rbac.clusterWide=true",),
    ("networkPolicy.enabled=false",),
]
"""The chart's RBAC and NetworkPolicy modes: default (the release namespace only), more
namespaces, cluster-wide, and no NetworkPolicies."""


# ---- no helm needed -------------------------------------------------------------------------


def test_chart_crd_is_an_exact_copy_of_the_crd() -> None:
    source = ROOT / "crds" / "malleusjob.yaml"
    copy = CHART / "crds" / "malleusjob.yaml"
    assert copy.read_bytes() == source.read_bytes(), (
        "the chart's CRD differs from crds/malleusjob.yaml: "
        "cp crds/malleusjob.yaml helm/malleus-operator/crds/malleusjob.yaml"
    )


def _validation_rules(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = list(node.get("x-kubernetes-validations") or [])
        return found + [r for v in node.values() for r in _validation_rules(v)]
    if isinstance(node, list):
        return [r for v in node for r in _validation_rules(v)]
    return []


def test_the_charts_kube_version_is_one_the_crd_validates_on() -> None:
    """A CEL rule's `reason` and `fieldPath` arrived in Kubernetes 1.28: an older API server
    refuses the CRD, so the chart must not promise less (it said >= 1.27)."""
    crd = yaml.safe_load((ROOT / "crds" / "malleusjob.yaml").read_text())
    rules = _validation_rules(crd)
    assert rules and any("fieldPath" in r or "reason" in r for r in rules)
    assert not any("optionalOldSelf" in r for r in rules)  # 1.29+: would raise the floor
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    floor = chart["kubeVersion"].removeprefix(">=").split("-")[0]
    assert tuple(int(x) for x in floor.split(".")[:2]) >= (1, 28), chart["kubeVersion"]


def test_values_schema_accepts_the_default_values() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    bad = {
        **values,
        "securityContext": {**values["securityContext"], "readOnlyRootFilesystem": False},
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_chart_sources_pass_yamllint() -> None:
    linter = pytest.importorskip("yamllint.linter")
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig("extends: default\nrules: {line-length: {max: 100}}")
    for path in [CHART / "Chart.yaml", CHART / "values.yaml"]:
        problems = [p for p in linter.run(path.read_text(), config) if p.level == "error"]
        assert problems == [], f"{path.name}: {problems}"


# ---- helm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [*MODES, ("metrics.serviceMonitor.enabled=true",)])
def test_helm_lint_strict(sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    result = helm(*args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_rejects_unsafe_or_unknown_values() -> None:
    for bad in (
        "securityContext.readOnlyRootFilesystem=false",
        "podSecurityContext.runAsNonRoot=false",
        "image.pullPolicy=Sometimes",
        "noSuchKey=1",
    ):
        result = helm("template", "rel", str(CHART), "--set", bad, check=False)
        assert result.returncode != 0, f"--set {bad} was accepted"
        assert "schema" in (result.stderr + result.stdout).lower()


@pytest.mark.parametrize("sets", MODES)
def test_rendered_objects_validate_against_kubernetes(sets: tuple[str, ...]) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the test extra)"
    )
    docs = render(*sets, include_crds=True)
    kinds = sorted(d["kind"] for d in docs)
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)


def test_rendered_output_passes_yamllint() -> None:
    linter = pytest.importorskip("yamllint.linter")
    from yamllint.config import YamlLintConfig

    out = helm("template", "rel", str(CHART), "--set", "watchNamespaces={ml}").stdout
    # helm's toYaml writes block sequences unindented: allow both styles, as chart-testing does
    config = YamlLintConfig(
        "extends: default\nrules: {line-length: {max: 120}, document-start: disable, "
        "indentation: {spaces: consistent, indent-sequences: whatever}}"
    )
    problems = [p for p in linter.run(out, config) if p.level == "error"]
    assert problems == [], "\n".join(f"{p.line}: {p.message}" for p in problems)


def _args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = of_kind(docs, "Deployment")
    args: list[str] = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize("sets", MODES)
def test_rbac_is_least_privilege(sets: tuple[str, ...]) -> None:
    docs = render(*sets)
    cluster_wide = "rbac.clusterWide=true" in sets
    policies = "networkPolicy.enabled=false" not in sets
    granted: dict[tuple[str, str], set[str]] = {}
    for kind, group, resource, verbs in operator_rules(docs):
        assert "*" not in (group, resource) and "*" not in verbs, (kind, group, resource, verbs)
        assert not verbs & {"escalate", "bind", "impersonate", "deletecollection", "update"}
        key = (group, resource)
        assert key in ALLOWED_VERBS, f"unexpected access to {key}"
        assert verbs <= ALLOWED_VERBS[key], f"{key}: {verbs - ALLOWED_VERBS[key]} not needed"
        granted.setdefault(key, set()).update(verbs)
        if not cluster_wide and key not in CLUSTER_SCOPED:
            assert kind == "Role", f"{key} must be namespaced unless rbac.clusterWide"
    expected = dict(ALLOWED_VERBS)
    if not policies:
        del expected[("networking.k8s.io", "networkpolicies")]
    assert granted == expected  # and everything the operator uses is granted
    assert "list" not in granted[("", "secrets")]
    (sa,) = of_kind(docs, "ServiceAccount")
    for binding in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": sa["metadata"]["name"],
                "namespace": "malleus-system",
            }
        ]


@pytest.mark.parametrize(
    ("sets", "namespaces"),
    [
        ((), ["malleus-system"]),
        (("watchNamespaces={ml,research}",), ["malleus-system", "ml", "research"]),
        (("watchNamespaces={malleus-system,ml}",), ["malleus-system", "ml"]),
        (("rbac.clusterWide=true",), []),
    ],
)
def test_the_default_is_namespaced_and_cluster_wide_only_when_asked(
    sets: tuple[str, ...], namespaces: list[str]
) -> None:
    """A Role and RoleBinding per watched namespace, and the operator told to watch exactly
    those; a ClusterRole that reaches into namespaces only with rbac.clusterWide."""
    docs = render(*sets)
    for kind in ("Role", "RoleBinding"):
        assert sorted(d["metadata"]["namespace"] for d in of_kind(docs, kind)) == namespaces
    watched = [a.removeprefix("--namespace=") for a in _args(docs) if a.startswith("--namespace")]
    assert watched == namespaces  # none: kopf runs cluster-wide
    (cluster_role,) = [d for d in of_kind(docs, "ClusterRole") if not is_user_role(d)]
    reach = {(g, r) for _, g, r, _ in operator_rules([cluster_role])}
    if namespaces:
        assert reach == CLUSTER_SCOPED  # no pods, no Secrets outside the watched namespaces
    else:
        assert ("", "secrets") in reach and ("", "pods") in reach
    out = helm(
        "install",
        "rel",
        str(CHART),
        "--dry-run=client",
        "-n",
        "malleus-system",
        *(a for s in sets for a in ("--set", s)),
    ).stdout
    assert ("all namespaces" in out.lower()) == (not namespaces)


def test_cluster_wide_and_a_namespace_list_are_refused_together() -> None:
    result = helm(
        "template",
        "rel",
        str(CHART),
        "--set",
        "rbac.clusterWide=true",
        "--set",
        "watchNamespaces={ml}",
        check=False,
    )
    assert result.returncode != 0 and "not both" in result.stderr


def test_deployment_is_hardened_single_and_probed() -> None:
    docs = render("watchNamespaces={ml}")
    (dep,) = of_kind(docs, "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert c["command"] == ["python", "-m", "malleus.operator"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]
    assert c["args"].count("--namespace=ml") == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"healthz": 8080, "metrics": 8081}
    probe = c["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "healthz"}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
    assert pod["serviceAccountName"] == of_kind(docs, "ServiceAccount")[0]["metadata"]["name"]


def test_the_image_tag_defaults_to_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (dep,) = of_kind(render(), "Deployment")
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith(":" + chart["appVersion"])
    (dep,) = of_kind(render("image.tag=v9"), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":v9")


def test_notes_render() -> None:
    out = helm("install", "rel", str(CHART), "--dry-run=client", "-n", "ml-ops").stdout
    assert "kubectl -n ml-ops get mj -w" in out
