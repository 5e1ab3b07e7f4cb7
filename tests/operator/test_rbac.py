"""The chart's tenant roles (``malleus-edit`` / ``malleus-view``) and the operator's Role,
enforced by the real control plane (``tests/cluster``): kube-apiserver's RBAC authorizer, and
kube-controller-manager's clusterrole-aggregation controller folding the chart's roles into the
built-in ``admin`` / ``edit`` / ``view``. Tenants and the operator authenticate with client
certificates of the test CA; RoleBindings give them the built-in roles in one namespace.
Skips without ``MALLEUS_K8S_ASSETS`` or helm.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
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
from tests.chart import of_kind, render
from tests.cluster.controlplane import ControlPlane, wait_until
from tests.cluster.fixtures import AdminApi, apply_chart_rbac

CRDS = {
    d["spec"]["group"]: d
    for d in yaml.safe_load_all((Path(__file__).parent / "data" / "podgroup-crds.yaml").read_text())
}
TENANTS = {"alice": "edit", "bob": "view", "carol": "admin"}
"""User -> the built-in ClusterRole a RoleBinding in the tenants' namespace gives them."""
MERGE = {"Content-Type": "application/merge-patch+json"}


def _binding(ns: str, name: str, kind: str, role: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }


class Tenancy:
    """Two namespaces (``ns``, where the tenants are bound, and ``other``) on the real API."""

    def __init__(self, control_plane: ControlPlane, ns: str, other: str) -> None:
        self.control_plane, self.ns, self.other = control_plane, ns, other
        self.server = AdminApi(control_plane)

    def tenant(self, user: str) -> httpx.Client:
        return self.control_plane.http(self.control_plane.identity(user, ("tenants",)))


@pytest.fixture(scope="module")
def tenancy(control_plane: ControlPlane, cluster_crd: dict[str, Any]) -> Iterator[Tenancy]:
    suffix = uuid.uuid4().hex[:6]
    ns, other = f"team-a-{suffix}", f"team-b-{suffix}"
    apply_chart_rbac(control_plane)  # the user roles, aggregated by the real controller
    for name in (ns, other):
        control_plane.create_namespace(name)
    control_plane.apply([_binding(ns, f"{u}-{r}", "ClusterRole", r, u) for u, r in TENANTS.items()])

    def aggregated() -> bool | None:
        asked = control_plane.kubectl(
            "auth", "can-i", "create", "malleusjobs.malleus.io", "-n", ns, "--as", "alice",
            check=False,
        )  # fmt: skip
        return True if asked.stdout.strip() == "yes" else None

    wait_until(aggregated, 30, "the chart's roles aggregated into edit", alive=control_plane.dead)
    yield Tenancy(control_plane, ns, other)
    for name in (ns, other):
        control_plane.http().delete(f"/api/v1/namespaces/{name}")


def _job(make_job: Any, ns: str, name: str = "demo") -> dict[str, Any]:
    body: dict[str, Any] = make_job(namespace=ns)
    body["metadata"] = {"name": name, "namespace": ns}
    return body


def _url(ns: str, name: str = "", sub: str = "") -> str:
    url = f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs"
    return url + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


# ---- tests ------------------------------------------------------------------------------------


def test_the_built_in_roles_aggregate_the_chart_roles(tenancy: Tenancy) -> None:
    def can(user: str, verb: str, *extra: str) -> bool:
        asked = tenancy.control_plane.kubectl(
            "auth", "can-i", verb, "malleusjobs.malleus.io", "-n", tenancy.ns, "--as", user,
            *extra, check=False,
        )  # fmt: skip
        return asked.stdout.strip() == "yes"

    assert can("alice", "create") and can("carol", "create") and not can("bob", "create")
    assert all(can(u, "list") for u in TENANTS)
    assert not any(can(u, "patch", "--subresource=status") for u in TENANTS)


def test_edit_may_create_and_delete_jobs_but_never_write_their_status(
    tenancy: Tenancy, make_job: Any
) -> None:
    ns, other = tenancy.ns, tenancy.other
    alice = tenancy.tenant("alice")
    made = alice.post(_url(ns), json=_job(make_job, ns))
    assert made.status_code == 201, made.text
    assert alice.get(_url(ns)).status_code == 200
    assert alice.get(_url(ns, "demo")).status_code == 200
    assert alice.get(_url(ns, "demo", "status")).status_code == 200
    spec = {"spec": {"suspend": True}}
    assert alice.patch(_url(ns, "demo"), json=spec, headers=MERGE).status_code == 200
    forged = {"status": {"phase": "Succeeded"}}
    denied = alice.patch(_url(ns, "demo", "status"), json=forged, headers=MERGE)
    assert denied.status_code == 403, denied.text
    message = denied.json()["message"]
    assert 'User "alice" cannot patch resource "malleusjobs/status"' in message, message
    elsewhere = alice.post(_url(other), json=_job(make_job, other))
    assert elsewhere.status_code == 403, elsewhere.text  # bound in one namespace only
    assert alice.delete(_url(ns, "demo")).status_code == 200
    assert alice.delete(_url(ns)).status_code == 200  # deletecollection


def test_view_may_read_jobs_and_nothing_more(tenancy: Tenancy, make_job: Any) -> None:
    ns, other = tenancy.ns, tenancy.other
    made = tenancy.server.client.post(_url(ns), json=_job(make_job, ns, "seen"))  # by the admin
    assert made.status_code == 201, made.text
    bob = tenancy.tenant("bob")
    assert bob.get(_url(ns)).status_code == 200
    assert bob.get(_url(ns, "seen")).status_code == 200
    assert bob.get(_url(ns, "seen", "status")).status_code == 200
    for response in (
        bob.post(_url(ns), json=_job(make_job, ns, "mine")),
        bob.patch(_url(ns, "seen"), json={"spec": {"suspend": True}}, headers=MERGE),
        bob.delete(_url(ns, "seen")),
        bob.get(_url(other)),
    ):
        assert response.status_code == 403, response.text
    carol = tenancy.tenant("carol")  # admin gets edit's rules by aggregation
    assert carol.delete(_url(ns, "seen")).status_code == 200


def _operator_rules(*sets: str) -> list[dict[str, Any]]:
    """The rules of the operator's Role in the release namespace, as the chart renders them."""
    docs = render(*sets)
    (role,) = [d for d in of_kind(docs, "Role") if d["metadata"]["namespace"] == "malleus-system"]
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
    tenancy: Tenancy, make_job: Any
) -> None:
    """The operator's own Role, as the chart renders it, on the real server: it may write a
    job's status, and create a Volcano PodGroup only with ``rbac.podGroups.volcano``; without,
    the job says ``Forbidden`` and names the value."""
    server, ns = tenancy.server, tenancy.other
    server.apply_crd(CRDS["scheduling.volcano.sh"])
    body = make_job(namespace=ns, scheduling={"podGroup": {"name": "gang", "create": "volcano"}})
    body["metadata"] = {"name": "gang-job", "namespace": ns}
    made = server.client.post(_url(ns), json=body)
    assert made.status_code == 201, made.text
    ref = JobRef.from_body(made.json())
    spec = jobs.resolve(made.json()).spec
    outcomes: dict[str, dict[str, Any]] = {}
    for mode, sets in (("off", ()), ("on", ("rbac.podGroups.volcano=true",))):
        user = f"operator-{mode}"
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": user, "namespace": ns},
            "rules": _operator_rules(*sets),
        }
        tenancy.control_plane.apply([role, _binding(ns, user, "Role", user, user)])
        ident = tenancy.control_plane.identity(user, ("system:authenticated",))
        cluster = Cluster.connect(str(ident.kubeconfig))
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
