"""A job's certificates (`operator/tls.py`) and the trainer's control endpoint serving them.

The certificates are read back with `cryptography` and used for real: a `ControlServer` over
TLS on 127.0.0.1 with a certificate issued for ``localhost``, and the clients of
`malleus.control`, which trust the job's CA and nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from malleus.control import (
    AsyncControlClient,
    ControlClient,
    ControlError,
    ControlStatus,
    ControlTLS,
)
from malleus.operator import jobs, tls, workers
from malleus.operator.resources import JobRef, coordinator_host
from malleus.trainer.endpoint.credentials import (
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    ServingTLS,
    control_host,
    load_tls,
)
from malleus.trainer.endpoint.server import ControlServer
from malleus.trainer.measure.emulation import InjectionQueue
from tests.statuses import control_status

TOKEN = "s3cret"
NOW = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)


def status() -> ControlStatus:
    return control_status(world=2, rates={0: 1.0, 1: 1.0})


def write(certs: tls.JobCertificates, folder: Path) -> tuple[Path, Path]:
    """The Secret's server files as the pod mounts them."""
    cert, key = folder / tls.CERT_KEY, folder / tls.KEY_KEY
    cert.write_text(certs.servers[0].cert)
    key.write_text(certs.servers[0].key)
    return cert, key


class Served:
    """A TLS control endpoint on 127.0.0.1 with `certs`, emulation on (so /inject exists)."""

    def __init__(self, certs: tls.JobCertificates, folder: Path) -> None:
        self.injections = InjectionQueue()
        self.server = ControlServer("127.0.0.1", 0, TOKEN, status=status, inbox=None,
                                    metrics=None, inject=self.injections.put,
                                    tls=ServingTLS(*write(certs, folder)))  # fmt: skip

    def url(self, host: str = "localhost") -> str:
        return f"https://{host}:{self.server.port}"


@pytest.fixture(scope="module")
def certs() -> tls.JobCertificates:
    return tls.issue([["localhost"]], dt.datetime.now(dt.UTC))


@pytest.fixture
def served(certs: tls.JobCertificates, tmp_path: Path) -> Iterator[Served]:
    s = Served(certs, tmp_path)
    with s.server:
        yield s


def test_each_worker_has_a_certificate_of_its_own_signed_by_a_constrained_ca() -> None:
    ref = JobRef("ml", "tiny")
    names = tls.worker_names(ref, 2)
    assert names == [
        ["tiny-node-0.tiny.ml.svc", "tiny.ml.svc"],
        ["tiny-node-1.tiny.ml.svc", "tiny.ml.svc"],
    ]
    certs = tls.issue_for_job(ref, 2, NOW)
    assert set(certs.secret_data()) == {
        "ca.crt",
        "tls-0.crt",
        "tls-0.key",
        "tls-1.crt",
        "tls-1.key",
    }
    ca = x509.load_pem_x509_certificate(certs.ca.encode())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 0
    constraints = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    assert constraints.value.permitted_subtrees == [
        x509.DNSName("tiny-node-0.tiny.ml.svc"),
        x509.DNSName("tiny.ml.svc"),
        x509.DNSName("tiny-node-1.tiny.ml.svc"),
    ]
    keys = set()
    for server, wanted in zip(certs.servers, names, strict=True):
        cert = x509.load_pem_x509_certificate(server.cert.encode())
        cert.verify_directly_issued_by(ca)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == wanted
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
        assert cert.not_valid_after_utc == NOW + tls.VALIDITY
        assert NOW - dt.timedelta(minutes=10) < cert.not_valid_before_utc < NOW
        assert "PRIVATE KEY" in server.key and "PRIVATE KEY" not in certs.ca + server.cert
        keys.add(server.key)
    assert len(keys) == 2  # one key per worker
    other = x509.load_pem_x509_certificate(tls.issue_for_job(ref, 2, NOW).ca.encode())
    assert other.public_key() != ca.public_key()  # every job (every issue) has a CA of its own
    assert other.subject != ca.subject  # and a subject of its own (chains are built by subject)
    with pytest.raises(ValueError, match="at least one name"):
        tls.issue([], NOW)
    with pytest.raises(ValueError, match="at least one name"):
        tls.issue([["a"], []], NOW)


def test_a_client_trusting_the_job_ca_works_and_the_token_still_counts(
    served: Served, certs: tls.JobCertificates
) -> None:
    with ControlClient(served.url(), TOKEN, tls=ControlTLS(certs.ca)) as client:
        assert client.status().step == 3 and client.healthz()
        client.inject(1, 2.0)
    assert served.injections.drain() == {1: 2.0}
    with (
        pytest.raises(ControlError) as refused,
        ControlClient(served.url(), "wrong", tls=ControlTLS(certs.ca)) as client,
    ):
        client.inject(1, 2.0)
    assert refused.value.code == 401 and served.injections.drain() == {}
    # By IP, asking for the name the certificate carries (the operator reaching a pod by IP).
    by_ip = ControlTLS(certs.ca, server_name="localhost")
    with ControlClient(served.url("127.0.0.1"), TOKEN, tls=by_ip) as client:
        assert client.status().generation == 1


@pytest.mark.parametrize("trust", ["none", "another job's CA", "wrong name"])
def test_a_client_that_cannot_verify_the_server_is_refused(
    served: Served, certs: tls.JobCertificates, trust: str
) -> None:
    given = {
        "none": None,  # the system's CAs: they never signed a job's certificate
        "another job's CA": ControlTLS(tls.issue([["localhost"]], NOW).ca),
        "wrong name": ControlTLS(certs.ca, server_name="tiny-node-0.tiny.ml.svc"),
    }[trust]
    with ControlClient(served.url(), TOKEN, timeout=2.0, tls=given) as client:
        assert not client.healthz()
        with pytest.raises(ControlError) as refused:
            client.inject(0, 2.0)
    assert refused.value.code is None and "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
    assert served.injections.drain() == {}  # the token never reached the server


def test_a_certificate_for_another_name_or_expired_is_refused(tmp_path: Path) -> None:
    for bad in (
        tls.issue([["tiny-node-0.tiny.ml.svc"]], NOW),
        tls.issue([["localhost"]], NOW - 2 * tls.VALIDITY),
    ):
        s = Served(bad, tmp_path)
        with (
            s.server,  # started first: the client's URL needs its port
            ControlClient(s.url(), TOKEN, timeout=2.0, tls=ControlTLS(bad.ca)) as client,
            pytest.raises(ControlError, match="CERTIFICATE_VERIFY_FAILED"),
        ):
            client.status()


def test_plain_http_and_silent_clients_do_not_stall_the_server(
    served: Served, certs: tls.JobCertificates
) -> None:
    plain = ControlClient(served.url().replace("https", "http"), TOKEN, timeout=2.0)
    with plain, pytest.raises(ControlError):
        plain.status()  # no answer in clear, not even an error page
    with socket.create_connection(("127.0.0.1", served.server.port)):  # connects, says nothing
        started = time.monotonic()
        with ControlClient(served.url(), TOKEN, tls=ControlTLS(certs.ca)) as client:
            assert client.healthz()
        assert time.monotonic() - started < 2.0  # its handshake waits in its own thread


def test_the_trainer_finds_its_certificate_and_address_in_the_environment(
    certs: tls.JobCertificates, tmp_path: Path
) -> None:
    cert, key = write(certs, tmp_path)
    assert load_tls({}) is None  # local runs: plain HTTP on loopback
    assert isinstance(load_tls({TLS_CERT_ENV: str(cert), TLS_KEY_ENV: str(key)}), ServingTLS)
    with pytest.raises(RuntimeError, match=TLS_KEY_ENV):
        load_tls({TLS_CERT_ENV: str(cert)})
    with pytest.raises(RuntimeError, match="cannot load"):
        load_tls({TLS_CERT_ENV: str(cert), TLS_KEY_ENV: str(tmp_path / "missing")})
    assert control_host({}) == "127.0.0.1"
    assert control_host({"POD_IP": "10.1.2.3"}) == "10.1.2.3"


def test_the_pods_serve_what_the_secret_holds_and_the_operator_trusts(
    make_job: Any, tmp_path: Path
) -> None:
    """Secret -> pod mount and env -> the trainer's `load_tls` -> a client verifying node 0's
    stable name with the Secret's CA, as the daemon does (here reached by IP)."""
    job = jobs.resolve(make_job())
    ref = JobRef("ml", "demo", uid="u-1")
    certs = tls.issue_for_job(ref, job.nodes, dt.datetime.now(dt.UTC))
    kids = workers.build_children(job, ref, job.initial_plan(), "tok", certificates=certs)
    secret = next(c for c in kids if c["kind"] == "Secret")
    files = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert files == {"token": "tok", **certs.secret_data()}
    pod = next(c for c in kids if c["kind"] == "Pod" and c["metadata"]["name"] == "demo-node-0")
    container = pod["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == workers.TLS_MOUNT)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    items = {item["key"]: item["path"] for item in volume["secret"]["items"]}
    assert items == {
        "tls-0.crt": "tls.crt",
        "tls-0.key": "tls.key",
        "ca.crt": "ca.crt",
        "token": "token",
    }  # fmt: skip  (no other worker's key in this pod)
    for key, path in items.items():  # the kubelet's copy of the mounted keys
        (tmp_path / path).write_text(files[key])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert next(e["valueFrom"] for e in container["env"] if e["name"] == "POD_IP") == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    local = {k: v.replace(workers.TLS_MOUNT, str(tmp_path)) for k, v in env.items() if v}
    served = ControlServer(control_host({**local, "POD_IP": "127.0.0.1"}), 0, TOKEN,
                           status=status, inbox=None, metrics=None, inject=None,
                           tls=load_tls(local))  # fmt: skip
    trust = ControlTLS(files[tls.CA_KEY], server_name=coordinator_host(ref))
    with served, ControlClient(served.url, TOKEN, tls=trust) as client:
        assert served.url.startswith("https://127.0.0.1:")
        assert client.status().job == "demo"


def test_the_async_client_verifies_alike(served: Served, certs: tls.JobCertificates) -> None:
    async def session() -> tuple[int, bool]:
        trust = ControlTLS(certs.ca, server_name="localhost")  # as the daemon: by IP, by name
        async with AsyncControlClient(served.url("127.0.0.1"), TOKEN, tls=trust) as client:
            await client.inject(0, 3.0)
            generation = (await client.status()).generation
        async with AsyncControlClient(served.url(), TOKEN, timeout=2.0) as untrusting:
            return generation, await untrusting.healthz()

    assert asyncio.run(session()) == (1, False)
    assert served.injections.drain() == {0: 3.0}
