"""The test cluster (real CRD server + emulated core API behind one proxy) serves real clients.

The store tests run everywhere; the rest need ``MALLEUS_K8S_ASSETS`` (and kubectl, found via
``MALLEUS_KUBECTL`` or PATH, for the kubectl test) and skip without them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

from tests.k8s.apiserver import wait_until
from tests.k8s.core import ApiError, CoreStore, json_patch, label_matcher, merge_patch

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.k8s.proxy import ClusterProxy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
MJ = ("malleus.io", "v1alpha1")


# ---- the store alone ------------------------------------------------------------------------


def test_store_stamps_metadata_and_bumps_versions_only_on_change() -> None:
    store = CoreStore()
    made = store.create(
        "configmaps", "a", {"metadata": {"generateName": "cm-"}, "data": {"k": "1"}}
    )
    meta = made["metadata"]
    assert meta["name"].startswith("cm-") and meta["uid"] and meta["generation"] == 1
    assert meta["namespace"] == "a" and meta["creationTimestamp"].endswith("Z")
    assert store.get("namespaces", "", "a")["status"]["phase"] == "Active"  # made on first use

    same = store.patch("configmaps", "a", meta["name"], {"data": {"k": "1"}})
    assert same["metadata"]["resourceVersion"] == meta["resourceVersion"]  # no-op: no new rv
    changed = store.patch("configmaps", "a", meta["name"], {"data": {"k": "2"}})
    assert int(changed["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert changed["metadata"]["generation"] == 2
    labelled = store.patch("configmaps", "a", meta["name"], {"metadata": {"labels": {"x": "y"}}})
    assert labelled["metadata"]["generation"] == 2  # metadata is not spec

    with pytest.raises(ApiError) as conflict:
        store.create("configmaps", "a", {"metadata": {"name": meta["name"]}})
    assert conflict.value.code == 409
    with pytest.raises(ApiError) as stale:
        store.replace("configmaps", "a", meta["name"], {"metadata": {"resourceVersion": "1"}})
    assert stale.value.code == 409


def test_store_status_subresource_json_patch_and_finalizers() -> None:
    store = CoreStore()
    pod = store.create("pods", "p", {"metadata": {"name": "w0"}, "spec": {"containers": []}})
    assert pod["status"]["phase"] == "Pending"
    ignored = store.patch("pods", "p", "w0", {"status": {"phase": "Running"}})
    assert ignored["status"]["phase"] == "Pending"  # the main resource leaves status alone
    running = store.set_pod_phase("p", "w0", "Running", podIP="127.0.0.1")
    assert running["status"]["phase"] == "Running" and running["status"]["podIP"] == "127.0.0.1"

    rv = running["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]
    held = store.patch("pods", "p", "w0", ops, "json")
    with pytest.raises(ApiError) as failed:  # kopf's optimistic concurrency: a stale test is 422
        store.patch("pods", "p", "w0", ops, "json")
    assert failed.value.code == 422

    marked = store.delete("pods", "p", "w0")
    assert marked["metadata"]["deletionTimestamp"] and marked["metadata"]["finalizers"] == ["x/y"]
    store.patch("pods", "p", "w0", [{"op": "remove", "path": "/metadata/finalizers"}], "json")
    with pytest.raises(ApiError) as gone:
        store.get("pods", "p", "w0")
    assert gone.value.code == 404 and held["metadata"]["finalizers"] == ["x/y"]


def test_store_watch_replays_from_a_version_and_follows_selectors() -> None:
    store = CoreStore(history=50)
    start = store.resource_version
    store.create("pods", "w", {"metadata": {"name": "a", "labels": {"role": "worker"}}})
    store.patch("pods", "w", "a", {"metadata": {"labels": {"role": "idle"}}})
    store.delete("pods", "w", "a")
    seen = [
        (t, o["metadata"]["labels"]["role"])
        for t, o in store.watch("pods", "w", since=start, timeout=0.1, label_selector="role=worker")
    ]
    assert seen == [("ADDED", "worker"), ("DELETED", "idle")]  # leaving the selector = DELETED

    store.create("pods", "x", {"metadata": {"name": "b"}})
    for i in range(60):  # more changes than the history keeps
        store.set_pod_status("x", "b", step=i)
    with pytest.raises(ApiError) as expired:
        list(store.watch("pods", since=start, timeout=0.1))
    assert expired.value.code == 410


def test_store_wait_for_wakes_on_changes_and_times_out() -> None:
    store = CoreStore()
    store.create("pods", "w", {"metadata": {"name": "a"}})
    store.set_pod_phase("w", "a", "Running")
    phase = store.wait_for(lambda: store.get("pods", "w", "a")["status"].get("phase"), timeout=1)
    assert phase == "Running"
    with pytest.raises(TimeoutError):
        store.wait_for(lambda: None, timeout=0.1, what="never")


def test_patches_and_selectors() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None, "d": 3}}) == {
        "a": {"c": 2, "d": 3}
    }
    smp = {"spec": {"$setElementOrder/containers": [{"name": "x"}], "replicas": 2}}
    assert merge_patch({}, smp, strategic=True) == {"spec": {"replicas": 2}}
    doc = {"a": [1, 2], "b": {"c~d/e": 1}}
    ops = [
        {"op": "add", "path": "/a/-", "value": 3},
        {"op": "move", "from": "/b/c~0d~1e", "path": "/f"},
        {"op": "replace", "path": "/a/0", "value": 0},
        {"op": "copy", "from": "/a", "path": "/g"},
    ]
    assert json_patch(doc, ops) == {"a": [0, 2, 3], "b": {}, "f": 1, "g": [0, 2, 3]}
    match = label_matcher("app in (x, y),tier!=db,!legacy,team")
    assert match({"metadata": {"labels": {"app": "x", "tier": "web", "team": "t"}}})
    assert not match({"metadata": {"labels": {"app": "z", "team": "t"}}})
    assert not match({"metadata": {"labels": {"app": "x", "team": "t", "legacy": ""}}})


# ---- real clients through the proxy ---------------------------------------------------------


@pytest.fixture
def kube(k8s_cluster: ClusterProxy) -> Iterator[Any]:
    """A kubernetes.client.ApiClient configured from the proxy's kubeconfig."""
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig))
    try:
        yield api
    finally:
        api.close()


def test_kubernetes_client_core_objects(
    k8s_cluster: ClusterProxy, kube: Any, k8s_namespace: str
) -> None:
    from kubernetes import client, watch
    from kubernetes.client.exceptions import ApiException

    core, ns = client.CoreV1Api(kube), k8s_namespace
    since = core.list_namespaced_pod(ns).metadata.resource_version
    labels = {"app.kubernetes.io/managed-by": "malleus", "malleus.io/job": "j"}
    pod = {
        "metadata": {"name": "j-0", "labels": labels},
        "spec": {"containers": [{"name": "t", "image": "x"}]},
    }
    core.create_namespaced_pod(ns, pod)
    with pytest.raises(ApiException) as exists:
        core.create_namespaced_pod(ns, pod)
    assert exists.value.status == 409
    core.patch_namespaced_pod("j-0", ns, {"metadata": {"annotations": {"a": "b"}}})
    core.patch_namespaced_pod_status("j-0", ns, {"status": {"phase": "Running"}})
    assert k8s_cluster.core.get("pods", ns, "j-0")["status"]["phase"] == "Running"
    listed = core.list_namespaced_pod(ns, label_selector="malleus.io/job=j")
    assert [p.metadata.name for p in listed.items] == ["j-0"]
    assert core.list_pod_for_all_namespaces(field_selector=f"metadata.namespace={ns}").items
    assert not core.list_namespaced_pod(ns, label_selector="malleus.io/job=other").items
    core.delete_namespaced_pod("j-0", ns)

    stream = watch.Watch()
    seen = []
    for event in stream.stream(
        core.list_namespaced_pod, ns, resource_version=since, timeout_seconds=5
    ):
        seen.append((event["type"], event["object"].status.phase))
        if event["type"] == "DELETED":
            stream.stop()
    assert seen == [
        ("ADDED", "Pending"),
        ("MODIFIED", "Pending"),
        ("MODIFIED", "Running"),
        ("DELETED", "Running"),
    ]

    for i in range(3):
        core.create_namespaced_config_map(
            ns,
            {
                "metadata": {"name": f"cm{i}", "labels": {"set": "a" if i else "b"}},
                "data": {"i": str(i)},
            },
        )
    core.delete_collection_namespaced_config_map(ns, label_selector="set=a")
    assert [c.metadata.name for c in core.list_namespaced_config_map(ns).items] == ["cm0"]

    involved = {"kind": "MalleusJob", "name": "j", "namespace": ns, "uid": "u-1"}
    for name in ("j", "other"):
        body = {
            "metadata": {"generateName": f"{name}."},
            "involvedObject": {**involved, "name": name},
            "reason": "Planned",
            "message": "hello",
            "type": "Normal",
        }
        core.create_namespaced_event(ns, body)
    selector = f"involvedObject.name=j,involvedObject.namespace={ns},involvedObject.uid=u-1"
    events = core.list_namespaced_event(ns, field_selector=selector).items
    assert [(e.reason, e.involved_object.name) for e in events] == [("Planned", "j")]


def test_malleusjob_through_the_proxy_lands_on_the_real_server(
    k8s_cluster: ClusterProxy, malleus_crd: dict[str, Any], kube: Any, k8s_namespace: str
) -> None:
    from kubernetes import client, watch

    objects, ns = client.CustomObjectsApi(kube), k8s_namespace
    made = objects.create_namespaced_custom_object(
        *MJ, ns, "malleusjobs", yaml.safe_load(EXAMPLE.read_text())
    )
    real = k8s_cluster.apiserver.client.get(
        f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs/tiny-cpu"
    )
    assert real.status_code == 200 and real.json()["metadata"]["uid"] == made["metadata"]["uid"]

    objects.patch_namespaced_custom_object_status(
        *MJ, ns, "malleusjobs", "tiny-cpu", {"status": {"phase": "Running"}}
    )
    stream, seen = watch.Watch(), []
    for event in stream.stream(
        objects.list_namespaced_custom_object, *MJ, ns, "malleusjobs",
        resource_version=made["metadata"]["resourceVersion"], timeout_seconds=5,
    ):  # fmt: skip
        seen.append((event["type"], (event["object"].get("status") or {}).get("phase")))
        stream.stop()
    assert seen == [("MODIFIED", "Running")]
    with pytest.raises(client.exceptions.ApiException) as invalid:  # real schema validation
        objects.patch_namespaced_custom_object_status(
            *MJ, ns, "malleusjobs", "tiny-cpu", {"status": {"phase": "Bogus"}}
        )
    assert invalid.value.status == 422


def test_discovery_and_errors(k8s_cluster: ClusterProxy, malleus_crd: dict[str, Any]) -> None:
    with httpx.Client(base_url=k8s_cluster.url, timeout=10) as http:
        groups = {g["name"] for g in http.get("/apis").json()["groups"]}
        assert {"malleus.io", "apiextensions.k8s.io"} <= groups
        assert http.get("/api").json()["versions"] == ["v1"]
        names = {r["name"] for r in http.get("/api/v1").json()["resources"]}
        assert {"pods", "pods/status", "events", "namespaces", "configmaps"} <= names
        assert http.get("/version").json()["major"] == "1"
        missing = http.get("/api/v1/namespaces/x/pods/nope")
        assert missing.status_code == 404 and missing.json()["reason"] == "NotFound"
        assert http.get("/api/v1/namespaces/x/widgets").status_code == 404
        bad = http.patch(
            "/api/v1/namespaces/default", content=b"{}", headers={"Content-Type": "text/plain"}
        )
        assert bad.status_code == 415


def test_owned_objects_are_collected_when_the_owner_is_gone(
    k8s_cluster: ClusterProxy, malleus_crd: dict[str, Any], k8s_namespace: str
) -> None:
    ns, real = k8s_namespace, k8s_cluster.apiserver.client
    url = f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs"
    body = {**yaml.safe_load(EXAMPLE.read_text()), "metadata": {"name": "owner"}}
    job = real.post(url, json=body).json()
    owner = {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "name": "owner",
        "uid": job["metadata"]["uid"],
    }
    store = k8s_cluster.core
    store.create("configmaps", ns, {"metadata": {"name": "owned", "ownerReferences": [owner]}})
    store.create("configmaps", ns, {"metadata": {"name": "free"}})
    assert real.delete(f"{url}/owner").status_code == 200

    def collected() -> bool | None:
        names = {c["metadata"]["name"] for c in store.list("configmaps", ns)}
        return True if names == {"free"} else None

    store.wait_for(collected, timeout=10, what="owned ConfigMap collected")


# ---- kopf -----------------------------------------------------------------------------------

OPERATOR = """
import os

import kopf
import kubernetes


@kopf.on.login()
def login(**kwargs):
    return kopf.login_with_kubeconfig(**kwargs)  # reads KUBECONFIG now, not at import


@kopf.on.create("malleus.io", "v1alpha1", "malleusjobs")
def created(body, name, namespace, patch, **_):
    api = kubernetes.config.new_client_from_config(config_file=os.environ["KUBECONFIG"])
    cm = {"metadata": {"name": f"{name}-plan"}, "data": {"plan.json": "{}"}}
    kopf.adopt(cm, owner=body)
    kubernetes.client.CoreV1Api(api).create_namespaced_config_map(namespace, cm)
    api.close()
    kopf.info(body, reason="Planned", message="a plan was made")
    patch.status["phase"] = "Running"
    patch.status["step"] = 7


@kopf.on.delete("malleus.io", "v1alpha1", "malleusjobs")
def deleted(body, **_):  # makes kopf add its finalizer (a JSON patch testing resourceVersion)
    kopf.info(body, reason="Deleting", message="bye")
"""


def test_kopf_operator_runs_against_the_proxy(
    k8s_cluster: ClusterProxy,
    malleus_crd: dict[str, Any],
    k8s_namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kopf = pytest.importorskip("kopf")
    from kopf.testing import KopfRunner

    ns, store, real = k8s_namespace, k8s_cluster.core, k8s_cluster.apiserver.client
    store.create("namespaces", "", {"metadata": {"name": ns}})
    operator = tmp_path / "operator.py"
    operator.write_text(textwrap.dedent(OPERATOR))
    monkeypatch.setenv("KUBECONFIG", str(k8s_cluster.kubeconfig))
    url = f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs"
    # A glob namespace makes kopf list and watch Namespaces too, as it does cluster-wide.
    args = ["run", "--standalone", "--namespace", f"{ns}*", str(operator)]
    with KopfRunner(args, registry=kopf.OperatorRegistry(), timeout=30) as runner:
        made = real.post(url, json=yaml.safe_load(EXAMPLE.read_text()))
        assert made.status_code == 201, made.text
        uid = made.json()["metadata"]["uid"]

        cm = store.wait_for(
            lambda: next(
                iter(store.list("configmaps", ns, field_selector="metadata.name=tiny-cpu-plan")),
                None,
            ),
            timeout=20,
            what="the handler's ConfigMap",
        )
        assert cm["metadata"]["ownerReferences"][0]["uid"] == uid

        def status() -> dict[str, Any] | None:
            got = real.get(f"{url}/tiny-cpu").json().get("status") or {}
            return got if got.get("phase") == "Running" else None

        assert wait_until(status, 20, "status patched on the real server")["step"] == 7
        store.wait_for(
            lambda: (
                store.list("events", ns, field_selector=f"involvedObject.uid={uid},reason=Planned")
                or None
            ),
            timeout=20,
            what="the handler's event",
        )
        assert real.get(f"{url}/tiny-cpu").json()["metadata"].get("finalizers")

        # Deleting: kopf runs the delete handler and lifts its finalizer; the job goes, and the
        # garbage collector takes its ConfigMap.
        assert real.delete(f"{url}/tiny-cpu").status_code == 200
        wait_until(
            lambda: True if real.get(f"{url}/tiny-cpu").status_code == 404 else None,
            20,
            "the job deleted once kopf lifts its finalizer",
        )
        store.wait_for(
            lambda: True if not store.list("configmaps", ns) else None,
            timeout=10,
            what="the ConfigMap collected",
        )
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert "Handler 'created' succeeded" in runner.output


# ---- kubectl --------------------------------------------------------------------------------


def _kubectl() -> str:
    found = os.environ.get("MALLEUS_KUBECTL") or shutil.which("kubectl")
    if not found:
        pytest.skip(
            "kubectl not found: set MALLEUS_KUBECTL (scripts/helm-bin.sh DEST puts one in DEST)"
        )
    return found


def test_kubectl_get_and_describe_malleusjob(
    k8s_cluster: ClusterProxy, malleus_crd: dict[str, Any], k8s_namespace: str, tmp_path: Path
) -> None:
    kubectl, ns, real = _kubectl(), k8s_namespace, k8s_cluster.apiserver.client

    def run(*args: str) -> str:
        done = subprocess.run(
            [kubectl, *args],
            env=k8s_cluster.env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    manifest = tmp_path / "mj.yaml"
    manifest.write_text(EXAMPLE.read_text())
    run("apply", "--validate=false", "-n", ns, "-f", str(manifest))
    status = {"status": {"phase": "Running", "step": 12, "tokensPerSecond": 345.5, "gpus": 8}}
    url = f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs/tiny-cpu/status"
    patched = real.patch(url, json=status, headers={"Content-Type": "application/merge-patch+json"})
    assert patched.status_code == 200, patched.text
    uid = patched.json()["metadata"]["uid"]
    k8s_cluster.core.create(
        "events",
        ns,
        {
            "metadata": {"generateName": "tiny-cpu."},
            "involvedObject": {
                "apiVersion": "malleus.io/v1alpha1",
                "kind": "MalleusJob",
                "name": "tiny-cpu",
                "namespace": ns,
                "uid": uid,
            },
            "type": "Normal",
            "reason": "Replanned",
            "message": "moved layers off rank 3",
            "source": {"component": "malleus-operator"},
            "count": 1,
        },
    )

    table = run("get", "mj", "-n", ns)
    header, row = table.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "PHASE", "PLAN", "STEP", "TOKENS/S"]
    assert row.split()[:2] == ["tiny-cpu", "Running"] and "12" in row.split()

    described = run("describe", "mj", "tiny-cpu", "-n", ns)
    assert "Phase:" in described and "Running" in described
    events = described.split("Events:")[1]
    assert "Replanned" in events and "moved layers off rank 3" in events

    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "extra"}}
    manifest.write_text(yaml.safe_dump(configmap))
    run("apply", "--validate=false", "-n", ns, "-f", str(manifest))
    assert "extra" in run("get", "cm", "-n", ns)
    run("label", "cm", "extra", "-n", ns, "x=y")
    assert k8s_cluster.core.get("configmaps", ns, "extra")["metadata"]["labels"] == {"x": "y"}
    run("delete", "cm", "extra", "-n", ns)
    assert not k8s_cluster.core.list("configmaps", ns)


# ---- lifecycle ------------------------------------------------------------------------------


def test_hang_ups_and_stop_end_watches(
    k8s_apiserver: Any, malleus_crd: dict[str, Any], tmp_path: Path
) -> None:
    from tests.k8s.proxy import ClusterProxy

    proxy = ClusterProxy(k8s_apiserver, tmp_path, gc_interval=None)
    with proxy:
        watchers = proxy.core._watchers  # the subscriptions open watch streams hold
        with httpx.Client(base_url=proxy.url, timeout=30) as http:
            with http.stream("GET", "/api/v1/pods", params={"watch": "true"}) as hung_up:
                assert hung_up.status_code == 200
                wait_until(lambda: True if watchers else None, 30, "a core watch subscribed")
            wait_until(lambda: True if not watchers else None, 30, "the hang-up unsubscribed")

        ended: list[str] = []
        failed: list[str] = []
        paths = ["/api/v1/configmaps", "/apis/malleus.io/v1alpha1/malleusjobs"]
        opened = {p: threading.Event() for p in paths}

        def watch(path: str) -> None:
            try:
                with httpx.stream(
                    "GET", proxy.url + path, params={"watch": "true"}, timeout=60
                ) as r:
                    assert r.status_code == 200
                    opened[path].set()  # the proxy holds the stream (upstream: the real watch)
                    for _ in r.iter_raw():
                        pass
                ended.append(path)
            except Exception as e:  # an abrupt end (no last chunk) fails the assertion below
                failed.append(f"{path}: {e!r}")
                opened[path].set()

        threads = [threading.Thread(target=watch, args=(p,), daemon=True) for p in paths]
        for thread in threads:
            thread.start()
        for path in paths:  # both streams open before stop(): no sleep, no race with it
            assert opened[path].wait(60), path
    for thread in threads:
        thread.join(60)
    assert failed == []
    assert sorted(ended) == sorted(paths)  # stop() closed both streams
    with pytest.raises(httpx.TransportError):
        httpx.get(proxy.url + "/api", timeout=2)


def test_stop_ends_a_watch_still_waiting_for_the_real_server(
    k8s_apiserver: Any, malleus_crd: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stop() began while a forwarded watch was still waiting for the real server's answer:
    # stop() closed the streams it saw, this one registered after it and ran on, until the
    # 2 s grace ran out and it was cancelled without a last chunk (the client: "peer closed
    # connection"). Here stop() begins exactly then: as the proxy sends the watch upstream.
    import aiohttp

    from tests.k8s.proxy import ClusterProxy

    proxy = ClusterProxy(k8s_apiserver, tmp_path, gc_interval=None)
    request = aiohttp.ClientSession.request

    def stop_as_it_is_sent(session: Any, method: str, url: Any, **kw: Any) -> Any:
        if "watch=true" in str(url) and proxy._stopping is not None:
            proxy._stopping.set()  # on the proxy's loop, as stop() does it
        return request(session, method, url, **kw)

    monkeypatch.setattr(aiohttp.ClientSession, "request", stop_as_it_is_sent)
    proxy.start()
    try:
        path = proxy.url + "/apis/malleus.io/v1alpha1/malleusjobs"
        with httpx.stream("GET", path, params={"watch": "true"}, timeout=60) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():  # ends with the last chunk: no RemoteProtocolError
                pass
    finally:
        proxy.stop()
