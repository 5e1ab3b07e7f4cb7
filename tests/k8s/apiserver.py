"""A real Kubernetes API server (etcd + apiextensions-apiserver) for tests.

The binaries come from the folder named by ``MALLEUS_K8S_ASSETS`` (like envtest's
``KUBEBUILDER_ASSETS``; ``scripts/k8s-assets.sh DEST`` fills one from ``shared/k8s/bin``). The
server serves CRDs and custom resources with the real validation, CEL, defaulting, pruning,
status subresource and printer columns; it has no core API (``/api/v1``).

Every wait polls with a deadline; a process that dies early fails the start at once, with the
tail of its log in the error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx
import yaml

__all__ = [
    "ASSETS_ENV",
    "ApiServer",
    "ApiServerError",
    "assets_dir",
    "free_port",
    "wait_until",
]

ASSETS_ENV = "MALLEUS_K8S_ASSETS"
"""Environment variable naming the folder that holds ``etcd`` and ``apiextensions-apiserver``."""

_BINARIES = ("etcd", "apiextensions-apiserver")
_T = TypeVar("_T")


class ApiServerError(RuntimeError):
    """The API server (or its etcd) could not be started or did not answer in time."""


def assets_dir() -> Path | None:
    """The assets folder from the environment, or None when unset (tests then skip).

    A folder that is set but lacks an executable is a broken setup, not a reason to skip.
    """
    value = os.environ.get(ASSETS_ENV, "").strip()
    if not value:
        return None
    folder = Path(value).expanduser().resolve()
    for name in _BINARIES:
        binary = folder / name
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise ApiServerError(
                f"{ASSETS_ENV}={value}: {binary} is missing or not executable "
                f"(run scripts/k8s-assets.sh {value})"
            )
    return folder


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller retries on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    probe: Callable[[], _T | None],
    timeout: float,
    what: str,
    interval: float = 0.05,
    alive: Callable[[], str | None] | None = None,
) -> _T:
    """Poll ``probe`` until it returns something other than None, or fail at the deadline.

    ``alive`` returns an error text when a process the wait depends on has died, which ends the
    wait at once instead of at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result is not None:
            return result
        if alive is not None and (dead := alive()) is not None:
            raise ApiServerError(f"{what}: {dead}")
        if time.monotonic() >= deadline:
            raise ApiServerError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(interval)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certificates(folder: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1 and an admin client (O=system:masters)."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("openssl") is None:
        raise ApiServerError("openssl is needed to make the test certificates")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=malleus-test-ca", cwd=folder,
    )  # fmt: skip
    for name, subject, extensions in (
        ("serving", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "/O=system:masters/CN=malleus-test-admin", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req", "-new", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", subject, cwd=folder,
        )  # fmt: skip
        (folder / f"{name}.ext").write_text(extensions + "\n")
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
            "-extfile", f"{name}.ext", cwd=folder,
        )  # fmt: skip


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


class ApiServer:
    """etcd + apiextensions-apiserver on free ports, with a kubeconfig and an HTTPS client.

    Use as a context manager (or ``start()`` / ``stop()``). ``client`` is an ``httpx.Client``
    authenticated as a member of ``system:masters``; ``kubeconfig`` points other clients
    (kubernetes, kopf, kubectl) at the same server.
    """

    def __init__(self, assets: Path, workdir: Path, start_timeout: float = 60.0) -> None:
        self.assets = Path(assets)
        self.workdir = Path(workdir)
        self.start_timeout = start_timeout
        self.certs = self.workdir / "pki"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.url = ""
        self._processes: list[_Process] = []
        self._client: httpx.Client | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> None:
        """Start etcd and the API server, retrying on a port clash; wait for ``/livez``."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        _make_certificates(self.certs)
        self._write_dummy_kubeconfig()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(attempt)
            except ApiServerError:
                self.stop()
                if attempt == attempts:
                    raise
            else:
                return

    def stop(self) -> None:
        """Stop the API server, then etcd (reverse start order)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        while self._processes:
            self._processes.pop().stop()

    def _start_once(self, attempt: int) -> None:
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        data = self.workdir / f"etcd-{attempt}"
        # fmt: off
        etcd_argv = [
            str(self.assets / "etcd"), "--data-dir", str(data),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
            "--log-level", "error",
        ]
        # fmt: on
        etcd = _Process("etcd", etcd_argv, self.workdir / "etcd.log")
        self._processes.append(etcd)
        wait_until(
            lambda: _http_ok(f"{etcd_url}/health"),
            self.start_timeout,
            "etcd /health",
            alive=etcd.dead,
        )
        dummy = str(self.workdir / "dummy.kubeconfig")
        # fmt: off
        api_argv = [
            str(self.assets / "apiextensions-apiserver"),
            "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--secure-port", str(api_port),
            "--cert-dir", str(self.workdir / "serving"),
            "--tls-cert-file", str(self.certs / "serving.crt"),
            "--tls-private-key-file", str(self.certs / "serving.key"),
            "--client-ca-file", str(self.certs / "ca.crt"),
            "--kubeconfig", dummy,
            "--authentication-kubeconfig", dummy, "--authentication-skip-lookup",
            "--authorization-kubeconfig", dummy,
            "--authorization-always-allow-paths",
            "/healthz,/readyz,/livez,/version,/openapi/v2,/openapi/v3,/openapi/v3/*",
            "--disable-admission-plugins",
            "NamespaceLifecycle,MutatingAdmissionPolicy,MutatingAdmissionWebhook,"
            "ValidatingAdmissionPolicy,ValidatingAdmissionWebhook",
            "--enable-priority-and-fairness=false",
        ]
        # fmt: on
        api = _Process("apiextensions-apiserver", api_argv, self.workdir / "apiserver.log")
        self._processes.append(api)
        self.url = f"https://127.0.0.1:{api_port}"
        self._client = httpx.Client(
            base_url=self.url, verify=self.ssl_context(), timeout=httpx.Timeout(30.0)
        )
        wait_until(self._livez, self.start_timeout, "apiserver /livez", alive=api.dead)
        self._write_kubeconfig()

    def _livez(self) -> bool | None:
        try:
            response = self.client.get("/livez")
        except httpx.TransportError:
            return None
        return True if response.status_code == 200 else None

    # -- clients ------------------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        """TLS context trusting the test CA and presenting the admin client certificate."""
        context = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        context.load_cert_chain(str(self.certs / "client.crt"), str(self.certs / "client.key"))
        return context

    @property
    def client(self) -> httpx.Client:
        """HTTPS client to the API server (base URL set; raises before ``start()``)."""
        if self._client is None:
            raise ApiServerError("the API server is not running")
        return self._client

    def env(self) -> dict[str, str]:
        """Environment for a child process (kopf, kubectl) that should talk to this server."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def _write_dummy_kubeconfig(self) -> None:
        # Names must not be YAML booleans such as "n" or "y".
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "unused", "cluster": {"server": "https://127.0.0.1:1"}}],
            "users": [{"name": "unused-user", "user": {"token": "unused"}}],
            "contexts": [
                {"name": "unused-context", "context": {"cluster": "unused", "user": "unused-user"}}
            ],
            "current-context": "unused-context",
        }
        (self.workdir / "dummy.kubeconfig").write_text(yaml.safe_dump(config))

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "malleus-test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.certs / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": "malleus-test-admin",
                    "user": {
                        "client-certificate": str(self.certs / "client.crt"),
                        "client-key": str(self.certs / "client.key"),
                    },
                }
            ],
            "contexts": [
                {
                    "name": "malleus-test",
                    "context": {
                        "cluster": "malleus-test",
                        "user": "malleus-test-admin",
                        "namespace": "default",
                    },
                }
            ],
            "current-context": "malleus-test",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))

    # -- CRDs -------------------------------------------------------------------------------

    def apply_crd(self, crd: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        """Create (or replace) a CRD and wait until it is Established and served.

        Returns the CRD as stored. Raises ``ApiServerError`` with the server's reason when the
        CRD is rejected or never established.
        """
        name = crd["metadata"]["name"]
        base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        response = self.client.post(base, json=crd)
        if response.status_code == 409:
            current = self.client.get(f"{base}/{name}").json()
            body = {**crd, "metadata": {**crd["metadata"], **_version_of(current)}}
            response = self.client.put(f"{base}/{name}", json=body)
        if response.status_code not in (200, 201):
            raise ApiServerError(f"CRD {name} rejected ({response.status_code}): {response.text}")

        def established() -> dict[str, Any] | None:
            stored = self.client.get(f"{base}/{name}").json()
            conditions = {
                c["type"]: c for c in (stored.get("status") or {}).get("conditions") or []
            }
            if conditions.get("NonStructuralSchema", {}).get("status") == "True":
                raise ApiServerError(f"CRD {name}: {conditions['NonStructuralSchema']}")
            if conditions.get("Established", {}).get("status") == "True":
                return stored
            return None

        stored = wait_until(established, timeout, f"CRD {name} Established", interval=0.1)
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        version = next(v["name"] for v in crd["spec"]["versions"] if v.get("served", True))
        # Established can precede the handler serving the resource by a moment.
        wait_until(
            lambda: (
                True
                if self.client.get(f"/apis/{group}/{version}/{plural}").status_code == 200
                else None
            ),
            timeout,
            f"{plural}.{group}/{version} served",
            interval=0.1,
        )
        return stored


def _version_of(current: dict[str, Any]) -> dict[str, Any]:
    return {"resourceVersion": current["metadata"]["resourceVersion"]}


def _http_ok(url: str) -> bool | None:
    with contextlib.suppress(httpx.TransportError):
        if httpx.get(url, timeout=2.0).status_code == 200:
            return True
    return None
