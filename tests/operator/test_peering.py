"""Leader election: kopf peering from the settings to ``kopf.run``, and the chart's half of it.

Two replicas are safe only if kopf sees both (a peering object they heartbeat into) and their
priorities differ (kopf pauses every peer of equal priority), so both halves are checked here:
the arguments the operator hands kopf, and the chart rendered with two replicas (CRDs, the
peering objects, RBAC), validated by kubernetes-validate.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from malleus.operator import __main__ as cli
from malleus.operator import handlers
from malleus.operator.context import MEMO_KEY, Context
from malleus.operator.settings import Settings
from tests.operator.test_helm import CHART, _kind, _rules, helm, render


def test_standalone_unless_a_peering_name_is_given() -> None:
    assert Settings().peering_options() == {"standalone": True}
    named = Settings(peering_name="malleus-operator")
    a = named.peering_options({"HOSTNAME": "malleus-operator-7d9f-abcde"})
    b = named.peering_options({"HOSTNAME": "malleus-operator-7d9f-fghij"})
    assert a["standalone"] is False and a["peering_name"] == "malleus-operator"
    assert a["priority"] != b["priority"]  # two replicas: one works, one stands by
    assert a == named.peering_options({"HOSTNAME": "malleus-operator-7d9f-abcde"})  # stable
    assert 1 <= a["priority"] <= 1_000_000
    pinned = Settings(peering_name="p", peering_priority=100).peering_options({})
    assert pinned["priority"] == 100
    env = Settings.from_env({"MALLEUS_OPERATOR_PEERING_NAME": "p"})
    assert env.peering_name == "p"


def test_main_hands_the_peering_to_kopf(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: None)
    assert cli.main(["--peering", "malleus-operator", "--priority", "7", "-n", "ml"]) == 0
    (kw,) = calls
    assert (kw["standalone"], kw["peering_name"], kw["priority"]) == (False, "malleus-operator", 7)
    assert kw["memo"]["settings"].peering_name == "malleus-operator"
    calls.clear()
    cli.main([])
    assert calls[0]["standalone"] is True and "peering_name" not in calls[0]


def test_the_startup_handler_does_not_undo_the_peering(ctx: Context) -> None:
    """kopf.run maps its arguments into the settings before the startup handlers run, so
    ``configure`` must apply ours, not force standalone (as under a bare ``kopf run``)."""
    for peering_name, standalone in (("malleus-operator", False), ("", True)):
        ours = Context(
            cluster=ctx.cluster,
            settings=Settings(metrics_port=0, peering_name=peering_name, peering_priority=5),
            metrics=ctx.metrics,
        )
        settings = kopf.OperatorSettings()
        asyncio.run(handlers.configure(settings=settings, memo=kopf.Memo({MEMO_KEY: ours})))
        assert settings.peering.standalone is standalone
        if peering_name:
            assert settings.peering.name == peering_name and settings.peering.priority == 5
            assert settings.peering.mandatory is True


def test_two_replicas_render_peering_crds_objects_and_rbac() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    docs = render("replicaCount=2", "watchNamespaces={ml}", include_crds=True)
    (dep,) = _kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2 and "strategy" not in dep["spec"]  # rolling
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--peering=malleus-operator" in container["args"]
    crds = {d["metadata"]["name"] for d in _kind(docs, "CustomResourceDefinition")}
    assert {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= crds
    peerings = _kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["malleus-system", "ml"]
    for p in peerings:  # after the CRD exists: Helm maps ordinary manifests before installing
        assert p["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    granted = [r for r in _rules(docs) if r[1] == "kopf.dev"]
    assert {(kind, resource) for kind, _, resource, _ in granted} == {("Role", "kopfpeerings")}
    assert all(verbs == {"get", "list", "watch", "patch"} for *_, verbs in granted)
    for doc in docs:
        if doc["kind"] != "KopfPeering":  # a custom kind: the schema is the CRD above
            kv.validate(doc, kv.latest_version(), strict=True)


def test_cluster_wide_peering_is_one_cluster_object() -> None:
    docs = render("replicaCount=2", "rbac.clusterWide=true")
    assert [d["metadata"]["name"] for d in _kind(docs, "ClusterKopfPeering")] == [
        "malleus-operator"
    ]
    assert _kind(docs, "KopfPeering") == []
    granted = {(kind, resource) for kind, group, resource, _ in _rules(docs) if group == "kopf.dev"}
    assert granted == {("ClusterRole", "clusterkopfpeerings")}


def test_one_replica_is_standalone_and_two_without_peering_are_refused() -> None:
    docs = render()
    (dep,) = _kind(docs, "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(d["kind"].endswith("KopfPeering") for d in docs)
    assert not any("kopf.dev" in str(d.get("spec", {}).get("group")) for d in docs)
    result = helm(
        "template",
        "rel",
        CHART,
        "--set",
        "replicaCount=2",
        "--set",
        "peering.enabled=false",
        check=False,
    )
    assert result.returncode != 0 and "needs peering.enabled" in result.stderr
