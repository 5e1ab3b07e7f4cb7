"""spec.metrics.prometheus auth and TLS: read by name from the job's namespace, handed to the
PrometheusSource (which tests/prometheus/test_real_prometheus.py runs against Prometheus)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from malleus.controller.prometheus import PrometheusSource
from malleus.errors import BadInput
from malleus.job import ResolvedJob, load_job
from malleus.operator import resources
from malleus.operator.sources import (
    CREDENTIALS_LABEL,
    PrometheusAuthError,
    prometheus_credentials,
    rate_source,
)

BASE: dict[str, Any] = {
    "apiVersion": "malleus.io/v1alpha1",
    "kind": "MalleusJob",
    "metadata": {"name": "mj", "namespace": "ml"},
    "spec": {
        "image": "malleus:test",
        "nodes": 2,
        "gpusPerNode": 4,
        "model": {"preset": "tiny"},
        "training": {
            "globalBatchSize": 16,
            "microBatchSize": 2,
            "steps": 10,
            "learningRate": 0.001,
        },
        "parallelism": {"tp": 2},
    },
}


def job(prometheus: dict[str, Any]) -> ResolvedJob:
    manifest = copy.deepcopy(BASE)
    manifest["spec"]["metrics"] = {"source": "prometheus", "prometheus": prometheus}
    return ResolvedJob.of(load_job(manifest))


class Cluster:
    """The two reads of operator/k8s.py that the credentials use, over a dict of objects."""

    def __init__(self, objects: dict[tuple[str, str, str], dict[str, Any]]) -> None:
        self.objects = objects
        self.reads: list[tuple[str, str, str]] = []

    async def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append((kind, namespace, name))
        return self.objects.get((kind, namespace, name))

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        secret = await self.read("Secret", namespace, name)
        return None if secret is None else secret.get("stringData", {}).get(key)


CA = "-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----\n"
MARKED = {"labels": {CREDENTIALS_LABEL: "true"}}
"""A Secret its owner marked for the operator's Prometheus client."""
CLUSTER = {
    ("Secret", "ml", "prom-token"): {"metadata": MARKED, "stringData": {"token": "abc\n"}},
    ("ConfigMap", "ml", "prom-ca"): {"data": {"ca.crt": CA}},
    ("Secret", "ml", "prom-ca"): {"metadata": MARKED, "stringData": {"bundle.pem": CA}},
    ("Secret", "ml", "db-password"): {"stringData": {"password": "hunter2"}},
}
URL = "https://thanos.monitoring:10902"


def test_token_and_ca_are_read_from_the_jobs_namespace_by_name() -> None:
    spec = {
        "url": URL,
        "bearerTokenSecret": {"name": "prom-token", "key": "token"},
        "tls": {"caConfigMap": {"name": "prom-ca", "key": "ca.crt"}},
    }
    cluster = Cluster(CLUSTER)
    resolved = job(spec)
    token, ca = asyncio.run(prometheus_credentials(cluster, "ml", resolved))
    assert (token, ca) == ("abc", CA)
    assert cluster.reads == [  # the Secret's label, then its value; the ConfigMap
        ("Secret", "ml", "prom-token"),
        ("Secret", "ml", "prom-token"),
        ("ConfigMap", "ml", "prom-ca"),
    ]
    secret_ca = {**spec, "tls": {"caSecret": {"name": "prom-ca", "key": "bundle.pem"}}}
    assert asyncio.run(prometheus_credentials(cluster, "ml", job(secret_ca)))[1] == CA
    source = rate_source(
        resolved,
        resources.JobRef("ml", "mj"),
        "https://unused",
        timeout=1.0,
        prometheus_auth=(token, None),
    )
    assert isinstance(source, PrometheusSource)
    assert source._headers["Authorization"] == "Bearer abc"


def test_a_missing_key_stops_instead_of_querying_unauthenticated() -> None:
    spec = {"url": URL, "bearerTokenSecret": {"name": "prom-token", "key": "nope"}}
    with pytest.raises(PrometheusAuthError, match="ml/prom-token has no key 'nope'"):
        asyncio.run(prometheus_credentials(Cluster(CLUSTER), "ml", job(spec)))
    assert asyncio.run(prometheus_credentials(Cluster({}), "ml", job({"url": URL}))) == (
        None,
        None,
    )


def test_the_schema_takes_one_ca_source() -> None:
    both = {"caSecret": {"name": "a", "key": "k"}, "caConfigMap": {"name": "b", "key": "k"}}
    with pytest.raises(BadInput, match="tls"):
        job({"url": URL, "tls": both})
    with pytest.raises(BadInput, match="key"):
        job({"url": URL, "bearerTokenSecret": {"name": "prom-token"}})


@pytest.mark.usefixtures("cluster_crd")
def test_the_real_api_server_keeps_the_auth_fields_and_refuses_two_ca_sources(
    admin_api: Any, job_namespace: str
) -> None:
    url = f"/apis/malleus.io/v1alpha1/namespaces/{job_namespace}/malleusjobs"
    manifest = copy.deepcopy(BASE)
    del manifest["metadata"]["namespace"]
    prom = {
        "url": URL,
        "bearerTokenSecret": {"name": "prom-token", "key": "token"},
        "tls": {"caSecret": {"name": "prom-ca", "key": "ca.crt"}},
    }
    manifest["spec"]["metrics"] = {"source": "prometheus", "prometheus": prom}
    response = admin_api.client.post(url, json=manifest)
    assert response.status_code == 201, response.text
    kept = response.json()["spec"]["metrics"]["prometheus"]
    assert (kept["bearerTokenSecret"], kept["tls"]) == (prom["bearerTokenSecret"], prom["tls"])
    manifest["metadata"]["name"] = "mj-two-cas"
    prom["tls"] = {"caSecret": {"name": "a", "key": "k"}, "caConfigMap": {"name": "b", "key": "k"}}
    response = admin_api.client.post(url, json=manifest)
    assert response.status_code == 422, response.text
    assert "spec.metrics.prometheus.tls" in response.text


@pytest.mark.parametrize("field", ["bearerTokenSecret", "caSecret"])
def test_a_job_cannot_make_the_operator_read_a_secret_its_owner_did_not_mark(field: str) -> None:
    """The confused deputy: a job author who may not read Secrets names the namespace's
    database password as the Prometheus token (or CA). The operator refuses before reading the
    value, naming the label that would allow it; nothing reaches a Prometheus client."""
    ref = {"name": "db-password", "key": "password"}
    spec: dict[str, Any] = {"url": URL}
    if field == "bearerTokenSecret":
        spec["bearerTokenSecret"] = ref
    else:
        spec["tls"] = {"caSecret": ref}
    cluster = Cluster(CLUSTER)
    with pytest.raises(PrometheusAuthError, match=f"not labelled {CREDENTIALS_LABEL}=true"):
        asyncio.run(prometheus_credentials(cluster, "ml", job(spec)))
    assert cluster.reads == [("Secret", "ml", "db-password")]  # the label looked at, no value read
