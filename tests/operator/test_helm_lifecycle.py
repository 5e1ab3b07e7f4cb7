"""The chart's lifecycle: names, labels, tenants' roles, pull secrets, NOTES, CRD upgrades.

Rendering needs helm (``MALLEUS_HELM``, see tests/operator/test_helm.py); the CRD upgrade and
the NOTES' first job run against a private real control plane (`tests.cluster.controlplane`
from ``MALLEUS_K8S_ASSETS``) with kubectl from ``MALLEUS_KUBECTL``. The control plane is this
module's own: installing an old CRD on the session's server would change the CRD every other
test sees.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart import CHART, helm, helm_binary, of_kind, render
from tests.cluster.controlplane import ControlPlane, assets_dir, wait_until
from tests.cluster.fixtures import AdminApi
from tests.job.cases import base_manifest

OLD_CRD = Path(__file__).with_name("data") / "malleusjob-before-precision.yaml"
CRD_NAME = "malleusjobs.malleus.io"
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"

OWN_NAMES = {"CustomResourceDefinition", "KopfPeering", "ClusterKopfPeering"}
"""Kinds whose names are not the release's: CRDs (named by their group) and kopf's peering
objects (named by ``peering.name``); the user roles are named by ``rbac.userRoles``."""


def _switches(values: dict[str, Any], path: str = "") -> list[str]:
    """``KEY.enabled=true`` for every switch of values.yaml that is off (false or null)."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _switches(value, f"{path}{key}.")
        elif key == "enabled" and not value:
            out.append(f"{path}enabled=true")
    return out


EVERYTHING = (
    "watchNamespaces={ml,research}",
    "imagePullSecrets[0].name=registry-credentials",
    *_switches(yaml.safe_load((CHART / "values.yaml").read_text())),
)
"""Values that turn on every optional object of the chart (found in values.yaml, so a new
optional template is covered the day it is added)."""


def _user_roles(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The aggregated ClusterRoles, by name."""
    return {
        d["metadata"]["name"]: d
        for d in of_kind(docs, "ClusterRole")
        if any(k.startswith(AGGREGATE) for k in d["metadata"].get("labels", {}))
    }


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = of_kind(docs, "Deployment")
    pod: dict[str, Any] = dep["spec"]["template"]
    return pod


# ---- names and labels -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "prefix", "name"),
    [
        ((), "rel-malleus-operator", "malleus-operator"),
        (("nameOverride=trainops",), "rel-trainops", "trainops"),
        (("fullnameOverride=mx",), "mx", "malleus-operator"),
        (("nameOverride=trainops", "fullnameOverride=mx"), "mx", "trainops"),
    ],
)
def test_names_follow_name_and_fullname_overrides(
    sets: tuple[str, ...], prefix: str, name: str
) -> None:
    docs = render(*EVERYTHING, *sets)
    users = _user_roles(docs)
    assert set(users) == {"malleus-edit", "malleus-view"}
    for doc in docs:
        meta = doc["metadata"]
        if meta["name"] not in users and doc["kind"] not in OWN_NAMES:
            assert meta["name"] == prefix or meta["name"].startswith(f"{prefix}-"), (
                doc["kind"],
                meta["name"],
            )
        assert meta["labels"]["app.kubernetes.io/name"] == name, (doc["kind"], meta["name"])
    pod = _pod(docs)
    (dep,) = of_kind(docs, "Deployment")
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": name, "app.kubernetes.io/instance": "rel"}
    assert selector.items() <= pod["metadata"]["labels"].items()
    (service,) = of_kind(docs, "Service")
    assert service["spec"]["selector"] == selector
    (sa,) = of_kind(docs, "ServiceAccount")
    assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"] == prefix
    for binding in of_kind(docs, "RoleBinding") + of_kind(docs, "ClusterRoleBinding"):
        assert binding["roleRef"]["name"] == prefix
        assert binding["subjects"][0]["name"] == prefix
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    # the per-job NetworkPolicies admit the operator by these labels: they must be its own
    admitted = dict(kv.split("=") for kv in env["MALLEUS_OPERATOR_OPERATOR_LABELS"].split(","))
    assert admitted == selector


def test_common_labels_are_on_every_object_and_the_pods() -> None:
    docs = render(
        *EVERYTHING,
        "commonLabels.team=ml-platform",
        "commonLabels.cost-center=r42",
        # the chart's own labels win: a selector cannot be broken by commonLabels
        "commonLabels.app\\.kubernetes\\.io/name=other",
    )
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Role", "ClusterRole", "ServiceMonitor", "NetworkPolicy"} <= kinds
    for doc in [*docs, _pod(docs)]:
        labels = doc["metadata"]["labels"]
        assert labels["team"] == "ml-platform" and labels["cost-center"] == "r42", doc
        assert labels["app.kubernetes.io/name"] == "malleus-operator", doc
    without = render(*EVERYTHING)
    assert all("team" not in d["metadata"]["labels"] for d in without)


def test_overrides_and_labels_the_schema_refuses() -> None:
    for bad in (
        "nameOverride=Not_A_DNS_Label",
        "fullnameOverride=" + "x" * 64,
        "commonLabels.team=" + "x" * 64,
        "imagePullSecrets[0].secret=registry-credentials",
        "rbac.userRoles.enabled=true",
    ):
        result = helm("template", "rel", str(CHART), "--set", bad, check=False)
        assert result.returncode != 0, f"--set {bad} was accepted"
        assert "schema" in (result.stderr + result.stdout).lower(), result.stderr


# ---- tenants' roles -------------------------------------------------------------------------


def test_aggregated_user_roles_give_edit_and_view_on_malleusjobs() -> None:
    users = _user_roles(render())
    edit, view = users["malleus-edit"], users["malleus-view"]
    aggregated = {
        name: {
            k.removeprefix(AGGREGATE)
            for k, v in role["metadata"]["labels"].items()
            if k.startswith(AGGREGATE) and v == "true"
        }
        for name, role in users.items()
    }
    assert aggregated == {"malleus-edit": {"admin", "edit"}, "malleus-view": {"view"}}

    def verbs(role: dict[str, Any]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["malleus.io"], rule  # nothing but MalleusJobs
            for resource in rule["resources"]:
                out.setdefault(resource, set()).update(rule["verbs"])
        return out

    read = {"get", "list", "watch"}
    assert verbs(edit) == {
        "malleusjobs": read | {"create", "update", "patch", "delete", "deletecollection"},
        "malleusjobs/status": read,  # only the operator writes status
    }
    assert verbs(view) == {"malleusjobs": read, "malleusjobs/status": read}
    renamed = _user_roles(render("rbac.userRoles.namePrefix=acme-malleus"))
    assert set(renamed) == {"acme-malleus-edit", "acme-malleus-view"}
    assert _user_roles(render("rbac.userRoles.create=false")) == {}


# ---- images ---------------------------------------------------------------------------------


def test_image_pull_secrets_reach_the_operator_pod() -> None:
    assert "imagePullSecrets" not in _pod(render())["spec"]
    pod = _pod(render("imagePullSecrets[0].name=a", "imagePullSecrets[1].name=b"))
    assert pod["spec"]["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}]


def _notes(*sets: str, upgrade: bool = False) -> str:
    args = ["upgrade", "--install"] if upgrade else ["install"]
    out = helm(
        *args,
        "rel",
        str(CHART),
        "--dry-run=client",
        "-n",
        "malleus-system",
        *(a for s in sets for a in ("--set", s)),
    ).stdout
    return out.split("NOTES:", 1)[1]


def test_notes_warn_of_the_placeholder_image_until_one_is_set() -> None:
    notes = _notes()
    assert "WARNING: image.repository is the chart's placeholder" in notes
    assert "docs/images.md" in notes
    mine = _notes("image.repository=registry.example.com/ml/malleus-operator")
    assert "WARNING" not in mine
    assert "image: registry.example.com/ml/malleus:0.1.0-cpu" in mine  # the trainer beside it


@pytest.mark.parametrize(
    ("sets", "scope"),
    [
        ((), "these namespaces only: malleus-system"),
        (("watchNamespaces={ml}",), "these namespaces only: malleus-system, ml"),
        (("rbac.clusterWide=true",), "ALL namespaces"),
    ],
)
def test_notes_say_what_was_installed_and_where_jobs_go(sets: tuple[str, ...], scope: str) -> None:
    notes = _notes(*sets)
    assert scope in notes
    assert "Deployment rel-malleus-operator" in notes
    assert "malleus-edit and malleus-view" in notes
    assert "kubectl apply --server-side --force-conflicts" in notes
    assert "docs/guide/operator.md" in notes
    job_ns = "ml" if "watchNamespaces={ml}" in sets else "malleus-system"
    assert f"kubectl -n {job_ns} apply -f - <<'YAML'" in notes


def _first_job(notes: str) -> dict[str, Any]:
    """The MalleusJob of the NOTES' heredoc."""
    match = re.search(r"<<'YAML'\n(.*?)\n\s*YAML\n", notes, re.DOTALL)
    assert match, notes
    job: dict[str, Any] = yaml.safe_load(match.group(1))
    return job


# ---- lint and validation --------------------------------------------------------------------

NEW_VALUES = [
    EVERYTHING,
    (*EVERYTHING, "nameOverride=trainops", "commonLabels.team=ml"),
    ("fullnameOverride=mx", "rbac.clusterWide=true", "rbac.userRoles.namePrefix=acme"),
    ("rbac.userRoles.create=false", "networkPolicy.enabled=false"),
]


@pytest.mark.parametrize("sets", NEW_VALUES)
def test_lint_strict_and_kubernetes_validate_with_the_new_values(sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART), *(a for s in sets for a in ("--set", s))]
    result = helm(*args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    kv = pytest.importorskip("kubernetes_validate")
    docs = render(*sets, include_crds=True)
    assert len(docs) >= 8
    for doc in docs:
        try:
            kv.validate(doc, kv.latest_version(), strict=True)
        except kv.SchemaNotFoundError:
            # custom kinds only (ServiceMonitor, ...): every built-in kind must be validated
            group = doc["apiVersion"].rpartition("/")[0]
            assert group and not group.endswith(".k8s.io"), doc["kind"]


# ---- the real API server: CRD upgrades and the first job ------------------------------------


def _kubectl() -> str:
    found = os.environ.get("MALLEUS_KUBECTL") or shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl not found: set MALLEUS_KUBECTL (scripts/helm-bin.sh DEST puts one)")
    return found


class Cluster:
    """A private control plane, with kubectl and helm wired to it."""

    def __init__(self, control_plane: ControlPlane) -> None:
        self.control_plane = control_plane
        self.server = AdminApi(control_plane)

    def shell(self, script: str) -> str:
        """Run a bash pipeline (``kubectl`` and ``helm`` on PATH) against this cluster; its
        stdout (it must succeed)."""
        done = self.run(script)
        assert done.returncode == 0, f"{script}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        """`shell` without the check."""
        bindir = Path(self.control_plane.workdir) / "bin"
        bindir.mkdir(exist_ok=True)
        for name, path in (("kubectl", _kubectl()), ("helm", helm_binary())):
            link = bindir / name
            if not link.exists():
                link.symlink_to(path)
        env = {**self.server.env(), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return done

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        path = f"/apis/malleus.io/v1alpha1/namespaces/{namespace}/malleusjobs/{name}"
        response = self.server.client.get(path)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def crd(self) -> dict[str, Any]:
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
        body: dict[str, Any] = self.server.client.get(path).json()
        return body


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    assets, reason = assets_dir()
    if assets is None:
        pytest.skip(reason)
    _kubectl()
    helm_binary()
    with ControlPlane(assets, tmp_path_factory.mktemp("helm-control-plane")) as control_plane:
        for ns in ("tenant-a", "first"):
            control_plane.create_namespace(ns)
        yield Cluster(control_plane)


def _training_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    props: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return dict(props["properties"]["training"]["properties"])


def test_documented_crd_upgrade_stores_new_fields(cluster: Cluster, tmp_path: Path) -> None:
    """helm install puts the old CRD in place (a plain create, as Helm does for crds/); a job
    with a field the old CRD does not know loses it; the documented command upgrades the CRD,
    after which the field is stored, the old job gets its default, and nothing was deleted."""
    old = yaml.safe_load(OLD_CRD.read_text())
    assert "precision" not in _training_schema(old)
    cluster.server.apply_crd(old)
    ns = "tenant-a"
    manifest = base_manifest()
    manifest["metadata"] = {"name": "before"}
    manifest["spec"]["training"]["precision"] = "bf16"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    cluster.shell(f"kubectl -n {ns} apply --validate=false -f {path}")
    assert "precision" not in cluster.job(ns, "before")["spec"]["training"]  # pruned
    uid = cluster.job(ns, "before")["metadata"]["uid"]

    # the upgrade, exactly as docs/guide/operator.md and NOTES.txt give it (twice: it is idempotent)
    for _ in range(2):
        out = cluster.shell(
            f"helm show crds {CHART} | kubectl apply --server-side --force-conflicts -f -"
        )
        assert f"customresourcedefinition.apiextensions.k8s.io/{CRD_NAME} serverside-applied" in (
            out
        )
    wait_until(
        lambda: True if "precision" in _training_schema(cluster.crd()) else None,
        10,
        "the new CRD schema served",
        interval=0.1,
    )
    kept = cluster.job(ns, "before")
    assert kept["metadata"]["uid"] == uid  # the job survived the upgrade
    assert kept["spec"]["training"]["precision"] == "fp32"  # new default applied on read

    # The old job's spec cannot gain the field: what its pods are made from is fixed once it
    # exists (the CRD's transition rule, which the upgrade brought).
    refused = cluster.run(f"kubectl -n {ns} apply --validate=false -f {path}")
    assert refused.returncode != 0 and "delete and re-create the job" in refused.stderr, refused
    manifest["metadata"] = {"name": "after"}
    path.write_text(yaml.safe_dump(manifest))

    def stored_precision() -> str | None:
        out = cluster.shell(
            f"kubectl -n {ns} create --dry-run=server -o json --validate=false -f {path}"
        )
        value: str | None = json.loads(out)["spec"]["training"].get("precision")
        return value if value == "bf16" else None

    # the CRD handler may serve the old schema for a moment after the update
    assert wait_until(stored_precision, 10, "precision stored", interval=0.2) == "bf16"
    cluster.shell(f"kubectl -n {ns} apply --validate=false -f {path}")
    assert cluster.job(ns, "after")["spec"]["training"]["precision"] == "bf16"
    # the CRD the cluster now has is the chart's (which the equality test pins to crds/)
    chart_crd = yaml.safe_load((CHART / "crds" / "malleusjob.yaml").read_text())
    assert (
        cluster.crd()["spec"]["versions"][0]["schema"] == chart_crd["spec"]["versions"][0]["schema"]
    )


def test_the_first_job_of_the_notes_is_accepted(cluster: Cluster, tmp_path: Path) -> None:
    """The heredoc NOTES.txt prints is a valid MalleusJob for the chart's CRD."""
    cluster.shell(f"helm show crds {CHART} | kubectl apply --server-side --force-conflicts -f -")
    notes = _notes("image.repository=registry.example.com/malleus-operator")
    job = _first_job(notes)
    assert job["spec"]["image"] == "registry.example.com/malleus:0.1.0-cpu"
    path = tmp_path / "first.yaml"
    path.write_text(yaml.safe_dump(job))

    def created() -> bool | None:
        done = subprocess.run(
            [_kubectl(), "-n", "first", "create", "--validate=false", "-f", str(path)],
            env=cluster.server.env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode == 0 or "AlreadyExists" in done.stderr:
            return True
        assert "not find the requested resource" in done.stderr, done.stderr  # not yet served
        return None

    wait_until(created, 10, "the first job created", interval=0.2)
    stored = cluster.job("first", "tiny-cpu")
    assert stored["spec"]["emulation"]["enabled"] is True
    assert stored["spec"]["nodes"] * stored["spec"]["gpusPerNode"] == 8
