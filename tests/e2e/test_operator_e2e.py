"""The operator end to end: kopf, a real API server, and trainers that really train.

``python -m malleus.operator`` (the real handlers, standalone, watching a namespace of its own)
runs against the test cluster (``tests/k8s``: the real API server for MalleusJobs behind a proxy
that emulates the core API), and `LocalKubelet` (``tests/e2e/pods.py``) runs the worker Pods it
creates as local trainer processes (2 nodes x 2 emulated GPUs, tp 2). A job applied with kubectl
is planned, its pods run and the status follows the training; a slowdown injected through the
coordinator's ``POST /inject`` is detected, re-planned around and migrated in place; ``kubectl
get`` and ``describe`` tell the story; deleting the job removes its pods and their processes.
A job the schema accepts but the operator cannot run fails with nothing created.

Needs ``MALLEUS_K8S_ASSETS`` (etcd + apiextensions-apiserver) and kubectl (``MALLEUS_KUBECTL``
or PATH); skips without them. 25-40 s on a loaded 2-core machine.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import yaml

from malleus.control import ControlClient, ControlError, ControlTLS
from tests.e2e.pods import LocalKubelet, listen_port
from tests.k8s.apiserver import ApiServerError, wait_until

if TYPE_CHECKING:
    from tests.k8s.proxy import ClusterProxy

pytestmark = pytest.mark.timeout(300)

_T = TypeVar("_T")

JOB = "e2e-tiny"
STRAGGLER = 3  # global rank: node 1, local GPU 1
FACTOR = 4.0


# ---- the operator process -------------------------------------------------------------------


class Operator:
    """``python -m malleus.operator`` in a subprocess of its own, logging to a file."""

    def __init__(self, cluster: ClusterProxy, namespace: str, log: Path) -> None:
        self.log = log
        # The test cluster serves no policy/v1 either: no PodDisruptionBudgets.
        env = {**cluster.env(), "PYTHONUNBUFFERED": "1", "MALLEUS_OPERATOR_DISRUPTION_BUDGETS": "0"}
        args = [
            *("--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace),
            *("--liveness", "", "--metrics-port", "0", "--ack-timeout", "60"),
            # The test cluster serves the core API only (no networking.k8s.io).
            "--no-network-policies",
            # Every pod runs on 127.0.0.1; node 0 keeps the control port of its manifest and
            # serves HTTPS, verified for its stable DNS name (which does not resolve here).
            *("--endpoint-template", "https://{pod_ip}:{port}"),
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

    def dead(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"the operator exited with {code}:\n{self.tail()}"

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (kopf stops its daemons), SIGKILL after 15 s."""
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            if self.process.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait)


# ---- fixtures -------------------------------------------------------------------------------


def _kubectl_binary() -> str:
    found = os.environ.get("MALLEUS_KUBECTL") or shutil.which("kubectl")
    if not found:
        pytest.skip(
            "kubectl not found: set MALLEUS_KUBECTL (scripts/helm-bin.sh DEST puts one there)"
        )
    return found


@pytest.fixture(scope="module")
def namespace() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def kubectl(k8s_cluster: ClusterProxy) -> Callable[..., str]:
    """``kubectl(*args)`` against the test cluster; its stdout, or an assertion error."""
    binary = _kubectl_binary()

    def run(*args: str) -> str:
        done = subprocess.run(
            [binary, *args],
            env=k8s_cluster.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    return run


@pytest.fixture(scope="module")
def kubelet(
    k8s_cluster: ClusterProxy, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalKubelet]:
    """Runs the namespace's pods as local processes; kills them all at the end, come what may."""
    with LocalKubelet(k8s_cluster.core, namespace, tmp_path_factory.mktemp("pods")) as node:
        yield node


@pytest.fixture(scope="module")
def operator(
    k8s_cluster: ClusterProxy,
    malleus_crd: dict[str, Any],
    kubectl: Callable[..., str],
    namespace: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Operator]:
    """The operator, watching only ``namespace``; stopped at the end of the module."""
    k8s_cluster.core.create("namespaces", "", {"metadata": {"name": namespace}})
    op = Operator(k8s_cluster, namespace, tmp_path_factory.mktemp("operator") / "operator.log")
    try:
        yield op
    finally:
        op.stop()


# ---- helpers --------------------------------------------------------------------------------


def _manifest(name: str, control_port: int, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": name},
        "spec": {
            "image": "malleus:e2e",
            "nodes": 2,
            "gpusPerNode": 2,
            "model": {"preset": "tiny", "layers": 4},
            "training": {
                "globalBatchSize": 4,
                "microBatchSize": 1,
                "steps": 400,  # far more than the test needs: the job still runs at the end
                "learningRate": 0.003,
            },
            "parallelism": {"tp": 2},
            "stragglerPolicy": {"windowSteps": 3, "cooldownSeconds": 0},
            "metrics": {"scrapeIntervalSeconds": 1},
            "controlPort": control_port,
            "emulation": {"enabled": True, "layerForwardMs": 10, "layerBackwardMs": 20},
        },
    }
    body["spec"].update(spec)
    return body


class Cluster:
    """Reads of the job and its children, and waits that fail with the whole story."""

    def __init__(
        self, cluster: ClusterProxy, namespace: str, operator: Operator, kubelet: LocalKubelet
    ) -> None:
        self.cluster, self.ns, self.operator, self.kubelet = cluster, namespace, operator, kubelet
        self.url = f"/apis/malleus.io/v1alpha1/namespaces/{namespace}/malleusjobs"

    def job(self, name: str) -> dict[str, Any] | None:
        got = self.cluster.apiserver.client.get(f"{self.url}/{name}")
        if got.status_code == 404:
            return None
        assert got.status_code == 200, got.text
        body: dict[str, Any] = got.json()
        return body

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def in_phase(self, name: str, phase: str) -> dict[str, Any] | None:
        """The job's status once it is in ``phase``, else None."""
        status = self.status(name)
        return status if status.get("phase") == phase else None

    def children(self, plural: str, name: str) -> list[dict[str, Any]]:
        return self.cluster.core.list(plural, self.ns, label_selector=f"malleus.io/job={name}")

    def workers(self, name: str) -> list[dict[str, Any]]:
        """The job's worker pods (not its store)."""
        return [
            p
            for p in self.children("pods", name)
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
        ]

    def events(self, name: str) -> list[dict[str, Any]]:
        return self.cluster.core.list(
            "events", self.ns, field_selector=f"involvedObject.name={name}"
        )

    def reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in self.events(name)]

    def wait(
        self,
        probe: Callable[[], _T | None],
        timeout: float,
        what: str,
        *,
        job: str = JOB,
        running: bool = True,
    ) -> _T:
        """Poll ``probe`` every 0.2 s until it is not None; fail with ``job``'s story at the
        deadline, or at once when the operator or the kubelet failed (or, with ``running``,
        when ``job`` went Failed)."""

        def alive() -> str | None:
            dead = self.operator.dead() or self.kubelet.check()
            if dead is None and running and self.in_phase(job, "Failed"):
                dead = f"job {job} Failed"
            return dead

        try:
            return wait_until(probe, timeout, what, interval=0.2, alive=alive)
        except ApiServerError as e:
            pytest.fail(self.story(str(e), job), pytrace=False)

    def story(self, headline: str, name: str = JOB) -> str:
        status = json.dumps(self.status(name), indent=1, sort_keys=True)[:4000]
        return (
            f"{headline}\n--- job status\n{status}\n--- events {self.reasons(name)}\n"
            f"--- operator log\n{self.operator.tail()}\n--- pods\n{self.kubelet.logs(15)}"
        )


def _exactly(n: int, items: list[_T]) -> list[_T] | None:
    return items if len(items) == n else None


# ---- tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(
    k8s_cluster: ClusterProxy, namespace: str, operator: Operator, kubelet: LocalKubelet
) -> Cluster:
    return Cluster(k8s_cluster, namespace, operator, kubelet)


def test_a_spec_the_schema_accepts_but_no_layout_fits_fails_with_nothing_created(
    world: Cluster, kubectl: Callable[..., str], tmp_path: Path
) -> None:
    # llama-70b on two 1 GiB GPUs: schema-valid, but no layout fits (the planner is the judge).
    name = "e2e-too-big"
    body = _manifest(
        name,
        listen_port(),
        model={"preset": "llama-70b"},
        resources={"gpuMemoryMiB": 1024},
    )
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    kubectl("apply", "--validate=false", "-n", world.ns, "-f", str(path))

    status = world.wait(
        lambda: world.in_phase(name, "Failed"), 60, f"{name} Failed", job=name, running=False
    )
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec", ready
    assert "no parallel layout" in ready["message"], ready
    world.wait(
        lambda: "InvalidSpec" in world.reasons(name) or None,
        20,
        "InvalidSpec event",
        job=name,
        running=False,
    )
    # on.create fails before creating anything, and the status is written after it returns.
    for plural in ("pods", "services", "configmaps", "secrets"):
        assert not world.children(plural, name), plural
    kubectl("delete", "mj", name, "-n", world.ns, "--wait=false")
    world.wait(
        lambda: world.job(name) is None or None, 30, f"{name} deleted", job=name, running=False
    )


def test_a_job_runs_replans_around_a_straggler_and_is_deleted(
    world: Cluster, kubectl: Callable[..., str], kubelet: LocalKubelet, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    ns, store = world.ns, world.cluster.core
    port = listen_port()
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_manifest(JOB, port)))
    kubectl("apply", "--validate=false", "-n", ns, "-f", str(path))

    # Created: Service, ConfigMap (plan + manifest), Secret, two pods running torchrun.
    pods = world.wait(lambda: _exactly(2, world.workers(JOB)), 60, "two pods")
    job = world.job(JOB)
    assert job is not None
    uid = job["metadata"]["uid"]
    for child in pods:
        owner = child["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "MalleusJob" and owner["uid"] == uid
        command = child["spec"]["containers"][0]["command"]
        # torchrun launches the pod's own ranks; they meet in the job's store pod
        assert command[0] == "torchrun" and "--nnodes=1" in command
    assert world.children("pods", JOB) != pods  # + the store
    assert world.children("services", JOB) and world.children("configmaps", JOB)
    secret = store.get("secrets", ns, f"{JOB}-control")
    token = base64.b64decode(secret["data"]["token"]).decode()

    # Running: the operator scrapes the coordinator; step and tokens/s advance.
    def training() -> dict[str, Any] | None:
        st = world.status(JOB)
        ok = st.get("phase") == "Running" and st.get("step", 0) >= 3 and st.get("tokensPerSecond")
        return st if ok else None

    running = world.wait(training, 120, "phase Running with steps and tokens/s")
    timings["running"] = time.monotonic() - t0
    created = [e["message"] for e in world.events(JOB) if e["reason"] == "Created"]
    assert created and "plan generation 1:" in created[0], created
    for pod in world.workers(JOB):
        assert pod["status"]["phase"] == "Running"
    first_step, first_generation = running["step"], running["plan"]["generation"]
    served = kubelet.control_url(f"{JOB}-node-0")
    assert served == f"http://127.0.0.1:{port}"  # where the operator's template points
    coordinator = served.replace("http:", "https:", 1)  # the Secret's certificate, mounted
    ca = base64.b64decode(secret["data"]["ca.crt"]).decode()
    trust = ControlTLS(ca, server_name=f"{JOB}-node-0.{JOB}.{ns}.svc")

    # A straggler: writes need the Secret's token, and a client that trusts the job's CA.
    with ControlClient(coordinator, token) as client, pytest.raises(ControlError) as e:
        client.inject(STRAGGLER, FACTOR)
    assert e.value.code is None and "CERTIFICATE_VERIFY_FAILED" in str(e.value)
    for refused in (None, "wrong"):
        with (
            ControlClient(coordinator, refused, tls=trust) as client,
            pytest.raises(ControlError) as e,
        ):
            client.inject(STRAGGLER, FACTOR)
        assert e.value.code == 401
    with ControlClient(coordinator, token, tls=trust) as client:
        client.inject(STRAGGLER, FACTOR)

    def replanned() -> dict[str, Any] | None:
        """The status once a plan made for the straggler that moved state is in force. Not
        necessarily the first re-plan: one decided while the straggler's measured rate was
        still climbing can re-split micro-batches only (0 bytes, seen once in CI on a loaded
        machine); the next, at its full rate, regroups it."""
        st = world.status(JOB)
        generation = (st.get("plan") or {}).get("generation", 0)
        last = st.get("lastReplan") or {}
        ours = f"rank {STRAGGLER}" in str(last.get("reason"))
        moved = (last.get("migrationBytes") or 0) > 0
        return (
            st
            if generation > first_generation
            and last.get("generation") == generation
            and ours
            and moved
            else None
        )

    after = world.wait(replanned, 90, f"a new plan in force around rank {STRAGGLER}")
    timings["replanned"] = time.monotonic() - t0
    assert STRAGGLER in [s["rank"] for s in after["stragglers"]], world.story("no straggler")
    assert after["stragglerSummary"].startswith("1 (r3 "), after["stragglerSummary"]
    last = after["lastReplan"]
    assert last["planningSeconds"] >= 0 and last["migrationSeconds"] >= 0, last
    assert last["migrationBytes"] > 0, last
    conditions = {c["type"]: c for c in after["conditions"]}
    assert conditions["Straggling"]["status"] == "True", conditions
    assert conditions["Ready"]["status"] == "True", conditions
    generation = after["plan"]["generation"]
    # The trainers run that plan (their own word), the ConfigMap holds it, training goes on.
    with ControlClient(coordinator, token, tls=trust) as client:
        coord = client.status()
    assert coord.generation >= generation, coord
    cm = store.get("configmaps", ns, f"{JOB}-config")
    assert json.loads(cm["data"]["plan.json"])["generation"] >= generation
    world.wait(
        lambda: world.status(JOB).get("step", 0) > max(after["step"], first_step) + 2 or None,
        60,
        "steps under the new plan",
    )
    world.wait(
        lambda: {"StragglerDetected", "Replanned", "Migrated"} <= set(world.reasons(JOB)) or None,
        20,
        "the re-plan's events",
    )
    assert {"Created", "Running"} <= set(world.reasons(JOB))

    # kubectl tells the story.
    header, row = kubectl("get", "mj", JOB, "-n", ns).splitlines()[:2]
    assert header.split()[:6] == ["NAME", "PHASE", "PLAN", "STEP", "TOKENS/S", "STRAGGLERS"]
    cells = row.split()
    assert cells[0] == JOB and cells[1] in ("Running", "Replanning"), row
    assert int(cells[2]) >= generation and int(cells[3]) > 0 and float(cells[4]) > 0, row
    assert "r3" in row, row
    described = kubectl("describe", "mj", JOB, "-n", ns)
    head, events = described.split("Events:")
    assert "Plan:" in head and "Last Replan:" in head, head
    # The plan in brief (one line), never a list per stage: the whole plan is the ConfigMap's.
    assert re.search(r"Summary:\s+\d+ pipelines? \[[0-9,x]+ stages?\] tp \d", head), head
    assert "Pipelines:" not in head and "Ranks:" not in head, head
    wide_header, wide_row = kubectl("get", "mj", JOB, "-n", ns, "-o", "wide").splitlines()[:2]
    assert wide_header.split()[-2:] == ["LAYOUT", "AGE"], wide_header
    assert re.search(r"\d+ pipelines? \[", wide_row), wide_row
    assert "Migration Bytes:" in head and "Planning Seconds:" in head, head
    for reason in ("Created", "StragglerDetected", "Replanned", "Migrated"):
        assert reason in events, events
    timings["described"] = time.monotonic() - t0

    # Deleting the job deletes its pods; the kubelet kills their processes.
    started = kubelet.started()
    assert len(started) == 5  # 2 pods x 2 ranks, and the store
    kubectl("delete", "mj", JOB, "-n", ns, "--wait=false")
    world.wait(lambda: world.job(JOB) is None or None, 60, "the job deleted", running=False)
    world.wait(
        lambda: not world.children("pods", JOB) or None, 30, "the pods deleted", running=False
    )
    world.wait(
        lambda: not kubelet.processes() or None, 30, "the trainer processes gone", running=False
    )
    for plural in ("services", "configmaps", "secrets"):
        assert not world.children(plural, JOB), plural
    timings["deleted"] = time.monotonic() - t0
    print("timings (s from kubectl apply):", {k: round(v, 1) for k, v in timings.items()})
