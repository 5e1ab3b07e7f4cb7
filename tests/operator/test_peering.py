"""Leader election: kopf peering from the settings to ``kopf.run``, and the chart's half of it.

Two replicas are safe only if kopf sees both (a peering object they heartbeat into) and their
priorities differ (kopf pauses every peer of equal priority), so both halves are checked here:
the arguments the operator hands kopf, and the chart rendered with two replicas (CRDs, the
peering objects, RBAC), validated by kubernetes-validate. Then for real: two
``python -m malleus.operator --peering`` processes on the real API server (the chart's kopf CRD
and peering object), one SIGKILLed (needs ``MALLEUS_K8S_ASSETS`` and helm; about 45 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kopf
import pytest

from malleus.job import Phase
from malleus.operator import __main__ as cli
from malleus.operator import handlers
from malleus.operator.context import MEMO_KEY, Context
from malleus.operator.settings import Settings
from tests.chart import CHART, helm, of_kind, operator_rules, render
from tests.cluster.controlplane import ControlPlaneError, wait_until
from tests.operator.kube import Kube

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi


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
    (dep,) = of_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2 and "strategy" not in dep["spec"]  # rolling
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--peering=malleus-operator" in container["args"]
    crds = {d["metadata"]["name"] for d in of_kind(docs, "CustomResourceDefinition")}
    assert {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= crds
    peerings = of_kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["malleus-system", "ml"]
    for p in peerings:  # after the CRD exists: Helm maps ordinary manifests before installing
        assert p["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    granted = [r for r in operator_rules(docs) if r[1] == "kopf.dev"]
    assert {(kind, resource) for kind, _, resource, _ in granted} == {("Role", "kopfpeerings")}
    assert all(verbs == {"get", "list", "watch", "patch"} for *_, verbs in granted)
    for doc in docs:
        if doc["kind"] != "KopfPeering":  # a custom kind: the schema is the CRD above
            kv.validate(doc, kv.latest_version(), strict=True)


def test_cluster_wide_peering_is_one_cluster_object() -> None:
    docs = render("replicaCount=2", "rbac.clusterWide=true")
    assert [d["metadata"]["name"] for d in of_kind(docs, "ClusterKopfPeering")] == [
        "malleus-operator"
    ]
    assert of_kind(docs, "KopfPeering") == []
    granted = {
        (kind, resource) for kind, group, resource, _ in operator_rules(docs) if group == "kopf.dev"
    }
    assert granted == {("ClusterRole", "clusterkopfpeerings")}


def test_one_replica_is_standalone_and_two_without_peering_are_refused() -> None:
    docs = render()
    (dep,) = of_kind(docs, "Deployment")
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


def test_the_lifetime_reaches_kopf_and_the_chart_passes_it() -> None:
    settings = kopf.OperatorSettings()
    Settings(peering_name="p", peering_priority=3, peering_lifetime_seconds=12).apply_peering(
        settings.peering
    )
    assert settings.peering.lifetime == 12
    assert cli.build_parser().parse_args(["--peering-lifetime", "15"]).peering_lifetime == 15
    docs = render("replicaCount=2", "peering.lifetimeSeconds=20")
    (dep,) = of_kind(docs, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--peering-lifetime=20" in container["args"]


def test_a_standby_redoes_the_create_whose_status_the_killed_replica_never_wrote(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """kopf writes on.create's record (the ``last-handled-configuration`` annotation), then the
    status subresource, in two requests, other handlers running in between: a replica killed
    there leaves a job kopf will only resume, without a phase. The standby's on.resume redoes
    the create: what is missing comes back (once), the rest is kept, the status is written."""
    body = make_job()
    kube.add_job(body)
    lost = kopf.Patch()
    asyncio.run(handlers.on_create(body=body, patch=lost, memo=memo))  # the killed replica's
    assert lost["status"]["phase"] == "Pending"  # ... but it never reached the job
    token = kube.of_kind("Secret")[0]["data"]["token"]
    kube.remove("Pod", "ml", "demo-node-1")  # while nobody worked
    assert "phase" not in (kube.job("ml", "demo").get("status") or {})

    resumed = kopf.Patch()
    asyncio.run(handlers.on_resume(body=kube.job("ml", "demo"), patch=resumed, memo=memo))
    assert kube.get("Pod", "ml", "demo-node-1") is not None
    assert kube.of_kind("Secret")[0]["data"]["token"] == token  # kept, not re-made
    st = resumed["status"]
    assert (st["phase"], st["pods"]) == ("Pending", ["demo-node-0", "demo-node-1"])
    assert st["plan"]["generation"] == lost["status"]["plan"]["generation"]
    assert kube.reasons() == ["Created", "Resumed"]
    assert ctx.metrics.phases.counts()[Phase.PENDING] == 1

    # killed again before that status landed: redone again, nothing left to re-create
    again = kopf.Patch()
    asyncio.run(handlers.on_resume(body=kube.job("ml", "demo"), patch=again, memo=memo))
    assert again["status"]["phase"] == "Pending"
    assert len(kube.of_kind("Pod")) == 3  # two workers and the store
    assert kube.reasons() == ["Created", "Resumed"]


# ---- two real operator processes ------------------------------------------------------------

LIFETIME = 10
"""The test replicas' peering lifetime: the standby takes over about this long after a kill."""


class _Replica:
    """``python -m malleus.operator --peering`` in a process (and session) of its own."""

    def __init__(self, cluster: AdminApi, namespace: str, priority: int, log: Path) -> None:
        self.log, self.priority = log, priority
        env = {**cluster.env(), "PYTHONUNBUFFERED": "1"}
        args = [
            *("--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace),
            *("--liveness", "", "--metrics-port", "0"),
            *("--peering", "malleus-operator", "--priority", str(priority)),
            *("--peering-lifetime", str(LIFETIME)),
        ]
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "malleus.operator", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no cleanup, no farewell in the peering object (a crashed node)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def _wait(probe: Callable[[], Any], timeout: float, what: str, *replicas: _Replica) -> Any:
    def dead() -> str | None:
        for r in replicas:
            if r.process.poll() is not None:
                return f"replica {r.priority} exited with {r.process.returncode}"
        return None

    try:
        return wait_until(lambda: probe() or None, timeout, what, interval=0.2, alive=dead)
    except ControlPlaneError as e:
        logs = "\n".join(f"--- replica {r.priority}\n{r.text()[-4000:]}" for r in replicas)
        pytest.fail(f"{e}\n{logs}", pytrace=False)


@pytest.mark.timeout(240)
def test_two_live_replicas_one_works_and_the_other_takes_over_when_it_is_killed(
    admin_api: AdminApi,
    namespace: str,
    make_job: Any,
    tmp_path: Path,
) -> None:
    """Two operator processes with the chart's peering CRD and object on the real API server:
    the higher priority handles the job alone; SIGKILLed, the standby takes over after the
    peering lifetime, re-creates the one pod deleted while nobody worked (once), and goes on
    reconciling (suspending the job deletes its pods)."""
    ns, server = namespace, admin_api
    docs = render("replicaCount=2", f"watchNamespaces={{{ns}}}", include_crds=True)
    (crd,) = [d for d in docs if d["metadata"]["name"] == "kopfpeerings.kopf.dev"]
    server.apply_crd(crd)
    (peering,) = [d for d in of_kind(docs, "KopfPeering") if d["metadata"]["namespace"] == ns]
    got = server.client.post(f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings", json=peering)
    assert got.status_code == 201, got.text

    def peers() -> dict[str, Any]:
        url = f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/malleus-operator"
        return dict(server.client.get(url).json().get("status") or {})

    def pods() -> list[dict[str, Any]]:
        """The job's worker pods (not its rendezvous store's)."""
        found = server.client.get(
            f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": "malleus.io/job=demo"}
        ).json()["items"]
        return sorted(
            (
                p
                for p in found
                if p["metadata"]["name"].startswith("demo-node-")
                and not p["metadata"].get("deletionTimestamp")
            ),
            key=lambda p: p["metadata"]["name"],
        )

    def reasons() -> list[str]:
        events = server.client.get(
            f"/api/v1/namespaces/{ns}/events", params={"fieldSelector": "involvedObject.name=demo"}
        ).json()["items"]
        return [e["reason"] for e in events]

    active = _Replica(server, ns, 200, tmp_path / "active.log")
    standby: _Replica | None = None
    try:
        _wait(lambda: any(p["priority"] == 200 for p in peers().values()), 60, "200 heartbeats")
        standby = _Replica(server, ns, 100, tmp_path / "standby.log")
        both = (active, standby)
        _wait(lambda: len(peers()) == 2, 60, "both replicas in the peering object", *both)
        # kopf starts every watch paused and resumes it (and says so) only where no live peer
        # outranks it: the active replica did at once, the standby must not.
        assert "Resuming operations" in active.text(), active.text()

        body = make_job(namespace=ns)
        body["metadata"] = {"name": "demo", "namespace": ns}
        # no node may run its pods (the session's kubelets would): they stay Pending
        body["spec"]["podTemplate"] = {"spec": {"nodeSelector": {"malleus.io/test": "nowhere"}}}
        made = server.client.post(
            f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs", json=body
        )
        assert made.status_code == 201, made.text
        first = _wait(lambda: len(pods()) == 2 and pods(), 60, "two pods", *both)
        _wait(lambda: "Created" in reasons(), 30, "the Created event", *both)

        # kopf's own record that on.create is done (else it runs again). Its status lands a
        # moment later (a second request): a kill in between leaves the standby a job without
        # a phase, whose create it redoes (the test above).
        def handled() -> bool:
            url = f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs/demo"
            annotations = server.client.get(url).json()["metadata"].get("annotations") or {}
            return "malleus.io/last-handled-configuration" in annotations

        _wait(handled, 30, "on.create recorded as handled", *both)
        assert "Handler 'on_create' succeeded" in active.text(), active.text()
        assert "Resuming operations" not in standby.text(), standby.text()
        assert "Handler" not in standby.text(), standby.text()  # it never saw the job

        active.kill()
        killed = time.monotonic()
        # while nobody works: the standby must see it
        assert server.client.delete(f"/api/v1/namespaces/{ns}/pods/demo-node-1").is_success
        assert [p["metadata"]["name"] for p in pods()] == ["demo-node-0"]
        _wait(
            lambda: "Resuming operations" in standby.text(), 3 * LIFETIME + 30, "takeover", standby
        )
        took = time.monotonic() - killed
        assert took >= LIFETIME - 6, f"took over {took:.1f} s after the kill: too early"
        again = _wait(lambda: len(pods()) == 2 and pods(), 60, "demo-node-1 again", standby)
        _wait(lambda: "Resumed" in reasons(), 30, "the Resumed event", standby)
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in again}
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in first}
        assert sorted(uids) == ["demo-node-0", "demo-node-1"]
        assert uids["demo-node-0"] == before["demo-node-0"]  # kept, not re-created
        assert uids["demo-node-1"] != before["demo-node-1"]  # the deleted one, once
        assert reasons().count("Created") == 1 and reasons().count("Resumed") == 1

        # ... and goes on reconciling: suspending the job deletes its pods.
        server.client.patch(
            f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs/demo",
            json={"spec": {"suspend": True}},
            headers={"Content-Type": "application/merge-patch+json"},
        ).raise_for_status()
        _wait(lambda: not pods(), 60, "the suspended job's pods deleted", standby)
        print(f"standby took over {took:.1f} s after SIGKILL (lifetime {LIFETIME} s)")
    finally:
        active.kill()
        if standby is not None:
            standby.kill()
