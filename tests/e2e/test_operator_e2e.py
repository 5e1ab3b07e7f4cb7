"""The operator end to end on the real control plane (``tests/cluster``): etcd, kube-apiserver
(RBAC, admission), every controller (the garbage collector included) and the scheduler, with
process-kubelet nodes whose pods are local processes.

``python -m malleus.operator`` runs as the Helm chart's ServiceAccount (``helm template``'s RBAC
for this module's namespace), one per module. A 2-node job (2 x 2 emulated GPUs, tp 2) is placed
by the real scheduler, one worker per node; its trainers train; a straggler from the job's
emulation schedule is detected, re-planned around and its state migrated in place; ``kubectl
get`` / ``describe`` tell the story; ``spec.suspend`` gives the pods back and resuming brings
them again; deleting the job lets the garbage collector remove its children, with the operator
running and with it stopped (no finalizer holds a job: docs/reference/operator.md). A job the
schema accepts but the operator cannot run fails with nothing created.

Needs ``MALLEUS_K8S_ASSETS`` and helm (``scripts/helm-bin.sh``); skips without them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.fixtures import SHARED_NODES
from tests.cluster.kubelet import ProcessKubelet
from tests.cluster.operating import JobWorld, exactly, operated_namespace
from tests.jobs import cluster_job

pytestmark = pytest.mark.timeout(300)

JOB = "e2e-tiny"
STRAGGLER = 3  # global rank: node 1, local GPU 1
FACTOR = 4.0
SLOW_FROM = 6  # the emulation schedule's step


def manifest(name: str, nodes: int = 2, **spec: Any) -> dict[str, Any]:
    """The module's job: emulated GPUs, a straggler policy that acts at once, metrics every
    second; ``spec`` entries replace these."""
    defaults = {
        "stragglerPolicy": {"windowSteps": 3, "cooldownSeconds": 0},
        "metrics": {"scrapeIntervalSeconds": 1},
        "emulation": {"enabled": True, "layerForwardMs": 10, "layerBackwardMs": 20},
    }
    return cluster_job(name, nodes, **{**defaults, **spec})


@pytest.fixture(scope="module")
def world(
    control_plane: ControlPlane,
    cluster_crd: dict[str, Any],
    nodes: list[ProcessKubelet],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[JobWorld]:
    """The operator (the chart's ServiceAccount) watching a namespace of this module's own."""
    with operated_namespace(control_plane, tmp_path_factory, "e2e", nodes) as world:
        yield world


def training(world: JobWorld, name: str, past: int = 3) -> Any:
    def probe() -> dict[str, Any] | None:
        st = world.status(name)
        ok = st.get("phase") == "Running" and st.get("step", 0) > past and st.get("tokensPerSecond")
        return st if ok else None

    return probe


@pytest.fixture(scope="module")
def job(world: JobWorld) -> str:
    """The module's 2-node job, training, with rank 3 four times slower from step 6."""
    schedule = [{"step": SLOW_FROM, "rank": STRAGGLER, "factor": FACTOR}]
    emulation = {"enabled": True, "layerForwardMs": 10, "layerBackwardMs": 20, "schedule": schedule}
    world.create(manifest(JOB, emulation=emulation))
    world.wait(lambda: exactly(2, world.workers(JOB)), 60, "two worker pods", job=JOB)
    return JOB


def test_a_spec_the_schema_accepts_but_no_layout_fits_fails_with_nothing_created(
    world: JobWorld,
) -> None:
    # llama-70b on two 1 GiB GPUs: schema-valid, but no layout fits (the planner is the judge).
    name = "e2e-too-big"
    world.create(manifest(name, model={"preset": "llama-70b"}, resources={"gpuMemoryMiB": 1024}))
    st = world.wait(
        lambda: world.in_phase(name, "Failed"), 60, f"{name} Failed", job=name, running=False
    )
    ready = {c["type"]: c for c in st["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec", ready
    assert "no parallel layout" in ready["message"], ready
    world.wait(
        lambda: "InvalidSpec" in world.reasons(name) or None,
        20,
        "InvalidSpec event",
        job=name,
        running=False,
    )
    for plural in ("pods", "services", "configmaps", "secrets"):
        assert not world.children(plural, name), plural
    assert world.http.delete(f"{world.url}/{name}").is_success
    world.wait(lambda: world.job(name) is None or None, 30, "deleted", job=name, running=False)


def test_a_job_whose_store_cannot_be_scheduled_says_so_in_ready_and_one_warning(
    world: JobWorld,
) -> None:
    name = "e2e-nowhere"
    body = manifest(name, nodes=1)
    body["spec"]["podTemplate"]["spec"]["nodeSelector"] = {"malleus.io/pool": "none-such"}
    world.create(body)
    store = f"{name}-store"

    def stuck() -> dict[str, Any] | None:
        st = world.status(name)
        ready = next((c for c in st.get("conditions") or [] if c["type"] == "Ready"), {})
        ok = ready.get("reason") == "Unschedulable" and f"{store}: Unschedulable" in str(
            ready.get("message")
        )
        return ready if ok else None

    ready = world.wait(stuck, 60, "Ready=False naming the unschedulable store", job=name)
    assert (
        ready["status"] == "False"
        and "didn't match Pod's node affinity/selector" in (ready["message"])
    ), ready
    assert world.in_phase(name, "Pending"), world.status(name)

    pods = (store, f"{name}-node-0")

    def warned() -> list[dict[str, Any]] | None:
        found = [e for e in world.events(name) if e["reason"] == "Unschedulable"]
        return found if all(any(p in e["message"] for e in found) for p in pods) else None

    events = world.wait(warned, 30, "Warning events for the store and the worker", job=name)
    assert all(e["type"] == "Warning" for e in events), events
    # every pod event recomputes the same reasons: each is said once (one per occurrence)
    events = [e for e in world.events(name) if e["reason"] == "Unschedulable"]
    for pod in pods:
        assert sum(e["message"].startswith(pod) for e in events) == 1, events
    assert world.http.delete(f"{world.url}/{name}").is_success


def test_a_two_node_job_trains_on_two_nodes_and_replans_around_its_straggler(
    world: JobWorld, job: str, control_plane: ControlPlane
) -> None:
    t0 = time.monotonic()
    running = world.wait(training(world, job), 150, "Running with steps and tokens/s", job=job)
    timings = {"running": time.monotonic() - t0}
    uid = world.job(job)["metadata"]["uid"]  # type: ignore[index]
    pods = world.workers(job)
    # the real scheduler put one worker on each node (the pod template's anti-affinity)
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(SHARED_NODES), pods
    for pod in pods:
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "MalleusJob" and owner["uid"] == uid
        assert pod["status"]["phase"] == "Running" and pod["status"]["podIP"].startswith("127.")
        command = pod["spec"]["containers"][0]["command"]
        assert command[0] == "torchrun" and "--nnodes=1" in command
    assert len(world.children("pods", job)) == 3  # + the store

    def workers_ready() -> list[dict[str, Any]] | None:
        # the readiness probe (torchrun's agent store) passes on every worker, not only on the
        # coordinator's
        found = world.workers(job)
        conds = [
            {c["type"]: c["status"] for c in p["status"].get("conditions") or []} for p in found
        ]
        return found if len(found) == 2 and all(c.get("Ready") == "True" for c in conds) else None

    world.wait(workers_ready, 60, "every worker pod Ready", job=job)
    assert world.children("services", job) and world.children("configmaps", job)
    created = [e["message"] for e in world.events(job) if e["reason"] == "Created"]
    assert created and "plan generation 1:" in created[0], created
    # Ready is the trainers' word: True (Training) once every rank trains, said once
    ready = world.wait(
        lambda: next(
            (c for c in world.status(job)["conditions"] if c["type"] == "Ready"
             and c["status"] == "True"), None,
        ),
        30, "Ready=True", job=job,
    )  # fmt: skip
    assert ready["reason"] == "Training", ready
    assert ready["message"].startswith("every rank (4) is training"), ready
    assert world.reasons(job).count("Running") == 1, world.reasons(job)  # one per occurrence
    first_generation = running["plan"]["generation"]

    def replanned() -> dict[str, Any] | None:
        """A plan made for the straggler that moved state, in force (not necessarily the
        first re-plan: one decided while the measured rate still climbed may only re-split
        micro-batches, 0 bytes)."""
        st = world.status(job)
        generation = (st.get("plan") or {}).get("generation", 0)
        last = st.get("lastReplan") or {}
        ours = f"rank {STRAGGLER}" in str(last.get("reason"))
        moved = (last.get("migrationBytes") or 0) > 0
        fresh = generation > first_generation and last.get("generation") == generation
        return st if fresh and ours and moved else None

    after = world.wait(replanned, 120, f"a new plan in force around rank {STRAGGLER}", job=job)
    timings["replanned"] = time.monotonic() - t0
    assert STRAGGLER in [s["rank"] for s in after["stragglers"]], after["stragglers"]
    assert after["stragglerSummary"].startswith("1 (r3 "), after["stragglerSummary"]
    conditions = {c["type"]: c for c in after["conditions"]}
    assert conditions["Straggling"]["status"] == "True", conditions
    assert conditions["Ready"]["status"] == "True", conditions
    world.wait(
        lambda: world.status(job).get("step", 0) > after["step"] + 2 or None,
        60,
        "steps under the new plan",
        job=job,
    )
    world.wait(
        lambda: {"StragglerDetected", "Replanned", "Migrated"} <= set(world.reasons(job)) or None,
        20,
        "the re-plan's events",
        job=job,
    )

    # kubectl tells the story
    got = control_plane.kubectl("get", "mj", job, "-n", world.ns).stdout
    header, row = got.splitlines()[:2]
    assert header.split()[:6] == ["NAME", "PHASE", "PLAN", "STEP", "TOKENS/S", "STRAGGLERS"]
    cells = row.split()
    assert cells[0] == job and cells[1] in ("Running", "Replanning"), row
    assert int(cells[2]) >= after["plan"]["generation"] and int(cells[3]) > 0, row
    assert "r3" in row, row
    described = control_plane.kubectl("describe", "mj", job, "-n", world.ns).stdout
    head, events = described.split("Events:")
    assert "Plan:" in head and "Last Replan:" in head, head
    assert re.search(r"Summary:\s+\d+ pipelines? \[[0-9,x]+ stages?\] tp \d", head), head
    for reason in ("Created", "StragglerDetected", "Replanned", "Migrated"):
        assert reason in events, events
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})


def test_a_suspended_job_gives_its_pods_back_and_resumes(world: JobWorld, job: str) -> None:
    st = world.wait(training(world, job), 150, "Running", job=job)
    generation = st["plan"]["generation"]
    world.patch_spec(job, {"suspend": True})
    world.wait(lambda: world.in_phase(job, "Suspended"), 60, "Suspended", job=job)
    # the trainers stop when asked; their pods and the store go (the store would hold the resume)
    world.wait(lambda: exactly(0, world.children("pods", job)), 60, "no pods left", job=job)
    world.patch_spec(job, {"suspend": False})
    world.wait(lambda: exactly(2, world.workers(job)), 60, "two workers again", job=job)
    again = world.wait(training(world, job), 150, "Running again", job=job)
    assert again["plan"]["generation"] >= generation, again["plan"]  # never reset
    assert {"Suspended", "Resumed"} <= set(world.reasons(job)), world.reasons(job)


def test_a_deleted_job_is_collected_with_the_operator_running(world: JobWorld, job: str) -> None:
    pids = [pid for k in world.kubelets for p in list(k.pods.values()) for pid in p.pids()]
    assert pids
    assert not (world.job(job) or {})["metadata"].get("finalizers")  # nothing to do first
    assert world.http.delete(f"{world.url}/{job}").is_success
    world.wait(lambda: world.job(job) is None or None, 30, "the job gone", job=job, running=False)
    for plural in ("pods", "services", "configmaps", "secrets"):
        world.wait(
            lambda p=plural: not world.children(p, job) or None,
            60,
            f"the job's {plural} collected",
            job=job,
            running=False,
        )
    world.wait(
        lambda: all(not p.pids() for k in world.kubelets for p in list(k.pods.values())) or None,
        60,
        "the trainer processes gone",
        job=job,
        running=False,
    )


def test_a_job_is_deleted_and_collected_with_no_operator_running(
    world: JobWorld, control_plane: ControlPlane
) -> None:
    name = "e2e-orphan"
    world.create(manifest(name, nodes=1))
    world.wait(lambda: exactly(1, world.workers(name)), 60, "its worker", job=name)
    world.operator.stop()
    # kubectl delete waits for the job to be gone: no finalizer may hold it with no operator
    control_plane.kubectl("delete", "mj", name, "-n", world.ns, "--timeout=30s")
    assert world.job(name) is None
    for plural in ("pods", "services", "configmaps", "secrets"):
        world.wait(
            lambda p=plural: not world.children(p, name) or None,
            60,
            f"the job's {plural} collected by the garbage collector",
            job=name,
            running=False,
        )
    world.operator.start()  # the module's teardown stops it again
