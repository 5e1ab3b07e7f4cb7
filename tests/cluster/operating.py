"""The operator on the real control plane, for tests: ``python -m malleus.operator`` as the Helm
chart's ServiceAccount (`Operator`, `token_kubeconfig`); `JobWorld`, a test's view of one
namespace's MalleusJobs, their children and events, with waits that fail with the whole story
(job status, events, the operator's log, the kubelets' pods); and `operated_namespace`, the
set-up every end-to-end module shares: a namespace of its own, the chart's RBAC for it, the
operator watching it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.cluster.controlplane import RESTRICTED, ControlPlane, ControlPlaneError, wait_until
from tests.cluster.fixtures import apply_chart_rbac
from tests.cluster.kubelet import ProcessKubelet

__all__ = [
    "ACCOUNT",
    "OPERATOR_NS",
    "JobWorld",
    "Operator",
    "exactly",
    "operated_namespace",
    "token_kubeconfig",
]

OPERATOR_NS = "malleus-system"
"""The chart's release namespace (its ServiceAccount's)."""
ACCOUNT = "rel-malleus-operator"
"""The chart's ServiceAccount (release ``rel``)."""

_T = TypeVar("_T")


def token_kubeconfig(cluster: ControlPlane, path: Path, namespace: str = OPERATOR_NS) -> Path:
    """A kubeconfig with a token of the chart's ServiceAccount (TokenRequest, as admin)."""
    response = cluster.http().post(
        f"/api/v1/namespaces/{OPERATOR_NS}/serviceaccounts/{ACCOUNT}/token",
        json={"spec": {"expirationSeconds": 3600}},
    )
    assert response.status_code == 201, response.text
    token = response.json()["status"]["token"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": cluster.url, "certificate-authority": str(cluster.ca)},
            }
        ],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [
            {"name": "c", "context": {"cluster": "c", "user": "operator", "namespace": namespace}}
        ],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class Operator:
    """``python -m malleus.operator`` watching one namespace, in a session of its own, logging
    to a file; `start` again after `stop` (or a kill) appends to the same log."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log: Path,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log = log
        self.environ = dict(environ or {})
        """Added to the operator's environment (``MALLEUS_OPERATOR_*`` settings)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False
        """Stopped on purpose (`stop`): not `dead`."""
        self.start()

    def start(self) -> None:
        self.stopped = False
        args = [
            *("--kubeconfig", str(self.kubeconfig), "--namespace", self.namespace),
            *("--liveness", "", "--metrics-port", "0", "--ack-timeout", "60"),
            # every pod has a loopback IP of its own; the job's DNS names do not resolve here
            *("--endpoint-template", "https://{pod_ip}:{port}"),
        ]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "malleus.operator", *args],
                env={**os.environ, **self.environ, "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def dead(self) -> str | None:
        code = None if self.process is None or self.stopped else self.process.poll()
        return None if code is None else f"the operator exited with {code}:\n{self.tail()}"

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """SIGTERM (kopf stops its daemons), SIGKILL after 15 s."""
        self.stopped = True
        process = self.process
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            if process is None or process.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(wait)


class JobWorld:
    """One namespace's MalleusJobs as a test sees them through the API server (as admin)."""

    def __init__(
        self,
        cluster: ControlPlane,
        namespace: str,
        operator: Operator,
        kubelets: Sequence[ProcessKubelet],
    ) -> None:
        self.cluster, self.ns, self.operator = cluster, namespace, operator
        self.kubelets = list(kubelets)
        self.http = cluster.http()
        self.url = f"/apis/malleus.io/v1alpha1/namespaces/{namespace}/malleusjobs"

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        created = self.http.post(self.url, json=body)
        assert created.status_code == 201, created.text
        return dict(created.json())

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        patched = self.http.patch(
            f"{self.url}/{name}",
            json={"spec": spec},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert patched.status_code == 200, patched.text

    def job(self, name: str) -> dict[str, Any] | None:
        got = self.http.get(f"{self.url}/{name}")
        if got.status_code == 404:
            return None
        assert got.status_code == 200, got.text
        return dict(got.json())

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def in_phase(self, name: str, phase: str) -> dict[str, Any] | None:
        """The job's status once it is in ``phase``, else None."""
        st = self.status(name)
        return st if st.get("phase") == phase else None

    def children(self, plural: str, name: str) -> list[dict[str, Any]]:
        group = "/apis/policy/v1" if plural == "poddisruptionbudgets" else "/api/v1"
        listed = self.http.get(
            f"{group}/namespaces/{self.ns}/{plural}",
            params={"labelSelector": f"malleus.io/job={name}"},
        )
        assert listed.status_code == 200, listed.text
        return list(listed.json()["items"])

    def workers(self, name: str, *, live: bool = True) -> list[dict[str, Any]]:
        """The job's worker pods (not its store); ``live``: not being deleted."""
        return [
            p
            for p in self.children("pods", name)
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
            and not (live and p["metadata"].get("deletionTimestamp"))
        ]

    def secret(self, name: str) -> dict[str, Any]:
        got = self.http.get(f"/api/v1/namespaces/{self.ns}/secrets/{name}")
        assert got.status_code == 200, got.text
        return dict(got.json())

    def events(self, name: str) -> list[dict[str, Any]]:
        listed = self.http.get(
            f"/api/v1/namespaces/{self.ns}/events",
            params={"fieldSelector": f"involvedObject.name={name}"},
        )
        assert listed.status_code == 200, listed.text
        return list(listed.json()["items"])

    def reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in self.events(name)]

    def wait(
        self,
        probe: Callable[[], _T | None],
        timeout: float,
        what: str,
        *,
        job: str,
        running: bool = True,
    ) -> _T:
        """Poll ``probe`` until it is not None; fail with ``job``'s story at the deadline, or at
        once when the operator or a kubelet failed (or, with ``running``, ``job`` went Failed)."""

        def alive() -> str | None:
            dead = self.operator.dead()
            for kubelet in self.kubelets:
                dead = dead or kubelet.check()
            if dead is None and running and self.in_phase(job, "Failed"):
                dead = f"job {job} Failed"
            return dead

        try:
            return wait_until(probe, timeout, what, interval=0.3, alive=alive)
        except ControlPlaneError as e:
            pytest.fail(self.story(str(e), job), pytrace=False)

    def story(self, headline: str, name: str) -> str:
        st = json.dumps(self.status(name), indent=1, sort_keys=True)[:4000]
        pods = {
            p["metadata"]["name"]: (p["status"].get("phase"), p["spec"].get("nodeName"))
            for p in self.children("pods", name)
        }
        kubelets = "\n".join(k.logs(12) for k in self.kubelets)
        return (
            f"{headline}\n--- job status\n{st}\n--- events {self.reasons(name)}\n"
            f"--- pods {pods}\n--- operator log\n{self.operator.tail()}\n--- kubelets\n{kubelets}"
        )


def exactly(n: int, items: list[_T]) -> list[_T] | None:
    """``items`` when there are ``n`` of them, else None (for waits)."""
    return items if len(items) == n else None


@contextlib.contextmanager
def operated_namespace(
    cluster: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
    prefix: str,
    kubelets: Sequence[ProcessKubelet] = (),
    environ: Mapping[str, str] | None = None,
) -> Iterator[JobWorld]:
    """A namespace ``PREFIX-xxxxxx`` of the caller's own, enforcing the restricted Pod Security
    Standard (every pod the operator makes must pass it, as in docs/security.md), watched by
    the operator as the chart's ServiceAccount (``helm template``'s RBAC for that namespace,
    applied for real; the operator with a token of that account, ``environ`` added to its
    environment, logging to ``operator.log`` in a fresh folder); its `JobWorld` over
    ``kubelets``. Afterwards the operator is stopped and the namespace deleted (with everything
    in it)."""
    ns = cluster.create_namespace(f"{prefix}-{uuid.uuid4().hex[:6]}", labels=RESTRICTED)
    apply_chart_rbac(cluster, watch=(ns,))
    folder = tmp_path_factory.mktemp("operator")
    kubeconfig = token_kubeconfig(cluster, folder / "kubeconfig", ns)
    op = Operator(kubeconfig, ns, folder / "operator.log", environ=environ)
    try:
        yield JobWorld(cluster, ns, op, kubelets)
    finally:
        op.stop()
        cluster.http().delete(f"/api/v1/namespaces/{ns}")
