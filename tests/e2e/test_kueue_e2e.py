"""A MalleusJob queued in Kueue's real manager (v0.17), on the real control plane.

Kueue runs with its CRDs and webhooks (`tests.cluster.kueue`); the operator runs as the chart's
ServiceAccount; a ClusterQueue holds a GPU quota, preempting lower priorities within it. A
2-node job (2 x 2 GPUs, ``kueue.x-k8s.io/queue-name``, priority class ``low``) is one
Workload (its two workers and its store, operator/kueue.py). No emulated clock: its workers
request their GPUs (2 ``nvidia.com/gpu`` each, which the process-kubelet nodes have) and train
on the CPU with real timings.

- with 2 GPUs of quota it waits (Kueue keeps the Workload pending; no pod exists);
- with 4 it is admitted whole: its workers and store are created and it trains;
- a ``high`` priority batch Job needing 2 GPUs preempts it: the job is suspended with a
  checkpoint (on a claim that outlives its pods), its pods exit and go, no failure is counted,
  and its quota goes back so the Job runs;
- once the Job is gone it is admitted again and resumes from its checkpoint.

Needs ``MALLEUS_K8S_ASSETS`` (with Kueue: scripts/k8s-assets.sh), helm and a mount namespace
for Kueue's private ``/etc``; skips, saying which, without them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubelet import ProcessKubelet
from tests.cluster.kueue import Kueue
from tests.cluster.operating import JobWorld, exactly, operated_namespace
from tests.jobs import cluster_job

pytestmark = pytest.mark.timeout(420)

JOB = "e2e-queued"
QUEUE = "team"
CQ = "malleus-gpus"
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
WORKLOAD = f"malleusjob-{JOB}"
CLAIM = "e2e-checkpoints"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 65534,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""What the restricted Pod Security Standard (the namespace's) asks of the batch Job's container."""


def cluster_queue(gpus: int) -> dict[str, Any]:
    quota = [
        {"name": "cpu", "nominalQuota": "64"},
        {"name": "memory", "nominalQuota": "256Gi"},
        {"name": "nvidia.com/gpu", "nominalQuota": str(gpus)},
    ]
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": CQ},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                    "flavors": [{"name": "default-flavor", "resources": quota}],
                }
            ],
        },
    }


def manifest() -> dict[str, Any]:
    body = cluster_job(JOB, checkpoint={"claimName": CLAIM, "intervalSteps": 5})
    body["metadata"]["labels"] = {
        "kueue.x-k8s.io/queue-name": QUEUE,
        "kueue.x-k8s.io/priority-class": "low",
    }
    return body


def urgent_job() -> dict[str, Any]:
    """A high-priority batch Job of the same queue needing 2 GPUs (Kueue suspends it at
    creation and admits it)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "urgent",
            "labels": {"kueue.x-k8s.io/queue-name": QUEUE, "kueue.x-k8s.io/priority-class": "high"},
        },
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "tolerations": [GPU_TOLERATION],
                    "containers": [
                        {
                            "name": "work",
                            "image": "busybox",
                            "command": ["sleep", "600"],
                            "securityContext": RESTRICTED_CONTAINER,
                            "resources": {
                                "requests": {"cpu": "100m", "nvidia.com/gpu": "2"},
                                "limits": {"nvidia.com/gpu": "2"},
                            },
                        }
                    ],
                }
            },
        },
    }


@pytest.fixture(scope="module")
def world(
    control_plane: ControlPlane,
    cluster_crd: dict[str, Any],
    nodes: list[ProcessKubelet],
    kueue: Kueue,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[JobWorld]:
    """The operator as the chart's ServiceAccount; Kueue's queues: a flavour, a ClusterQueue
    of 2 GPUs (too few for the job), a LocalQueue and two priority classes; a checkpoint
    claim bound to a volume (the claim outlives the pods)."""
    with operated_namespace(control_plane, tmp_path_factory, "e2e-kueue", nodes) as world:
        ns = world.ns
        control_plane.apply(
            [
                {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                 "metadata": {"name": "default-flavor"}},
                cluster_queue(2),
                {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                 "metadata": {"name": QUEUE, "namespace": ns}, "spec": {"clusterQueue": CQ}},
                {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                 "metadata": {"name": "low"}, "value": 100},
                {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                 "metadata": {"name": "high"}, "value": 1000},
                {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-ckpt"},
                 "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                          "storageClassName": "manual", "hostPath": {"path": "/nonexistent"},
                          "claimRef": {"namespace": ns, "name": CLAIM}}},
                {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": CLAIM, "namespace": ns},
                 "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual",
                          "volumeName": f"{ns}-ckpt",
                          "resources": {"requests": {"storage": "1Gi"}}}},
            ]
        )  # fmt: skip
        try:
            yield world
        finally:
            world.http.delete(f"{KUEUE}/clusterqueues/{CQ}")
            world.http.delete(f"/api/v1/persistentvolumes/{ns}-ckpt")


def workload(world: JobWorld) -> dict[str, Any] | None:
    got = world.http.get(f"{KUEUE}/namespaces/{world.ns}/workloads/{WORKLOAD}")
    return dict(got.json()) if got.status_code == 200 else None


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def phase(world: JobWorld, name: str, wanted: str, past: int = -1) -> Any:
    """A probe: the job's status once in phase `wanted` (past step `past`), else None."""

    def probe() -> dict[str, Any] | None:
        st = world.status(name)
        return st if st.get("phase") == wanted and st.get("step", 0) > past else None

    return probe


def requeued(world: JobWorld) -> dict[str, dict[str, Any]] | None:
    """The Workload's conditions once its quota was given back and it was queued again."""
    c = conditions(workload(world))
    ok = c.get("Requeued", {}).get("status") == "True"
    return c if ok and c.get("QuotaReserved", {}).get("status") == "False" else None


def admitted_job(world: JobWorld, name: str) -> dict[str, Any] | None:
    """The batch Job once Kueue unsuspended it."""
    got = world.http.get(f"/apis/batch/v1/namespaces/{world.ns}/jobs/{name}").json()
    return got if got["spec"].get("suspend") is False else None


def trainer_logs(world: JobWorld, pod: dict[str, Any]) -> str:
    """The trainer container's output of this very pod (its uid), from whichever kubelet."""
    meta = pod["metadata"]
    folders = [
        f
        for k in world.kubelets
        for f in Path(k.workdir).glob(f"{world.ns}_{meta['name']}_{meta['uid'][:8]}")
    ]
    logs = [f / "trainer.log" for f in folders]
    return "".join(log.read_text(errors="replace") for log in logs if log.exists())


def test_a_queued_job_waits_is_admitted_whole_preempted_with_a_checkpoint_and_resumes(
    world: JobWorld, control_plane: ControlPlane
) -> None:
    world.create(manifest())

    # 1. 2 GPUs of quota for a 4-GPU job: Kueue keeps its Workload pending, no pod is made
    def pending() -> dict[str, Any] | None:
        wl = workload(world)
        reserved = conditions(wl).get("QuotaReserved") or {}
        return wl if reserved.get("status") == "False" and reserved.get("reason") else None

    wl = world.wait(pending, 60, "the Workload pending in Kueue", job=JOB)
    assert "insufficient" in conditions(wl)["QuotaReserved"]["message"].lower(), wl["status"]
    sets = {s["name"]: s["count"] for s in wl["spec"]["podSets"]}
    assert sets == {"workers": 2, "store": 1}, wl["spec"]  # one gang, the store included
    assert wl["spec"]["priority"] == 100
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "MalleusJob"
    st = world.wait(phase(world, JOB, "Suspended"), 30, "the job Suspended (queued)", job=JOB)
    assert "queued in Kueue" in st["message"], st
    assert world.children("pods", JOB) == []

    # 2. enough quota: admitted as one gang, the workers and the store made, training
    control_plane.apply([cluster_queue(4)])
    running = world.wait(
        phase(world, JOB, "Running", past=6),
        180,
        "admitted and training past a checkpoint",
        job=JOB,
    )
    wl = workload(world)
    assigned = {a["name"]: a["count"] for a in wl["status"]["admission"]["podSetAssignments"]}
    assert assigned == {"workers": 2, "store": 1}
    pods = world.children("pods", JOB)
    assert len(pods) == 3 and len(world.workers(JOB)) == 2, [p["metadata"]["name"] for p in pods]
    assert not [k for p in pods for k in p["metadata"]["labels"] if k.startswith("kueue.")]
    first_pods = world.workers(JOB)

    # 3. a higher priority preempts it: suspended with a checkpoint, pods gone, no failure
    created = world.http.post(f"/apis/batch/v1/namespaces/{world.ns}/jobs", json=urgent_job())
    assert created.status_code == 201, created.text
    suspended = world.wait(
        phase(world, JOB, "Suspended"),
        90,
        "Suspended by Kueue's eviction",
        job=JOB,
    )
    assert "evicted by Kueue" in suspended["message"], suspended
    assert "checkpointing" in suspended["message"], suspended
    world.wait(
        lambda: exactly(0, world.children("pods", JOB)),
        90,
        "the preempted job's pods gone",
        job=JOB,
        running=False,
    )
    back = world.wait(
        lambda: requeued(world), 60, "the Workload's quota given back", job=JOB, running=False
    )
    assert back["Evicted"]["reason"] in ("Preempted", "InClusterQueue"), back
    urgent = world.wait(
        lambda: admitted_job(world, "urgent"),
        60,
        "the urgent Job admitted",
        job=JOB,
        running=False,
    )
    assert urgent["spec"]["suspend"] is False
    st = world.status(JOB)
    assert not st.get("failures"), st.get("failures")  # a preemption is no failure
    reasons = world.reasons(JOB)
    assert "PodFailed" not in reasons and "Suspended" in reasons and "Requeued" in reasons, reasons
    # the trainers were asked to stop and saved a checkpoint of the step they stopped after
    (first,) = [p for p in first_pods if p["metadata"]["name"].endswith("-node-0")]
    log = trainer_logs(world, first)
    stopped = re.search(r"stop requested: stopping after step (\d+)", log)
    assert stopped, log[-2000:]
    saved = re.findall(r"saved checkpoint \S*step-0*(\d+)", log)  # periodic ones, then the stop's
    assert saved and saved[-1] == stopped[1], log[-2000:]

    # 4. the Job gone: admitted again, resumed from the checkpoint
    gone = world.http.delete(
        f"/apis/batch/v1/namespaces/{world.ns}/jobs/urgent",
        params={"propagationPolicy": "Background"},
    )
    assert gone.is_success, gone.text

    def resumed_log() -> re.Match[str] | None:
        node0 = [p for p in world.workers(JOB) if p["metadata"]["name"].endswith("-node-0")]
        if not node0 or node0[0]["metadata"]["uid"] == first["metadata"]["uid"]:
            return None
        return re.search(r"resumed from \S+ at step (\d+)", trainer_logs(world, node0[0]))

    # from the checkpoint it saved when preempted, not from step 0
    resumed = world.wait(resumed_log, 180, "the new workers resumed from the checkpoint", job=JOB)
    assert int(resumed[1]) >= int(stopped[1]) >= running["step"], (resumed[0], stopped[0])
    again = world.wait(
        phase(world, JOB, "Running", past=int(resumed[1]) + 1),
        120,
        "admitted again and training past the checkpoint",
        job=JOB,
    )
    assert again["plan"]["generation"] >= running["plan"]["generation"]
    assert not world.status(JOB).get("failures")
    print(f"preempted after step {stopped[1]}; resumed at step {resumed[1]}")
