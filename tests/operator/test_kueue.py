"""The Kueue Workload of a queued job (operator/kueue.py): what it asks for, how its state is
read, and the status patches that give an evicted job's quota back and finish it. The whole
cycle on Kueue's real manager: tests/e2e/test_kueue_e2e.py."""

from __future__ import annotations

import datetime as dt
from typing import Any

from malleus.job import ResolvedJob
from malleus.operator import kueue, store, workers
from malleus.operator.resources import JobRef

AT = dt.datetime(2026, 12, 3, 22, 0, tzinfo=dt.UTC)


def _workload(make_job: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    body = make_job()
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a", kueue.PRIORITY_LABEL: "low"}
    job = ResolvedJob.load(body)
    ref = JobRef.from_body(body)
    worker = workers.build_pod(job, ref, 0)
    wl = kueue.build_workload(
        ref, "team-a", worker, store.build_store_pod(job, ref), job.nodes, "low"
    )
    return wl, worker


def test_the_workload_is_the_whole_gang_workers_and_store_owned_by_the_job(make_job: Any) -> None:
    wl, worker = _workload(make_job)
    assert wl["metadata"]["name"] == "malleusjob-demo"
    (owner,) = wl["metadata"]["ownerReferences"]
    assert owner["kind"] == "MalleusJob" and owner["controller"] is True
    spec = wl["spec"]
    assert spec["queueName"] == "team-a"
    assert spec["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "low",
    }
    workers_set, store_set = spec["podSets"]
    assert (workers_set["name"], workers_set["count"]) == ("workers", 2)
    assert (store_set["name"], store_set["count"]) == ("store", 1)
    (container,) = workers_set["template"]["spec"]["containers"]
    assert container["resources"] == worker["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" in container["resources"]["limits"]
    assert store_set["template"]["spec"]["containers"][0]["resources"]["requests"]


def _with(conditions: dict[str, str], admission: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": "malleusjob-demo"},
        "status": {
            "admission": {"clusterQueue": "cq"} if admission else None,
            "conditions": [
                {"type": t, "status": v, "reason": t, "message": f"{t} says so",
                 "lastTransitionTime": "2026-12-03T21:00:00Z"}
                for t, v in conditions.items()
            ],
        },
    }  # fmt: skip


def test_the_job_may_run_only_while_admitted_and_not_evicted() -> None:
    assert not kueue.state(None).may_run  # no Workload yet: queued
    assert not kueue.state(_with({"QuotaReserved": "True"})).may_run  # not Admitted yet
    admitted = kueue.state(_with({"QuotaReserved": "True", "Admitted": "True"}))
    assert admitted.may_run and admitted.reserved and admitted.evicted is None
    evicted = kueue.state(_with({"QuotaReserved": "True", "Admitted": "True", "Evicted": "True"}))
    assert not evicted.may_run and evicted.reserved and evicted.evicted == "Evicted says so"
    assert not kueue.state(_with({"Admitted": "True"}, admission=False)).may_run


def test_an_evicted_workload_gives_its_quota_back_and_is_requeued() -> None:
    wl = _with({"QuotaReserved": "True", "Admitted": "True", "Evicted": "True"})
    patch = kueue.released(wl, AT)
    assert patch["status"]["admission"] is None
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == (
        "False",
        "Pending",
    )
    assert conds["Admitted"]["status"] == "False"
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Evicted")
    assert conds["Evicted"]["status"] == "True"  # Kueue's own, kept
    after = {**wl, "status": {**wl["status"], **patch["status"]}}
    assert not kueue.state(after).reserved


def test_a_finished_jobs_workload_is_finished() -> None:
    wl = _with({"QuotaReserved": "True", "Admitted": "True"})
    patch = kueue.finished(wl, True, "done", AT)
    after = {**wl, "status": {**wl["status"], **patch["status"]}}
    assert kueue.state(after).finished and not kueue.state(after).may_run
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conds["Finished"]["reason"] == "Succeeded"
    # an unchanged condition keeps its transition time
    assert conds["Admitted"]["lastTransitionTime"] == "2026-12-03T21:00:00Z"
