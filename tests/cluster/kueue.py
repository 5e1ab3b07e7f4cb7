"""Kueue's real manager (v0.17) on the test control plane: CRDs, webhooks, one process.

`Kueue` applies Kueue's CRDs (server side: they are large), starts ``kueue`` from the assets
folder with a configuration of its own (everything on 127.0.0.1; leader election, internal
certificate management and the visibility server off; the ``batch/job`` framework and, as an
external framework, ``MalleusJob.v1alpha1.malleus.io``: the operator makes the Workload of a
queued job, `malleus.operator.kueue`), then registers the webhooks of what it runs (Workload,
ClusterQueue, Cohort, ResourceFlavor and batch Job) with ``url: https://127.0.0.1:PORT/...``
clientConfigs and the test CA: the API server cannot reach a Service here. The others (plain
pods, Deployments, ...) are left out, so no pod creation goes through Kueue.

Kueue v0.17 with its internal certificate management off reads metrics certificates from the
fixed path ``/etc/kueue/metrics/certs`` and exits without them (even with metrics off): the
manager runs in a mount namespace of its own whose ``/etc`` holds them (`_private_etc`), so
the machine's ``/etc`` is never written; where no mount namespace can be made the tests skip,
saying so.

Found in the assets folder (`controlplane.ASSETS_ENV`): the ``kueue`` binary and
``kueue-manifests/`` (``crd/`` and ``webhook/manifests.yaml``), which scripts/k8s-assets.sh
unpacks from shared/k8s; a test skips, saying so, without them. Its metrics server is off
(``bindAddress: "0"``); without ``VisibilityOnDemand=false`` it exits looking for the
visibility server's certificate (shared/k8s/README.md).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import (
    ControlPlane,
    ControlPlaneError,
    established,
    free_port,
    wait_until,
)

__all__ = ["EXTERNAL_FRAMEWORK", "MANIFESTS", "Kueue", "kueue_assets"]

MANIFESTS = "kueue-manifests"
"""The folder beside the binary, in the assets folder, holding Kueue's ``crd/`` and ``webhook/``."""
EXTERNAL_FRAMEWORK = "MalleusJob.v1alpha1.malleus.io"
"""How Kueue's configuration names the MalleusJob kind (``integrations.externalFrameworks``)."""
_WEBHOOKS = ("workload", "clusterqueue", "cohort", "resourceflavor", "batch-v1-job")
"""The webhooks registered: the paths that contain one of these."""


def _private_etc(workdir: Path, certs: Path, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own whose ``/etc`` is a tmpfs of links to the real
    one's entries plus ``kueue/metrics/certs`` (the fixed path Kueue v0.17 reads with its
    internal certificate management off): the machine's ``/etc`` is never written."""
    real = workdir / "real-etc"
    real.mkdir(exist_ok=True)
    script = (
        f"set -e; mount --bind /etc {shlex.quote(str(real))}; mount -t tmpfs tmpfs /etc; "
        f"for e in {shlex.quote(str(real))}/* {shlex.quote(str(real))}/.[!.]*; do "
        '[ -e "$e" ] && ln -s "$e" /etc/; done; '
        f"mkdir -p /etc/kueue/metrics; ln -s {shlex.quote(str(certs))} /etc/kueue/metrics/certs; "
        'exec "$@"'
    )
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "kueue", *argv]


def mount_namespaces() -> str:
    """ "" when this process may make a mount namespace (Kueue's private ``/etc``), else why not."""
    try:
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "t", "/mnt"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare: {e}"
    if done.returncode != 0:
        return "no mount namespace for Kueue's private /etc: " + done.stderr.decode().strip()
    return ""


def kueue_assets(assets: Path) -> tuple[Path | None, str]:
    """The manifests folder and "" when ``assets`` holds Kueue; None and the reason otherwise."""
    binary, manifests = assets / "kueue", assets / MANIFESTS
    if not os.access(binary, os.X_OK):
        return None, f"{binary} is missing (scripts/k8s-assets.sh unpacks Kueue's manager)"
    if not (manifests / "crd").is_dir() or not (manifests / "webhook" / "manifests.yaml").is_file():
        return None, f"{manifests}/crd or webhook/manifests.yaml is missing (scripts/k8s-assets.sh)"
    why = mount_namespaces()
    return (None, why) if why else (manifests, "")


class Kueue:
    """Kueue's manager as admin on `cluster`; `start_seconds`: CRDs to webhooks registered."""

    def __init__(self, cluster: ControlPlane, manifests: Path, workdir: Path) -> None:
        self.cluster, self.manifests, self.workdir = cluster, manifests, workdir
        self.port = 0
        self.start_seconds = 0.0
        self._proc: Any = None

    def start(self) -> Kueue:
        began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        crds = sorted((self.manifests / "crd").glob("*.yaml"))
        self.cluster.apply(doc for f in crds for doc in yaml.safe_load_all(f.read_text()) if doc)
        wait_until(self._served, 60, "Kueue's APIs served", alive=self.cluster.dead)
        self.cluster.create_namespace("kueue-system")
        self.port = free_port()
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        cert, key = self.cluster.serving_cert("kueue-webhook", "IP:127.0.0.1")
        (certs / "tls.crt").write_bytes(cert.read_bytes())
        (certs / "tls.key").write_bytes(key.read_bytes())
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{free_port()}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": self.port, "host": "127.0.0.1", "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {
                "frameworks": ["batch/job"],
                "externalFrameworks": [EXTERNAL_FRAMEWORK],
            },
        }
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(config))
        kueue = [
            str(self.cluster.assets / "kueue"),
            *("--config", str(self.workdir / "config.yaml")),
            *("--kubeconfig", str(self.cluster.admin)),
            *("--feature-gates", "VisibilityOnDemand=false"),
        ]
        self._proc = self.cluster.spawn("kueue", _private_etc(self.workdir, certs, kueue))
        wait_until(self._listening, 60, "Kueue's webhook server", alive=self.dead)
        self.cluster.apply(self._webhooks(), server_side=False)
        self.start_seconds = time.monotonic() - began
        return self

    def _served(self) -> bool | None:
        """Every Kueue CRD established (the manager exits when one is not served yet)."""
        got = self.cluster.http().get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        ours = [c for c in got.json().get("items", []) if c["spec"]["group"] == "kueue.x-k8s.io"]
        ok = ours and all(established(c) for c in ours)
        return (
            True if ok and len(ours) == len(list((self.manifests / "crd").glob("*.yaml"))) else None
        )

    def _listening(self) -> bool | None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1):
            return True
        return None

    def _webhooks(self) -> list[dict[str, Any]]:
        """Kueue's webhook configurations for what runs here, pointed at 127.0.0.1."""
        ca = base64.b64encode(self.cluster.ca.read_bytes()).decode()
        text = (self.manifests / "webhook" / "manifests.yaml").read_text()
        out = []
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            kept = []
            for hook in doc.get("webhooks") or []:
                path = hook["clientConfig"]["service"]["path"]
                if any(w in path for w in _WEBHOOKS):
                    url = f"https://127.0.0.1:{self.port}{path}"
                    hook["clientConfig"] = {"url": url, "caBundle": ca}
                    kept.append(hook)
            doc["webhooks"] = kept
            out.append(doc)
        return out

    def dead(self) -> str | None:
        if self._proc is None:
            return None
        why = self._proc.dead()
        return None if why is None else f"{why}\n{self.cluster.log('kueue')}"

    def stop(self) -> None:
        """Webhook configurations first (else every write they cover fails), then the manager."""
        for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            for doc in self._webhooks():
                if doc["kind"].lower() + "s" == kind:
                    with contextlib.suppress(Exception):
                        self.cluster.http().delete(
                            f"/apis/admissionregistration.k8s.io/v1/{kind}/{doc['metadata']['name']}"
                        )
        if self._proc is not None:
            self._proc.stop()
            self._proc = None

    def __enter__(self) -> Kueue:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def raise_dead(kueue: Kueue) -> None:
    """A ControlPlaneError with Kueue's log when its manager has exited."""
    why = kueue.dead()
    if why:
        raise ControlPlaneError(why)
