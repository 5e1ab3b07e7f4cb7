"""The chart's tenant roles (``malleus-edit`` / ``malleus-view``) enforced by a real API server.

What this harness can and cannot do: its server is apiextensions-apiserver (no kube-apiserver
and no kube-controller-manager in ``shared/k8s``), which serves neither
``rbac.authorization.k8s.io`` nor the SubjectAccessReview API, has no RBAC authorizer of its
own and no clusterrole-aggregation controller, so ``kubectl auth can-i`` has nothing to ask.
It does authenticate client certificates and authorize every request of a user outside
``system:masters`` by *delegation*: it POSTs a SubjectAccessReview, built from the request
(user, groups, verb, API group, resource, subresource, namespace, name), to the webhook of its
``--authorization-kubeconfig``, and answers 403 when the webhook says no.

So here a second API server delegates to a webhook in this test, which decides like Kubernetes'
RBAC authorizer over the roles as the chart renders them, aggregated into the built-in
``admin`` / ``edit`` / ``view`` the way the aggregation controller does (label selectors,
chained: view's rules flow into edit, edit's into admin). Real: the server's authentication,
the attributes of every request (a ``create`` of ``malleusjobs`` in ``malleus.io``, a patch of
the ``status`` subresource, a ``deletecollection``), the 403s. Emulated (by `allows` and
`aggregate`, a few lines each, after k8s.io/kubernetes/pkg/apis/rbac/v1/evaluation_helpers.go
``RuleAllows`` and the clusterrole-aggregation controller): rule matching and aggregation.
Tenants use client certificates of the test CA (``O=`` their group); so does the operator, as
its service account bound to the chart's Role, for what it does on custom resources (a job's
status, a coscheduler's PodGroup). Skips without ``MALLEUS_K8S_ASSETS`` or helm.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from malleus.job import MalleusJobStatus
from malleus.operator import admission, jobs, status
from malleus.operator.context import Context
from malleus.operator.k8s import Cluster
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.resources import JobRef
from malleus.operator.settings import Settings
from tests.k8s.apiserver import ApiServer, assets_dir
from tests.operator.test_helm import _kind, render

AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"
CRDS = {
    d["spec"]["group"]: d
    for d in yaml.safe_load_all((Path(__file__).parent / "data" / "podgroup-crds.yaml").read_text())
}
BUILT_IN: list[dict[str, Any]] = [
    # Kubernetes' bootstrap policy (plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go):
    # admin aggregates aggregate-to-admin; edit carries that label and aggregates
    # aggregate-to-edit; view carries aggregate-to-edit and aggregates aggregate-to-view.
    {
        "metadata": {"name": "admin", "labels": {}},
        "aggregationRule": {
            "clusterRoleSelectors": [{"matchLabels": {AGGREGATE + "admin": "true"}}]
        },
    },
    {
        "metadata": {"name": "edit", "labels": {AGGREGATE + "admin": "true"}},
        "aggregationRule": {
            "clusterRoleSelectors": [{"matchLabels": {AGGREGATE + "edit": "true"}}]
        },
    },
    {
        "metadata": {"name": "view", "labels": {AGGREGATE + "edit": "true"}},
        "aggregationRule": {
            "clusterRoleSelectors": [{"matchLabels": {AGGREGATE + "view": "true"}}]
        },
    },
]
NS, OTHER = "team-a", "team-b"
TENANTS = {"alice": "edit", "bob": "view", "carol": "admin"}
"""User -> the built-in ClusterRole a RoleBinding in `NS` gives them."""


# ---- the RBAC emulation ------------------------------------------------------------------------


def _selected(role: Mapping[str, Any], selectors: list[dict[str, Any]]) -> bool:
    labels = role["metadata"].get("labels") or {}
    return any(
        all(labels.get(k) == v for k, v in (s.get("matchLabels") or {}).items()) for s in selectors
    )


def aggregate(roles: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """ClusterRole name -> rules, aggregated to a fixpoint as the controller does."""
    rules = {r["metadata"]["name"]: list(r.get("rules") or []) for r in roles}
    changed = True
    while changed:
        changed = False
        for role in roles:
            selectors = (role.get("aggregationRule") or {}).get("clusterRoleSelectors")
            if not selectors:
                continue
            name = role["metadata"]["name"]
            for other in roles:
                if other is role or not _selected(other, selectors):
                    continue
                for rule in rules[other["metadata"]["name"]]:
                    if rule not in rules[name]:
                        rules[name].append(rule)
                        changed = True
    return rules


def allows(rule: Mapping[str, Any], attrs: Mapping[str, Any]) -> bool:
    """RBAC's RuleAllows for resource attributes (verbs, groups, resource[/subresource], names)."""

    def has(items: list[str] | None, value: str) -> bool:
        return bool(items) and ("*" in items or value in items)  # type: ignore[operator]

    resource = attrs.get("resource", "")
    if attrs.get("subresource"):
        resource += "/" + attrs["subresource"]
    names = rule.get("resourceNames") or []
    return (
        has(rule.get("verbs"), attrs.get("verb", ""))
        and has(rule.get("apiGroups"), attrs.get("group", ""))
        and has(rule.get("resources"), resource)
        and (not names or attrs.get("name", "") in names)
    )


class Webhook:
    """The API server's delegated authorizer: SubjectAccessReviews in, RBAC's answer out."""

    def __init__(self, roles: list[dict[str, Any]]) -> None:
        self.rules = aggregate(roles)
        self.bindings: dict[tuple[str, str], str] = {}  # (namespace, user) -> ClusterRole
        self.reviews: list[dict[str, Any]] = []
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                allowed = webhook.decide(body.get("spec") or {})
                answer = {**body, "status": {"allowed": allowed, "reason": "test RBAC"}}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.send_error(404)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def decide(self, spec: Mapping[str, Any]) -> bool:
        attrs = spec.get("resourceAttributes")
        if attrs is None:
            return False
        self.reviews.append({"user": spec.get("user"), **attrs})
        role = self.bindings.get((attrs.get("namespace", ""), spec.get("user", "")))
        return role is not None and any(allows(r, attrs) for r in self.rules.get(role, []))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DelegatingApiServer(ApiServer):
    """The harness's API server, its authorization delegated to `Webhook` (by the kubeconfig
    it is started with for that: the harness's dummy one, pointed at the webhook)."""

    def __init__(self, assets: Path, workdir: Path, webhook_url: str) -> None:
        super().__init__(assets, workdir)
        self.webhook_url = webhook_url

    def _write_dummy_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "authz", "cluster": {"server": self.webhook_url}}],
            "users": [{"name": "authz-user", "user": {"token": "unused"}}],
            "contexts": [{"name": "authz", "context": {"cluster": "authz", "user": "authz-user"}}],
            "current-context": "authz",
        }
        (self.workdir / "dummy.kubeconfig").write_text(yaml.safe_dump(config))

    def kubeconfig_for(self, user: str, group: str) -> Path:
        """A kubeconfig authenticating as ``user`` in ``group`` (for a `k8s.Cluster`)."""
        self.tenant(user, group).close()
        name = user.replace(":", "-")
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.certs / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": name,
                    "user": {
                        "client-certificate": str(self.certs / f"{name}.crt"),
                        "client-key": str(self.certs / f"{name}.key"),
                    },
                }
            ],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": name}}],
            "current-context": "test",
        }
        path = self.workdir / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    def tenant(self, user: str, group: str) -> httpx.Client:
        """A client authenticated as ``user`` in ``group`` (a certificate of the test CA)."""
        folder, name = self.certs, user.replace(":", "-")
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for args in (
            ["req", "-new", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/O={group}/CN={user}"],
            ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", "-extfile", "client.ext"],
        ):  # fmt: skip
            subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
        context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
        context.load_cert_chain(str(folder / f"{name}.crt"), str(folder / f"{name}.key"))
        return httpx.Client(base_url=self.url, verify=context, timeout=30.0)


# ---- fixtures ---------------------------------------------------------------------------------


def _chart_roles(*sets: str) -> list[dict[str, Any]]:
    return [r for r in _kind(render(*sets), "ClusterRole") if AGGREGATE[:-1] in json.dumps(r)]


@pytest.fixture(scope="module")
def authz(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[DelegatingApiServer, Webhook]]:
    assets = assets_dir()
    if assets is None:
        pytest.skip("MALLEUS_K8S_ASSETS is unset (scripts/k8s-assets.sh DEST fills one)")
    webhook = Webhook([*BUILT_IN, *_chart_roles()])
    for user, role in TENANTS.items():
        webhook.bindings[(NS, user)] = role
    server = DelegatingApiServer(assets, tmp_path_factory.mktemp("authz"), webhook.url)
    try:
        with server:
            from tests.k8s.fixtures import CRD_FILE

            server.apply_crd(yaml.safe_load(CRD_FILE.read_text()))  # as system:masters
            yield server, webhook
    finally:
        webhook.close()


def _job(make_job: Any, ns: str, name: str = "demo") -> dict[str, Any]:
    body: dict[str, Any] = make_job(namespace=ns)
    body["metadata"] = {"name": name, "namespace": ns}
    return body


def _url(ns: str, name: str = "", sub: str = "") -> str:
    url = f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs"
    return url + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


MERGE = {"Content-Type": "application/merge-patch+json"}


# ---- tests ------------------------------------------------------------------------------------


def test_the_emulation_aggregates_the_chart_roles_into_the_built_in_ones() -> None:
    rules = aggregate([*BUILT_IN, *_chart_roles()])
    create = {"verb": "create", "group": "malleus.io", "resource": "malleusjobs"}
    status = {**create, "verb": "patch", "subresource": "status"}
    read = {**create, "verb": "list"}
    assert [allows(r, create) for r in rules["edit"]].count(True) == 1
    assert any(allows(r, create) for r in rules["admin"])  # edit's rules flow into admin
    assert not any(allows(r, create) for r in rules["view"])
    assert all(any(allows(r, read) for r in rules[role]) for role in ("admin", "edit", "view"))
    assert not any(allows(r, status) for role in rules for r in rules[role])
    bare = aggregate([*BUILT_IN, *_chart_roles("rbac.userRoles.create=false")])
    assert bare == {"admin": [], "edit": [], "view": []}


def test_edit_may_create_and_delete_jobs_but_never_write_their_status(
    authz: tuple[DelegatingApiServer, Webhook], make_job: Any
) -> None:
    server, webhook = authz
    with server.tenant("alice", "team-a") as alice:
        made = alice.post(_url(NS), json=_job(make_job, NS))
        assert made.status_code == 201, made.text
        assert alice.get(_url(NS)).status_code == 200
        assert alice.get(_url(NS, "demo")).status_code == 200
        assert alice.get(_url(NS, "demo", "status")).status_code == 200
        spec = {"spec": {"suspend": True}}
        assert alice.patch(_url(NS, "demo"), json=spec, headers=MERGE).status_code == 200
        forged = {"status": {"phase": "Succeeded"}}
        denied = alice.patch(_url(NS, "demo", "status"), json=forged, headers=MERGE)
        assert denied.status_code == 403, denied.text
        message = denied.json()["message"]
        assert 'User "alice" cannot patch resource "malleusjobs/status"' in message, message
        elsewhere = alice.post(_url(OTHER), json=_job(make_job, OTHER))
        assert elsewhere.status_code == 403, elsewhere.text  # bound in team-a only
        assert alice.delete(_url(NS, "demo")).status_code == 200
        assert alice.delete(_url(NS)).status_code == 200  # deletecollection
    seen = {(r["verb"], r.get("subresource", "")) for r in webhook.reviews if r["user"] == "alice"}
    assert {("create", ""), ("patch", "status"), ("deletecollection", "")} <= seen
    assert all(
        (r["group"], r["resource"]) == ("malleus.io", "malleusjobs")
        for r in webhook.reviews
        if r["user"] == "alice"
    )


def test_view_may_read_jobs_and_nothing_more(
    authz: tuple[DelegatingApiServer, Webhook], make_job: Any
) -> None:
    server, _ = authz
    made = server.client.post(_url(NS), json=_job(make_job, NS, "seen"))  # by the admin
    assert made.status_code == 201, made.text
    with server.tenant("bob", "team-a") as bob:
        assert bob.get(_url(NS)).status_code == 200
        assert bob.get(_url(NS, "seen")).status_code == 200
        assert bob.get(_url(NS, "seen", "status")).status_code == 200
        for response in (
            bob.post(_url(NS), json=_job(make_job, NS, "mine")),
            bob.patch(_url(NS, "seen"), json={"spec": {"suspend": True}}, headers=MERGE),
            bob.delete(_url(NS, "seen")),
            bob.get(_url(OTHER)),
        ):
            assert response.status_code == 403, response.text
    with server.tenant("carol", "team-a") as carol:  # admin gets edit's rules by aggregation
        assert carol.delete(_url(NS, "seen")).status_code == 200


def _operator_rules(*sets: str) -> list[dict[str, Any]]:
    """The rules of the operator's Role in the release namespace, as the chart renders them."""
    docs = render(*sets)
    (role,) = [d for d in _kind(docs, "Role") if d["metadata"]["namespace"] == "malleus-system"]
    rules: list[dict[str, Any]] = role["rules"]
    return rules


async def _pod_group_condition(ctx: Context, spec: Any, ref: JobRef) -> dict[str, Any]:
    """`admission.ensure_pod_group` as the operator, its condition written and read back."""
    merged = await admission.ensure_pod_group(ctx, spec, ref, [], status.now())
    assert merged is not None
    patch = status.dump(MalleusJobStatus(conditions=merged))
    await ctx.cluster.patch_job_status(ref.namespace, ref.name, patch)  # the Role allows it
    job = await ctx.cluster.get_job(ref.namespace, ref.name)
    assert job is not None
    conds = {c["type"]: c for c in job["status"]["conditions"]}
    return dict(conds[admission.POD_GROUP_CREATED])


def test_the_operator_role_writes_status_and_pod_groups_only_when_granted(
    authz: tuple[DelegatingApiServer, Webhook], make_job: Any
) -> None:
    """The operator's own Role (release namespace) on the real server: it may write a job's
    status, and create a Volcano PodGroup only with ``rbac.podGroups.volcano``; without, the job
    says ``Forbidden`` and names the value."""
    server, webhook = authz
    ns = "malleus-system"
    server.apply_crd(CRDS["scheduling.volcano.sh"])
    body = make_job(namespace=ns, scheduling={"podGroup": {"name": "gang", "create": "volcano"}})
    body["metadata"] = {"name": "gang-job", "namespace": ns}
    made = server.client.post(_url(ns), json=body)
    assert made.status_code == 201, made.text
    ref = JobRef.from_body(made.json())
    spec = jobs.resolve(made.json()).spec
    outcomes: dict[str, dict[str, Any]] = {}
    for mode, sets in (("off", ()), ("on", ("rbac.podGroups.volcano=true",))):
        user = f"system:serviceaccount:{ns}:operator-{mode}"
        webhook.rules[f"operator-{mode}"] = _operator_rules(*sets)
        webhook.bindings[(ns, user)] = f"operator-{mode}"
        cluster = Cluster.connect(str(server.kubeconfig_for(user, "system:serviceaccounts")))
        ctx = Context(cluster=cluster, settings=Settings(metrics_port=0), metrics=OperatorMetrics())
        try:
            outcomes[mode] = asyncio.run(_pod_group_condition(ctx, spec, ref))
        finally:
            cluster.close()
    off, on = outcomes["off"], outcomes["on"]
    assert (off["status"], off["reason"]) == ("False", "Forbidden"), off
    assert "rbac.podGroups.volcano=true" in off["message"]
    assert (on["status"], on["reason"]) == ("True", "Created"), on
    got = server.client.get(f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{ns}/podgroups/gang")
    assert got.status_code == 200 and got.json()["spec"] == {"minMember": 2}
    denied = [r for r in webhook.reviews if r["user"].endswith("operator-off")]
    assert any((r["verb"], r["resource"]) == ("create", "podgroups") for r in denied)
