"""NetworkPolicies: the per-job one the operator makes and the chart's one for the operator pod.

Torch's rendezvous store (TCPStore) and the collectives' sockets have no authentication, so
the policy is what keeps other pods off them: built, validated against the Kubernetes schema,
created by the handlers before any pod, and aimed (through the chart's settings) at the very
pod labels the chart gives the operator.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kopf
import pytest

from malleus.operator import children, handlers, jobs, resources, workers
from malleus.operator.resources import JobRef
from malleus.operator.settings import Settings
from tests.chart import render
from tests.operator.kube import KINDS, Kube

REF = JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
IN_CLUSTER = Settings(
    operator_namespace="malleus-system",
    operator_labels="app.kubernetes.io/name=malleus-operator,app.kubernetes.io/instance=rel",
    control_port_peers=json.dumps([PROMETHEUS]),
)


def _validate(obj: dict[str, Any]) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the test extra)"
    )
    kv.validate(obj, kv.latest_version(), strict=True)


def _job(make_job: Any, **spec: Any) -> Any:
    return jobs.resolve(make_job(**spec))


def test_only_the_jobs_pods_reach_them_and_the_operator_only_the_control_port(
    make_job: Any,
) -> None:
    job = _job(make_job, controlPort=8123)
    policy = children.network_policy(IN_CLUSTER, job, REF)
    assert policy is not None
    _validate(policy)
    assert policy["metadata"]["name"] == "demo-network"
    assert policy["metadata"]["ownerReferences"] == [resources.owner_reference(REF)]
    spec = policy["spec"]
    assert spec["podSelector"] == {
        "matchLabels": {
            "malleus.io/job": "demo",
            "app.kubernetes.io/managed-by": "malleus-operator",
        }
    }
    assert spec["policyTypes"] == ["Ingress"]  # egress (storage, DNS) is not this policy's
    own, control = spec["ingress"]
    # the job's own pods: every port (the store pod's 29400, gloo/NCCL's ephemeral ports)
    assert own == {"from": [{"podSelector": {"matchLabels": {"malleus.io/job": "demo"}}}]}
    # the operator (its namespace and pod labels) and the configured Prometheus: control only
    # every rank's control port (4 GPUs a node): the coordinator may be any of them
    assert control["ports"] == [{"port": 8123, "endPort": 8126, "protocol": "TCP"}]
    assert control["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "malleus-system"}},
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "malleus-operator",
                    "app.kubernetes.io/instance": "rel",
                }
            },
        },
        PROMETHEUS,
    ]
    # the selector matches every worker pod, and the worker pods carry the "own pods" label
    for pod in (
        c for c in workers.build_children(job, REF, job.initial_plan(), "t") if c["kind"] == "Pod"
    ):
        labels = pod["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items()
        assert own["from"][0]["podSelector"]["matchLabels"].items() <= labels.items()


def test_without_a_known_operator_pod_only_the_jobs_pods_are_admitted(make_job: Any) -> None:
    job = _job(make_job)
    policy = children.network_policy(Settings(), job, REF)
    assert policy is not None
    _validate(policy)
    assert [r.get("ports") for r in policy["spec"]["ingress"]] == [None]
    assert children.network_policy(Settings(network_policies=False), job, REF) is None


def test_the_policy_is_created_before_any_pod(kube: Kube, memo: kopf.Memo, make_job: Any) -> None:
    body = make_job()
    kube.add_job(body)
    asyncio.run(handlers.on_create(body=body, patch=kopf.Patch(), memo=memo))
    made = [r.resource for r in list(kube.emulator) if r.action == "CREATE"]
    made = [r for r in made if r in (KINDS["NetworkPolicy"], KINDS["Pod"])]
    assert made[0] == KINDS["NetworkPolicy"] and made.count(KINDS["NetworkPolicy"]) == 1
    stored = kube.get("NetworkPolicy", "ml", "demo-network")
    assert stored is not None and stored["spec"]["policyTypes"] == ["Ingress"]


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep


def _env(dep: dict[str, Any], namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (metadata.namespace filled in)."""
    env = {}
    for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}:
            env[e["name"]] = namespace
    return env


def test_the_charts_settings_admit_the_charts_operator_pod(make_job: Any) -> None:
    """From the rendered chart to the per-job policy: the operator peer selects the labels
    the chart puts on the operator's pod, in the release namespace."""
    sets = "networkPolicy.controlPortPeers[0].namespaceSelector.matchLabels.team=obs"
    dep = _deployment(render(sets))
    settings = Settings.from_env(_env(dep, "malleus-system"))
    policy = children.network_policy(settings, _job(make_job), REF)
    assert policy is not None
    _validate(policy)
    operator, extra = policy["spec"]["ingress"][1]["from"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert operator["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert operator["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert operator["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "malleus-system"
    }
    assert extra == {"namespaceSelector": {"matchLabels": {"team": "obs"}}}


def test_the_charts_policy_opens_only_the_operators_health_and_metrics_ports() -> None:
    docs = render("operator.healthPort=9080", "operator.metricsPort=9081")
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    _validate(policy)
    dep = _deployment(docs)
    assert policy["metadata"]["namespace"] == "malleus-system"
    assert policy["spec"]["podSelector"] == dep["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule == {"ports": [{"port": 9080, "protocol": "TCP"}, {"port": 9081, "protocol": "TCP"}]}
    ports = {p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {9080, 9081}


def test_network_policies_can_be_turned_off() -> None:
    docs = render("networkPolicy.enabled=false")
    assert [d for d in docs if d["kind"] == "NetworkPolicy"] == []
    settings = Settings.from_env(_env(_deployment(docs), "malleus-system"))
    assert settings.network_policies is False
    assert children.child_kinds(settings) == (
        "Pod",
        "PodDisruptionBudget",
        "Service",
        "ConfigMap",
        "Secret",
    )
