"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, built from upstream source, on 127.0.0.1 and free ports.

The binaries come from the folder named by ``MALLEUS_K8S_ASSETS`` (``scripts/k8s-assets.sh
DEST`` unpacks them from ``shared/k8s/bin``). `ControlPlane` makes the certificates with
``openssl`` (one CA; the API server's serving certificate for ``IP:127.0.0.1,DNS:localhost``; a
client certificate per identity, the subject being the identity: admin in ``system:masters``,
the controller manager, the scheduler, nodes ``system:node:NAME`` in ``system:nodes``, any user
a test names), the service-account key pair and one kubeconfig per identity, then starts:

- etcd (no fsync: test data);
- kube-apiserver with ``Node,RBAC`` authorization, service-account tokens, the default admission
  plugins (PodSecurity, ValidatingAdmissionPolicy, ServiceAccount, ...) plus NodeRestriction,
  ``--endpoint-reconciler-type none`` (required on loopback) and webhooks reached by URL;
- kube-controller-manager with every controller (``--controllers '*'``), each with its own
  service account, and a node monitor fast enough that a node whose Lease stops being renewed
  turns NotReady within seconds (`NODE_GRACE_S`);
- kube-scheduler.

Nothing here is a kubelet: `tests.cluster.kubelet.ProcessKubelet` is the one emulated part.

Every wait polls with a deadline; a process that dies fails the start at once with the tail of
its log.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import yaml

from tests.ports import free_port

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

__all__ = [
    "ASSETS_ENV",
    "BINARIES",
    "CRD_ESTABLISHED_S",
    "NODE_GRACE_S",
    "RESTRICTED",
    "ControlPlane",
    "ControlPlaneError",
    "Identity",
    "assets_dir",
    "established",
    "wait_until",
]

ASSETS_ENV = "MALLEUS_K8S_ASSETS"
"""Environment variable naming the folder with the binaries (like envtest's KUBEBUILDER_ASSETS)."""

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
"""What this harness runs from the assets folder."""

CRD_ESTABLISHED_S = 60.0
"""How long `ControlPlane.wait_established` waits for a CRD. kube-apiserver's
EstablishingController establishes a CRD as soon as its names are accepted (queued with no
delay on a single API server; the 5 s delay is for ``--apiserver-count`` > 1): what takes time
is the CRD itself, the MalleusJob schema (85 kB, 28 CEL rules) being compiled and checked on
the create and on each status write. From the create's answer to Established, 10 CRDs
(scripts/measure_crd_established.py): a small schema 4-9 ms, the MalleusJob schema 40-155 ms
(median 52) on the idle-ish 2-core machine (load ~7); with the control plane held to 8% of a
CPU (cgroup quota: it started in 64 s instead of 10, load average 49) 0.7-7.9 s (median 1.2).
The bound only catches a server that never establishes it (a name conflict, a dead
component fails at once): ~8x the worst seen starved."""

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
"""The labels that make a namespace enforce the restricted Pod Security Standard (the API server
runs the PodSecurity admission plugin)."""

NODE_GRACE_S = 6
"""kube-controller-manager's ``--node-monitor-grace-period``: a node whose Lease is older than
this turns Ready=Unknown (a real cluster waits 40-50 s)."""

_T = TypeVar("_T")


class ControlPlaneError(RuntimeError):
    """The control plane could not be started or did not answer in time."""


def assets_dir(binaries: Sequence[str] = BINARIES) -> tuple[Path | None, str]:
    """The assets folder and "" when it holds ``binaries``; None and the reason to skip otherwise."""
    value = os.environ.get(ASSETS_ENV, "").strip()
    if not value:
        return None, (
            f"{ASSETS_ENV} is unset: point it at a folder with {', '.join(binaries)} "
            f"(scripts/k8s-assets.sh DEST unpacks them from shared/k8s/bin)"
        )
    folder = Path(value).expanduser().resolve()
    missing = [n for n in binaries if not os.access(folder / n, os.X_OK)]
    if missing:
        return None, (
            f"{ASSETS_ENV}={value} lacks {', '.join(missing)} "
            f"(run scripts/k8s-assets.sh {value} to unpack them)"
        )
    return folder, ""


def wait_until(
    probe: Callable[[], _T | None],
    timeout: float,
    what: str,
    interval: float = 0.1,
    alive: Callable[[], str | None] | None = None,
) -> _T:
    """Poll ``probe`` until it returns something other than None, or fail at the deadline.

    ``alive`` returns an error text when something the wait depends on has died, which ends the
    wait at once instead of at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result is not None:
            return result
        if alive is not None and (dead := alive()) is not None:
            raise ControlPlaneError(f"{what}: {dead}")
        if time.monotonic() >= deadline:
            raise ControlPlaneError(f"{what}: not so after {timeout:.0f} s")
        time.sleep(interval)


def established(crd: dict[str, Any]) -> bool:
    """Whether a CRD (as the API server returns it) has its ``Established`` condition True."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class _Process:
    """One child process with its log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def dead(self) -> str | None:
        code = self.popen.poll()
        if code is None:
            return None
        return f"{self.name} exited with {code}; last lines of {self.log}:\n{_tail(self.log)}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=timeout)


class Identity:
    """A client identity: its certificate, key and kubeconfig (made by `ControlPlane`)."""

    def __init__(self, name: str, groups: tuple[str, ...], cert: Path, key: Path, kubeconfig: Path):
        self.name = name
        self.groups = groups
        self.cert = cert
        self.key = key
        self.kubeconfig = kubeconfig


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler (see the module doc).

    Use as a context manager (or ``start()`` / ``stop()``). ``admin`` is the kubeconfig of a
    ``system:masters`` member; `identity` makes one for anybody else (a user, a node),
    `client` a kubernetes ``ApiClient`` and `http` an ``httpx.Client`` for an identity.
    """

    def __init__(
        self,
        assets: Path,
        workdir: Path,
        *,
        start_timeout: float = 90.0,
        controllers: str = "*",
        extra_apiserver_args: Iterable[str] = (),
    ) -> None:
        self.assets = Path(assets)
        self.workdir = Path(workdir)
        self.start_timeout = start_timeout
        self.controllers = controllers
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.pki = self.workdir / "pki"
        self.url = ""
        self.port = 0
        self.start_seconds = 0.0
        """How long `start` took (the fixture reports it)."""
        self.phases: dict[str, float] = {}
        """Seconds from the start of `start` until each component was ready."""
        self._began = 0.0
        self._processes: list[_Process] = []
        self._identities: dict[tuple[str, tuple[str, ...]], Identity] = {}
        self._http: dict[str, httpx.Client] = {}
        self._clients: dict[str, ApiClient] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
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
        """Make the certificates, start every component and wait until the cluster serves
        (each component's ports from `tests.ports`, where no outgoing connection takes them
        between their pick and the component's bind)."""
        began = self._began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._make_pki()
        self._mark("certificates")
        try:
            self._start()
        except ControlPlaneError:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began

    def stop(self) -> None:
        """Stop the components in reverse start order."""
        for client in self._http.values():
            client.close()
        self._http.clear()
        for api in self._clients.values():
            with contextlib.suppress(Exception):
                api.close()
        self._clients.clear()
        while self._processes:
            self._processes.pop().stop()

    def dead(self) -> str | None:
        """An error text when a component has exited (for ``wait_until(..., alive=...)``)."""
        for process in self._processes:
            if (text := process.dead()) is not None:
                return text
        return None

    def _start(self) -> None:
        etcd_port, peer_port = free_port(), free_port()
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        for ident in self._identities.values():  # made before the port was known
            self._write_kubeconfig(ident)
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        # fmt: off
        etcd = self._spawn("etcd", [
            "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "error",
        ])
        # fmt: on
        wait_until(lambda: _http_ok(f"{etcd_url}/health"), 30, "etcd /health", alive=etcd.dead)
        self._mark("etcd")
        pki = self.pki
        # fmt: off
        self._spawn("kube-apiserver", [
            "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.port),
            "--tls-cert-file", str(pki / "apiserver.crt"),
            "--tls-private-key-file", str(pki / "apiserver.key"),
            "--client-ca-file", str(pki / "ca.crt"),
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-cluster-ip-range", "10.96.0.0/16",
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction",
            "--endpoint-reconciler-type", "none",
            "--enable-aggregator-routing=true",
            "--profiling=false",
            *self.extra_apiserver_args,
        ])
        # fmt: on
        wait_until(self._readyz, self.start_timeout, "kube-apiserver /readyz", alive=self.dead)
        self._mark("kube-apiserver")
        cm = self.identity("system:kube-controller-manager").kubeconfig
        sched = self.identity("system:kube-scheduler").kubeconfig
        cm_port, sched_port = free_port(), free_port()
        # fmt: off
        self._spawn("kube-controller-manager", [
            "--kubeconfig", str(cm), "--authentication-kubeconfig", str(cm),
            "--authorization-kubeconfig", str(cm),
            "--bind-address", "127.0.0.1", "--secure-port", str(cm_port),
            "--cert-dir", str(self.workdir / "kcm-serving"),
            "--leader-elect=false", "--use-service-account-credentials",
            "--service-account-private-key-file", str(pki / "sa.key"),
            "--root-ca-file", str(pki / "ca.crt"),
            "--cluster-signing-cert-file", str(pki / "ca.crt"),
            "--cluster-signing-key-file", str(pki / "ca.key"),
            "--controllers", self.controllers,
            "--node-monitor-period", "1s",
            "--node-monitor-grace-period", f"{NODE_GRACE_S}s",
            "--profiling=false",
        ])
        self._spawn("kube-scheduler", [
            "--kubeconfig", str(sched), "--authentication-kubeconfig", str(sched),
            "--authorization-kubeconfig", str(sched),
            "--bind-address", "127.0.0.1", "--secure-port", str(sched_port),
            "--cert-dir", str(self.workdir / "scheduler-serving"),
            "--leader-elect=false", "--profiling=false",
        ])
        # fmt: on
        for name, port in (("kube-controller-manager", cm_port), ("kube-scheduler", sched_port)):
            wait_until(
                lambda port=port: _http_ok(f"https://127.0.0.1:{port}/healthz", verify=False),
                self.start_timeout,
                f"{name} /healthz",
                alive=self.dead,
            )
            self._mark(name)
        # The service-account controller has run: pods can be created in "default".
        wait_until(
            lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
            self.start_timeout,
            "ServiceAccount default/default",
            alive=self.dead,
        )
        self._mark("default ServiceAccount")

    def _mark(self, phase: str) -> None:
        self.phases[phase] = time.monotonic() - self._began

    def _spawn(self, name: str, args: list[str]) -> _Process:
        process = _Process(name, [str(self.assets / name), *args], self.workdir / f"{name}.log")
        self._processes.append(process)
        return process

    def spawn(self, name: str, argv: list[str]) -> _Process:
        """Start another component (Kueue's manager, say), logging to ``workdir/NAME.log``.
        The caller stops it: it is none of `stop`'s or `dead`'s."""
        return _Process(name, argv, self.workdir / f"{name}.log")

    def serving_cert(self, stem: str, sans: str) -> tuple[Path, Path]:
        """(certificate, key) files of a serving certificate the cluster CA signed for
        ``sans`` (``IP:127.0.0.1``): a webhook's, which the API server then trusts."""
        if not (self.pki / f"{stem}.crt").exists():
            self._sign(stem, f"/CN={stem}", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth")
        return self.pki / f"{stem}.crt", self.pki / f"{stem}.key"

    def _readyz(self) -> bool | None:
        with contextlib.suppress(httpx.TransportError):
            if self.http().get("/readyz").status_code == 200:
                return True
        return None

    def _exists(self, path: str) -> bool | None:
        with contextlib.suppress(httpx.TransportError):
            if self.http().get(path).status_code == 200:
                return True
        return None

    def wait_established(self, name: str, timeout: float = CRD_ESTABLISHED_S) -> dict[str, Any]:
        """The CRD ``name`` as stored once its ``Established`` condition is True (the API server
        serves its resource), polled every 0.1 s; fails at once if a component exits, and at the
        deadline with the CRD's last status and the API server's log."""
        url = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
        last: list[Any] = [None]

        def probe() -> dict[str, Any] | None:
            got = self.http().get(url)
            crd = got.json() if got.is_success else {}
            last[0] = crd.get("status") if got.is_success else f"{got.status_code} {got.text}"
            return dict(crd) if established(crd) else None

        try:
            return wait_until(probe, timeout, f"CRD {name} Established", alive=self.dead)
        except ControlPlaneError as e:
            apiserver = self.log("kube-apiserver")
            raise ControlPlaneError(
                f"{e}; its last status: {last[0]}\n--- kube-apiserver\n{apiserver}"
            ) from None

    def log(self, component: str, lines: int = 40) -> str:
        """The last lines of a component's log (for failure messages)."""
        return _tail(self.workdir / f"{component}.log", lines)

    # -- certificates and identities ----------------------------------------------------------

    def _make_pki(self) -> None:
        if shutil.which("openssl") is None:
            raise ControlPlaneError("openssl is needed to make the test certificates")
        self.pki.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", *_EC_KEY, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=malleus-test-ca", cwd=self.pki,
        )  # fmt: skip
        self._sign(
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth",
        )
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=self.pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=self.pki)
        self.admin = self.identity("admin", ("system:masters",)).kubeconfig
        """The kubeconfig of a ``system:masters`` member (can do anything)."""

    def _sign(self, stem: str, subject: str, extensions: str) -> None:
        _openssl(
            "req", "-new", *_EC_KEY, "-keyout", f"{stem}.key", "-out", f"{stem}.csr",
            "-subj", subject, cwd=self.pki,
        )  # fmt: skip
        (self.pki / f"{stem}.ext").write_text(extensions + "\n")
        _openssl(
            "x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{stem}.crt", "-days", "2",
            "-extfile", f"{stem}.ext", cwd=self.pki,
        )  # fmt: skip

    def identity(self, name: str, groups: Sequence[str] = ()) -> Identity:
        """A client certificate (CN=name, O=each group) and a kubeconfig for it, made once."""
        key = (name, tuple(groups))
        if key in self._identities:
            return self._identities[key]
        stem = "user-" + "".join(c if c.isalnum() else "-" for c in name)
        if groups:
            stem += "-" + hashlib.sha256(repr(key).encode()).hexdigest()[:8]
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={name}"
        self._sign(stem, subject, "extendedKeyUsage=clientAuth")
        ident = Identity(
            name,
            tuple(groups),
            self.pki / f"{stem}.crt",
            self.pki / f"{stem}.key",
            self.workdir / f"{stem}.kubeconfig",
        )
        self._identities[key] = ident
        self._write_kubeconfig(ident)
        return ident

    def node_identity(self, node: str) -> Identity:
        """The identity a kubelet on ``node`` uses (Node authorizer, NodeRestriction)."""
        return self.identity(f"system:node:{node}", ("system:nodes",))

    def _write_kubeconfig(self, ident: Identity) -> None:
        # The server is known once `start` picked the port; it rewrites the earlier ones.
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "malleus-test",
                    "cluster": {"server": self.url, "certificate-authority": str(self.ca)},
                }
            ],
            "users": [
                {
                    "name": "user",
                    "user": {"client-certificate": str(ident.cert), "client-key": str(ident.key)},
                }
            ],
            "contexts": [
                {
                    "name": "malleus-test",
                    "context": {"cluster": "malleus-test", "user": "user", "namespace": "default"},
                }
            ],
            "current-context": "malleus-test",
        }
        ident.kubeconfig.write_text(yaml.safe_dump(config))

    @property
    def ca(self) -> Path:
        """The cluster CA's certificate (trusted for the API server's serving certificate)."""
        return self.pki / "ca.crt"

    # -- clients ------------------------------------------------------------------------------

    def ssl_context(self, ident: Identity | None = None) -> ssl.SSLContext:
        """TLS context trusting the cluster CA and presenting ``ident``'s (admin's) cert."""
        ident = ident or self.identity("admin", ("system:masters",))
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(ident.cert), str(ident.key))
        return context

    def http(self, ident: Identity | None = None) -> httpx.Client:
        """An ``httpx.Client`` for the API server as ``ident`` (admin by default)."""
        ident = ident or self.identity("admin", ("system:masters",))
        key = f"{ident.name}/{','.join(ident.groups)}"
        if key not in self._http or str(self._http[key].base_url).rstrip("/") != self.url:
            self._http[key] = httpx.Client(
                base_url=self.url, verify=self.ssl_context(ident), timeout=httpx.Timeout(30.0)
            )
        return self._http[key]

    def client(self, user: str = "admin", groups: Sequence[str] = ()) -> ApiClient:
        """A kubernetes ``ApiClient`` authenticated as ``user`` (admin: ``system:masters``)."""
        from kubernetes import config  # imported here: it reads KUBECONFIG when imported

        if user == "admin" and not groups:
            groups = ("system:masters",)
        ident = self.identity(user, groups)
        key = f"{ident.name}/{','.join(ident.groups)}"
        if key not in self._clients:
            self._clients[key] = config.new_client_from_config(config_file=str(ident.kubeconfig))
        return self._clients[key]

    def env(self, user: str = "admin", groups: Sequence[str] = ()) -> dict[str, str]:
        """Environment for a child process (kubectl, kopf) acting as ``user``."""
        if user == "admin" and not groups:
            groups = ("system:masters",)
        return {**os.environ, "KUBECONFIG": str(self.identity(user, groups).kubeconfig)}

    def kubectl(
        self, *args: str, user: str = "admin", check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's kubectl as ``user``; raises with its stderr when ``check``. Killed
        after 60 s: a kubectl ``--timeout`` beyond that is not in force (wait in-process)."""
        done = subprocess.run(
            [str(self.assets / "kubectl"), *args],
            env=self.env(user),
            capture_output=True,
            text=True,
            input=stdin,
            timeout=60,
        )
        if check and done.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def apply(self, objects: Iterable[dict[str, Any]], server_side: bool = True) -> str:
        """``kubectl apply`` these objects as admin; returns kubectl's output."""
        text = yaml.safe_dump_all(list(objects))
        args = ["apply", "-f", "-"]
        if server_side:
            args += ["--server-side", "--force-conflicts", "--field-manager", "malleus-tests"]
        return self.kubectl(*args, stdin=text).stdout

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create a namespace and wait for its ``default`` ServiceAccount (pods need it)."""
        body = {"metadata": {"name": name, "labels": labels or {}}}
        response = self.http().post("/api/v1/namespaces", json=body)
        if response.status_code not in (201, 409):
            raise ControlPlaneError(f"namespace {name}: {response.status_code} {response.text}")
        wait_until(
            lambda: self._exists(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            30,
            f"ServiceAccount {name}/default",
            alive=self.dead,
        )
        return name


_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, timeout=60)
    if done.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)}: {done.stderr.decode().strip()}")


def _http_ok(url: str, verify: bool = True) -> bool | None:
    with contextlib.suppress(httpx.TransportError):
        if httpx.get(url, timeout=2.0, verify=verify).status_code == 200:
            return True
    return None
