"""A kubelet for the real test control plane that runs a node's pods as local processes.

`ProcessKubelet` is the one emulated part of `tests.cluster.controlplane.ControlPlane`. It speaks
to the API server as ``system:node:NAME`` (group ``system:nodes``), so the Node authorizer and
NodeRestriction judge it as they judge a real kubelet: it can read only the Secrets and
ConfigMaps of pods bound to it, patch only its own Node, Lease and pods. What it does:

- registers its Node with capacity (cpu, memory, pods, ``nvidia.com/gpu``) and labels, posts a
  Ready status, and renews its Lease in ``kube-node-lease`` every `LEASE_RENEW_S`;
- runs each pod the scheduler binds to it (``spec.nodeName``) as local processes, one per
  container, in sessions of their own: the command (``python`` is this interpreter) with its
  args, ``$(VAR)`` expanded; the environment from ``value``, ``valueFrom`` (fieldRef for the
  pod's name, namespace, uid, IP, node, service account, labels and annotations;
  configMapKeyRef, secretKeyRef, resourceFieldRef) and ``envFrom``, plus
  ``KUBERNETES_SERVICE_HOST``/``PORT`` pointing at the API server (its Service has no
  endpoints here);
- writes the pod's configMap, secret, projected (service-account token from the TokenRequest
  API, configMap, secret, downwardAPI), downwardAPI and emptyDir volumes into a folder per pod,
  a persistentVolumeClaim into one folder per claim that the machine's kubelets share (it
  outlives the pod: a checkpoint survives a suspension), and rewrites every container path
  under a mount (args, env values, workingDir) to it; an argument ``0.0.0.0`` becomes the pod
  IP (no network namespaces here: a wildcard bind would take the port for every pod);
- stands in for the cluster's DNS, which does not exist here: a ``SERVICE.NAMESPACE.svc`` name
  in an env value or argument becomes the IP of a ready pod its selector picks (its
  EndpointSlice stays empty: the API server refuses loopback endpoint addresses),
  ``HOST.SUBDOMAIN.NAMESPACE.svc`` the IP of the
  pod with that hostname and subdomain; a pod whose names do not resolve yet stays Pending;
- stands in for each pod's own network namespace, which processes on one machine do not have:
  ``torchrun``'s agent store (``--master-addr=127.0.0.1 --master-port=N``, on the pod's own
  loopback) moves to the pod's IP and a free port; ``torchrun`` is the one beside this Python;
- judges ``readinessProbe.tcpSocket`` by connecting to the pod's IP (others count as ready;
  a probe of torchrun's agent port follows the agent where it moved);
- gives each pod a loopback IP of its own (``127.<100+node index>.x.y``: any 127/8 address binds
  on Linux without setup; nothing here may use 10.x, 172.16-31.x or 192.168.x);
- reports the pod's status (Running with the IP, each container's state and exit code,
  Succeeded / Failed under ``restartPolicy: Never``; restarts under OnFailure / Always);
- refuses a pod it cannot run (no command: there are no images here; an unsupported volume or
  field) as a kubelet refuses a bad container config: Waiting, CreateContainerConfigError;
- honours a deletion's grace period: SIGTERM to each container's process group, SIGKILL when
  the grace period ends, the final status, then the delete with grace 0 that lets the API server
  remove the pod.

Tests can make it misbehave like a node: `lose` stops the Lease, the status reports and the
watch (a lost node: its processes go on running, unseen), `recover` undoes that, and `hold`
leaves a pod Terminating when it is deleted (its processes go on).

Process output goes to ``WORKDIR/<namespace>_<pod>/<container>.log`` (`logs` quotes it).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from tests.cluster.controlplane import ControlPlane
from tests.ports import free_port

__all__ = ["CONTAINER_ENV", "LEASE_RENEW_S", "KubeletError", "PodProcesses", "ProcessKubelet"]

CONTAINER_ENV = "MALLEUS_TEST_CONTAINER"
"""Set in every container's environment (inherited by its descendants), so that the kubelet
finds all of a container's processes (`_marked`), as a runtime finds them in its cgroup."""

LEASE_RENEW_S = 1.0
"""How often the Lease is renewed (a real kubelet: every 10 s of a 40 s lease)."""

KUBELET_VERSION = "v1.37.2"
_SMP = {"Content-Type": "application/strategic-merge-patch+json"}
Obj = dict[str, Any]


class KubeletError(RuntimeError):
    """A pod this kubelet cannot run, or an answer from the API server it cannot take."""


class _NotYet(Exception):
    """Something a pod needs is not readable yet (a missing ConfigMap or Secret, or the Node
    authorizer's graph not knowing the pod yet): the pod stays Pending and is tried again."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _Container:
    name: str
    image: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    exit_code: int | None = None
    finished_at: str = ""
    restarts: int = 0
    restart_at: float = 0.0
    probe_port: int | None = None
    """``readinessProbe.tcpSocket``'s port: ready once it accepts on the pod's IP."""

    @property
    def marker(self) -> str:
        """The value of `CONTAINER_ENV` in this container's processes (unique: its log path)."""
        return str(self.log)


@dataclass
class PodProcesses:
    """One pod as this kubelet runs it."""

    namespace: str
    name: str
    uid: str
    ip: str
    folder: Path
    restart_policy: str
    containers: list[_Container] = field(default_factory=list)
    started_at: str = ""
    phase: str = "Running"  # Running | Succeeded | Failed
    terminating_until: float | None = None
    """Monotonic deadline of the deletion's grace period once it began (SIGTERM sent)."""
    deleted: bool = False
    reported: str = ""

    def pids(self) -> list[int]:
        """Pids of this pod's processes that still run: each container's own and every
        descendant (`_marked`: torchrun starts its ranks in sessions of their own)."""
        own = [c.process.pid for c in self.containers if c.process and c.process.poll() is None]
        return own + [p for c in self.containers for p in _marked(c.marker) if p not in own]

    def kill(self) -> None:
        """SIGKILL what is left (descendants included) and wait for it to end."""
        self.signal(signal.SIGKILL)
        for container in self.containers:
            if container.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    container.process.wait(5)
        deadline = time.monotonic() + 5
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every process of the pod, as a runtime does to a container's cgroup."""
        for container in self.containers:
            proc = container.process
            marked = _marked(container.marker)  # before the parent dies and they are reparented
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)  # its own session: the group id is its pid
            for pid in marked:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)


class ProcessKubelet:
    """The kubelet of node ``name``: its pods run as processes here (see the module doc)."""

    def __init__(
        self,
        cluster: ControlPlane,
        name: str,
        workdir: Path,
        *,
        index: int = 1,
        gpus: int = 8,
        cpu: str = "16",
        memory: str = "64Gi",
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Obj] = (),
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        poll_s: float = 0.2,
    ) -> None:
        if not 1 <= index <= 155:
            raise ValueError(f"node index {index} outside 1..155 (127.<100+index>.x.y)")
        self.cluster = cluster
        self.name = name
        self.workdir = Path(workdir)
        self.index = index
        self.host_ip = f"127.{100 + index}.0.1"
        self.capacity = {
            "cpu": cpu,
            "memory": memory,
            "pods": "110",
            "ephemeral-storage": "100Gi",
            "nvidia.com/gpu": str(gpus),
        }
        self.labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.taints = list(taints)
        self.python = python
        self.env = dict(env or {})
        self.poll_s = poll_s
        self.pods: dict[str, PodProcesses] = {}  # by uid
        self.errors: list[str] = []
        self._held: set[tuple[str, str]] = set()
        self._refused: set[str] = set()  # uids of pods this kubelet cannot run
        self._lost = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ips = 0
        self._lease: Obj | None = None
        self._last_lease = 0.0
        self._last_status = 0.0
        self._node_uid = ""
        self._http: httpx.Client | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> ProcessKubelet:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def api(self) -> httpx.Client:
        if self._http is None:
            self._http = self.cluster.http(self.cluster.node_identity(self.name))
        return self._http

    def start(self) -> None:
        """Register the Node (as the node itself), its Lease and status; then run the loop."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "spec": {"taints": self.taints} if self.taints else {},
        }
        node = self._call("POST", "/api/v1/nodes", body, ok=(201, 409))
        if node.get("kind") != "Node":
            node = self._call("GET", f"/api/v1/nodes/{self.name}")
        self._node_uid = node["metadata"]["uid"]
        self._post_node_status()
        self._renew_lease()
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, delete_node: bool = True) -> None:
        """Stop the loop, kill every process started here and (as admin) delete the Node."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            pod.kill()
        if delete_node:
            with contextlib.suppress(httpx.HTTPError):
                self.cluster.http().delete(f"/api/v1/nodes/{self.name}")

    def lose(self) -> None:
        """Behave as a lost node: no more Lease renewals, status reports or pod changes seen."""
        self._lost.set()

    def recover(self) -> None:
        """Come back after `lose`: Ready again, pods reported again."""
        self._last_status = 0.0
        with self._lock:
            for pod in self.pods.values():
                pod.reported = ""  # report again: the node lifecycle controller changed it
        self._lost.clear()

    def hold(self, namespace: str, name: str) -> None:
        """Leave this pod Terminating when it is deleted (its processes go on running)."""
        self._held.add((namespace, name))

    def release(self, namespace: str, name: str) -> None:
        """Undo `hold`: a pending deletion of the pod proceeds."""
        self._held.discard((namespace, name))

    # -- what tests read ----------------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> PodProcesses | None:
        """The newest pod of that name run here, or None."""
        with self._lock:
            found = [p for p in self.pods.values() if (p.namespace, p.name) == (namespace, name)]
        return found[-1] if found else None

    def logs(self, lines: int = 25) -> str:
        """The last lines of every container's output and the kubelet's errors."""
        out = [f"kubelet {self.name} error: {e}" for e in self.errors]
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            for c in pod.containers:
                try:
                    text = c.log.read_text(errors="replace").splitlines()[-lines:]
                except OSError:
                    text = []
                out.append(f"--- {pod.namespace}/{pod.name} {c.name} (exit {c.exit_code})")
                out.extend(text)
        return "\n".join(out)

    def check(self) -> str | None:
        """The kubelet's errors so far, or None (for ``wait_until(..., alive=...)``)."""
        return "; ".join(self.errors) or None

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            try:
                self._tick()
            except Exception as e:  # reported through check(); the loop goes on
                self.errors.append(f"{type(e).__name__}: {e}")
                if len(self.errors) > 50:
                    del self.errors[:-50]

    def _tick(self) -> None:
        now = time.monotonic()
        self._reap()
        if self._lost.is_set():
            return
        if now - self._last_lease >= LEASE_RENEW_S:
            self._renew_lease()
        if now - self._last_status >= 10.0:
            self._post_node_status()
        listed = self._call(
            "GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.name}"}
        )
        seen: set[str] = set()
        for pod in listed.get("items") or []:
            seen.add(pod["metadata"]["uid"])
            self._sync(pod)
        with self._lock:
            gone = [p for uid, p in self.pods.items() if uid not in seen and not p.deleted]
        for pod in gone:  # removed without us (force deletion): stop its processes
            pod.deleted = True
            pod.signal(signal.SIGKILL)
        for pod in self._running():
            self._report(pod)

    def _running(self) -> list[PodProcesses]:
        with self._lock:
            return [p for p in self.pods.values() if not p.deleted]

    def _sync(self, body: Obj) -> None:
        meta = body["metadata"]
        uid = meta["uid"]
        with self._lock:
            pod = self.pods.get(uid)
        if meta.get("deletionTimestamp"):
            if (meta["namespace"], meta["name"]) in self._held:
                return
            if pod is None:
                self._finish_delete(meta)
            elif not pod.deleted:
                self._terminate(pod, meta)
            return
        pending = (body.get("status") or {}).get("phase", "Pending") == "Pending"
        if pod is None and pending and uid not in self._refused:
            try:
                self._start(body)
            except _NotYet:
                pass  # tried again on the next tick
            except KubeletError as e:  # the pod's fault: said on the pod, as a kubelet does
                self._refused.add(uid)
                self._refuse(body, str(e))

    # -- starting a pod -----------------------------------------------------------------------

    def _start(self, body: Obj) -> None:
        meta, spec = body["metadata"], body.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        if spec.get("initContainers"):
            raise KubeletError(f"pod {ns}/{name}: init containers are not supported here")
        folder = self.workdir / f"{ns}_{name}_{meta['uid'][:8]}"
        ip = self._ip_for(meta["uid"])
        mounts = self._volumes(body, folder, ip)
        pod = PodProcesses(
            ns, name, meta["uid"], ip, folder, spec.get("restartPolicy", "Always"),
            started_at=_now(),
        )  # fmt: skip
        for container in spec.get("containers") or []:
            env = self._container_env(body, container, ip)
            env = {k: _rewrite(v, mounts) for k, v in env.items()}
            command = [*(container.get("command") or []), *(container.get("args") or [])]
            if not container.get("command"):
                raise KubeletError(
                    f"pod {ns}/{name} container {container['name']}: no command "
                    f"(this kubelet has no images, so no entrypoints)"
                )
            env = {k: self._resolve(v) for k, v in env.items()}
            argv = [self._resolve(_rewrite(_expand(a, env), mounts)) for a in command]
            moved: dict[int, int] = {}
            # A pod's wildcard address is its own IP: with no network namespace here, a
            # process binding 0.0.0.0 would take the port on every pod of the machine (two
            # jobs' stores on 29400, other test runs' included).
            argv = [ip if a == "0.0.0.0" else a for a in argv]
            if Path(argv[0]).name in ("python", "python3"):
                argv[0] = self.python
            elif Path(argv[0]).name == "torchrun":
                rest, moved = _own_loopback(argv[1:], ip)
                argv = [str(Path(self.python).with_name("torchrun")), *rest]
            cwd = Path(_rewrite(container.get("workingDir") or str(folder), mounts))
            probe = (container.get("readinessProbe") or {}).get("tcpSocket") or {}
            pod.containers.append(
                _Container(
                    container["name"],
                    container.get("image", ""),
                    argv,
                    env,
                    cwd,
                    folder / f"{container['name']}.log",
                    probe_port=_moved(_port(container, probe.get("port")), moved),
                )
            )
        for c in pod.containers:
            self._spawn(c)
        with self._lock:
            self.pods[pod.uid] = pod
        self._report(pod)

    def _resolve(self, value: str) -> str:
        """Cluster DNS names in ``value`` -> pod IPs (_NotYet while one does not resolve).

        Asks as admin: DNS is a component of its own, not the kubelet, whose node identity may
        not list pods and Services. A Service resolves to a ready pod its selector picks, as its
        EndpointSlice would: the real EndpointSlice controller cannot publish loopback pod IPs
        ("may not be in the loopback range (127.0.0.0/8, ::1/128)")."""

        def one(match: re.Match[str]) -> str:
            parts = match[1].split(".")
            admin = self.cluster.http()
            if len(parts) == 2:  # SERVICE.NAMESPACE: a ready pod its selector picks
                service, ns = parts
                got = admin.get(f"/api/v1/namespaces/{ns}/services/{service}")
                selector = (
                    (got.json().get("spec") or {}).get("selector") if got.is_success else None
                )
                if selector:
                    chosen = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
                    pods = admin.get(
                        f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": chosen}
                    ).json()
                    for pod in pods.get("items") or []:
                        status = pod.get("status") or {}
                        ready = {c["type"]: c["status"] for c in status.get("conditions") or []}
                        deleting = pod["metadata"].get("deletionTimestamp")
                        if ready.get("Ready") == "True" and status.get("podIP") and not deleting:
                            return str(status["podIP"])
            elif len(parts) == 3:  # HOSTNAME.SUBDOMAIN.NAMESPACE
                host, sub, ns = parts
                pods = admin.get(f"/api/v1/namespaces/{ns}/pods").json()
                for pod in pods.get("items") or []:
                    spec, status = pod.get("spec") or {}, pod.get("status") or {}
                    named = (spec.get("hostname"), spec.get("subdomain")) == (host, sub)
                    if named and status.get("podIP"):
                        return str(status["podIP"])
            raise _NotYet(f"DNS name {match[0]}")

        return _SVC_NAME.sub(one, value)

    def _refuse(self, body: Obj, message: str) -> None:
        """Report every container Waiting with CreateContainerConfigError and the reason."""
        meta = body["metadata"]
        waiting = {"reason": "CreateContainerConfigError", "message": message}
        statuses = [
            {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
             "restartCount": 0, "state": {"waiting": waiting}}
            for c in (body.get("spec") or {}).get("containers") or []
        ]  # fmt: skip
        status = {"status": {"phase": "Pending", "containerStatuses": statuses}}
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        self._call("PATCH", path, status, headers=_SMP, ok=(200, 404))

    def _ip_for(self, uid: str) -> str:
        with self._lock:
            self._ips += 1
            k = self._ips
        return f"127.{100 + self.index}.{1 + k // 250}.{k % 250 + 1}"

    def _spawn(self, c: _Container) -> None:
        base = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": str(c.cwd),
        }
        c.cwd.mkdir(parents=True, exist_ok=True)
        with c.log.open("ab") as out:
            c.process = subprocess.Popen(
                c.argv,
                env={**base, **self.env, **c.env, CONTAINER_ENV: c.marker},
                cwd=c.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        c.started_at, c.exit_code, c.finished_at = _now(), None, ""

    def _get(self, path: str) -> Obj:
        """GET an object the pod needs; _NotYet on 404 or 403 (the authorizer's graph lags)."""
        response = self.api.get(path)
        if response.status_code in (403, 404):
            raise _NotYet(path)
        if response.status_code != 200:
            raise KubeletError(f"GET {path}: {response.status_code} {response.text[:300]}")
        return dict(response.json())

    def _source_files(self, source: Obj, kind: str, ns: str) -> dict[str, bytes]:
        """The files of a configMap or secret volume source (``items`` honoured)."""
        if kind == "configMap":
            ref = source["name"]
            path = f"/api/v1/namespaces/{ns}/configmaps/{ref}"
        else:
            ref = source.get("secretName") or source["name"]
            path = f"/api/v1/namespaces/{ns}/secrets/{ref}"
        try:
            obj = self._get(path)
        except _NotYet:
            if source.get("optional"):
                return {}
            raise
        if kind == "configMap":
            data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
            data |= {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
        else:
            data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        if source.get("items"):
            return {i["path"]: data[i["key"]] for i in source["items"] if i["key"] in data}
        return data

    @staticmethod
    def _downward_files(body: Obj, items: Sequence[Obj], ip: str) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        for item in items:
            if "fieldRef" in item:
                files[item["path"]] = _field(body, item["fieldRef"]["fieldPath"], ip).encode()
        return files

    def _token(self, body: Obj, source: Obj) -> bytes:
        meta, spec = body["metadata"], body.get("spec") or {}
        account = spec.get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [source["audience"]] if source.get("audience") else None,
                "expirationSeconds": int(source.get("expirationSeconds", 3607)),
                "boundObjectRef": {
                    "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                },
            },
        }  # fmt: skip
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        response = self.api.post(path, json=request)
        if response.status_code in (403, 404):
            raise _NotYet(path)
        if response.status_code != 201:
            raise KubeletError(f"POST {path}: {response.status_code} {response.text[:300]}")
        return str(response.json()["status"]["token"]).encode()

    def _volumes(self, body: Obj, folder: Path, ip: str) -> list[tuple[str, Path]]:
        """Write the mounted volumes; (mount path, local path), longest mount path first."""
        ns = body["metadata"]["namespace"]
        spec = body.get("spec") or {}
        written: dict[str, Path] = {}
        for volume in spec.get("volumes") or []:
            local = folder / "volumes" / volume["name"]
            files: dict[str, bytes] = {}
            if "configMap" in volume:
                files = self._source_files(volume["configMap"], "configMap", ns)
            elif "secret" in volume:
                files = self._source_files(volume["secret"], "secret", ns)
            elif "downwardAPI" in volume:
                files = self._downward_files(body, volume["downwardAPI"].get("items") or [], ip)
            elif "projected" in volume:
                for source in volume["projected"].get("sources") or []:
                    if "configMap" in source:
                        files |= self._source_files(source["configMap"], "configMap", ns)
                    elif "secret" in source:
                        files |= self._source_files(source["secret"], "secret", ns)
                    elif "downwardAPI" in source:
                        files |= self._downward_files(body, source["downwardAPI"]["items"], ip)
                    elif "serviceAccountToken" in source:
                        token = source["serviceAccountToken"]
                        files[token["path"]] = self._token(body, token)
            elif "persistentVolumeClaim" in volume:  # a claim outlives the pod: one folder
                # per claim, shared by this machine's kubelets (beside their workdirs)
                claim = volume["persistentVolumeClaim"]["claimName"]
                local = self.workdir.parent / "claims" / ns / claim
            elif not ({"emptyDir", "ephemeral"} & set(volume)):
                raise KubeletError(
                    f"pod {ns}/{body['metadata']['name']} volume {volume['name']!r}: "
                    f"unsupported type {sorted(set(volume) - {'name'})}"
                )
            written[volume["name"]] = local
            local.mkdir(parents=True, exist_ok=True)
            for rel, data in files.items():
                target = local / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        mounts: list[tuple[str, Path]] = []
        for container in spec.get("containers") or []:
            for mount in container.get("volumeMounts") or []:
                local = written.get(mount["name"])
                if local is None:
                    raise KubeletError(f"volume {mount['name']!r} is mounted but not declared")
                if mount.get("subPath"):
                    local = local / mount["subPath"]
                mounts.append((mount["mountPath"].rstrip("/") or "/", local))
        return sorted(set(mounts), key=lambda m: -len(m[0]))

    def _container_env(self, body: Obj, container: Obj, ip: str) -> dict[str, str]:
        ns = body["metadata"]["namespace"]
        env = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.cluster.port),
            "HOSTNAME": body["metadata"]["name"],
        }
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                ref = {"name": source["configMapRef"]["name"]}
                ref["optional"] = source["configMapRef"].get("optional", False)
                files = self._source_files(ref, "configMap", ns)
            else:
                ref = {"secretName": source["secretRef"]["name"]}
                ref["optional"] = source["secretRef"].get("optional", False)
                files = self._source_files(ref, "secret", ns)
            env |= {prefix + k: v.decode() for k, v in files.items()}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = _expand(str(var.get("value", "")), env)
            elif "fieldRef" in source:
                env[var["name"]] = _field(body, source["fieldRef"]["fieldPath"], ip)
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                kind = "configMap" if "configMapKeyRef" in source else "secret"
                ref = source.get("configMapKeyRef") or source["secretKeyRef"]
                name_key = "name" if kind == "configMap" else "secretName"
                files = self._source_files(
                    {name_key: ref["name"], "optional": ref.get("optional", False)}, kind, ns
                )
                if ref["key"] in files:
                    env[var["name"]] = files[ref["key"]].decode()
                elif not ref.get("optional"):
                    raise _NotYet(f"{kind} {ref['name']} key {ref['key']}")
            elif "resourceFieldRef" in source:
                resource = source["resourceFieldRef"]["resource"]  # e.g. limits.cpu
                kind, _, what = resource.partition(".")
                value = ((container.get("resources") or {}).get(kind) or {}).get(what)
                env[var["name"]] = str(value if value is not None else self.capacity.get(what))
            else:
                raise KubeletError(f"env {var['name']}: unsupported valueFrom {sorted(source)}")
        return env

    # -- running, reporting, ending -----------------------------------------------------------

    def _reap(self) -> None:
        """Notice exited containers; restart them or end the pod as its restartPolicy says."""
        now = time.monotonic()
        for pod in self._running():
            if pod.terminating_until is not None:
                if not pod.pids() or now >= pod.terminating_until:
                    pod.kill()
                    self._collect(pod)
                    if not self._lost.is_set():
                        self._finish(pod)
                continue
            if pod.phase != "Running":
                continue
            self._collect(pod)
            policy = pod.restart_policy
            for c in pod.containers:
                if c.exit_code is None:
                    continue
                if policy == "Always" or (policy == "OnFailure" and c.exit_code != 0):
                    if c.restart_at == 0.0:
                        c.restart_at = now + min(10.0, 0.5 * 2**c.restarts)
                    elif now >= c.restart_at:
                        c.restarts, c.restart_at = c.restarts + 1, 0.0
                        self._spawn(c)
            codes = [c.exit_code for c in pod.containers]
            if policy == "Never" and all(code is not None for code in codes):
                pod.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
            elif policy == "OnFailure" and all(code == 0 for code in codes):
                pod.phase = "Succeeded"

    @staticmethod
    def _collect(pod: PodProcesses) -> None:
        for c in pod.containers:
            if c.process is not None and c.exit_code is None:
                code = c.process.poll()
                if code is not None:
                    c.exit_code = 128 - code if code < 0 else code  # SIGKILL -> 137, as runc
                    c.finished_at = _now()

    def _status(self, pod: PodProcesses) -> Obj:
        statuses = []
        for c in pod.containers:
            if c.exit_code is None and c.process is not None:
                state: Obj = {"running": {"startedAt": c.started_at}, "terminated": None}
                last: Obj | None = None
            else:
                reason = "Completed" if c.exit_code == 0 else "Error"
                state = {
                    "running": None,
                    "waiting": None,
                    "terminated": {
                        "exitCode": c.exit_code,
                        "reason": reason,
                        "startedAt": c.started_at,
                        "finishedAt": c.finished_at,
                        "containerID": f"process://{c.process.pid if c.process else 0}",
                    },
                }
                last = None
            statuses.append(
                {
                    "name": c.name,
                    "image": c.image,
                    "imageID": "",
                    "containerID": f"process://{c.process.pid if c.process else 0}",
                    "ready": c.exit_code is None and _accepts(pod.ip, c.probe_port),
                    "started": c.exit_code is None,
                    "restartCount": c.restarts,
                    "state": state,
                    "lastState": last or {},
                }
            )
        ready = "True" if pod.phase == "Running" and all(s["ready"] for s in statuses) else "False"
        conditions = [
            {"type": t, "status": s, "lastTransitionTime": pod.started_at}
            for t, s in (
                ("PodReadyToStartContainers", "True"),
                ("Initialized", "True"),
                ("ContainersReady", ready),
                ("Ready", ready),
            )
        ]
        return {
            "status": {
                "phase": pod.phase,
                "hostIP": self.host_ip,
                "hostIPs": [{"ip": self.host_ip}],
                "podIP": pod.ip,
                "podIPs": [{"ip": pod.ip}],
                "startTime": pod.started_at,
                "conditions": conditions,
                "containerStatuses": statuses,
            }
        }

    def _report(self, pod: PodProcesses) -> None:
        if self._lost.is_set():
            return
        status = self._status(pod)
        text = json.dumps(status, sort_keys=True)
        if text == pod.reported:
            return
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status"
        response = self.api.patch(path, content=text, headers=_SMP)
        if response.status_code == 200:
            pod.reported = text
        elif response.status_code != 404:
            raise KubeletError(f"PATCH {path}: {response.status_code} {response.text[:300]}")

    def _terminate(self, pod: PodProcesses, meta: Obj) -> None:
        if pod.terminating_until is not None:
            return
        grace = meta.get("deletionGracePeriodSeconds")
        grace = 30 if grace is None else int(grace)
        pod.terminating_until = time.monotonic() + grace
        pod.signal(signal.SIGTERM)

    def _finish(self, pod: PodProcesses) -> None:
        """Report the pod's final status and let the API server remove it (grace 0)."""
        if pod.phase == "Running":
            codes = [c.exit_code for c in pod.containers]
            pod.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
        self._report(pod)
        pod.deleted = True
        self._finish_delete({"namespace": pod.namespace, "name": pod.name, "uid": pod.uid})

    def _finish_delete(self, meta: Obj) -> None:
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        response = self.api.request("DELETE", path, json=body)
        if response.status_code not in (200, 404, 409):
            raise KubeletError(f"DELETE {path}: {response.status_code} {response.text[:300]}")

    # -- the node -----------------------------------------------------------------------------

    def _post_node_status(self) -> None:
        now = _now()
        conditions = [
            {
                "type": kind,
                "status": "False",
                "reason": f"KubeletHasNo{kind}",
                "message": "emulated",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "process kubelet is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        )
        status = {
            "status": {
                "capacity": self.capacity,
                "allocatable": self.capacity,
                "conditions": conditions,
                "addresses": [
                    {"type": "InternalIP", "address": self.host_ip},
                    {"type": "Hostname", "address": self.name},
                ],
                "nodeInfo": {
                    "kubeletVersion": KUBELET_VERSION,
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                    "containerRuntimeVersion": "process://0",
                    "kernelVersion": os.uname().release,
                    "osImage": "process kubelet",
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kubeProxyVersion": "",
                },
            }
        }
        self._call("PATCH", f"/api/v1/nodes/{self.name}/status", status, headers=_SMP, ok=(200,))
        self._last_status = time.monotonic()

    def _renew_lease(self) -> None:
        base = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        if self._lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.name,
                    "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": self.name,
                         "uid": self._node_uid},
                    ],
                },
                "spec": {
                    "holderIdentity": self.name,
                    "leaseDurationSeconds": 40,
                    "renewTime": _micro_now(),
                },
            }  # fmt: skip
            lease = self._call("POST", base, body, ok=(201, 409))
            if lease.get("kind") != "Lease":
                lease = self._call("GET", f"{base}/{self.name}")
            self._lease = lease
        else:
            self._lease["spec"]["renewTime"] = _micro_now()
            response = self.api.put(f"{base}/{self.name}", json=self._lease)
            if response.status_code == 200:
                self._lease = dict(response.json())
            else:
                self._lease = None  # conflict or gone: read or make it afresh next time
                raise KubeletError(f"Lease renewal: {response.status_code} {response.text[:300]}")
        self._last_lease = time.monotonic()

    def _call(
        self,
        method: str,
        path: str,
        body: Obj | None = None,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        ok: Sequence[int] = (200,),
    ) -> Obj:
        content = None if body is None else json.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        response = self.api.request(method, path, content=content, params=params, headers=hdrs)
        if response.status_code not in ok:
            raise KubeletError(f"{method} {path}: {response.status_code} {response.text[:300]}")
        return dict(response.json())


def _marked(marker: str) -> list[int]:
    """Pids of the live processes whose environment carries ``CONTAINER_ENV=marker``: a
    container's processes and all their descendants, even those in sessions of their own or
    reparented to init (what a container's cgroup holds, and a runtime signals)."""
    needle = f"\0{CONTAINER_ENV}={marker}\0".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = b"\0" + f.read()
        except OSError:
            continue
        if needle in environ:
            found.append(int(entry.name))
    return found


def _field(body: Obj, path: str, ip: str) -> str:
    """A pod's downward-API field (``metadata.labels['x']`` included)."""
    meta, spec = body["metadata"], body.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": ip,
        "status.podIPs": ip,
        "status.hostIP": ip.rsplit(".", 2)[0] + ".0.1",
        "status.hostIPs": ip.rsplit(".", 2)[0] + ".0.1",
    }
    if path in simple:
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return str((meta.get(match[1]) or {}).get(match[2], ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = (meta.get(path.split(".")[1]) or {}).items()
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items))
    raise KubeletError(f"unsupported fieldRef {path!r}")


def _expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$(VAR)`` stays literal, unknown names stay)."""

    def one(match: re.Match[str]) -> str:
        if match[0].startswith("$$"):
            return match[0][1:]
        return env.get(match[1], match[0])

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, value)


def _rewrite(value: str, mounts: Sequence[tuple[str, Path]]) -> str:
    """A container path under a mount -> the same path under the mount's local folder
    (also ``--flag=/mount/path``)."""
    head, eq, tail = value.partition("=")
    flag = f"{head}=" if eq and head.startswith("-") else ""
    path = tail if flag else value
    for mount, local in mounts:  # longest mount path first
        if path == mount or path.startswith(mount + "/"):
            return f"{flag}{local}{path[len(mount) :]}"
    return value


_SVC_NAME = re.compile(r"\b((?:[a-z0-9-]+\.){1,2}[a-z0-9-]+)\.svc(?:\.cluster\.local)?\b")


def _own_loopback(args: Sequence[str], ip: str) -> tuple[list[str], dict[int, int]]:
    """torchrun's options with its agent store moved from the pod's loopback to its IP and a
    free port (``--master-port=29500`` in every pod would clash on one machine), and the port
    moved (the pod's -> the one used here, for a probe of the agent's port)."""
    out: list[str] = []
    moved: dict[int, int] = {}
    for arg in args:
        if arg.startswith("--master-addr=") or arg.startswith("--master_addr="):
            host = arg.split("=", 1)[1]
            arg = f"--master-addr={ip}" if host in ("127.0.0.1", "localhost") else arg
        elif arg.startswith("--master-port=") or arg.startswith("--master_port="):
            port = free_port()
            given = arg.split("=", 1)[1]
            if given.isdigit():
                moved[int(given)] = port
            arg = f"--master-port={port}"
        out.append(arg)
    return out, moved


def _moved(port: int | None, moved: dict[int, int]) -> int | None:
    """A probe's port where this machine moved it (torchrun's agent store), else itself."""
    return moved.get(port, port) if port is not None else None


def _port(container: Obj, port: object) -> int | None:
    """A probe's port (a number, or the name of one of the container's ports)."""
    if port is None:
        return None
    if isinstance(port, int) or str(port).isdigit():
        return int(str(port))
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise KubeletError(f"probe port {port!r} is not a port of container {container['name']}")


def _accepts(ip: str, port: int | None) -> bool:
    """Whether a TCP connection to ip:port succeeds (True without a port: no probe)."""
    if port is None:
        return True
    try:
        with socket.create_connection((ip, port), timeout=0.2):
            return True
    except OSError:
        return False
