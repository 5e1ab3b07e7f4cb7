"""Worker pod failures as recovery: the pure rules (`failures`), the store's builders (`store`),
and the replacement of failed pods against kmock (`children.replace_failed`), including an
operator restarted mid-recovery."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import kopf
import pytest

from malleus.errors import BAD_INPUT_EXIT, LEFT_OUT_EXIT, NO_PLAN_EXIT
from malleus.job import FailurePolicy
from malleus.job.status import GpuOut, NodeFailure
from malleus.operator import children, failures, handlers, jobs, resources, store, workers
from malleus.operator.context import Context
from malleus.operator.status import now as status_now
from tests.operator.kube import Kube

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
REF = resources.JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)
POLICY = FailurePolicy(max_restarts=2, restart_backoff_seconds=10)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def failed_pod(node: int, uid: str, code: int = 137, reason: str = "Error") -> dict[str, Any]:
    term = {"exitCode": code, "reason": reason}
    return {
        "metadata": {"name": f"demo-node-{node}", "uid": uid},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": term}}],
        },
    }


# ---- the pure rules -------------------------------------------------------------------------


def test_pod_failure_classifies_exit_codes_evictions_and_deletions() -> None:
    f = failures.pod_failure(failed_pod(1, "u1"), "demo")
    assert f is not None and (f.node, f.uid, f.reason, f.exit_code) == (1, "u1", "Error", 137)
    left = failures.pod_failure(failed_pod(1, "u1", code=LEFT_OUT_EXIT), "demo")
    assert left is not None and left.reason == "LeftOut"
    no_plan = failures.pod_failure(failed_pod(0, "u0", code=NO_PLAN_EXIT), "demo")
    assert no_plan is not None and no_plan.reason == failures.NO_VALID_PLAN
    evicted = {
        "metadata": {"name": "demo-node-2"},
        "status": {"phase": "Failed", "reason": "Evicted"},
    }
    assert failures.pod_failure(evicted, "demo").reason == "Evicted"  # type: ignore[union-attr]
    running = {"metadata": {"name": "demo-node-2"}, "status": {"phase": "Running"}}
    assert failures.pod_failure(running, "demo") is None
    gone = failures.pod_failure(running, "demo", deleted=True)
    assert gone is not None and gone.reason == "Deleted"
    assert (
        failures.pod_failure(failed_pod(0, "x") | {"metadata": {"name": "demo-store"}}, "demo")
        is None
    )


def test_backoff_doubles_per_failure_and_is_capped() -> None:
    assert [failures.backoff_seconds(POLICY, n) for n in (1, 2, 3)] == [10, 20, 40]
    assert failures.backoff_seconds(FailurePolicy(restart_backoff_seconds=100), 5) == 300
    assert failures.backoff_seconds(FailurePolicy(restart_backoff_seconds=0), 3) == 0


def test_a_pod_is_counted_once_and_a_node_past_max_restarts_stays_out() -> None:
    seen = [failures.pod_failure(failed_pod(1, "u1"), "demo")]
    records, changed = failures.record_failures(None, seen, POLICY, T0)  # type: ignore[arg-type]
    assert [(r.node, r.failures, r.state) for r in records] == [(1, 1, "Waiting")]
    assert records[0].replace_at == T0 + dt.timedelta(seconds=10)
    # the same pod again (a later watch event, a restarted operator): nothing new
    again, changed = failures.record_failures(records, seen, POLICY, T0)  # type: ignore[arg-type]
    assert changed == [] and again == records
    # its deletion for the replacement is not a failure either
    deleted = failures.pod_failure(failed_pod(1, "u1"), "demo", deleted=True)
    _, changed = failures.record_failures(records, [deleted], POLICY, T0)  # type: ignore[list-item]
    assert changed == []
    # replacements fail too: the third failure (maxRestarts 2) leaves the node out
    for n, uid in ((2, "u2"), (3, "u3")):
        records = [failures.replaced(r, T0) for r in records]
        seen = [failures.pod_failure(failed_pod(1, uid), "demo")]
        records, changed = failures.record_failures(records, seen, POLICY, T0)  # type: ignore[arg-type]
        assert changed[0].failures == n
    assert (records[0].state, records[0].restarts, records[0].replace_at) == ("Out", 2, None)
    assert failures.terminal_reason(records, 2) is None  # node 0 goes on
    assert failures.terminal_reason(records, 1) == (
        failures.NO_WORKERS_LEFT,
        "every worker pod failed past spec.failurePolicy.maxRestarts (nodes [1])",
    )


def test_no_valid_plan_ends_the_job() -> None:
    seen = [failures.pod_failure(failed_pod(0, "u0", code=NO_PLAN_EXIT), "demo")]
    records, _ = failures.record_failures(None, seen, POLICY, T0)  # type: ignore[arg-type]
    assert records[0].state == "Out"
    reason, message = failures.terminal_reason(records, 4)  # type: ignore[misc]
    assert reason == "NoValidPlan" and "no valid plan exists on the GPUs left" in message


REFUSAL = (
    "BadInput: invalid MalleusJob in /etc/malleus/job.json (1 fault):\n"
    "  - spec.model.path: /models/llamma: no such folder; correct the path"
)
"""A trainer's termination message when it refused the job's input (trainer/cli.py `_refuse`)."""


def test_a_trainer_that_refused_its_input_ends_the_job_naming_the_fault() -> None:
    # torchrun exits 1 whatever its ranks' codes: the termination message says it was a refusal
    under_torchrun = failures.pod_failure(failed_pod(0, "u0", code=1), "demo")
    assert under_torchrun is not None and under_torchrun.reason == "Error"  # no message: a crash
    pod = failed_pod(0, "u0", code=1)
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = REFUSAL
    refused = failures.pod_failure(pod, "demo")
    assert refused is not None and refused.reason == failures.BAD_INPUT == "BadInput"
    direct = failures.pod_failure(failed_pod(1, "u1", code=BAD_INPUT_EXIT), "demo")
    assert direct is not None and direct.reason == failures.BAD_INPUT
    records, _ = failures.record_failures(None, [refused], POLICY, T0)
    assert records[0].state == "Out"  # no replacement: it would refuse the same input
    reason, message = failures.terminal_reason(records, 4)  # type: ignore[misc]
    assert reason == "BadInput"
    assert "a trainer refused the job's input before training" in message
    assert "spec.model.path: /models/llamma: no such folder" in message
    assert "correct the spec and create the job again" in message


def test_due_replacements_wait_for_the_backoff() -> None:
    seen = [failures.pod_failure(failed_pod(n, f"u{n}"), "demo") for n in (2, 0)]
    records, _ = failures.record_failures(None, seen, POLICY, T0)  # type: ignore[arg-type]
    assert failures.due_replacements(records, T0 + dt.timedelta(seconds=9)) == []
    due = failures.due_replacements(records, T0 + dt.timedelta(seconds=10))
    assert [r.node for r in due] == [0, 2]
    assert failures.live_nodes(records, 3) == [1]


def test_gpus_out_and_the_degraded_condition() -> None:
    seen = [failures.pod_failure(failed_pod(1, "u1"), "demo")]
    records, _ = failures.record_failures(None, seen, POLICY, T0)  # type: ignore[arg-type]
    out = failures.gpus_out(records, {5: "killed", 0: "hung"}, 4)
    assert [(o.gpu, o.source) for o in out] == [
        (0, "trainers"),
        (4, "pod"),
        (5, "trainers"),
        (6, "pod"),
        (7, "pod"),
    ]
    cond = failures.degraded_condition(records, out, 1, T0)
    assert (cond.type, cond.status, cond.reason) == ("Degraded", "True", "PodFailed")
    assert "5 GPU(s) out" in cond.message and "node 1 (demo-node-1): Error" in cond.message
    assert "0 (hung)" in cond.message and "replacement due 12:00:10Z" in cond.message
    trainers_only = failures.degraded_condition([], [GpuOut(gpu=3, reason="hung")], 1, T0)
    assert trainers_only.reason == "GpusOut"
    ok = failures.degraded_condition([failures.replaced(records[0], T0)], [], 1, T0)
    assert (ok.status, ok.reason) == ("False", "AllGpusIn")


def test_a_replacement_made_before_a_restart_is_recognised() -> None:
    seen = [failures.pod_failure(failed_pod(1, "u1"), "demo")]
    records, _ = failures.record_failures(None, seen, POLICY, T0)  # type: ignore[arg-type]
    new_pod = {"metadata": {"name": "demo-node-1", "uid": "u1b"}, "status": {"phase": "Pending"}}
    (fixed,) = failures.reconcile_replaced(records, {"demo-node-1": new_pod}, T0)
    assert (fixed.state, fixed.restarts) == ("Replaced", 1)
    # the failed pod itself is no replacement
    assert failures.reconcile_replaced(records, {"demo-node-1": failed_pod(1, "u1")}, T0) == []


# ---- builders -------------------------------------------------------------------------------


def test_the_store_pod_and_service(make_job: Any) -> None:
    job = jobs.resolve(make_job(image="registry.example/malleus:1"))
    pod = store.build_store_pod(job, REF)
    assert pod["metadata"]["name"] == "demo-store"
    assert pod["metadata"]["ownerReferences"] == [resources.owner_reference(REF)]
    labels = pod["metadata"]["labels"]
    assert labels[resources.JOB_LABEL] == "demo"  # the job's NetworkPolicy selects it
    assert labels["app.kubernetes.io/component"] == "store"  # the workers' selectors do not
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "registry.example/malleus:1"
    assert container["command"] == [
        *("python", "-m", "malleus.trainer", "store"),
        *("--host", "0.0.0.0", "--port", "29400"),
    ]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert spec["tolerations"] == [resources.GPU_TOLERATION]  # may sit on a tainted GPU node
    assert "nodeSelector" not in spec and "affinity" not in spec
    svc = store.build_store_service(REF)
    assert svc["spec"]["selector"] == {
        resources.JOB_LABEL: "demo",
        "app.kubernetes.io/component": "store",
    }
    assert svc["spec"]["ports"][0]["port"] == store.STORE_PORT
    assert store.store_address(REF) == "demo-store.ml.svc:29400"


def test_the_store_pod_goes_where_the_jobs_workers_may(make_job: Any) -> None:
    """On tainted GPU nodes, or a job pinned to a node pool, a store without the job's
    placement stayed Pending forever while its workers ran (seen on a real control plane)."""
    pool = {"key": "pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}
    zone = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}
            ]
        }
    }
    template = {
        "spec": {
            "nodeSelector": {"gpu": "a100"},
            "tolerations": [pool],
            "affinity": {"nodeAffinity": zone, "podAffinity": {"x": 1}},
            "priorityClassName": "training",
            "schedulerName": "gang",
        }
    }
    job = jobs.resolve(make_job(podTemplate=template))
    spec = store.build_store_pod(job, REF)["spec"]
    worker = workers.build_pod(job, REF, 0)["spec"]
    assert spec["tolerations"] == [resources.GPU_TOLERATION, pool]
    assert spec["tolerations"] == worker["tolerations"]
    assert spec["nodeSelector"] == worker["nodeSelector"] == {"gpu": "a100"}
    assert spec["affinity"] == {"nodeAffinity": zone}  # not the workers' pod (anti-)affinity
    assert spec["priorityClassName"] == "training"
    assert "schedulerName" not in spec  # a gang scheduler would wait for a group it is not in
    small = spec["containers"][0]["resources"]
    assert small["requests"] == small["limits"] == {"cpu": "100m", "memory": "256Mi"}


def test_a_replacement_pod_joins_and_keeps_its_predecessors_name(make_job: Any) -> None:
    job = jobs.resolve(make_job(failurePolicy={"gracePeriodSeconds": 120}))
    first = workers.build_pod(job, REF, 1)
    second = workers.build_pod(job, REF, 1, join=True, restart=1)
    assert first["metadata"]["name"] == second["metadata"]["name"] == "demo-node-1"
    assert "--join" not in first["spec"]["containers"][0]["command"]
    assert second["spec"]["containers"][0]["command"][-1] == "--join"
    assert not any(a.startswith("--plan") for a in second["spec"]["containers"][0]["command"])
    assert second["metadata"]["annotations"][resources.RESTART_ANNOTATION] == "1"
    assert resources.RESTART_ANNOTATION not in first["metadata"]["annotations"]
    assert second["spec"]["terminationGracePeriodSeconds"] == 120
    # anti-affinity keeps workers apart from each other, not from the store
    term = first["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ][0]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"


# ---- replacement against kmock --------------------------------------------------------------


def _create(kube: Kube, memo: kopf.Memo, body: dict[str, Any]) -> None:
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    run(handlers.sync_pods(Context.of(memo), "ml", "demo"))
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"


def _fail(
    kube: Kube, memo: kopf.Memo, node: int, code: int = 137, message: str | None = None
) -> None:
    pod = kube.get("Pod", "ml", f"demo-node-{node}")
    assert pod is not None
    term: dict[str, Any] = {"exitCode": code, "reason": "Error"}
    if message is not None:
        term["message"] = message
    kube.set_pod_phase(
        "ml",
        f"demo-node-{node}",
        "Failed",
        containerStatuses=[{"name": "trainer", "state": {"terminated": term}}],
    )
    body = kube.get("Pod", "ml", f"demo-node-{node}")
    run(
        handlers.on_pod_event(
            event={"type": "MODIFIED"},
            body=body,
            namespace="ml",
            labels=body["metadata"]["labels"],
            memo=memo,  # type: ignore[index]
        )
    )


def _uid(kube: Kube, name: str) -> str:
    pod = kube.get("Pod", "ml", name)
    assert pod is not None
    return str(pod["metadata"].get("uid") or "")


def _set_uid(kube: Kube, name: str, uid: str) -> None:
    pod = kube.get("Pod", "ml", name)
    assert pod is not None
    pod["metadata"]["uid"] = uid
    kube.put("Pod", pod)


def test_a_failed_pod_is_replaced_after_its_backoff_and_joins(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    _create(kube, memo, make_job(failurePolicy={"maxRestarts": 1, "restartBackoffSeconds": 5}))
    _set_uid(kube, "demo-node-1", "pod-a")
    _fail(kube, memo, 1)
    st = kube.job("ml", "demo")["status"]
    (record,) = st["failures"]
    assert (record["state"], record["podUid"]) == ("Waiting", "pod-a")
    due = dt.datetime.fromisoformat(record["replaceAt"])
    # not before the backoff
    assert (
        run(children.replace_failed(ctx, kube.job("ml", "demo"), due - dt.timedelta(seconds=1)))
        == []
    )
    assert _uid(kube, "demo-node-1") == "pod-a"
    # then: the failed pod (every container ended: nothing to wait for) is deleted with no
    # grace and its replacement created at once, in the same step
    created = run(children.replace_failed(ctx, kube.job("ml", "demo"), due))
    assert created == ["demo-node-1"]
    assert _uid(kube, "demo-node-1") != "pod-a"
    pod = kube.get("Pod", "ml", "demo-node-1")
    assert pod is not None and pod["spec"]["containers"][0]["command"][-1] == "--join"
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running"
    assert (st["failures"][0]["state"], st["failures"][0]["restarts"]) == ("Replaced", 1)
    assert "PodReplaced" in kube.reasons()
    # the replacement fails too: maxRestarts 1, so node 1 stays out and node 0 goes on
    _set_uid(kube, "demo-node-1", "pod-b")
    _fail(kube, memo, 1)
    st = kube.job("ml", "demo")["status"]
    assert (st["failures"][0]["state"], st["failures"][0]["failures"]) == ("Out", 2)
    assert st["phase"] == "Running"
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "NodesOut"
    assert (
        run(children.replace_failed(ctx, kube.job("ml", "demo"), due + dt.timedelta(hours=1))) == []
    )
    # node 0 completes: the job succeeds on the GPUs left
    kube.set_pod_phase("ml", "demo-node-0", "Succeeded")
    run(handlers.sync_pods(ctx, "ml", "demo"))
    assert kube.job("ml", "demo")["status"]["phase"] == "Succeeded"


def test_the_last_worker_out_fails_the_job(kube: Kube, memo: kopf.Memo, make_job: Any) -> None:
    _create(kube, memo, make_job(failurePolicy={"maxRestarts": 0}))
    _set_uid(kube, "demo-node-0", "pod-0")
    _set_uid(kube, "demo-node-1", "pod-1")
    _fail(kube, memo, 1)
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"
    _fail(kube, memo, 0)
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NoWorkersLeft"
    assert "NoWorkersLeft" in kube.reasons()


def test_no_valid_plan_fails_the_job_with_a_condition_that_says_so(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _create(kube, memo, make_job())
    _set_uid(kube, "demo-node-0", "pod-0")
    _fail(kube, memo, 0, code=NO_PLAN_EXIT)
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NoValidPlan"


def test_a_refused_input_fails_the_job_with_a_condition_that_says_which(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _create(kube, memo, make_job())
    _set_uid(kube, "demo-node-0", "pod-0")
    _fail(kube, memo, 0, code=1, message=REFUSAL)
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BadInput"
    assert "spec.model.path: /models/llamma: no such folder" in failed["message"]
    assert "BadInput" in kube.reasons()


def test_an_operator_restarted_mid_replacement_creates_no_duplicate(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    _create(kube, memo, make_job(failurePolicy={"restartBackoffSeconds": 0}))
    _set_uid(kube, "demo-node-1", "pod-a")
    _fail(kube, memo, 1)
    body = kube.job("ml", "demo")
    waiting = kube.job("ml", "demo")["status"]
    # the operator created the replacement and died before writing the status
    kube.remove("Pod", "ml", "demo-node-1")
    job = jobs.resolve(body)
    run(ctx.cluster.create(workers.build_pod(job, REF, 1, join=True, restart=1)))
    _set_uid(kube, "demo-node-1", "pod-b")
    assert kube.job("ml", "demo")["status"] == waiting
    creates = kube.requests("create", "Pod")
    # the restarted operator: resume, then the timer
    run(handlers.on_resume(body=kube.job("ml", "demo"), patch=kopf.Patch(), memo=memo))
    run(children.replace_failed(ctx, kube.job("ml", "demo"), T0 + dt.timedelta(days=3650)))
    assert kube.requests("create", "Pod") == creates
    assert len([p for p in kube.of_kind("Pod") if "node" in p["metadata"]["name"]]) == 2
    record = kube.job("ml", "demo")["status"]["failures"][0]
    assert (record["state"], record["restarts"], record["failures"]) == ("Replaced", 1, 1)


def test_a_pod_event_racing_the_replacer_counts_one_restart(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    _create(kube, memo, make_job(failurePolicy={"restartBackoffSeconds": 0}))
    _set_uid(kube, "demo-node-1", "pod-a")
    _fail(kube, memo, 1)
    later = T0 + dt.timedelta(days=3650)
    run(children.replace_failed(ctx, kube.job("ml", "demo"), later))  # deletes the failed pod
    run(children.replace_failed(ctx, kube.job("ml", "demo"), later))  # creates the replacement
    _set_uid(kube, "demo-node-1", "pod-b")
    body = kube.get("Pod", "ml", "demo-node-1")
    run(
        handlers.on_pod_event(
            event={"type": "ADDED"},
            body=body,
            namespace="ml",
            labels=body["metadata"]["labels"],
            memo=memo,  # type: ignore[index]
        )
    )
    record = kube.job("ml", "demo")["status"]["failures"][0]
    assert (record["state"], record["restarts"]) == ("Replaced", 1)


@pytest.mark.parametrize("state", ["Waiting", "Out"])
def test_the_timer_runs_only_while_a_replacement_waits(state: str) -> None:
    status = {"failures": [{"state": state}]}
    assert handlers._replacing(status=status) is (state == "Waiting")
    assert not handlers._replacing(status={})


def test_node_failure_model_round_trips() -> None:
    r = NodeFailure(node=1, pod="p", failures=1, state="Waiting", reason="Error", time=T0)
    assert NodeFailure.model_validate(r.model_dump(by_alias=True)) == r


def test_a_replacement_still_pending_when_the_others_completed_does_not_hold_the_job() -> None:
    from malleus.operator import lifecycle

    records, _ = failures.record_failures(
        None, [failures.pod_failure(failed_pod(1, "u1"), "demo")], POLICY, T0
    )  # type: ignore[list-item]
    stored = {
        "phase": "Running",
        "failures": [failures.replaced(records[0], T0).model_dump(mode="json", by_alias=True)],
    }
    pods = [
        {"metadata": {"name": "demo-node-0", "uid": "u0"}, "status": {"phase": "Succeeded"}},
        {"metadata": {"name": "demo-node-1", "uid": "u1b"}, "status": {"phase": "Pending"}},
    ]
    t = lifecycle.pods_transition(stored, pods, ["demo-node-0", "demo-node-1"], 1, T0)
    assert t.status is not None and t.status.phase == "Succeeded"
    pods[1]["status"]["phase"] = "Running"  # a running one finishes with the others
    assert not lifecycle.pods_transition(stored, pods, ["demo-node-0", "demo-node-1"], 1, T0)


def test_a_pod_failed_before_the_job_ran_is_replaced_like_a_first_pod(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    body = make_job(failurePolicy={"restartBackoffSeconds": 0})
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])  # Pending: no process group formed yet
    _set_uid(kube, "demo-node-1", "pod-a")
    _fail(kube, memo, 1)
    assert kube.job("ml", "demo")["status"]["failures"][0]["state"] == "Waiting"
    later = T0 + dt.timedelta(days=3650)
    assert run(children.replace_failed(ctx, kube.job("ml", "demo"), later)) == ["demo-node-1"]
    pod = kube.get("Pod", "ml", "demo-node-1")
    assert pod is not None
    command = pod["spec"]["containers"][0]["command"]
    assert "--join" not in command and "--plan=/etc/malleus/plan.json" in command


def test_a_pods_ranks_take_their_global_identity_from_the_node_index() -> None:
    """What `workers.torchrun_command` relies on: torchrun launches one pod's ranks
    (``--nnodes=1``); with the job's store, node index and local rank make the global rank."""
    launch = pytest.importorskip("malleus.trainer.launch.distributed")
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "MALLEUS_STORE": "demo-store.ml.svc:29400",
        "MALLEUS_NODE_RANK": "1",
        "MALLEUS_NODES": "2",
        "MALLEUS_GPUS_PER_NODE": "2",
    }
    dist_env = launch.DistEnv.from_env(env)
    assert (dist_env.rank, dist_env.world_size, dist_env.local_rank) == (3, 4, 1)
    del env["MALLEUS_STORE"]  # torchrun's own numbering without the job's store
    assert launch.DistEnv.from_env(env).rank == 1


def _terminating(kube: Kube, memo: kopf.Memo, node: int, ends: dt.datetime) -> None:
    """Node ``node``'s pod deleted while its trainers run (its grace period ``ends`` then), as
    the watch shows it: a failure of cause ``Deleted``."""
    name = f"demo-node-{node}"
    pod = kube.get("Pod", "ml", name)
    assert pod is not None
    pod["metadata"]["deletionTimestamp"] = ends.strftime("%Y-%m-%dT%H:%M:%SZ")
    pod["spec"]["nodeName"] = "gpu-7"
    kube.put("Pod", pod)
    body = kube.get("Pod", "ml", name)
    assert body is not None
    labels = body["metadata"]["labels"]
    run(handlers.on_pod_event(event={"type": "MODIFIED"}, body=body, namespace="ml",
                              labels=labels, memo=memo))  # fmt: skip


def test_a_pod_stuck_terminating_past_its_grace_is_said_and_forced_out(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """Within its grace period a deleted pod's trainers are waited for (they checkpoint); once
    it is over (and the kubelet still has not confirmed), one Warning event, ``Ready=False``
    with reason ``PodStuckTerminating``, a forced deletion and the replacement, at once."""
    _create(kube, memo, make_job(failurePolicy={"restartBackoffSeconds": 0}))
    _set_uid(kube, "demo-node-1", "pod-a")
    now = status_now()
    _terminating(kube, memo, 1, now + dt.timedelta(seconds=60))
    (record,) = kube.job("ml", "demo")["status"]["failures"]
    assert (record["state"], record["cause"], record["counted"]) == ("Waiting", "Deleted", 1)
    assert run(children.replace_failed(ctx, kube.job("ml", "demo"), now)) == []
    assert _uid(kube, "demo-node-1") == "pod-a"  # its grace: not touched
    assert failures.STUCK_TERMINATING not in kube.reasons()
    _terminating(kube, memo, 1, now - dt.timedelta(seconds=failures.STUCK_TERMINATING_SECONDS))
    deletes = kube.requests("delete", "Pod")
    assert run(children.replace_failed(ctx, kube.job("ml", "demo"), now)) == ["demo-node-1"]
    assert kube.requests("delete", "Pod") == deletes + 1
    assert _uid(kube, "demo-node-1") != "pod-a"
    assert kube.reasons().count(failures.STUCK_TERMINATING) == 1
    (event,) = [e for e in kube.events if e["reason"] == failures.STUCK_TERMINATING]
    assert event["type"] == "Warning" and "gpu-7 does not confirm" in event["message"]
    st = kube.job("ml", "demo")["status"]
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", failures.STUCK_TERMINATING)
    assert st["failures"][0]["state"] == "Replaced"


def test_a_lost_nodes_pod_frees_its_name_at_once(
    kube: Kube, memo: kopf.Memo, ctx: Context, make_job: Any
) -> None:
    """The taint manager deleted the pod of a lost node: no kubelet will confirm, so the
    replacement does not wait out the grace period (nor is it counted as stuck)."""
    _create(kube, memo, make_job(failurePolicy={"restartBackoffSeconds": 0}))
    _set_uid(kube, "demo-node-1", "pod-a")
    pod = kube.get("Pod", "ml", "demo-node-1")
    assert pod is not None
    pod["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    ]
    kube.put("Pod", pod)
    _terminating(kube, memo, 1, status_now() + dt.timedelta(seconds=60))
    (record,) = kube.job("ml", "demo")["status"]["failures"]
    assert record["cause"] == "NodeLost"
    assert run(children.replace_failed(ctx, kube.job("ml", "demo"), status_now())) == [
        "demo-node-1"
    ]
    assert _uid(kube, "demo-node-1") != "pod-a"
    assert failures.STUCK_TERMINATING not in kube.reasons()
