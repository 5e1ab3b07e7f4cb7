"""The real control plane itself: namespaces and controllers, the MalleusJob CRD as the real API
server applies it (and the harness's wait for a CRD to be Established), the Helm chart's RBAC
judged by the real RBAC authorizer, and the controllers that act on nodes and owners (node
lifecycle, garbage collector)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.controlplane import (
    NODE_GRACE_S,
    ControlPlane,
    ControlPlaneError,
    established,
    wait_until,
)
from tests.cluster.fixtures import node_ready
from tests.cluster.kubelet import ProcessKubelet

ROOT = Path(__file__).resolve().parents[2]
JOBS = "/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs"


def test_the_control_plane_has_its_namespaces_and_the_controllers_service_accounts(
    control_plane: ControlPlane,
) -> None:
    http = control_plane.http()
    names = {n["metadata"]["name"] for n in http.get("/api/v1/namespaces").json()["items"]}
    assert {"default", "kube-system", "kube-public", "kube-node-lease"} <= names
    # --use-service-account-credentials: each controller acts as its own service account
    expected = {"generic-garbage-collector", "node-controller", "namespace-controller",
                "replicaset-controller", "job-controller", "service-account-controller"}  # fmt: skip

    def accounts() -> bool | None:
        items = http.get("/api/v1/namespaces/kube-system/serviceaccounts").json()["items"]
        return True if expected <= {a["metadata"]["name"] for a in items} else None

    wait_until(accounts, 30, "controllers' service accounts", alive=control_plane.dead)
    roles = http.get("/apis/rbac.authorization.k8s.io/v1/clusterroles").json()["items"]
    assert {"cluster-admin", "admin", "edit", "view", "system:node"} <= {
        r["metadata"]["name"] for r in roles
    }
    # authorization is real: a user with no bindings is refused
    nobody = control_plane.http(control_plane.identity("nobody"))
    response = nobody.get("/api/v1/namespaces/default/pods")
    assert response.status_code == 403, response.text
    assert 'User "nobody" cannot list resource "pods"' in response.json()["message"]


def _job(name: str) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    job["metadata"] = {"name": name}
    return copy.deepcopy(job)


def test_the_crd_applies_and_the_server_rejects_an_invalid_job(
    control_plane: ControlPlane, cluster_crd: dict[str, Any], namespace: str
) -> None:
    http = control_plane.http()
    good = http.post(JOBS.format(ns=namespace), json=_job("tiny"))
    assert good.status_code == 201, good.text
    bad = _job("bad")
    bad["spec"]["parallelism"]["tp"] = 3  # neither a power of two nor a divisor of 4
    response = http.post(JOBS.format(ns=namespace), json=bad)
    assert response.status_code == 422, response.text
    message = response.json()["message"]
    assert "spec.parallelism.tp must be a power of two" in message, message
    assert "spec.parallelism.tp must divide spec.gpusPerNode" in message, message
    # the status subresource: a spec write does not touch status, and vice versa
    patch = {"status": {"phase": "Running"}}
    stored = http.patch(
        f"{JOBS.format(ns=namespace)}/tiny",
        json=patch,
        headers={"Content-Type": "application/merge-patch+json"},
    ).json()
    assert "status" not in stored or stored["status"].get("phase") != "Running"


def _can(cluster: ControlPlane, user: str, *args: str) -> bool:
    done = cluster.kubectl("auth", "can-i", *args, "--as", user, check=False)
    assert done.stdout.strip() in ("yes", "no"), done.stderr
    return done.stdout.strip() == "yes"


def _crd(plural: str, kind: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.harness.example.com"},
        "spec": {
            "group": "harness.example.com",
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": kind},
            "versions": [
                {"name": "v1", "served": True, "storage": True,
                 "schema": {"openAPIV3Schema": {"type": "object"}}}
            ],
        },
    }  # fmt: skip


def test_the_harness_waits_for_a_crd_established_and_says_why_one_never_is(
    control_plane: ControlPlane,
) -> None:
    control_plane.apply([_crd("gadgets", "Gadget")])
    stored = control_plane.wait_established("gadgets.harness.example.com")
    assert established(stored), stored["status"]
    # a second kind of the same name in the group: its names are refused, so it is never
    # Established; the wait ends at its bound, naming the CRD and the server's reason
    control_plane.apply([_crd("widgets", "Gadget")])
    with pytest.raises(ControlPlaneError) as failed:
        control_plane.wait_established("widgets.harness.example.com", timeout=3)
    message = str(failed.value)
    assert "CRD widgets.harness.example.com Established: not so after 3 s" in message, message
    assert "KindConflict" in message, message
    http = control_plane.http()
    for name in ("gadgets", "widgets"):
        http.delete(
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}.harness.example.com"
        )


def test_the_charts_edit_role_lets_a_tenant_create_jobs_and_nothing_more(
    control_plane: ControlPlane, chart_rbac: list[dict[str, Any]], namespace: str
) -> None:
    names = {d["metadata"]["name"] for d in chart_rbac if d["kind"] == "ClusterRole"}
    assert "malleus-edit" in names
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "alice-edit", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "malleus-edit"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}],
    }  # fmt: skip
    control_plane.apply([binding])
    ns = ["-n", namespace]
    assert _can(control_plane, "alice", "create", "malleusjobs.malleus.io", *ns)
    assert _can(control_plane, "alice", "delete", "malleusjobs.malleus.io", *ns)
    assert not _can(control_plane, "alice", "create", "malleusjobs.malleus.io", "-n", "default")
    assert not _can(control_plane, "alice", "create", "pods", *ns)
    assert not _can(control_plane, "alice", "get", "secrets", *ns)
    assert not _can(control_plane, "alice", "patch", "malleusjobs.malleus.io",
                    "--subresource", "status", *ns)  # fmt: skip
    # and the same as alice herself, through her own client certificate
    alice = control_plane.http(control_plane.identity("alice"))
    created = alice.post(JOBS.format(ns=namespace), json=_job("alices"))
    assert created.status_code == 201, created.text
    denied = alice.post(
        f"/api/v1/namespaces/{namespace}/pods",
        json={"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}},
    )
    assert denied.status_code == 403, denied.text
    # and through the kubernetes client, as alice
    from kubernetes import client as k8s

    jobs = k8s.CustomObjectsApi(control_plane.client("alice"))
    listed = jobs.list_namespaced_custom_object("malleus.io", "v1alpha1", namespace, "malleusjobs")
    assert {j["metadata"]["name"] for j in listed["items"]} == {"alices"}
    with pytest.raises(k8s.ApiException) as refused:
        k8s.CoreV1Api(control_plane.client("alice")).list_namespaced_secret(namespace)
    assert refused.value.status == 403

    # the aggregation labels fold the chart's rules into the built-in view role
    def view_has_jobs() -> bool | None:
        return True if _can(control_plane, "bob-viewer", "list", "malleusjobs.malleus.io",
                            *ns) else None  # fmt: skip

    control_plane.apply([{**binding, "metadata": {"name": "bob-view", "namespace": namespace},
                          "roleRef": {**binding["roleRef"], "name": "view"},
                          "subjects": [{**binding["subjects"][0], "name": "bob-viewer"}]}])  # fmt: skip
    wait_until(view_has_jobs, 20, "view aggregates malleus-view")


def test_the_operators_service_account_may_do_what_the_operator_needs(
    control_plane: ControlPlane, chart_rbac: list[dict[str, Any]]
) -> None:
    sa = "system:serviceaccount:malleus-system:rel-malleus-operator"
    ns = ["-n", "malleus-system"]
    assert _can(control_plane, sa, "create", "pods", *ns)
    assert _can(control_plane, sa, "patch", "malleusjobs.malleus.io", "--subresource", "status",
                *ns)  # fmt: skip
    assert _can(control_plane, sa, "watch", "customresourcedefinitions.apiextensions.k8s.io")
    assert not _can(control_plane, sa, "create", "pods", "-n", "default")
    assert not _can(control_plane, sa, "create", "clusterroles.rbac.authorization.k8s.io")


def test_a_lost_node_goes_not_ready_its_pods_unready_or_evicted_and_back(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str, tmp_path: Path
) -> None:
    # ``nodes``: healthy nodes beside the lost one. Were it the only node, the node lifecycle
    # controller would see "all Nodes are not-Ready. Entering master disruption mode" and
    # evict nothing (it blames its own connectivity).
    http = control_plane.http()
    with ProcessKubelet(control_plane, "node-lost", tmp_path, index=50) as kubelet:
        wait_until(lambda: node_ready(control_plane, "node-lost"), 30, "node-lost Ready")
        pod = {
            "metadata": {"name": "stranded"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": "node-lost"},
                "containers": [
                    {"name": "c", "image": "x", "command": ["sleep", "600"]},
                ],
            },
        }
        pods = f"/api/v1/namespaces/{namespace}/pods"
        assert http.post(pods, json=pod).status_code == 201
        # a pod that tolerates an unreachable node for 1 s only (the default is 300 s)
        evicted = copy.deepcopy(pod)
        evicted["metadata"]["name"] = "evicted"
        evicted["spec"]["tolerations"] = [
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
             "effect": "NoExecute", "tolerationSeconds": 1},
        ]  # fmt: skip
        assert http.post(pods, json=evicted).status_code == 201

        def ready(name: str) -> str | None:
            body = http.get(f"{pods}/{name}").json()
            conditions = {c["type"]: c["status"] for c in body["status"].get("conditions") or []}
            return conditions.get("Ready")

        for name in ("stranded", "evicted"):
            wait_until(lambda n=name: ready(n) == "True" or None, 30, f"{name} pod Ready")
        kubelet.lose()

        def not_ready() -> dict[str, Any] | None:
            node = http.get("/api/v1/nodes/node-lost").json()
            ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
            taints = {t["key"] for t in node["spec"].get("taints") or []}
            lost = ready["status"] == "Unknown" and "node.kubernetes.io/unreachable" in taints
            return node if lost else None

        node = wait_until(not_ready, NODE_GRACE_S + 20, "node-lost NotReady (Unknown)")
        condition = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert condition["reason"] == "NodeStatusUnknown", condition
        # the node lifecycle controller marks the node's pods not ready (no Service sends to it)
        wait_until(lambda: ready("stranded") == "False" or None, 15, "stranded pod not Ready")
        run = kubelet.pod(namespace, "stranded")
        assert run is not None and run.pids()  # a lost node's processes go on, unseen
        # taint-based eviction deletes the intolerant pod, which stays Terminating: no kubelet
        # confirms that its processes stopped
        wait_until(
            lambda: http.get(f"{pods}/evicted").json()["metadata"].get("deletionTimestamp"),
            15,
            "evicted pod Terminating",
        )
        gone = kubelet.pod(namespace, "evicted")
        assert gone is not None and gone.pids()
        kubelet.recover()
        wait_until(lambda: node_ready(control_plane, "node-lost"), 30, "node-lost Ready again")
        wait_until(lambda: ready("stranded") == "True" or None, 15, "stranded pod Ready again")
        # back, the kubelet stops the evicted pod's processes and lets the pod go
        wait_until(
            lambda: http.get(f"{pods}/evicted").status_code == 404 or None, 45, "evicted pod gone"
        )
        assert not gone.pids()


def test_node_restriction_keeps_a_kubelet_to_its_own_node(
    control_plane: ControlPlane, nodes: list[ProcessKubelet]
) -> None:
    node1 = control_plane.http(control_plane.node_identity(nodes[0].name))
    own = node1.get(f"/api/v1/nodes/{nodes[0].name}")
    assert own.status_code == 200
    patch = {"metadata": {"labels": {"stolen": "yes"}}}
    headers = {"Content-Type": "application/merge-patch+json"}
    other = node1.patch(f"/api/v1/nodes/{nodes[1].name}", json=patch, headers=headers)
    assert other.status_code == 403, other.text
    message = other.json()["message"]
    assert 'node "node-1" is not allowed to modify node "node-2"' in message, message
    # and no reading of Secrets that no pod of its own mounts
    secrets = node1.get("/api/v1/namespaces/kube-system/secrets")
    assert secrets.status_code == 403, secrets.text


def test_the_garbage_collector_deletes_a_child_when_its_owner_goes(
    control_plane: ControlPlane, namespace: str
) -> None:
    http = control_plane.http()
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    owner = http.post(base, json={"metadata": {"name": "owner"}}).json()
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
           "uid": owner["metadata"]["uid"]}  # fmt: skip
    child = {"metadata": {"name": "child", "ownerReferences": [ref]}}
    assert http.post(base, json=child).status_code == 201
    assert http.delete(f"{base}/owner").is_success
    wait_until(
        lambda: True if http.get(f"{base}/child").status_code == 404 else None,
        30,
        "child collected",
        alive=control_plane.dead,
    )


def test_a_validating_admission_policy_can_cap_a_namespaces_jobs(
    control_plane: ControlPlane, cluster_crd: dict[str, Any], namespace: str
) -> None:
    """What a cluster admin may add on top of the CRD: a CEL policy judged by the API server."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "malleus-max-gpus"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": ["malleus.io"], "apiVersions": ["*"],
                     "operations": ["CREATE", "UPDATE"], "resources": ["malleusjobs"]},
                ]
            },
            "validations": [
                {"expression": "object.spec.nodes * object.spec.gpusPerNode <= 4",
                 "message": "at most 4 GPUs per job here"},
            ],
        },
    }  # fmt: skip
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": "malleus-max-gpus"},
        "spec": {
            "policyName": "malleus-max-gpus",
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            },
        },
    }
    control_plane.apply([policy, binding])
    http = control_plane.http()
    job = _job("eight-gpus")  # 2 nodes x 4 GPUs

    def denied() -> str | None:
        response = http.post(JOBS.format(ns=namespace), json=job, params={"dryRun": "All"})
        return response.json()["message"] if response.status_code == 422 else None

    # the policy takes effect once the API server has compiled it (a second or so)
    message = wait_until(denied, 20, "the policy denies an 8-GPU job")
    assert "at most 4 GPUs per job here" in message, message
    job["spec"]["nodes"] = 1
    allowed = http.post(JOBS.format(ns=namespace), json=job)
    assert allowed.status_code == 201, allowed.text
    # elsewhere the policy does not apply
    other = http.post(JOBS.format(ns="default"), json=_job("elsewhere"), params={"dryRun": "All"})
    assert other.status_code == 201, other.text
