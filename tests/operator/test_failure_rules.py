"""``spec.failurePolicy`` by cause: what a failed worker pod's cause is (`failures.failure_cause`),
which rule decides it, what it counts, and when a node's counters start again (pure).

The pods are shaped as Kubernetes and Kueue leave them: the ``DisruptionTarget`` condition the
API server, the scheduler, the taint manager and the pod GC set before they delete a pod, Kueue's
``TerminationTarget`` on the pods of a workload it stops, the kubelet's ``Evicted``, an
``OOMKilled`` container.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from malleus.job import FailurePolicy, validate_manifest
from malleus.job.spec import FailureRule
from malleus.job.status import NodeFailure
from malleus.operator import children, failures, jobs, lifecycle
from malleus.operator.context import Context
from malleus.operator.k8s import Cluster
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.resources import JobRef
from malleus.operator.settings import Settings
from malleus.operator.status import now as status_now
from tests.jobs import manifest

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def pod(
    uid: str,
    *,
    node: int = 1,
    code: int | None = None,
    reason: str = "Error",
    condition: tuple[str, str] | None = None,
    phase: str = "Failed",
    status_reason: str | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if code is not None:
        term = {"exitCode": code, "reason": reason}
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": term}}]
    if condition is not None:
        status["conditions"] = [
            {"type": condition[0], "status": "True", "reason": condition[1]},
            {"type": "Ready", "status": "False"},
        ]
    if status_reason:
        status["reason"] = status_reason
    meta: dict[str, Any] = {"name": f"demo-node-{node}", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return {"metadata": meta, "status": status}


@pytest.mark.parametrize(
    ("body", "cause"),
    [
        # Kueue stopped the workload (preempted by a higher priority one, or evicted)
        (pod("a", code=143, condition=("TerminationTarget", "StoppedByKueue")), "Preempted"),
        (
            pod("b", deleting=True, condition=("DisruptionTarget", "PreemptionByScheduler")),
            "Preempted",
        ),
        # kubectl drain: the Eviction API; its SIGTERM'd containers exit 143, still an eviction
        (pod("c", code=143, condition=("DisruptionTarget", "EvictionByEvictionAPI")), "Evicted"),
        (pod("d", status_reason="Evicted"), "Evicted"),  # the kubelet, under node pressure
        (
            pod("e", deleting=True, condition=("DisruptionTarget", "DeletionByTaintManager")),
            "NodeLost",
        ),
        (pod("f", condition=("DisruptionTarget", "DeletionByPodGC")), "NodeLost"),
        (pod("g", code=137, reason="OOMKilled"), "OOMKilled"),
        (pod("h", code=1), "Error"),
        (pod("i", phase="Running", deleting=True), "Deleted"),
        (pod("j", status_reason="UnexpectedAdmissionError"), "Failed"),
    ],
)
def test_the_cause_of_a_failure(body: dict[str, Any], cause: str) -> None:
    found = failures.pod_failure(body, "demo")
    assert found is not None and found.cause == cause


def _fail(records: Any, body: dict[str, Any], policy: FailurePolicy, at: dt.datetime) -> Any:
    found = failures.pod_failure(body, "demo")
    assert found is not None
    return failures.record_failures(records, [found], policy, at)


def test_preemption_and_drains_never_burn_max_restarts() -> None:
    """Five preemptions and evictions of a node with maxRestarts 1: each replaced, none counted;
    then one real error is counted (1 of 1) and the next puts it out."""
    policy = FailurePolicy(max_restarts=1, restart_backoff_seconds=10)
    records: Any = None
    disruptions = [
        ("TerminationTarget", "StoppedByKueue"),
        ("DisruptionTarget", "EvictionByEvictionAPI"),
        ("DisruptionTarget", "PreemptionByScheduler"),
        ("DisruptionTarget", "EvictionByEvictionAPI"),
        ("TerminationTarget", "WorkloadEvicted"),
    ]
    for i, cond in enumerate(disruptions):
        records, (r,) = _fail(records, pod(f"p{i}", code=143, condition=cond), policy, T0)
        assert (r.state, r.action, r.counted) == ("Waiting", "Ignore", 0), r
        assert r.rule in ("preemption", "eviction")
        assert r.replace_at == T0 + dt.timedelta(seconds=10)  # no doubling either
        records = [failures.replaced(x, T0) for x in records]
    assert records[0].failures == 5 and records[0].causes == {"Preempted": 3, "Evicted": 2}
    records, (r,) = _fail(records, pod("e1", code=1), policy, T0)
    assert (r.state, r.action, r.counted, r.rule) == ("Waiting", "RestartWorker", 1, None)
    records = [failures.replaced(x, T0) for x in records]
    records, (r,) = _fail(records, pod("e2", code=1), policy, T0)
    assert (r.state, r.counted) == ("Out", 2)


def test_the_event_says_what_was_counted() -> None:
    """One ``PodFailed`` event per failure, naming its cause, its rule and whether it counted."""
    policy = FailurePolicy(max_restarts=1)
    drained = pod("d", code=143, condition=("DisruptionTarget", "EvictionByEvictionAPI"))
    expected = ["demo-node-0", "demo-node-1"]
    running = {"metadata": {"name": "demo-node-0", "uid": "r0"}, "status": {"phase": "Running"}}
    t = lifecycle.pods_transition(
        {"phase": "Running"}, [running, drained], expected, 1, T0, policy=policy
    )
    (event,) = t.events
    assert event.reason == "PodFailed"
    assert "cause Evicted, rule 'eviction': not counted" in event.message
    assert t.status is not None and t.status.phase is None  # still Running: a replacement comes
    (record,) = t.status.failures or []
    stored = {"phase": "Running", "failures": [record.model_dump(mode="json", by_alias=True)]}
    again = pod("e", code=1)
    t = lifecycle.pods_transition(stored, [running, again], expected, 1, T0, policy=policy)
    (event,) = t.events
    assert "cause Error: counted 1 of maxRestarts 1" in event.message


def test_rules_first_match_wins_with_their_own_budgets_and_fail_job() -> None:
    policy = FailurePolicy(
        max_restarts=10,
        rules=[
            FailureRule(name="bad-code", action="FailJob", on_exit_codes={"values": [3]}),
            FailureRule(
                name="oom", action="RestartWorker", on_causes=["OOMKilled"], max_restarts=1
            ),
            FailureRule(name="drains-count", action="RestartWorker", on_causes=["Evicted"]),
            FailureRule(name="lost", action="Ignore", on_causes=["NodeLost"]),
        ],
    )
    evicted = pod("v", code=143, condition=("DisruptionTarget", "EvictionByEvictionAPI"))
    records, (r,) = _fail(None, evicted, policy, T0)
    assert (r.rule, r.action, r.counted) == ("drains-count", "RestartWorker", 1)  # before built-in
    lost = pod("l", deleting=True, condition=("DisruptionTarget", "DeletionByTaintManager"))
    records, (r,) = _fail([failures.replaced(x, T0) for x in records], lost, policy, T0)
    assert (r.rule, r.action, r.counted) == ("lost", "Ignore", 1)
    for i, state in enumerate(("Waiting", "Out")):  # the rule's budget: 1 OOM, not maxRestarts
        replaced = [failures.replaced(x, T0) for x in records]
        records, (r,) = _fail(replaced, pod(f"o{i}", code=137, reason="OOMKilled"), policy, T0)
        assert (r.rule, r.state, r.rule_counts["oom"]) == ("oom", state, i + 1)
    assert failures.terminal_reason(records, 2) is None
    other = [failures.replaced(x, T0) for x in records]
    found = failures.pod_failure(pod("x", node=0, code=3), "demo")
    assert found is not None
    records, (r,) = failures.record_failures(other, [found], policy, T0)
    assert (r.node, r.action, r.state) == (0, "FailJob", "Out")
    reason, message = failures.terminal_reason(records, 4) or ("", "")
    assert reason == failures.FAILED_BY_RULE and "'bad-code'" in message
    # the CRD's rule for maxRestarts, in the model too
    with pytest.raises(ValueError, match="RestartWorker only"):
        FailureRule(name="x", action="Ignore", max_restarts=1)


def test_counters_start_again_after_a_healthy_period() -> None:
    policy = FailurePolicy(max_restarts=1, reset_after_seconds=600)
    records, (r,) = _fail(None, pod("a", code=1), policy, T0)
    records = [failures.replaced(x, T0 + dt.timedelta(seconds=10)) for x in records]
    # failed again 10 minutes after its replacement started: a fresh start, counted 1 of 1
    later = T0 + dt.timedelta(seconds=10 + 600)
    records, (r,) = _fail(records, pod("b", code=1), policy, later)
    assert (r.state, r.counted, r.failures, r.causes) == ("Waiting", 1, 2, {"Error": 1})
    records = [failures.replaced(x, later) for x in records]
    # and again 9 minutes after that: counted 2 of 1, out
    records, (r,) = _fail(records, pod("c", code=1), policy, later + dt.timedelta(seconds=540))
    assert (r.state, r.counted) == ("Out", 2)
    never = FailurePolicy(max_restarts=1, reset_after_seconds=None)
    records, _ = _fail(None, pod("a", code=1), never, T0)
    records = [failures.replaced(x, T0) for x in records]
    _, (r,) = _fail(records, pod("b", code=1), never, T0 + dt.timedelta(days=30))
    assert (r.state, r.counted) == ("Out", 2)


def test_only_a_pod_with_nothing_running_or_a_lost_node_is_deleted_without_grace() -> None:
    ended = {"state": {"terminated": {"exitCode": 1}}}
    running = {"state": {"running": {}}}
    body = {"status": {"phase": "Running", "containerStatuses": [ended]}}
    assert failures.nothing_to_wait_for(body, "Error")
    body["status"]["initContainerStatuses"] = [running]  # a native sidecar still flushing
    assert not failures.nothing_to_wait_for(body, "Error")
    assert failures.nothing_to_wait_for(body, "NodeLost")  # no kubelet will ever confirm
    assert failures.nothing_to_wait_for({"status": {"phase": "Failed"}}, "Evicted")
    assert not failures.nothing_to_wait_for({"status": {"phase": "Running"}}, "Deleted")


def test_the_crd_defaults_and_judges_the_rules_as_the_model_does(make_job: Any) -> None:
    """The schema (and its CEL, as the API server applies it) and the model agree: defaults
    (``resetAfterSeconds`` 3600, ``operator: In``), a budget only on ``RestartWorker``, causes
    by name, unique rule names."""
    rules = [
        {"name": "oom", "action": "RestartWorker", "onCauses": ["OOMKilled"], "maxRestarts": 1},
        {"name": "bad-code", "action": "FailJob", "onExitCodes": {"values": [3]}},
    ]
    body = make_job(failurePolicy={"rules": rules})
    defaulted, faults = validate_manifest(body)
    assert faults == []
    policy = FailurePolicy.model_validate(defaulted["spec"]["failurePolicy"])
    assert policy.reset_after_seconds == 3600
    assert policy.rules[1].on_exit_codes is not None
    assert policy.rules[1].on_exit_codes.operator == "In"
    for bad, where in (
        ({"name": "x", "action": "Ignore", "maxRestarts": 1}, "rules[0].maxRestarts"),
        ({"name": "x", "action": "RestartWorker", "onCauses": ["Sunspots"]}, "onCauses[0]"),
        ({"name": "X y", "action": "Ignore"}, "rules[0].name"),
    ):
        _, faults = validate_manifest(make_job(failurePolicy={"rules": [bad]}))
        assert any(where in f.path for f in faults), (bad, faults)
        with pytest.raises(ValueError):
            FailureRule.model_validate(bad)
    twice = [{"name": "x", "action": "Ignore"}, {"name": "x", "action": "FailJob"}]
    _, faults = validate_manifest(make_job(failurePolicy={"rules": twice}))
    assert faults, "rule names are unique"


def test_a_record_from_before_the_rules_keeps_its_count() -> None:
    old = {"node": 1, "pod": "demo-node-1", "failures": 3, "state": "Replaced",
           "reason": "Error", "time": "2026-01-01T11:00:00Z"}  # fmt: skip
    assert NodeFailure.model_validate(old).counted == 3


# ---- on the real control plane ----------------------------------------------------------------


def _node(name: str) -> dict[str, Any]:
    """A Node with no kubelet behind it: nothing ever confirms a deletion of its pods."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def test_a_drained_worker_is_replaced_uncounted_even_stuck_terminating(
    admin_api: AdminApi, cluster_crd: dict[str, Any], make_job: Any
) -> None:
    """The Eviction API (what ``kubectl drain`` calls) on a worker of a running job with
    ``maxRestarts: 0``: the API server marks the pod (``DisruptionTarget``,
    ``EvictionByEvictionAPI``) and deletes it; its node never confirms, so the pod stays
    Terminating. The operator records cause ``Evicted``, rule ``eviction``, not counted; once
    the pod is past its grace period (1 s) and the 15 s margin it says ``PodStuckTerminating``
    (Warning event, ``Ready=False``), force-deletes it and creates the replacement; the node is
    ``Replaced``, never ``Out``."""
    del cluster_crd
    cluster, http = admin_api.cluster, admin_api.client
    suffix = uuid.uuid4().hex[:8]
    namespace = cluster.create_namespace(f"drain-{suffix}")
    node = f"no-kubelet-{suffix}"
    assert http.post("/api/v1/nodes", json=_node(node)).status_code == 201
    real = Cluster.connect(str(admin_api.kubeconfig))
    settings = Settings(metrics_port=0, disruption_budgets=False, network_policies=False)
    ctx = Context(cluster=real, settings=settings, metrics=OperatorMetrics())
    try:
        policy = {"maxRestarts": 0, "restartBackoffSeconds": 0, "gracePeriodSeconds": 1}
        template = {"spec": {"nodeSelector": {"malleus.io/nowhere": suffix}}}
        body = manifest(make_job(namespace=namespace, failurePolicy=policy, podTemplate=template))
        url = f"/apis/malleus.io/v1alpha1/namespaces/{namespace}/malleusjobs"
        made = http.post(url, json=body)
        assert made.status_code == 201, made.text
        stored = made.json()
        job, ref = jobs.resolve(stored), JobRef.from_body(stored)
        plan, _ = asyncio.run(jobs.initial_plan(job))
        asyncio.run(children.ensure_children(ctx, job, ref, plan))
        running = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True",
                   "reason": "Training", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}  # fmt: skip
        asyncio.run(real.patch_job_status(namespace, "demo", running))
        pods = f"/api/v1/namespaces/{namespace}/pods"
        for name in ("demo-node-0", "demo-node-1"):
            target = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                      "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
            bound = http.post(f"{pods}/{name}/binding", json=target)
            assert bound.status_code == 201, bound.text
        old_uid = http.get(f"{pods}/demo-node-1").json()["metadata"]["uid"]
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": "demo-node-1"},
        }
        evicted = http.post(f"{pods}/demo-node-1/eviction", json=eviction)
        assert evicted.status_code == 201, evicted.text
        terminating = http.get(f"{pods}/demo-node-1").json()
        assert terminating["metadata"].get("deletionTimestamp"), terminating
        asyncio.run(children.sync_pods(ctx, namespace, "demo", fresh=terminating))
        (record,) = http.get(f"{url}/demo").json()["status"]["failures"]
        assert (record["cause"], record["rule"], record["action"]) == (
            "Evicted",
            "eviction",
            "Ignore",
        )
        assert (record["state"], record["counted"]) == ("Waiting", 0)

        def replaced() -> list[str] | None:
            latest = http.get(f"{url}/demo").json()
            return asyncio.run(children.replace_failed(ctx, latest, status_now())) or None

        deadline = time.monotonic() + 60  # 1 s of grace, then 15 s: stuck
        while (created := replaced()) is None:
            assert time.monotonic() < deadline, "no replacement"
            time.sleep(1)
        assert created == ["demo-node-1"]
        new = http.get(f"{pods}/demo-node-1").json()
        assert new["metadata"]["uid"] != old_uid and not new["metadata"].get("deletionTimestamp")
        st = http.get(f"{url}/demo").json()["status"]
        (record,) = st["failures"]
        assert (record["state"], record["counted"], record["restarts"]) == ("Replaced", 0, 1)
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", failures.STUCK_TERMINATING)
        events = http.get(f"/api/v1/namespaces/{namespace}/events").json()["items"]
        stuck = [e for e in events if e["reason"] == failures.STUCK_TERMINATING]
        assert len(stuck) == 1 and stuck[0]["type"] == "Warning", stuck
        assert node in stuck[0]["message"]
    finally:
        real.close()
        http.delete(f"/api/v1/namespaces/{namespace}")
        http.delete(f"/api/v1/nodes/{node}")
