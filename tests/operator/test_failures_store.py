"""A lost rendezvous store pod while the job is active (`store_recovery`): created again from
the job as started, once, with an event; never for a job that is not active; never over a pod
of that name the job does not control.

Against kmock (`tests.operator.kube`) through the handlers, like the worker failures in
`test_failures.py`; then on the real API server (`tests/cluster`), where uids are the
server's: through the handlers, and through a real operator process whose
pod watch sees the deletion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kopf
import pytest

from malleus.operator import handlers, jobs, resources, store, store_recovery
from malleus.operator.context import Context
from malleus.operator.k8s import Cluster
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.settings import Settings
from tests.cluster.controlplane import ControlPlaneError, wait_until
from tests.operator.kube import Kube

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi

STORE = "demo-store"
IMAGE = "ghcr.io/example/malleus-trainer:0.1.0"
"""`conftest.job_body`'s image: the one the job was started with."""
REF = resources.JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _start(kube: Kube, memo: kopf.Memo, body: dict[str, Any]) -> None:
    """on.create, its status stored, both workers Running: an active job with its store."""
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    run(handlers.sync_pods(Context.of(memo), "ml", "demo"))
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"
    pod = kube.get("Pod", "ml", STORE)
    assert pod is not None
    pod["metadata"]["uid"] = "store-a"  # kmock stamps none: the first store's, to tell it apart
    kube.put("Pod", pod)
    kube.set_pod_phase("ml", STORE, "Running")


def _event(memo: kopf.Memo, type_: str, body: dict[str, Any]) -> None:
    """The pod watch's event, as kopf hands it to the handler."""
    run(
        handlers.on_pod_event(
            event={"type": type_},
            body=body,  # type: ignore[arg-type]
            namespace="ml",
            labels=body["metadata"]["labels"],
            memo=memo,
        )
    )


def _delete_store(kube: Kube, memo: kopf.Memo) -> dict[str, Any]:
    """``kubectl delete pod demo-store``: gone, then its DELETED event; returns the old pod."""
    old = kube.get("Pod", "ml", STORE)
    assert old is not None
    kube.remove("Pod", "ml", STORE)
    _event(memo, "DELETED", old)
    return old


def _store_events(kube: Kube) -> list[dict[str, Any]]:
    reasons = (store_recovery.RECREATED, store_recovery.FAILED)
    return [e for e in kube.events if e["reason"] in reasons]


def _timer(kube: Kube, memo: kopf.Memo) -> None:
    run(handlers.store_timer(body=kube.job("ml", "demo"), memo=memo))


# ---- the pure decision ----------------------------------------------------------------------


def test_what_a_store_pod_needs() -> None:
    ours = {"ownerReferences": [resources.owner_reference(resources.JobRef("ml", "demo", "u1"))]}

    def pod(phase: str, **meta: Any) -> dict[str, Any]:
        return {"metadata": {**ours, **meta}, "status": {"phase": phase}}

    assert store_recovery.store_action(None, "u1") == "create"
    assert store_recovery.store_action(pod("Running"), "u1") is None
    assert store_recovery.store_action(pod("Pending"), "u1") is None
    assert store_recovery.store_action(pod("Failed"), "u1") == "delete"
    assert store_recovery.store_action(pod("Succeeded"), "u1") == "delete"
    going = pod("Failed", deletionTimestamp="2026-01-01T00:00:00Z")
    assert store_recovery.store_action(going, "u1") == "wait"
    assert store_recovery.store_action(pod("Failed"), "u2") == "foreign"  # another job's
    assert store_recovery.store_action({"status": {"phase": "Failed"}}, "u1") == "foreign"


# ---- against kmock --------------------------------------------------------------------------


def test_a_deleted_store_pod_is_created_again_once_with_an_event(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _start(kube, memo, make_job())
    workers = [kube.get("Pod", "ml", f"demo-node-{i}") for i in (0, 1)]
    creates = kube.requests("create", "Pod")
    _delete_store(kube, memo)
    new = kube.get("Pod", "ml", STORE)
    assert new is not None and new["metadata"].get("uid") != "store-a"  # a new pod, not the old
    assert resources.owned_by(new, "uid-1234")
    assert new["spec"] == store.build_store_pod(jobs.resolve(make_job()), REF)["spec"]
    assert kube.requests("create", "Pod") == creates + 1
    (event,) = _store_events(kube)
    assert (event["type"], event["reason"]) == ("Warning", "StoreRecreated")
    assert "Pod/demo-store" in event["message"] and "demo-store.ml.svc:29400" in event["message"]
    assert "dial it again" in event["message"] and "starts empty" in event["message"]
    # the workers and the phase are untouched
    assert [kube.get("Pod", "ml", f"demo-node-{i}") for i in (0, 1)] == workers
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"
    # the same DELETED event again, then the timer and a restarted operator: still one pod
    _event(memo, "DELETED", new)
    _timer(kube, memo)
    run(handlers.on_resume(body=kube.job("ml", "demo"), patch=kopf.Patch(), memo=memo))
    assert kube.requests("create", "Pod") == creates + 1
    assert len(_store_events(kube)) == 1


def test_the_store_is_created_again_as_the_job_was_started(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    """An image edited since (ignored by the running job) is not the new store's."""
    _start(kube, memo, make_job())
    job = kube.job("ml", "demo")
    job["spec"]["image"] = "registry.example/other:2"
    kube.put("MalleusJob", job)
    _delete_store(kube, memo)
    new = kube.get("Pod", "ml", STORE)
    assert new is not None and new["spec"]["containers"][0]["image"] == IMAGE


def test_an_evicted_store_pod_is_deleted_then_created_again(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _start(kube, memo, make_job())
    message = "The node was low on resource: memory."
    evicted = kube.set_pod_phase("ml", STORE, "Failed", reason="Evicted", message=message)
    _event(memo, "MODIFIED", evicted)
    assert kube.get("Pod", "ml", STORE) is None  # the name freed first
    (failed,) = _store_events(kube)
    assert (failed["type"], failed["reason"]) == ("Warning", "StoreFailed")
    assert f"Failed: Evicted: {message}" in failed["message"]
    _event(memo, "DELETED", evicted)  # what the deletion's watch event brings
    new = kube.get("Pod", "ml", STORE)
    assert new is not None and new["metadata"].get("uid") != "store-a"
    assert (new.get("status") or {}).get("phase") != "Failed"
    assert [e["reason"] for e in _store_events(kube)] == ["StoreFailed", "StoreRecreated"]


def test_an_evicted_store_pod_whose_event_was_missed_is_replaced_by_the_timer(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _start(kube, memo, make_job())
    kube.set_pod_phase("ml", STORE, "Failed", reason="Evicted")
    _timer(kube, memo)  # deletes it
    assert kube.get("Pod", "ml", STORE) is None
    _timer(kube, memo)  # creates it
    new = kube.get("Pod", "ml", STORE)
    assert new is not None and new["metadata"].get("uid") != "store-a"
    assert [e["reason"] for e in _store_events(kube)] == ["StoreFailed", "StoreRecreated"]


def test_a_deleted_store_service_is_created_again_by_the_timer(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _start(kube, memo, make_job())
    kube.remove("Service", "ml", STORE)  # nothing watches Services
    _timer(kube, memo)
    service = kube.get("Service", "ml", STORE)
    assert service is not None and service["spec"]["ports"][0]["port"] == 29400
    assert [e["reason"] for e in _store_events(kube)] == ["StoreRecreated"]
    _timer(kube, memo)  # once
    assert [e["reason"] for e in _store_events(kube)] == ["StoreRecreated"]


def test_a_store_pod_deleted_while_the_operator_was_away_is_back_at_resume(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _start(kube, memo, make_job())
    kube.remove("Pod", "ml", STORE)  # no watch event
    run(handlers.on_resume(body=kube.job("ml", "demo"), patch=kopf.Patch(), memo=memo))
    assert kube.get("Pod", "ml", STORE) is not None
    assert [e["reason"] for e in _store_events(kube)] == ["StoreRecreated"]


def test_the_stores_ordinary_events_cost_no_api_call(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _start(kube, memo, make_job())
    pod = kube.get("Pod", "ml", STORE)
    assert pod is not None
    before = [kube.requests(a) for a in ("fetch", "list", "create", "delete")]
    _event(memo, "MODIFIED", pod)
    assert [kube.requests(a) for a in ("fetch", "list", "create", "delete")] == before


@pytest.mark.parametrize("state", ["deleting", "Succeeded", "Failed", "Suspended"])
def test_a_job_that_is_not_active_gets_no_store_back(
    kube: Kube, memo: kopf.Memo, make_job: Any, state: str
) -> None:
    _start(kube, memo, make_job())
    job = kube.job("ml", "demo")
    if state == "deleting":
        job["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        kube.put("MalleusJob", job)
    else:
        kube.merge_status("ml", "demo", {"phase": state})
    creates = kube.requests("create", "Pod")
    _delete_store(kube, memo)
    _timer(kube, memo)
    assert kube.get("Pod", "ml", STORE) is None
    assert kube.requests("create", "Pod") == creates
    assert _store_events(kube) == []


@pytest.mark.parametrize("owner", [None, "uid-other"])
def test_a_pod_of_the_stores_name_that_the_job_does_not_control_is_left_alone(
    kube: Kube, memo: kopf.Memo, make_job: Any, owner: str | None
) -> None:
    """Not deleted though it failed, not replaced: neither a stranger's pod with the job's
    labels copied, nor another job's."""
    _start(kube, memo, make_job())
    kube.remove("Pod", "ml", STORE)
    meta: dict[str, Any] = {"name": STORE, "namespace": "ml", "labels": store.store_labels("demo")}
    if owner is not None:
        other = resources.JobRef(namespace="ml", name="other", uid=owner)
        meta["ownerReferences"] = [resources.owner_reference(other)]
    foreign = kube.put(
        "Pod", {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": {"phase": "Failed"}}
    )
    deletes, creates = kube.requests("delete", "Pod"), kube.requests("create", "Pod")
    _event(memo, "MODIFIED", foreign)
    _timer(kube, memo)
    assert kube.get("Pod", "ml", STORE) == foreign
    assert (kube.requests("delete", "Pod"), kube.requests("create", "Pod")) == (deletes, creates)
    assert _store_events(kube) == []


# ---- on the real API server (tests/cluster) -------------------------------------------------


def _post_job(server: AdminApi, ns: str, make_job: Any) -> None:
    body = make_job(namespace=ns)
    body["metadata"] = {"name": "demo", "namespace": ns}
    # no node may run its pods (the session's kubelets would): they stay Pending
    body["spec"]["podTemplate"] = {"spec": {"nodeSelector": {"malleus.io/test": "nowhere"}}}
    made = server.client.post(f"/apis/malleus.io/v1alpha1/namespaces/{ns}/malleusjobs", json=body)
    assert made.status_code == 201, made.text


def _uid(server: AdminApi, ns: str) -> str | None:
    found = [p for p in server.list("pods", ns) if p["metadata"]["name"] == STORE]
    return str(found[0]["metadata"]["uid"]) if found else None


def _reasons(server: AdminApi, ns: str) -> list[str]:
    """The job's event reasons, sorted (the core API lists by their generated names)."""
    events = server.list("events", ns, field_selector="involvedObject.name=demo")
    return sorted(e["reason"] for e in events)


def test_on_the_real_api_server_a_lost_store_pod_comes_back_with_a_new_uid(
    admin_api: AdminApi, namespace: str, make_job: Any
) -> None:
    """Deleted, then evicted: each time a new pod (the server's uid), the workers kept."""
    ns, core = namespace, admin_api
    _post_job(admin_api, ns, make_job)
    cluster = Cluster.connect(str(admin_api.kubeconfig))
    settings = Settings(metrics_port=0)
    memo = kopf.Memo({"malleus": Context(cluster, settings, OperatorMetrics())})

    async def event(type_: str, body: dict[str, Any]) -> None:
        labels = body["metadata"]["labels"]
        await handlers.on_pod_event(
            event={"type": type_}, body=body, namespace=ns, labels=labels, memo=memo
        )

    async def go() -> None:
        stored = await cluster.get_job(ns, "demo")
        assert stored is not None
        patch = kopf.Patch()
        await handlers.on_create(body=stored, patch=patch, memo=memo)
        await cluster.patch_job_status(ns, "demo", patch["status"])  # Pending: active
        workers = sorted(p["metadata"]["uid"] for p in core.list("pods", ns))
        first = _uid(core, ns)
        old = core.delete("pods", ns, STORE)
        await event("DELETED", old)
        second = _uid(core, ns)
        assert second is not None and second != first
        evicted = core.set_pod_phase(ns, STORE, "Failed", reason="Evicted")
        await event("MODIFIED", evicted)
        assert _uid(core, ns) is None  # deleted (no kubelet: at once)
        await event("DELETED", evicted)
        third = _uid(core, ns)
        assert third is not None and third not in (first, second)
        kept = sorted(p["metadata"]["uid"] for p in core.list("pods", ns))
        assert sorted(set(kept) - {third}) == sorted(set(workers) - {first})

    try:
        asyncio.run(go())
    finally:
        cluster.close()
    assert _reasons(core, ns) == [
        "Created",
        "StoreFailed",
        "StoreRecreated",
        "StoreRecreated",
    ]


@pytest.mark.timeout(180)
def test_a_running_operator_sees_the_store_pod_deleted_and_creates_it_again(
    admin_api: AdminApi,
    namespace: str,
    make_job: Any,
    tmp_path: Path,
) -> None:
    """``python -m malleus.operator`` on the real API server: its pod watch brings the
    deletion."""
    ns, core = namespace, admin_api
    log = tmp_path / "operator.log"
    env = {**admin_api.env(), "PYTHONUNBUFFERED": "1"}
    args = [
        *("--kubeconfig", str(admin_api.kubeconfig), "--namespace", ns),
        *("--liveness", "", "--metrics-port", "0"),
    ]
    with log.open("wb") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "malleus.operator", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(probe: Any, what: str, timeout: float = 60) -> Any:
        def dead() -> str | None:
            code = operator.poll()
            return None if code is None else f"the operator exited with {code}"

        try:
            return wait_until(lambda: probe() or None, timeout, what, interval=0.2, alive=dead)
        except ControlPlaneError as e:
            pytest.fail(f"{e}\n{log.read_text(errors='replace')[-4000:]}", pytrace=False)

    try:
        _post_job(core, ns, make_job)
        wait(lambda: len(core.list("pods", ns)) == 3, "two workers and the store")
        wait(lambda: "Created" in _reasons(core, ns), "the Created event")
        first = _uid(core, ns)
        core.delete("pods", ns, STORE)
        wait(lambda: _uid(core, ns) not in (None, first), "a store pod of a new uid")
        wait(lambda: "StoreRecreated" in _reasons(core, ns), "the StoreRecreated event")
        assert len(core.list("pods", ns)) == 3
        assert _reasons(core, ns).count("StoreRecreated") == 1
    finally:
        if operator.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(operator.pid, signal.SIGTERM)
            try:
                operator.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(operator.pid, signal.SIGKILL)
                operator.wait(10)
