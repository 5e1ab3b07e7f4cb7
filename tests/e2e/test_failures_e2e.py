"""The operator across faults, end to end on the real control plane (``tests/cluster``).

One 2-node job (module fixture ``job``) on three process-kubelet nodes of this module's own
(``A``, ``B``, spare ``C``; the shared nodes are left alone, the job's pod template selects
these), placed so that node A holds the coordinator (node 0) and the store: A comes up first,
B once node 0 and the store are bound to A, then the spare C.

- A trainer killed (SIGKILL to node 1's torchrun and its ranks, as the OOM killer would): its
  pod fails, is recorded (``PodFailed``, ``status.failures``) and replaced by a pod of the same
  name whose trainers ``--join`` the running job, once the survivors recovered without it.
- A node lost: its kubelet stops renewing its Lease and its processes die (a machine gone);
  the node lifecycle controller marks it NotReady (``unreachable`` taints), the taint manager
  evicts its pods (the job's pod template tolerates ``unreachable`` for 2 s, not the default
  300), and the evicted worker, Terminating forever on a node that never confirms, is
  force-deleted by the operator (`failures.stuck_terminating`) and replaced on the spare node.

Needs ``MALLEUS_K8S_ASSETS`` and helm, like the other end-to-end tests; skips without them.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane, wait_until
from tests.cluster.fixtures import node_ready
from tests.cluster.kubelet import ProcessKubelet
from tests.cluster.operating import JobWorld, operated_namespace
from tests.e2e.test_operator_e2e import manifest, training

pytestmark = pytest.mark.timeout(400)

JOB = "e2e-faults"
POOL = "malleus.io/test-pool"


class Nodes:
    """This module's kubelets, started on demand."""

    def __init__(self, cluster: ControlPlane, pool: str, workdir: Any) -> None:
        self.cluster, self.pool, self.workdir = cluster, pool, workdir
        self.kubelets: dict[str, ProcessKubelet] = {}

    def start(self, name: str, index: int) -> ProcessKubelet:
        kubelet = ProcessKubelet(
            self.cluster, f"{self.pool}-{name}", self.workdir / name, index=index,
            gpus=2, labels={POOL: self.pool},
        )  # fmt: skip
        self.kubelets[name] = kubelet
        kubelet.start()
        wait_until(
            lambda: node_ready(self.cluster, kubelet.name),
            30,
            f"node {kubelet.name} Ready",
            alive=lambda: kubelet.check() or self.cluster.dead(),
        )
        return kubelet

    def stop(self) -> None:
        for kubelet in self.kubelets.values():
            kubelet.stop()


@pytest.fixture(scope="module")
def world(
    control_plane: ControlPlane,
    cluster_crd: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[JobWorld]:
    """The operator watching a namespace of this module's own, with no kubelet yet: ``job``
    starts this module's nodes (``world.pool``) one by one."""
    with operated_namespace(control_plane, tmp_path_factory, "e2e-f") as world:
        pool = Nodes(control_plane, world.ns, tmp_path_factory.mktemp("kubelets"))
        world.pool = pool  # type: ignore[attr-defined]
        try:
            yield world
        finally:
            pool.stop()


def _node_of(world: JobWorld, pod: str) -> str | None:
    got = world.http.get(f"/api/v1/namespaces/{world.ns}/pods/{pod}")
    return got.json()["spec"].get("nodeName") if got.status_code == 200 else None


@pytest.fixture(scope="module")
def job(world: JobWorld) -> str:
    """The 2-node job on A (node 0 + store) and B (node 1), training, spare node C Ready."""
    pool: Nodes = world.pool  # type: ignore[attr-defined]
    world.kubelets.append(pool.start("a", 21))
    unreachable = {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                   "effect": "NoExecute", "tolerationSeconds": 2}  # fmt: skip
    not_ready = {**unreachable, "key": "node.kubernetes.io/not-ready"}
    body = manifest(
        JOB, failurePolicy={"maxRestarts": 3, "restartBackoffSeconds": 1, "gracePeriodSeconds": 3}
    )
    template = body["spec"]["podTemplate"]["spec"]
    template["nodeSelector"] = {POOL: world.ns}
    template["tolerations"] = [unreachable, not_ready]
    world.create(body)
    a = pool.kubelets["a"].name
    for pod in (f"{JOB}-node-0", f"{JOB}-store"):
        world.wait(lambda p=pod: _node_of(world, p) == a or None, 60, f"{pod} on A", job=JOB)
    world.kubelets.append(pool.start("b", 22))
    world.wait(lambda: _node_of(world, f"{JOB}-node-1"), 60, "node 1 bound", job=JOB)
    world.kubelets.append(pool.start("c", 23))
    world.wait(training(world, JOB), 150, "Running with steps", job=JOB)
    return JOB


def _replaced(world: JobWorld, before: str) -> Any:
    def probe() -> dict[str, Any] | None:
        pods = {p["metadata"]["name"]: p for p in world.workers(JOB)}
        new = pods.get(f"{JOB}-node-1")
        if new is None or new["metadata"]["uid"] == before:
            return None
        return new if (new.get("status") or {}).get("phase") == "Running" else None

    return probe


def _epoch(st: dict[str, Any]) -> int:
    return int((st.get("lastRecovery") or {}).get("epoch") or 0)


def _all_in(world: JobWorld, after_epoch: int = -1) -> dict[str, Any] | None:
    """The status once the trainers recovered past ``after_epoch`` and no GPU is out."""
    st = world.status(JOB)
    out = [o for o in st.get("gpusOut") or [] if o.get("node") == 1]
    ok = not out and st.get("phase") in ("Running", "Replanning") and _epoch(st) > after_epoch
    return st if ok else None


def test_a_killed_trainer_is_replaced_and_joins(world: JobWorld, job: str) -> None:
    t0 = time.monotonic()
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in world.workers(job)}
    where = _node_of(world, f"{job}-node-1")
    kubelet = next(k for k in world.kubelets if k.name == where)
    run = kubelet.pod(world.ns, f"{job}-node-1")
    assert run is not None and run.pids(), kubelet.logs()
    run.signal(signal.SIGKILL)

    def failed() -> dict[str, Any] | None:
        st = world.status(job)
        return st if st.get("failures") else None

    st = world.wait(failed, 90, "the killed trainer in status.failures", job=job)
    assert st["failures"][0]["node"] == 1, st["failures"]
    world.wait(lambda: "PodFailed" in world.reasons(job) or None, 30, "PodFailed", job=job)
    new = world.wait(_replaced(world, before[f"{job}-node-1"]), 90, "a replacement", job=job)
    assert new["spec"]["containers"][0]["command"][-1] == "--join"
    assert new["metadata"]["annotations"]["malleus.io/restart"] == "1"
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in world.workers(job)}
    assert uids[f"{job}-node-0"] == before[f"{job}-node-0"]  # the coordinator untouched
    world.wait(lambda: "PodReplaced" in world.reasons(job) or None, 30, "PodReplaced", job=job)
    # the survivors recovered without node 1 (the trainers' word), the replacement joined
    world.wait(lambda: "Recovered" in world.reasons(job) or None, 120, "Recovered", job=job)
    world.wait(lambda: _all_in(world, 0), 150, "node 1's GPUs back in the job", job=job)
    print(f"killed trainer: replaced and joined in {time.monotonic() - t0:.1f} s")


def test_a_lost_nodes_worker_is_evicted_and_replaced_on_the_spare_node(
    world: JobWorld, job: str, control_plane: ControlPlane
) -> None:
    t0 = time.monotonic()
    epoch = _epoch(world.wait(lambda: _all_in(world), 150, "every GPU in the job", job=job))
    pool: Nodes = world.pool  # type: ignore[attr-defined]
    where = _node_of(world, f"{job}-node-1")
    lost = next(k for k in pool.kubelets.values() if k.name == where)
    assert lost is not pool.kubelets["a"], "node 1 shares node A with the coordinator"
    before = next(p for p in world.workers(job) if p["metadata"]["name"] == f"{job}-node-1")
    world.kubelets.remove(lost)  # its errors from here on are the test's doing
    lost.lose()
    for pod in list(lost.pods.values()):
        pod.kill()  # the machine is gone: so are its processes

    def unreachable() -> bool | None:
        node = world.http.get(f"/api/v1/nodes/{lost.name}").json()
        taints = {t["key"] for t in node["spec"].get("taints") or []}
        return True if "node.kubernetes.io/unreachable" in taints else None

    world.wait(unreachable, 60, "the lost node tainted unreachable", job=job)
    new = world.wait(_replaced(world, before["metadata"]["uid"]), 120, "a replacement", job=job)
    assert new["spec"]["nodeName"] not in (lost.name, pool.kubelets["a"].name), new["spec"]
    records = {r["node"]: r for r in world.status(job)["failures"]}
    assert records[1]["restarts"] >= 2, records
    world.wait(lambda: _all_in(world, epoch), 150, "node 1's GPUs back in the job", job=job)
    print(f"lost node: replaced and joined in {time.monotonic() - t0:.1f} s")
