"""A job's TLS identity: a CA of its own and the certificate its control endpoints serve.

The trainers' control endpoints take the job's bearer token, so they serve HTTPS: the operator
makes, per job, a CA and a server certificate signed by it for the workers' stable DNS names
(``<job>-node-<i>.<job>.<namespace>.svc``, by name because a pod's IP is not known before it
runs), and stores the CA certificate, the server certificate and its key in the job's Secret
beside the token. The pods mount the certificate and key; the operator (and anyone given the
Secret) trusts the CA alone (`malleus.control.ControlTLS`).

The CA's private key is thrown away as soon as the server certificate is signed: nothing can
ever sign another certificate that this job's clients trust, so a leaked Secret exposes one
job, never a name of another. Keys are ECDSA P-256 (fast to make on every create, small).
Certificates are valid for `VALIDITY` from their creation (a few minutes earlier, for clock
skew): short enough that a copied key does not outlive the job by much, long enough for a long
training run. There is no rotation yet: a job running longer keeps training, but its endpoint
presents an expired certificate and the operator can no longer re-plan it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
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
    "VALIDITY",
    "JobCertificates",
    "issue",
    "worker_names",
]

CA_KEY = "ca.crt"
"""Secret key of the job's CA certificate (PEM): what a client verifies the endpoint with."""
CERT_KEY = "tls.crt"
"""Secret key of the server certificate (PEM), mounted in the pods."""
KEY_KEY = "tls.key"
"""Secret key of the server's private key (PEM, unencrypted PKCS#8), mounted in the pods."""
VALIDITY = dt.timedelta(days=30)
"""How long a job's certificates are valid from their creation."""
_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class JobCertificates:
    """PEM texts of one job's CA certificate, server certificate and server key."""

    ca: str
    cert: str
    key: str

    def secret_data(self) -> dict[str, str]:
        """The Secret's entries (before base64): `CA_KEY`, `CERT_KEY`, `KEY_KEY`."""
        return {CA_KEY: self.ca, CERT_KEY: self.cert, KEY_KEY: self.key}


def worker_names(ref: resources.JobRef, nodes: int) -> list[str]:
    """The stable DNS name of every worker pod under the job's headless Service."""
    service = resources.service_name(ref.name)
    return [
        f"{resources.pod_name(ref.name, i)}.{service}.{ref.namespace}.svc" for i in range(nodes)
    ]


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common[:64])])  # CN: 64 at most


def issue(
    names: Sequence[str], now: dt.datetime, validity: dt.timedelta = VALIDITY
) -> JobCertificates:
    """A fresh CA and a server certificate for `names` (DNS names, the first also its CN)."""
    if not names:
        raise ValueError("a server certificate needs at least one name")
    start, end = now - _SKEW, now + validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"malleus CA {names[0]}")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
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
        .sign(ca_key, hashes.SHA256())
    )
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
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    # ca_key goes out of scope here: the only key kept is the server's.
    pem = serialization.Encoding.PEM
    return JobCertificates(
        ca=ca.public_bytes(pem).decode(),
        cert=cert.public_bytes(pem).decode(),
        key=key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    )


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
