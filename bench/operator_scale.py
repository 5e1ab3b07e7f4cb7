"""Operator at scale: what a large job and many concurrent jobs cost the operator (issue 31).

On the real control plane of the tests (`tests.cluster.controlplane`: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler from ``MALLEUS_K8S_ASSETS``) with kwok nodes (Ready,
Leases, pods Running with a pod IP from a 127.X.0.0/16 claimed per run: loopback only), the operator
runs as ``python -m malleus.operator`` with the Helm chart's ServiceAccount
(`tests.cluster.operating.Operator`, endpoint template ``https://{pod_ip}:{port}``). Nothing
runs in kwok's pods, so a stub answers for every worker pod on its pod IP and control port
(one asyncio loop in a thread of this process): TLS with that worker's own certificate and key
from the job's Secret (``tls-<i>.crt``/``tls-<i>.key``, what the operator verifies for the
worker's stable DNS name), the job's bearer token checked; ``GET /status`` (a
`malleus.control.ControlStatus`), ``GET /metrics`` (the trainer's series: step, step seconds,
plan generation, one straggling rate per rank with ``node_rank``), ``GET /plan`` (the
ConfigMap's plan, then the last one posted) and ``POST /plan`` (202, applied at the next step
boundary: ``/status`` then reports the new generation and a migration record). A step
completes every ``--step-seconds``.

Measured, per run: time from create to phase ``Running`` and to ``Ready=True`` per job; the
re-plan latency once one rank of every job reports a straggling rate (onset to the operator's
``POST /plan``, to the switch, to the job's status showing the new generation); the operator's
CPU (its process and its planner children, from /proc) and memory (RSS) while jobs start and
while they run steadily; the API requests the operator made (the API server's audit log,
filtered to the operator's ServiceAccount) per minute, by verb, and all clients' requests
(``apiserver_request_total`` summed). Writes a JSON result and prints a table.

    MALLEUS_K8S_ASSETS=DIR MALLEUS_HELM=helm python bench/operator_scale.py \\
        --job-nodes 64 --gpus-per-node 8 --jobs 1 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import json
import os
import platform
import re
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's tests package is the harness
    sys.path.insert(0, str(ROOT))

from malleus.control import JOB_METRICS_PATH, ControlStatus, MigrationRecord  # noqa: E402
from malleus.operator.identity import (  # noqa: E402
    configmap_name,
    secret_name,
)
from malleus.operator.resources import PLAN_KEY, TOKEN_KEY  # noqa: E402
from malleus.operator.tls import worker_cert_key, worker_key_key  # noqa: E402
from tests.cluster.controlplane import ControlPlane, assets_dir, wait_until  # noqa: E402
from tests.cluster.fixtures import CRD_FILE, AdminApi, apply_chart_rbac  # noqa: E402
from tests.cluster.operating import ACCOUNT, OPERATOR_NS, Operator, token_kubeconfig  # noqa: E402

__all__ = ["Kwok", "Scale", "StubFleet", "main", "run"]

KWOK_RANGES = range(100, 228)
"""kwok's pod IPs come from one 127.X.0.0/16 of these (loopback: the stubs can bind them and
nothing leaves the machine), claimed per run (`claim_cidr`)."""
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NS}:{ACCOUNT}"
CONTROL_PORT = 29600
STRAGGLER_RATE = 4.0
_LOOPBACK = re.compile(r"^127\.\d+\.\d+\.\d+$")
_PLANNED = re.compile(r"planned in ([0-9.]+) s")


# -- kwok ------------------------------------------------------------------------------------


def claim_cidr() -> tuple[str, socket.socket]:
    """A 127.X.0.0/16 no other run of this bench uses now, and the socket that holds it: two
    runs at once (a test of the bench beside a benchmark run) with one range would bind each
    other's pod IPs, and one's operator would call the other's stubs. The claim is a listening
    socket on the range's last address, given up when the run ends (or its process dies)."""
    for x in KWOK_RANGES:
        claim = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            claim.bind((f"127.{x}.255.254", CONTROL_PORT))
            claim.listen(1)
        except OSError:
            claim.close()
            continue
        return f"127.{x}.0.0/16", claim
    raise RuntimeError(f"every 127.X.0.0/16 for X in {KWOK_RANGES} is taken by another run")


class Kwok:
    """kwok managing the nodes annotated ``kwok.x-k8s.io/node: fake`` (stages from shared/k8s),
    its pods' IPs from ``cidr``."""

    def __init__(self, binary: Path, stages: Path, kubeconfig: Path, log: Path, cidr: str) -> None:
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    str(binary),
                    *("--kubeconfig", str(kubeconfig), "--config", str(stages)),
                    *("--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake"),
                    *("--node-lease-duration-seconds", "40", "--cidr", cidr),
                    *("--server-address", "127.0.0.1:0"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def dead(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"kwok exited with {code} (log {self.log})"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def kwok_node(name: str, gpus: int) -> dict[str, Any]:
    capacity = {"cpu": "256", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {"type": "kwok", "nvidia.com/gpu.product": "kwok-emulated"},
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def kwok_stages() -> Path | None:
    """kwok's stages: ``MALLEUS_KWOK_STAGES`` or shared/k8s/kwok/stages.yaml in a folder above
    the tree (its fast stages, and pods held by a finalizer terminated); None if neither."""
    named = os.environ.get("MALLEUS_KWOK_STAGES")
    candidates = [Path(named)] if named else []
    candidates += [p / "shared" / "k8s" / "kwok" / "stages.yaml" for p in ROOT.parents]
    return next((path for path in candidates if path.is_file()), None)


# -- the stubs -------------------------------------------------------------------------------


@dataclass
class JobStub:
    """What one job's trainers would report; shared by every pod of the job."""

    name: str
    nodes: int
    gpus_per_node: int
    token: str
    step_seconds: float
    plan: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    generation: int = 0
    pending: dict[str, Any] | None = None
    pending_at_step: int = 0
    migration: MigrationRecord | None = None
    straggler_rank: int | None = None
    straggler_since: float | None = None
    posted_at: list[float] = field(default_factory=list)
    applied_at: list[float] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def step(self) -> int:
        """Steps completed; a posted plan is taken at the first step boundary after its post."""
        step = int((time.monotonic() - self.started) / self.step_seconds)
        if self.pending is not None and step > self.pending_at_step:
            self.plan, self.pending = self.pending, None
            self.generation = int(self.plan["generation"])
            self.migration = MigrationRecord(
                generation=self.generation, step=step, seconds=0.05, bytes=0
            )
            self.applied_at.append(time.monotonic())
        return step

    def rates(self) -> dict[int, float]:
        rates = dict.fromkeys(range(self.world), 1.0)
        if self.straggler_rank is not None:
            rates[self.straggler_rank] = STRAGGLER_RATE
        return rates

    def status(self) -> bytes:
        step = self.step()
        return (
            ControlStatus(
                job=self.name,
                world=self.world,
                generation=self.generation,
                pending_generation=None if self.pending is None else self.pending["generation"],
                step=step,
                steps=1_000_000,
                done=False,
                stopping=False,
                rates=dict(self.rates()),
                step_seconds=self.step_seconds,
                tokens_per_second=1000.0 / self.step_seconds,
                last_migration=self.migration,
                last_failure=None,
            )
            .model_dump_json()
            .encode()
        )

    def metrics(self) -> bytes:
        step = self.step()
        j = f'malleus_job="{self.name}"'
        lines = [
            "# TYPE malleus_step gauge",
            f"malleus_step{{{j}}} {step}",
            "# TYPE malleus_step_seconds gauge",
            f"malleus_step_seconds{{{j}}} {self.step_seconds}",
            "# TYPE malleus_plan_generation gauge",
            f"malleus_plan_generation{{{j}}} {self.generation}",
            "# TYPE malleus_gpu_straggling_rate gauge",
        ]
        g = self.gpus_per_node
        lines += [
            f'malleus_gpu_straggling_rate{{{j},rank="{r}",node_rank="{r // g}",gpu="{r % g}",'
            f'node_name="kwok-{r // g}"}} {rate}'
            for r, rate in self.rates().items()
        ]
        return ("\n".join(lines) + "\n").encode()

    def post_plan(self, body: bytes) -> tuple[int, dict[str, Any]]:
        step = self.step()
        try:
            plan = json.loads(body)
            generation = int(plan["generation"])
        except (ValueError, KeyError, TypeError) as e:
            return 400, {"error": f"not a plan: {e}"}
        newest = self.generation if self.pending is None else int(self.pending["generation"])
        if generation <= newest:
            return 409, {"error": "stale", "generation": self.generation, "newest": newest}
        self.pending, self.pending_at_step = plan, step
        self.posted_at.append(time.monotonic())
        return 202, {"generation": generation}


class StubFleet:
    """One asyncio loop (in a thread) serving every worker pod's control port on its pod IP."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.jobs: dict[str, JobStub] = {}
        self.requests: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._servers: dict[tuple[str, int], asyncio.AbstractServer] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def serving(self) -> int:
        return len(self._servers)

    def serve(self, job: JobStub, index: int, ip: str, cert: str, key: str) -> None:
        """Answer for worker ``index`` of ``job`` on ``ip`` (loopback only) with its pair."""
        if not _LOOPBACK.match(ip):
            raise RuntimeError(f"refusing to bind {ip}: pod IPs must be loopback here")
        folder = self.workdir / "tls" / job.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.crt").write_text(cert)
        (folder / f"{index}.key").write_text(key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(folder / f"{index}.crt"), str(folder / f"{index}.key"))

        async def start() -> None:
            server = await asyncio.start_server(
                lambda r, w: self._connection(job, r, w), ip, CONTROL_PORT, ssl=context
            )
            self._servers[(ip, CONTROL_PORT)] = server

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    async def _connection(
        self, job: JobStub, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                length = int(headers.get("content-length", "0") or 0)
                body = await reader.readexactly(length) if length else b""
                code, payload, kind = self._answer(job, method, path, headers, body)
                self.requests[f"{method} {path}"] += 1
                writer.write(
                    f"HTTP/1.1 {code} X\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, ValueError):
            writer.close()
        except asyncio.CancelledError:  # the fleet stops: no goodbye to a peer still there
            writer.transport.abort()
            raise
        else:
            writer.close()

    def _answer(
        self, job: JobStub, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes, str]:
        as_json = "application/json"
        if path == "/healthz":
            return 200, b"ok", "text/plain"
        if headers.get("authorization") != f"Bearer {job.token}":
            self.refused[path] += 1
            return 401, b'{"error": "unauthorized"}', as_json
        if method == "GET" and path == "/status":
            return 200, job.status(), as_json
        if method == "GET" and path in ("/metrics", JOB_METRICS_PATH):  # every rank: enough
            return 200, job.metrics(), "text/plain; version=0.0.4"
        if method == "GET" and path == "/plan":
            return 200, json.dumps(job.plan).encode(), as_json
        if method == "POST" and path == "/plan":
            code, answer = job.post_plan(body)
            return code, json.dumps(answer).encode(), as_json
        return 404, b'{"error": "not found"}', as_json

    def stop(self) -> None:
        async def close() -> None:
            for server in self._servers.values():
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# -- measuring the operator ------------------------------------------------------------------


_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _proc_tree(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                text = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(text.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        tree += frontier
    return tree


def _usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of one process; (0, 0) once it is gone."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / _TICK
        return cpu, int(fields[21]) * _PAGE
    return 0.0, 0


class Sampler:
    """Samples the operator's process tree every ``interval`` s in a thread: CPU seconds of the
    tree (the live processes, the exited ones' last reading kept) and RSS of the operator
    process and of the tree."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, float, int, int]] = []
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss_main, rss_tree = 0, 0
            for pid in _proc_tree(self.pid):
                cpu, rss = _usage(pid)
                if rss:
                    self._last[pid] = cpu
                    rss_tree += rss
                    if pid == self.pid:
                        rss_main = rss
            self.samples.append((time.monotonic(), sum(self._last.values()), rss_main, rss_tree))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def window(self, start: float, end: float) -> dict[str, float]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, c0, _, _), (t1, c1, _, _) = inside[0], inside[-1]
        return {
            "seconds": round(t1 - t0, 1),
            "cpu_percent": round(100 * (c1 - c0) / max(t1 - t0, 1e-9), 1),
            "rss_mib_max": round(max(s[2] for s in inside) / 2**20, 1),
            "tree_rss_mib_max": round(max(s[3] for s in inside) / 2**20, 1),
        }


AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
- level: Metadata
  users: ["{OPERATOR_USER}"]
- level: None
"""


def audit_counts(log: Path, start: dt.datetime, end: dt.datetime) -> Counter[str]:
    """The operator's requests completed in [start, end), by ``verb resource``."""
    counts: Counter[str] = Counter()
    with contextlib.suppress(OSError), log.open() as lines:
        for line in lines:
            with contextlib.suppress(ValueError, KeyError):
                event = json.loads(line)
                at = dt.datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00"))
                if start <= at < end:
                    ref = event.get("objectRef") or {}
                    sub = "/" + ref["subresource"] if ref.get("subresource") else ""
                    counts[f"{event['verb']} {ref.get('resource', '?')}{sub}"] += 1
    return counts


def apiserver_requests(cluster: ControlPlane) -> float:
    """``apiserver_request_total`` summed over every label (every client)."""
    text = cluster.http().get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("apiserver_request_total{")
    )


# -- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """One run's load."""

    job_nodes: int = 64
    gpus_per_node: int = 8
    jobs: int = 1
    spare_nodes: int = 0
    step_seconds: float = 0.5
    steady_seconds: float = 30.0
    timeout: float = 600.0
    replan: bool = True
    replan_stall: float = 90.0


def job_manifest(name: str, scale: Scale) -> dict[str, Any]:
    world = scale.job_nodes * scale.gpus_per_node
    tp = min(scale.gpus_per_node, 8)
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": name, "namespace": OPERATOR_NS},
        "spec": {
            "image": "malleus:bench",
            "nodes": scale.job_nodes,
            "gpusPerNode": scale.gpus_per_node,
            "controlPort": CONTROL_PORT,
            "model": {"preset": "llama-7b"},
            "training": {
                "globalBatchSize": max(world // tp, 1) * 2,
                "microBatchSize": 1,
                "steps": 1_000_000,
                "learningRate": 0.001,
            },
            "parallelism": {"tp": tp},
            "metrics": {"scrapeIntervalSeconds": 1},
            "stragglerPolicy": {"windowSteps": 2, "cooldownSeconds": 5},
        },
    }


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _ready(status: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
        "min": round(min(values), 2),
    }


def run(scale: Scale, workdir: Path) -> dict[str, Any]:
    """Start everything, run the load, measure; the result as a dict (see the module doc)."""
    assets, reason = assets_dir()
    if assets is None:
        raise SystemExit(reason)
    if not os.access(assets / "kwok", os.X_OK):
        raise SystemExit(f"{assets} has no kwok (scripts/k8s-assets.sh unpacks it)")
    stages = kwok_stages()
    if stages is None:
        raise SystemExit("kwok's stages.yaml not found: set MALLEUS_KWOK_STAGES")
    audit_log = workdir / "audit.log"
    (workdir / "audit-policy.yaml").write_text(AUDIT_POLICY)
    result: dict[str, Any] = {
        "scale": scale.__dict__,
        "date": _utcnow().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": [round(x, 1) for x in os.getloadavg()],
        },
    }
    began = time.monotonic()
    cluster = ControlPlane(
        assets,
        workdir / "cluster",
        extra_apiserver_args=[
            *("--audit-policy-file", str(workdir / "audit-policy.yaml")),
            *("--audit-log-path", str(audit_log), "--audit-log-mode", "batch"),
        ],
    )
    stoppers: list[Any] = [cluster.stop]
    try:
        _say("starting the control plane")
        cluster.start()
        result["control_plane_start_s"] = round(cluster.start_seconds, 1)
        AdminApi(cluster).apply_crd(yaml.safe_load(CRD_FILE.read_text()))
        apply_chart_rbac(cluster)
        cidr, claim = claim_cidr()
        stoppers.append(claim.close)
        result["pod_cidr"] = cidr
        kwok = Kwok(assets / "kwok", stages, cluster.admin, workdir / "kwok.log", cidr)
        stoppers.append(kwok.stop)
        total_nodes = scale.job_nodes * scale.jobs + scale.spare_nodes + 1  # 1: the warm-up
        _say(f"creating {total_nodes} kwok nodes of {scale.gpus_per_node} GPUs")
        http = cluster.http()
        for i in range(total_nodes):
            made = http.post("/api/v1/nodes", json=kwok_node(f"kwok-{i}", scale.gpus_per_node))
            if made.status_code not in (201, 409):
                raise RuntimeError(f"node kwok-{i}: {made.status_code} {made.text}")

        def nodes_ready() -> bool | None:
            items = http.get("/api/v1/nodes", params={"labelSelector": "type=kwok"}).json()
            ready = sum(
                any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in n["status"].get("conditions") or []
                )
                for n in items["items"]
            )
            return True if ready == total_nodes else None

        wait_until(nodes_ready, 120, "kwok nodes Ready", interval=0.5, alive=kwok.dead)
        fleet = StubFleet(workdir)
        stoppers.append(fleet.stop)  # after the operator: its connections end first
        kubeconfig = token_kubeconfig(cluster, workdir / "operator.kubeconfig")
        operator = Operator(kubeconfig, OPERATOR_NS, workdir / "operator.log")
        stoppers.append(operator.stop)
        assert operator.process is not None
        sampler = Sampler(operator.process.pid)
        stoppers.append(sampler.stop)
        jobs_url = f"/apis/malleus.io/v1alpha1/namespaces/{OPERATOR_NS}/malleusjobs"
        _warm_up(http, jobs_url, operator, scale)
        result["setup_s"] = round(time.monotonic() - began, 1)

        names = [f"scale-{k}" for k in range(scale.jobs)]
        api_before = apiserver_requests(cluster)
        created_wall = _utcnow()
        t0 = time.monotonic()
        _say(f"creating {scale.jobs} job(s) of {scale.job_nodes} x {scale.gpus_per_node} GPUs")
        created: dict[str, float] = {}
        for name in names:
            made = http.post(jobs_url, json=job_manifest(name, scale))
            if made.status_code != 201:
                raise RuntimeError(f"job {name}: {made.status_code} {made.text}")
            created[name] = time.monotonic()
        running: dict[str, float] = {}
        ready: dict[str, float] = {}
        stubs: dict[str, JobStub] = {}
        served: set[tuple[str, int]] = set()
        deadline = t0 + scale.timeout
        last_report = 0.0
        while len(ready) < len(names) and time.monotonic() < deadline:
            if dead := operator.dead() or kwok.dead() or cluster.dead():
                raise RuntimeError(dead)
            listed = http.get(jobs_url).json()["items"]
            pods = http.get(
                f"/api/v1/namespaces/{OPERATOR_NS}/pods",
                params={"labelSelector": "app.kubernetes.io/component=worker"},
            ).json()["items"]
            now = time.monotonic()
            for job in listed:
                name, st = job["metadata"]["name"], job.get("status") or {}
                if st.get("phase") in ("Running", "Replanning") and name not in running:
                    running[name] = now - created[name]
                if _ready(st) and name not in ready:
                    ready[name] = now - created[name]
            secrets: dict[str, dict[str, str]] = {}
            for pod in pods:
                meta, st = pod["metadata"], pod.get("status") or {}
                job_name = meta["labels"].get("malleus.io/job", "")
                ip = st.get("podIP") or ""
                if st.get("phase") != "Running" or not ip or job_name not in created:
                    continue
                index = int(meta["name"].rsplit("-", 1)[1])
                if (job_name, index) in served:
                    continue
                stub = stubs.get(job_name) or _job_stub(http, job_name, scale)
                if stub is None:
                    continue
                stubs[job_name] = stub
                fleet.jobs[job_name] = stub
                if job_name not in secrets:  # once a sweep: it holds every worker's pair
                    secrets[job_name] = http.get(
                        f"/api/v1/namespaces/{OPERATOR_NS}/secrets/{secret_name(job_name)}"
                    ).json()["data"]
                secret = secrets[job_name]
                cert = base64.b64decode(secret[worker_cert_key(index)]).decode()
                key = base64.b64decode(secret[worker_key_key(index)]).decode()
                fleet.serve(stub, index, ip, cert, key)
                served.add((job_name, index))
            if now - last_report > 10:
                last_report = now
                _say(
                    f"{now - t0:5.0f} s: {len(running)}/{len(names)} Running, "
                    f"{len(ready)}/{len(names)} Ready, {fleet.serving()} stubs serving"
                )
            time.sleep(0.5)
        t_started = time.monotonic()
        started_wall = _utcnow()
        result["startup"] = {
            "seconds": round(t_started - t0, 1),
            "running_s": _stats(list(running.values())),
            "ready_s": _stats(list(ready.values())),
            "jobs_running": len(running),
            "jobs_ready": len(ready),
            "operator": sampler.window(t0, t_started),
        }
        if len(ready) < len(names):
            result["broke"] = (
                f"only {len(running)} of {len(names)} jobs Running and {len(ready)} Ready "
                f"after {scale.timeout:.0f} s"
            )
        _say(f"steady state for {scale.steady_seconds:.0f} s")
        time.sleep(scale.steady_seconds)
        t_steady = time.monotonic()
        steady_wall = _utcnow()
        result["steady"] = {"operator": sampler.window(t_started, t_steady)}
        api_steady = apiserver_requests(cluster)
        if scale.replan and stubs:
            result["replan"] = _replan(http, jobs_url, stubs, scale, operator)
        t_end = time.monotonic()
        end_wall = _utcnow()
        result["replan_operator"] = sampler.window(t_steady, t_end)
        result["operator_rss_mib_max"] = round(max(s[2] for s in sampler.samples) / 2**20, 1)
        result["operator_tree_rss_mib_max"] = round(max(s[3] for s in sampler.samples) / 2**20, 1)
        time.sleep(3)  # the audit log is written in batches
        windows = {
            "startup": (created_wall, started_wall),
            "steady": (started_wall, steady_wall),
            "replan": (steady_wall, end_wall),
        }
        api: dict[str, Any] = {}
        for label, (a, b) in windows.items():
            counts = audit_counts(audit_log, a, b)
            minutes = max((b - a).total_seconds(), 1e-9) / 60
            api[label] = {
                "operator_requests": sum(counts.values()),
                "operator_per_minute": round(sum(counts.values()) / minutes, 1),
                "top": dict(counts.most_common(6)),
            }
        steady_minutes = max((steady_wall - started_wall).total_seconds(), 1e-9) / 60
        api["all_clients_per_minute_startup"] = round(
            (api_steady - api_before) / max((t_steady - t0) / 60, 1e-9), 1
        )
        api["steady"]["minutes"] = round(steady_minutes, 2)
        result["api"] = api
        result["stub_requests"] = dict(fleet.requests.most_common())
        result["stub_refused"] = dict(fleet.refused)
        log = operator.log.read_text(errors="replace")
        result["operator_log"] = {
            "tracebacks": log.count("Traceback"),
            "errors": sum(" ERROR " in line or "[ERROR" in line for line in log.splitlines()),
            "warnings": sum("[WARNING" in line for line in log.splitlines()),
            "lines": log.count("\n"),
            # the decision loop's own account: how long each plan took (a planner slot's wait
            # included) and how many re-plans it judged not worth their cost
            "planned_s": _stats([float(x) for x in _PLANNED.findall(log)]),
            "replans_published": log.count("Replanned at step"),
            "replans_skipped": log.count("ReplanSkipped at step"),
        }
        result["machine"]["load_after"] = [round(x, 1) for x in os.getloadavg()]
        return result
    finally:
        for stop in reversed(stoppers):
            with contextlib.suppress(Exception):
                stop()


def _warm_up(http: Any, jobs_url: str, operator: Operator, scale: Scale) -> None:
    """One 1-node job to Running and deleted, so the measured jobs meet an operator that has
    started (kopf's first watch, its planner processes), as a long-running one would be."""
    _say("warming the operator up with a 1-node job")
    warm = job_manifest("warm-up", Scale(job_nodes=1, gpus_per_node=scale.gpus_per_node))
    made = http.post(jobs_url, json=warm)
    if made.status_code != 201:
        raise RuntimeError(f"warm-up job: {made.status_code} {made.text}")

    def running() -> bool | None:
        st = http.get(f"{jobs_url}/warm-up").json().get("status") or {}
        return True if st.get("phase") == "Running" else None

    wait_until(running, scale.timeout, "the warm-up job Running", 0.5, alive=operator.dead)
    http.delete(f"{jobs_url}/warm-up")
    wait_until(
        lambda: True if http.get(f"{jobs_url}/warm-up").status_code == 404 else None,
        scale.timeout,
        "the warm-up job deleted",
        0.5,
        alive=operator.dead,
    )


def _job_stub(http: Any, name: str, scale: Scale) -> JobStub | None:
    """The job's stub once its Secret and ConfigMap exist (the plan in force, the token)."""
    cm = http.get(f"/api/v1/namespaces/{OPERATOR_NS}/configmaps/{configmap_name(name)}")
    secret = http.get(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/{secret_name(name)}")
    if cm.status_code != 200 or secret.status_code != 200:
        return None
    plan = json.loads(cm.json()["data"][PLAN_KEY])
    token = base64.b64decode(secret.json()["data"][TOKEN_KEY]).decode()
    stub = JobStub(name, scale.job_nodes, scale.gpus_per_node, token, scale.step_seconds, plan=plan)
    stub.generation = int(plan["generation"])
    return stub


def _replan(
    http: Any, jobs_url: str, stubs: dict[str, JobStub], scale: Scale, operator: Operator
) -> dict[str, Any]:
    """One rank of every job turns straggler at once; seconds to the operator's POST /plan, to
    the switch and to the job status showing the new generation."""
    _say(f"rank 3 of {len(stubs)} job(s) reports a straggling rate of {STRAGGLER_RATE}")
    before = {name: stub.generation for name, stub in stubs.items()}
    onset = time.monotonic()
    for stub in stubs.values():
        stub.straggler_rank, stub.straggler_since = 3, onset
    shown: dict[str, float] = {}
    deadline = onset + scale.timeout
    progress = onset  # the last new post or status: a re-plan skipped is not tried again
    while len(shown) < len(stubs) and time.monotonic() < deadline:
        if dead := operator.dead():
            raise RuntimeError(dead)
        for job in http.get(jobs_url).json()["items"]:
            name, st = job["metadata"]["name"], job.get("status") or {}
            generation = (st.get("plan") or {}).get("generation") or 0
            if name in before and generation > before[name] and name not in shown:
                shown[name] = time.monotonic() - onset
                progress = time.monotonic()
        progress = max([progress, *(s.posted_at[-1] for s in stubs.values() if s.posted_at)])
        if time.monotonic() - progress > scale.replan_stall:
            _say(f"no re-plan for {scale.replan_stall:.0f} s: {len(shown)}/{len(stubs)} done")
            break
        time.sleep(0.25)
    posted = [s.posted_at[0] - onset for s in stubs.values() if s.posted_at]
    applied = [s.applied_at[0] - onset for s in stubs.values() if s.applied_at]
    out = {
        "to_post_s": _stats(posted),
        "to_switch_s": _stats(applied),
        "to_status_s": _stats(list(shown.values())),
        "replanned_jobs": len(shown),
        "window": f"windowSteps 2 at one step per {scale.step_seconds} s, scrape every 1 s",
    }
    _say(f"re-planned {len(shown)}/{len(stubs)}: {json.dumps(out)}")
    return out


def table(result: dict[str, Any]) -> str:
    s = result["scale"]
    st, rp = result.get("startup", {}), result.get("replan", {})
    api = result.get("api", {})

    def fig(d: dict[str, Any], key: str = "median") -> str:
        return f"{d[key]}" if d else "-"

    rows = [
        ("load", f"{s['jobs']} job(s) x {s['job_nodes']} nodes x {s['gpus_per_node']} GPUs"),
        ("time to Running (median / max s)", f"{fig(st.get('running_s', {}))} / "
         f"{fig(st.get('running_s', {}), 'max')}"),
        ("time to Ready (median / max s)", f"{fig(st.get('ready_s', {}))} / "
         f"{fig(st.get('ready_s', {}), 'max')}"),
        ("re-plan: onset to POST /plan (median / max s)", f"{fig(rp.get('to_post_s', {}))} / "
         f"{fig(rp.get('to_post_s', {}), 'max')}"),
        ("re-plan: onset to status (median / max s)", f"{fig(rp.get('to_status_s', {}))} / "
         f"{fig(rp.get('to_status_s', {}), 'max')}"),
        ("operator CPU % startup / steady / re-plan",
         f"{st.get('operator', {}).get('cpu_percent', '-')} / "
         f"{result.get('steady', {}).get('operator', {}).get('cpu_percent', '-')} / "
         f"{result.get('replan_operator', {}).get('cpu_percent', '-')}"),
        ("operator RSS max (MiB; with planners)",
         f"{result.get('operator_rss_mib_max', '-')} ({result.get('operator_tree_rss_mib_max', '-')})"),
        ("operator API requests/min startup / steady / re-plan",
         " / ".join(str(api.get(k, {}).get("operator_per_minute", "-"))
                    for k in ("startup", "steady", "replan"))),
        ("machine load before / after", f"{result['machine']['load_before']} / "
         f"{result['machine'].get('load_after', '-')}"),
    ]  # fmt: skip
    log = result.get("operator_log", {})
    rows.append(
        (
            "re-plans published / skipped; planning s (median / max)",
            f"{log.get('replans_published', '-')} / {log.get('replans_skipped', '-')}; "
            f"{fig(log.get('planned_s', {}))} / {fig(log.get('planned_s', {}), 'max')}",
        )
    )
    if "broke" in result:
        rows.append(("BROKE", result["broke"]))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job-nodes", type=int, default=64, help="worker pods per job")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1, help="concurrent jobs")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="a stub step's length")
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per phase")
    parser.add_argument("--no-replan", action="store_true", help="skip the straggler phase")
    parser.add_argument(
        "--replan-stall",
        type=float,
        default=90.0,
        help="end the straggler phase after this long with no new re-plan",
    )
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temp folder)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args(argv)
    scale = Scale(
        job_nodes=args.job_nodes,
        gpus_per_node=args.gpus_per_node,
        jobs=args.jobs,
        step_seconds=args.step_seconds,
        steady_seconds=args.steady_seconds,
        timeout=args.timeout,
        replan=not args.no_replan,
        replan_stall=args.replan_stall,
    )
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        result = run(scale, workdir)
        result["command"] = " ".join(["python", "bench/operator_scale.py", *sys.argv[1:]])
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(table(result))
    return 0 if "broke" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
