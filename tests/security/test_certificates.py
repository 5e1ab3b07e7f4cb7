"""One certificate per worker, renewed while the job runs, without the operator losing control.

Findings: every worker served one shared certificate and key, so a compromised worker could
answer as the coordinator; certificates expired 30 days after the job's creation with no
renewal, so a long job lost control. The first test performs the impersonation.

The pieces are the product's: `tls.renewed` (what the operator writes into the Secret),
`ServingTLS` (the trainer's endpoint reading its files again when they change) and the
`malleus.control` client trusting the Secret's CA bundle. What the kubelet does in between, a
Secret volume's files swapped atomically (a ``..data`` symlink to a new folder), is done here by
`Mount`. The last test renews a job's Secret on the real API server (``tests/cluster``) as the
chart's ServiceAccount. The first certificates are issued as if 20 s ago, valid 30 s: they expire 10 s into
the test, so the test crosses a real expiry, with that much margin for each step before it.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import socket
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cryptography import x509

from malleus.control import ControlClient, ControlError, ControlStatus, ControlTLS
from malleus.operator import children, jobs, resources, tls
from malleus.operator.context import Context
from malleus.operator.k8s import Cluster
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.resources import JobRef, coordinator_host
from malleus.operator.settings import Settings
from malleus.trainer.endpoint.credentials import ServingTLS
from malleus.trainer.endpoint.server import ControlServer
from tests.cluster.fixtures import apply_chart_rbac
from tests.cluster.operating import token_kubeconfig
from tests.jobs import job_body, manifest
from tests.statuses import control_status

if TYPE_CHECKING:
    from tests.cluster.controlplane import ControlPlane
    from tests.cluster.fixtures import AdminApi

TOKEN = "s3cret"
REF = JobRef("ml", "demo", uid="u-1")
VALIDITY = dt.timedelta(seconds=30)


def status() -> ControlStatus:
    return control_status(world=1, rates={0: 1.0})


class Mount:
    """Worker 0's Secret volume as the kubelet lays it out: each file a symlink through
    ``..data``, which is swapped to a new folder in one rename when the Secret changes."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.version = folder, 0

    def publish(self, data: dict[str, str]) -> None:
        self.version += 1
        target = self.folder / f"..v{self.version}"
        target.mkdir()
        (target / tls.CERT_KEY).write_text(data[tls.worker_cert_key(0)])
        (target / tls.KEY_KEY).write_text(data[tls.worker_key_key(0)])
        (target / tls.CA_KEY).write_text(data[tls.CA_KEY])
        link = self.folder / "..data_tmp"
        link.symlink_to(target.name)
        os.replace(link, self.folder / "..data")
        for name in (tls.CERT_KEY, tls.KEY_KEY, tls.CA_KEY):
            if not (self.folder / name).is_symlink():
                (self.folder / name).symlink_to(f"..data/{name}")


def served_serial(port: int, ca: str) -> int:
    """The serial number of the certificate the endpoint presents now."""
    ctx = ssl.create_default_context(cadata=ca)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=coordinator_host(REF)) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def serial(pem: str) -> int:
    return x509.load_pem_x509_certificate(pem.encode()).serial_number


def test_a_worker_cannot_answer_as_another(tmp_path: Path) -> None:
    """Worker 1 (compromised) serves with its own certificate and key where the operator
    expects the coordinator, worker 0: the operator verifies worker 0's name and refuses
    before the token leaves it. Worker 1's pod holds no other worker's key to do better."""
    data = tls.issue_for_job(REF, 2, dt.datetime.now(dt.UTC)).secret_data()
    mount = Mount(tmp_path)
    mount.publish({**data, tls.worker_cert_key(0): data[tls.worker_cert_key(1)],
                   tls.worker_key_key(0): data[tls.worker_key_key(1)]})  # fmt: skip
    seen: list[str] = []

    def status_seen() -> ControlStatus:
        seen.append("status")
        return status()

    server = ControlServer("127.0.0.1", 0, TOKEN, status=status_seen, inbox=None, metrics=None,
                           inject=None,
                           tls=ServingTLS(tmp_path / tls.CERT_KEY, tmp_path / tls.KEY_KEY))  # fmt: skip
    as_itself = ControlTLS(data[tls.CA_KEY], server_name=tls.worker_names(REF, 2)[1][0])
    as_coordinator = ControlTLS(data[tls.CA_KEY], server_name=coordinator_host(REF))
    with server:
        with ControlClient(server.url, TOKEN, tls=as_itself) as client:
            assert client.status().step == 3  # under its own name it is who it says
        seen.clear()
        with (
            ControlClient(server.url, TOKEN, timeout=5.0, tls=as_coordinator) as client,
            pytest.raises(ControlError, match="CERTIFICATE_VERIFY_FAILED"),
        ):
            client.status()
    assert seen == []  # the request, and its token, never reached the impostor


def test_a_renewal_crosses_the_old_certificates_expiry_without_losing_control(
    tmp_path: Path,
) -> None:
    issued_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=20)
    secret = tls.issue_for_job(REF, 1, issued_at, VALIDITY).secret_data()
    first_cert = secret[tls.worker_cert_key(0)]
    first_expiry = tls.expiry(first_cert)[1]
    assert tls.renewed(secret, REF, 1, issued_at, VALIDITY) is None  # not due when new
    mount = Mount(tmp_path)
    mount.publish(secret)
    endpoint = ServingTLS(tmp_path / tls.CERT_KEY, tmp_path / tls.KEY_KEY)
    server = ControlServer("127.0.0.1", 0, TOKEN, status=status, inbox=None, metrics=None,
                           inject=None, tls=endpoint)  # fmt: skip

    def control(ca: str) -> int:
        """What the operator does with the job: GET /status, verifying node 0's name."""
        trust = ControlTLS(ca, server_name=coordinator_host(REF))
        with ControlClient(server.url, TOKEN, timeout=5.0, tls=trust) as client:
            return client.status().step

    with server:
        old_ca = secret[tls.CA_KEY]
        assert control(old_ca) == 3
        # The operator's check: a third of 30 s or less is left, so it renews.
        fresh = tls.renewed(secret, REF, 1, dt.datetime.now(dt.UTC), VALIDITY)
        assert fresh is not None
        secret.update(fresh)
        new_ca = secret[tls.CA_KEY]
        assert len(x509.load_pem_x509_certificates(new_ca.encode())) == 2  # new + old CA
        # Before the kubelet swaps the files the pod still serves the old certificate, and the
        # operator, trusting the Secret's new bundle, still reaches it.
        assert served_serial(server.port, new_ca) == serial(first_cert)
        assert control(new_ca) == 3
        mount.publish(secret)  # the kubelet's sync
        assert served_serial(server.port, new_ca) == serial(secret[tls.worker_cert_key(0)])
        assert control(new_ca) == 3
        # Past the first certificates' expiry: control is kept with the new ones.
        while dt.datetime.now(dt.UTC) < first_expiry + dt.timedelta(seconds=1):
            time.sleep(0.2)
        assert control(new_ca) == 3
        # A client that never read the new bundle (the reason the controller restarts after
        # a renewal) is refused: the old CA alone does not vouch for the new certificate.
        with pytest.raises(ControlError, match="CERTIFICATE_VERIFY_FAILED"):
            control(old_ca)


def test_an_unloadable_pair_keeps_the_previous_identity(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    first = tls.issue_for_job(REF, 1, now).secret_data()
    other = tls.issue_for_job(REF, 1, now).secret_data()
    mount = Mount(tmp_path)
    mount.publish(first)
    endpoint = ServingTLS(tmp_path / tls.CERT_KEY, tmp_path / tls.KEY_KEY)
    before = endpoint.context()
    # Half an update: the new certificate with the old key (a writer that is not atomic).
    mount.publish({**first, tls.worker_cert_key(0): other[tls.worker_cert_key(0)]})
    assert endpoint.context() is before
    mount.publish(other)
    assert endpoint.context() is not before


def test_the_bundle_drops_a_ca_once_it_expired() -> None:
    now = dt.datetime.now(dt.UTC)
    first = tls.issue_for_job(REF, 1, now, VALIDITY).secret_data()
    later = now + VALIDITY * 0.8
    second = tls.renewed(first, REF, 1, later, VALIDITY)
    assert second is not None
    assert len(x509.load_pem_x509_certificates(second[tls.CA_KEY].encode())) == 2
    third = tls.renewed(second, REF, 1, later + VALIDITY * 0.8, VALIDITY)
    assert third is not None  # the first CA expired in between: only the second is kept
    cas = x509.load_pem_x509_certificates(third[tls.CA_KEY].encode())
    assert len(cas) == 2
    assert x509.load_pem_x509_certificates(first[tls.CA_KEY].encode())[0] not in cas


def test_the_operator_renews_a_jobs_secret_with_the_charts_rights(
    control_plane: ControlPlane,
    admin_api: AdminApi,
    job_namespace: str,
    tmp_path: Path,
) -> None:
    """On the real API server, as the chart's ServiceAccount: the job's children created, then
    `children.renew_certificates` at a time a third of the lifetime before expiry patches the
    Secret (new certificates, both CAs, the token untouched) and posts an event; a Secret the
    job does not control is never touched."""
    apply_chart_rbac(control_plane, watch=(job_namespace,))
    body = manifest(job_body(namespace=job_namespace))
    url = f"/apis/malleus.io/v1alpha1/namespaces/{job_namespace}/malleusjobs"
    assert admin_api.client.post(url, json=body).status_code == 201
    cluster = Cluster.connect(str(token_kubeconfig(control_plane, tmp_path / "operator.yaml")))
    ctx = Context(cluster, Settings(metrics_port=0), OperatorMetrics())

    async def scenario() -> tuple[dict[str, str], dict[str, str], bool, bool]:
        stored = await cluster.get_job(job_namespace, "demo")
        assert stored is not None
        ref = JobRef.from_body(stored)
        job = jobs.resolve(stored)
        plan, _ = await jobs.initial_plan(job)
        await children.ensure_children(ctx, job, ref, plan, pods=False)
        before = await _secret(cluster, ref)
        assert not await children.renew_certificates(ctx, ref, job.nodes)  # fresh: not due
        due = dt.datetime.now(dt.UTC) + tls.VALIDITY * 0.7
        renewed = await children.renew_certificates(ctx, ref, job.nodes, due)
        after = await _secret(cluster, ref)
        stranger = JobRef(ref.namespace, ref.name, uid="someone-else")
        untouched = not await children.renew_certificates(ctx, stranger, job.nodes, due)
        return before, after, renewed, untouched

    try:
        before, after, renewed, untouched = asyncio.run(scenario())
    finally:
        cluster.close()
    assert renewed and untouched
    assert after[resources.TOKEN_KEY] == before[resources.TOKEN_KEY]
    for i in range(2):
        assert after[tls.worker_key_key(i)] != before[tls.worker_key_key(i)]
        assert serial(after[tls.worker_cert_key(i)]) != serial(before[tls.worker_cert_key(i)])
    cas = x509.load_pem_x509_certificates(after[tls.CA_KEY].encode())
    assert x509.load_pem_x509_certificate(before[tls.CA_KEY].encode()) in cas and len(cas) == 2
    events = admin_api.client.get(f"/api/v1/namespaces/{job_namespace}/events").json()["items"]
    assert [e["reason"] for e in events].count("CertificatesRenewed") == 1


async def _secret(cluster: Cluster, ref: JobRef) -> dict[str, str]:
    secret = await cluster.read("Secret", ref.namespace, resources.secret_name(ref.name))
    assert secret is not None
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
