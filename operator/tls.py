"""A job's TLS identity: a CA of its own and one certificate per worker, renewed while it runs.

The trainers' control endpoints take the job's bearer token, so they serve HTTPS: the operator
makes, per job, a CA and, per worker, a server certificate signed by it for that worker's stable
DNS name (``<job>-node-<i>.<job>.<namespace>.svc``, by name because a pod's IP is not known
before it runs) and the job's metrics name (``<job>.<namespace>.svc``, the one name a PodMonitor
can verify every worker by). The job's Secret holds the CA certificate, the token, and each
worker's certificate and key; worker ``i``'s pod mounts only its own pair
(`workers.build_pod`), so a compromised worker cannot answer as another: the operator verifies
the coordinator for that worker's own name (`malleus.control.ControlTLS`).

The CA's private key is thrown away as soon as the workers' certificates are signed, and the CA
may only sign the job's own names (X.509 name constraints): nothing can ever sign another
certificate that this job's clients trust, and a leaked Secret exposes one job, never a name of
another. Keys are ECDSA P-256 (fast to make on every create, small: about 1.3 KB of Secret per
worker, base64 included, so the API server's 1 MiB Secret limit holds some 750 workers).

Certificates are valid for the operator's ``certificate_validity_seconds`` (default `VALIDITY`)
from their creation (a few minutes earlier, for clock skew). Renewal (`renewal_due`,
`renewed`) makes a new CA and new worker certificates once a third of the lifetime is left;
the Secret's CA entry then holds the new CA and the old one (`trusted_bundle`) until the old
expires, so the operator trusts both while the kubelet swaps the pods' files and each endpoint
reloads its files at its next connection (`malleus.trainer.endpoint.credentials.ServingTLS`).
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from . import resources

__all__ = [
    "CA_KEY",
    "CERT_KEY",
    "KEY_KEY",
    "RENEW_FRACTION",
    "VALIDITY",
    "JobCertificates",
    "ServerCertificate",
    "expiry",
    "issue",
    "issue_for_job",
    "metrics_name",
    "renewal_due",
    "renewed",
    "trusted_bundle",
    "worker_cert_key",
    "worker_key_key",
    "worker_names",
]

CA_KEY = "ca.crt"
"""Secret key of the CA certificates clients trust (PEM; two during a renewal)."""
CERT_KEY = "tls.crt"
"""File name of a worker's server certificate (PEM) in its pod's mount."""
KEY_KEY = "tls.key"
"""File name of its private key (PEM, unencrypted PKCS#8) in the mount."""
VALIDITY = dt.timedelta(days=30)
"""How long a job's certificates are valid from their creation, unless the operator is told
otherwise (``certificate_validity_seconds``); renewed before they expire (`renewal_due`)."""
RENEW_FRACTION = 1 / 3
"""Renew once this fraction of a certificate's lifetime is left: ten days of thirty, time for
the kubelet to swap the files (about a minute) many times over, and for an operator that was
down for a while to catch up."""
_SKEW = dt.timedelta(minutes=5)


def worker_cert_key(index: int) -> str:
    """Secret key of worker ``index``'s certificate (its pod mounts it as `CERT_KEY`)."""
    return f"tls-{index}.crt"


def worker_key_key(index: int) -> str:
    """Secret key of worker ``index``'s private key (mounted as `KEY_KEY`)."""
    return f"tls-{index}.key"


@dataclass(frozen=True)
class ServerCertificate:
    """PEM texts of one server's certificate and private key."""

    cert: str
    key: str


@dataclass(frozen=True)
class JobCertificates:
    """PEM texts of the CA certificates to trust and of each server's certificate and key."""

    ca: str
    servers: tuple[ServerCertificate, ...]

    def secret_data(self) -> dict[str, str]:
        """The Secret's entries (before base64): `CA_KEY` and each worker's pair
        (`worker_cert_key`, `worker_key_key`)."""
        data = {CA_KEY: self.ca}
        for i, server in enumerate(self.servers):
            data[worker_cert_key(i)] = server.cert
            data[worker_key_key(i)] = server.key
        return data


def metrics_name(ref: resources.JobRef) -> str:
    """The name every worker's certificate also carries: what a PodMonitor verifies by (one
    ``serverName`` for all its targets). Control clients verify a worker's own name instead."""
    return f"{resources.service_name(ref.name)}.{ref.namespace}.svc"


def worker_names(ref: resources.JobRef, nodes: int) -> list[list[str]]:
    """Each worker's certificate names: its own stable DNS name, then `metrics_name`."""
    return [[resources.worker_host(ref, i), metrics_name(ref)] for i in range(nodes)]


def _name(common: str, unique: str = "") -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common[:64])]  # CN: 64 at most
    if unique:  # two CAs of one job (a renewal) must not share a subject: chains are built by it
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unique))
    return x509.Name(attributes)


def issue(
    servers: Sequence[Sequence[str]],
    now: dt.datetime,
    validity: dt.timedelta = VALIDITY,
    *,
    trusted: str = "",
) -> JobCertificates:
    """A fresh CA and one server certificate per entry of `servers` (its DNS names, the first
    also its CN). The CA may sign only those names. `trusted`: CA certificates (PEM) to keep
    trusting beside the new CA while they are valid (`trusted_bundle`; a renewal's old CA)."""
    if not servers or not all(servers):
        raise ValueError("every server certificate needs at least one name")
    start, end = now - _SKEW, now + validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"malleus CA {servers[0][0]}", secrets.token_hex(8))
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    permitted = [x509.DNSName(n) for n in dict.fromkeys(n for names in servers for n in names)]
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .add_extension(
            x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=None),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    issued = []
    for names in servers:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(names[0]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        issued.append(
            ServerCertificate(
                cert=cert.public_bytes(pem).decode(),
                key=key.private_bytes(
                    pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                ).decode(),
            )
        )
    # ca_key goes out of scope here: the only keys kept are the servers'.
    new_ca = ca.public_bytes(pem).decode()
    return JobCertificates(ca=trusted_bundle(new_ca, trusted, now), servers=tuple(issued))


def issue_for_job(
    ref: resources.JobRef,
    nodes: int,
    now: dt.datetime,
    validity: dt.timedelta = VALIDITY,
    *,
    trusted: str = "",
) -> JobCertificates:
    """`issue` for the job's workers (`worker_names`)."""
    return issue(worker_names(ref, nodes), now, validity, trusted=trusted)


def trusted_bundle(new_ca: str, previous: str, now: dt.datetime) -> str:
    """`new_ca` followed by each certificate of `previous` (PEM) still valid at `now` and not
    `new_ca` itself: the old CA stays trusted while pods may still serve its certificates,
    and drops out once they can no longer be valid."""
    kept = [new_ca]
    if previous.strip():
        for cert in x509.load_pem_x509_certificates(previous.encode()):
            text = cert.public_bytes(serialization.Encoding.PEM).decode()
            if cert.not_valid_after_utc > now and text not in kept:
                kept.append(text)
    return "".join(kept)


def expiry(cert_pem: str) -> tuple[dt.datetime, dt.datetime]:
    """(not valid before, not valid after) of the first certificate in `cert_pem`."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    return cert.not_valid_before_utc, cert.not_valid_after_utc


def renewal_due(cert_pem: str, now: dt.datetime) -> bool:
    """Whether the certificate in `cert_pem` has `RENEW_FRACTION` of its lifetime or less
    left at `now` (or is unreadable: a new one is the way out)."""
    try:
        start, end = expiry(cert_pem)
    except ValueError:
        return True
    return end - now <= (end - start - _SKEW) * RENEW_FRACTION  # the lifetime asked for


def renewed(
    data: Mapping[str, str],
    ref: resources.JobRef,
    nodes: int,
    now: dt.datetime,
    validity: dt.timedelta = VALIDITY,
) -> dict[str, str] | None:
    """The Secret entries to write when the job's certificates are due (`renewal_due` on
    worker 0's, which all share a lifetime), else None: new certificates for every worker and
    the CA bundle with the old CA kept (`trusted_bundle`). `data` is the Secret's current
    entries, decoded; the token is left alone."""
    current = data.get(worker_cert_key(0), "")
    if current and not renewal_due(current, now):
        return None
    fresh = issue_for_job(ref, nodes, now, validity, trusted=data.get(CA_KEY, ""))
    return fresh.secret_data()


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    """A CA signs certificates; a server signs its handshakes (ECDSA: digital signature)."""
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
