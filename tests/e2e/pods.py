"""A kubelet for the test cluster: runs the worker Pods of one namespace as local processes.

The test cluster (``tests/k8s``) stores Pods but runs nothing. `LocalKubelet` watches the pods
of a namespace in its `CoreStore` and, for each new one, does what a node would do, on this
machine:

- materialises the pod's volumes in a folder of its own: a ``configMap`` or ``secret`` volume
  becomes the object's keys as files, ``emptyDir`` / ``persistentVolumeClaim`` an empty folder;
  every container path under a mount (command arguments, environment values) is rewritten to
  that folder;
- resolves the container's environment (``value``, ``secretKeyRef``, ``configMapKeyRef``);
- translates the container's ``torchrun`` command into ``--nproc-per-node`` processes of
  ``python -m MODULE ARGS`` with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT, ...): the master is 127.0.0.1 on a free port chosen per job (the
  pods' labels say which job); worker ``i`` (``malleus.io/node-rank``) gets the pod IP
  ``127.0.0.<i+1>`` (all of 127/8 is the loopback), so every pod's ranks serve the control
  ports its manifest declares without clashing with another pod's;
- runs any other command (the job's rendezvous store, ``python -m malleus.trainer store``) as
  one process on 127.0.0.1, its ``--port`` a free port chosen per job, to which the workers'
  ``MALLEUS_STORE`` (the store Service's DNS name, which does not resolve here) is pointed;
- starts a pod of a name it ran before when it is a new pod (another uid): a replacement;
- reports the pod ``Running`` with ``podIP`` 127.0.0.1 once its processes are started, and
  ``Succeeded`` / ``Failed`` (with the container's exit code) when they end, as torchrun with
  ``--max-restarts=0`` would: the first rank to fail takes the pod's other ranks down;
- kills the pod's processes when the pod is deleted (or marked for deletion), and every
  process it started when it stops, even after a failure.

Processes run in sessions of their own and are killed by their process group id. Their output
goes to ``WORKDIR/<pod>/rank-<r>.log`` (`LocalKubelet.logs` quotes it for failure messages).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.k8s.apiserver import free_port
from tests.k8s.core import ApiError, CoreStore

__all__ = [
    "JOB_LABEL",
    "NODE_LABEL",
    "LocalKubelet",
    "LocalPod",
    "PodError",
    "Torchrun",
    "listen_port",
    "parse_torchrun",
]

JOB_LABEL = "malleus.io/job"
NODE_LABEL = "malleus.io/node-rank"
POD_IP = "127.0.0.1"
NODE_NAME = "e2e-node"  # spec.nodeName of every emulated pod (one machine)

Obj = dict[str, Any]


class PodError(RuntimeError):
    """A pod this kubelet cannot run (an unsupported command or volume, a missing object)."""


# ---- torchrun -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Torchrun:
    """What a ``torchrun`` command line asks for (the options the worker pods use)."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    target: list[str]
    """``["-m", module, *args]`` or ``[script, *args]``: what each process runs."""


_TORCHRUN_INT = {"nnodes", "nproc_per_node", "node_rank", "master_port", "max_restarts"}
_TORCHRUN_STR = {"master_addr", "rdzv_backend", "rdzv_endpoint", "rdzv_id"}


def parse_torchrun(command: Sequence[str]) -> Torchrun:
    """Parse ``torchrun [OPTIONS] (-m MODULE | SCRIPT) ARGS...``; PodError on anything else."""
    if not command or Path(command[0]).name != "torchrun":
        raise PodError(f"not a torchrun command: {list(command)!r}")
    values: dict[str, Any] = {"nnodes": 1, "nproc_per_node": 1, "node_rank": 0}
    values |= {"master_addr": "127.0.0.1", "master_port": 29500}
    rest = list(command[1:])
    while rest and rest[0].startswith("--"):
        opt = rest.pop(0)[2:]
        name, eq, value = opt.partition("=")
        name = name.replace("-", "_")
        if name not in _TORCHRUN_INT | _TORCHRUN_STR:
            raise PodError(f"torchrun option --{name} is not supported by this kubelet")
        if not eq:
            if not rest:
                raise PodError(f"torchrun option --{name} has no value")
            value = rest.pop(0)
        values[name] = int(value) if name in _TORCHRUN_INT else value
    if not rest or rest == ["-m"]:
        raise PodError("torchrun command has no module or script")
    return Torchrun(
        nnodes=int(values["nnodes"]),
        nproc_per_node=int(values["nproc_per_node"]),
        node_rank=int(values["node_rank"]),
        master_addr=str(values["master_addr"]),
        master_port=int(values["master_port"]),
        target=rest,
    )


# ---- one pod --------------------------------------------------------------------------------


@dataclass
class LocalPod:
    """A pod's processes and where they run."""

    namespace: str
    name: str
    job: str
    node_rank: int
    folder: Path
    control_port: int | None
    ip: str = POD_IP
    uid: str = ""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    outcome: str = "Running"  # Running | Succeeded | Failed | Deleted

    def alive(self) -> list[int]:
        """Pids of this pod's processes that still run."""
        return [p.pid for p in self.processes if p.poll() is None]

    def kill(self, grace: float) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds."""
        _signal_all(self.processes, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        _signal_all(self.processes, signal.SIGKILL)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def _signal_all(processes: Sequence[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    for proc in processes:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # its own session: the group id is its pid


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range.

    A port the OS hands out for ``bind(0)`` (``free_port``) comes from the ephemeral range,
    where, on a busy machine, outgoing connections can take it before the trainer binds it
    (seen: the rendezvous failing with EADDRINUSE). Below that range only explicit listeners
    compete, and every candidate is checked free.
    """
    low = min(_ephemeral_low(), 65536)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rewrite(value: str, mounts: Sequence[tuple[str, Path]]) -> str:
    """A container path under a mount -> the same path under the mount's local folder."""
    head, eq, tail = value.partition("=")
    flag = f"{head}=" if eq and head.startswith("-") else ""  # --flag=/mount/path
    path = tail if flag else value
    for mount, local in mounts:  # longest mount path first
        if path == mount or path.startswith(mount + "/"):
            return f"{flag}{local}{path[len(mount) :]}"
    return value


# ---- the kubelet ----------------------------------------------------------------------------


class LocalKubelet:
    """Runs the pods of ``namespace`` in ``store`` as local processes (see the module doc)."""

    def __init__(
        self,
        store: CoreStore,
        namespace: str,
        workdir: Path,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        grace_seconds: float = 3.0,
        poll_seconds: float = 0.1,
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.workdir = Path(workdir)
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.grace_seconds = grace_seconds
        self.poll_seconds = poll_seconds
        self.pods: dict[str, LocalPod] = {}
        self.errors: list[str] = []
        self._master_ports: dict[str, int] = {}
        self._store_ports: dict[str, int] = {}
        self._events: queue.Queue[tuple[str, Obj]] = queue.Queue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalKubelet:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Watch the namespace's pods (existing ones included) from a background thread."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        first, self._unsubscribe = self.store.subscribe(
            "pods", self.namespace, None, lambda t, o: self._events.put((t, o))
        )
        for event in first:
            self._events.put(event)
        self._thread = threading.Thread(target=self._run, name="local-kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and kill every process this kubelet started."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            pod.kill(self.grace_seconds)

    # -- what tests read ----------------------------------------------------------------------

    def processes(self) -> list[int]:
        """Pids of every process started so far that still runs."""
        with self._lock:
            return [pid for pod in self.pods.values() for pid in pod.alive()]

    def started(self) -> list[int]:
        """Pids of every process started so far."""
        with self._lock:
            return [p.pid for pod in self.pods.values() for p in pod.processes]

    def control_url(self, pod: str) -> str:
        """``http://127.0.0.1:PORT`` of a pod's control endpoint (its first rank)."""
        with self._lock:
            port = self.pods[pod].control_port
            ip = self.pods[pod].ip
        if port is None:
            raise KeyError(f"pod {pod} serves no control port")
        return f"http://{ip}:{port}"

    def logs(self, lines: int = 25) -> str:
        """The last ``lines`` of every process's output, for failure messages."""
        out: list[str] = [f"kubelet error: {e}" for e in self.errors]
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            for path, proc in zip(pod.logs, pod.processes, strict=True):
                try:
                    text = path.read_text(errors="replace").splitlines()[-lines:]
                except OSError:
                    text = []
                out.append(f"--- {pod.name} {path.name} (exit {proc.poll()})")
                out.extend(text)
        return "\n".join(out)

    def check(self) -> str | None:
        """An error text when the kubelet failed (for ``wait_until(..., alive=...)``)."""
        return "; ".join(self.errors) or None

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        pending: dict[str, Obj] = {}  # pods waiting for a ConfigMap or Secret
        while not self._stopping.is_set():
            try:
                event_type, pod = self._events.get(timeout=self.poll_seconds)
            except queue.Empty:
                event_type, pod = "", {}
            try:
                if pod:
                    self._on_event(event_type, pod, pending)
                for name, body in list(pending.items()):
                    if self._try_start(body):
                        pending.pop(name, None)
                self._reap()
            except Exception as e:  # reported through check(); the loop goes on
                self.errors.append(f"{type(e).__name__}: {e}")

    def _on_event(self, event_type: str, pod: Obj, pending: dict[str, Obj]) -> None:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "")
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            pending.pop(name, None)
            self._delete(name)
            return
        with self._lock:
            old = self.pods.get(name)
        replaced = old is not None and old.outcome != "Running" and old.uid != meta.get("uid")
        known = old is not None and not replaced
        if known or name in pending:
            return
        if (pod.get("status") or {}).get("phase", "Pending") != "Pending":
            return  # not ours to start (another kubelet's, or one we already ran)
        if not self._try_start(pod):
            pending[name] = pod

    def _delete(self, name: str) -> None:
        with self._lock:
            pod = self.pods.get(name)
        if pod is not None and pod.outcome != "Deleted":
            pod.outcome = "Deleted"
            pod.kill(self.grace_seconds)

    def _reap(self) -> None:
        """Report pods whose processes ended: Succeeded (all 0) or Failed (the first non-zero)."""
        with self._lock:
            running = [p for p in self.pods.values() if p.outcome == "Running"]
        for pod in running:
            codes = [proc.poll() for proc in pod.processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                pod.kill(self.grace_seconds)  # torchrun --max-restarts=0: one down, all down
                self._report(pod, "Failed", failed[0])
            elif all(c == 0 for c in codes):
                self._report(pod, "Succeeded", 0)

    def _report(self, pod: LocalPod, phase: str, code: int) -> None:
        pod.outcome = phase
        terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "finishedAt": _now(),
        }
        status = {
            "containerStatuses": [
                {"name": "trainer", "ready": False, "state": {"terminated": terminated}}
            ]
        }
        with contextlib.suppress(ApiError):  # deleted meanwhile
            self.store.set_pod_phase(pod.namespace, pod.name, phase, **status)

    # -- starting a pod -----------------------------------------------------------------------

    def _try_start(self, pod: Obj) -> bool:
        """Start the pod's processes; False while a ConfigMap or Secret it needs is missing."""
        meta = pod["metadata"]
        name, labels = meta["name"], meta.get("labels") or {}
        spec = pod.get("spec") or {}
        containers = spec.get("containers") or []
        if len(containers) != 1:
            raise PodError(f"pod {name}: this kubelet runs exactly one container")
        container = containers[0]
        job = labels.get(JOB_LABEL, name)
        node_rank = int(labels.get(NODE_LABEL, "0"))
        ip = POD_IP if NODE_LABEL not in labels else f"127.0.0.{node_rank + 1}"
        folder = self.workdir / name
        if (meta.get("annotations") or {}).get("malleus.io/restart"):
            folder = self.workdir / f"{name}-{meta['annotations']['malleus.io/restart']}"
        try:
            mounts = self._volumes(spec, container, folder)
            env = self._container_env(container, ip)
        except _Missing:
            return False
        with self._lock:
            store_port = self._store_ports.setdefault(job, listen_port())
        env = {k: _store(k, _rewrite(v, mounts), store_port) for k, v in env.items()}
        command = container.get("command") or []
        if command and Path(command[0]).name != "torchrun":
            return self._start_plain(pod, container, command, env, folder, store_port)
        run = parse_torchrun(command)
        with self._lock:
            master_port = self._master_ports.setdefault(job, listen_port())
        target = [_rewrite(a, mounts) for a in [*run.target, *(container.get("args") or [])]]
        control = _declared_port(container, "control")
        local = LocalPod(
            self.namespace, name, job, node_rank, folder, control, ip, meta.get("uid", "")
        )
        world = run.nnodes * run.nproc_per_node
        for local_rank in range(run.nproc_per_node):
            rank = node_rank * run.nproc_per_node + local_rank
            proc_env = {
                **self.env,
                "OMP_NUM_THREADS": "1",  # torchrun's default with several processes per node
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(run.nproc_per_node),
                "GROUP_RANK": str(node_rank),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": POD_IP,
                "MASTER_PORT": str(master_port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
            }
            log = folder / f"rank-{rank}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [self.python, *target],
                    env=proc_env,
                    cwd=folder,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            local.processes.append(proc)
            local.logs.append(log)
        self._running(local, container)
        return True

    def _running(self, local: LocalPod, container: Obj) -> None:
        with self._lock:
            self.pods[local.name] = local
        status = {
            "podIP": local.ip,
            "podIPs": [{"ip": local.ip}],
            "hostIP": POD_IP,
            "startTime": _now(),
            "containerStatuses": [
                {
                    "name": container.get("name", "trainer"),
                    "ready": True,
                    "started": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": _now()}},
                }
            ],
        }
        self.store.set_pod_phase(self.namespace, local.name, "Running", **status)

    def _start_plain(
        self,
        pod: Obj,
        container: Obj,
        command: Sequence[str],
        env: Mapping[str, str],
        folder: Path,
        store_port: int,
    ) -> bool:
        """A command other than torchrun (the job's store): one process on 127.0.0.1, any
        ``--port`` the job's store port, ``python`` this interpreter."""
        meta = pod["metadata"]
        argv = [*command, *(container.get("args") or [])]
        if Path(argv[0]).name.startswith("python"):
            argv[0] = self.python
        for i, arg in enumerate(argv[:-1]):
            if arg == "--port":
                argv[i + 1] = str(store_port)
            elif arg == "--host":
                argv[i + 1] = POD_IP
        local = LocalPod(
            self.namespace,
            meta["name"],
            (meta.get("labels") or {}).get(JOB_LABEL, ""),
            0,
            folder,
            None,
            POD_IP,
            meta.get("uid", ""),
        )
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "process.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                env={**self.env, **env},
                cwd=folder,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        local.processes.append(proc)
        local.logs.append(log)
        self._running(local, container)
        return True

    def _object(self, plural: str, name: str) -> Obj:
        try:
            return self.store.get(plural, self.namespace, name)
        except ApiError as e:
            if e.code == 404:
                raise _Missing(f"{plural}/{name}") from None
            raise

    def _volumes(self, spec: Obj, container: Obj, folder: Path) -> list[tuple[str, Path]]:
        """Materialise the mounted volumes; (mount path, local folder), longest path first."""
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts: list[tuple[str, Path]] = []
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise PodError(f"volume {mount['name']!r} is mounted but not declared")
            local = folder / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                cm = self._object("configmaps", volume["configMap"]["name"])
                files = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
            elif "secret" in volume:
                secret = self._object("secrets", volume["secret"]["secretName"])
                files = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
            elif "emptyDir" in volume or "persistentVolumeClaim" in volume:
                files = {}
            else:
                raise PodError(f"volume {mount['name']!r}: unsupported type {sorted(volume)}")
            for key, data in files.items():
                (local / key).write_bytes(data)
            mounts.append((mount["mountPath"].rstrip("/") or "/", local))
        return sorted(mounts, key=lambda m: -len(m[0]))

    def _container_env(self, container: Obj, ip: str = POD_IP) -> dict[str, str]:
        env: dict[str, str] = {}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = str(var.get("value", ""))
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                data = self._object("secrets", ref["name"]).get("data") or {}
                env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[var["name"]] = (self._object("configmaps", ref["name"]).get("data") or {})[
                    ref["key"]
                ]
            elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[var["name"]] = ip
            elif source.get("fieldRef", {}).get("fieldPath") == "status.hostIP":
                env[var["name"]] = POD_IP
            elif source.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                env[var["name"]] = NODE_NAME
            else:
                raise PodError(f"env {var['name']}: unsupported valueFrom {sorted(source)}")
        return env


class _Missing(Exception):
    """A ConfigMap or Secret the pod needs does not exist (yet): the pod stays Pending."""


def _store(name: str, value: str, port: int) -> str:
    """``MALLEUS_STORE`` (the store Service's DNS name) -> the job's store on 127.0.0.1."""
    return f"{POD_IP}:{port}" if name == "MALLEUS_STORE" and ".svc:" in value else value


def _declared_port(container: Obj, name: str) -> int | None:
    for port in container.get("ports") or []:
        if port.get("name") == name:
            return int(port["containerPort"])
    return None
