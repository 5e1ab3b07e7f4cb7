"""Where a job's trainers are: the URL of a rank's control endpoint, and which one is the
coordinator (docs/reference/trainer.md, "Control endpoint").

Not the Kubernetes API (that is `k8s.py`): these are the workers' control endpoints, by default
reached through their stable DNS names under the job's headless Service. The URL comes from a
template (`settings.DEFAULT_ENDPOINT`) so tests and out-of-cluster operators can point it
elsewhere; ``{pod_ip}`` in the template is resolved by reading the pod through the cluster.

The coordinator (the lowest GPU still in the job: global rank 0 until a failure takes it out)
publishes every rank's rate, takes plans and reports the plan in force, so the operator talks
to it alone, through `malleus.control`'s client. Every rank has a control port of its own
(``spec.controlPort + local rank``, `workers.control_ports`) and only the coordinator serves
it, so `Endpoints.coordinator` asks the running pods, lowest node first, each of its ranks'
ports in turn, and takes the first that answers ``GET /status``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from malleus.control import (
    MAX_RESPONSE_BYTES,
    AsyncControlClient,
    ControlError,
    ControlStatus,
    ControlTLS,
)
from malleus.planner.plan import Plan

from . import resources
from .k8s import Cluster

__all__ = ["Coordinator", "Endpoints", "fetch_plan", "running_nodes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Coordinator:
    """The rank that speaks for the job: its node, local rank, URL, TLS check and status."""

    node: int
    local_rank: int
    url: str
    tls: ControlTLS | None
    status: ControlStatus


def running_nodes(pods: list[Mapping[str, Any]], job: str, uid: str) -> list[int]:
    """Nodes whose worker pod (controlled by the job) may serve: running ones first, then those
    not known to have failed (a phase not reported yet), never one being deleted."""
    found: list[tuple[bool, int]] = []
    for p in pods:
        meta = p.get("metadata") or {}
        name = str(meta.get("name") or "")
        prefix = f"{job}-node-"
        tail = name[len(prefix) :]
        if not name.startswith(prefix) or not tail.isdigit() or str(int(tail)) != tail:
            continue  # not exactly a worker's name: `<job>-node-01` is not node 1
        if not resources.owned_by(p, uid) or meta.get("deletionTimestamp"):
            continue
        phase = (p.get("status") or {}).get("phase") or "Pending"
        if phase in ("Failed", "Succeeded"):
            continue
        found.append((phase != "Running", int(name[len(prefix) :])))
    return [node for _, node in sorted(found)]


class Endpoints:
    """Base URLs of a job's ranks from a template such as ``https://{pod}.{service}...``."""

    def __init__(
        self,
        cluster: Cluster,
        ref: resources.JobRef,
        port: int,
        template: str,
        *,
        gpus_per_node: int = 1,
        ca: str | None = None,
        token: str | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.cluster = cluster
        self.ref = ref
        self.port = port
        self.template = template
        self.gpus_per_node = gpus_per_node
        self.ca = ca
        self.token = token
        """The job's control token: ``GET /status`` needs it like every call but health."""
        self.max_bytes = max_bytes
        """The largest answer read from a trainer (`malleus.control.MAX_RESPONSE_BYTES`)."""

    def client(self, url: str, trust: ControlTLS | None, timeout: float) -> AsyncControlClient:
        """A client of the endpoint at `url` with the job's token and the operator's cap."""
        return AsyncControlClient(
            url, self.token, timeout=timeout, tls=trust, max_bytes=self.max_bytes
        )

    async def url(self, index: int = 0, local_rank: int = 0) -> str:
        """Base URL of rank ``local_rank`` of worker ``index``; ConnectionError if unknown yet."""
        pod = resources.pod_name(self.ref.name, index)
        pod_ip = ""
        if "{pod_ip}" in self.template:
            body = await self.cluster.read("Pod", self.ref.namespace, pod)
            pod_ip = ((body or {}).get("status") or {}).get("podIP") or ""
            if not pod_ip:
                raise ConnectionError(f"pod {pod} has no IP yet")
        return self.template.format(
            pod=pod,
            service=resources.service_name(self.ref.name),
            namespace=self.ref.namespace,
            port=self.port + local_rank,
            index=index,
            pod_ip=pod_ip,
        ).rstrip("/")

    def trust(self, index: int) -> ControlTLS | None:
        """How to verify worker ``index``: the job's CA, for its stable DNS name."""
        if not self.ca:
            return None
        return ControlTLS(self.ca, server_name=resources.worker_host(self.ref, index))

    async def coordinator(self, timeout: float) -> Coordinator:
        """The rank serving the control endpoint, lowest running node and rank first;
        ConnectionError when none answers (yet)."""
        pods = await self.cluster.list_children("Pod", self.ref.namespace, self.ref.name)
        nodes = running_nodes(pods, self.ref.name, self.ref.uid)
        tried: list[str] = []
        for node in nodes:
            for local in range(self.gpus_per_node):
                try:
                    url = await self.url(node, local)
                except ConnectionError as e:
                    tried.append(str(e))
                    break
                trust = self.trust(node)
                try:
                    async with self.client(url, trust, timeout) as client:
                        answer = await client.status()
                except ControlError as e:
                    tried.append(str(e))
                    continue
                return Coordinator(node, local, url, trust, answer)
        if not nodes:
            raise ConnectionError("no worker pod runs")
        raise ConnectionError("no rank serves the control endpoint: " + "; ".join(tried[-4:]))


async def fetch_plan(client: AsyncControlClient) -> Plan | None:
    """The plan in force on the trainers (``GET /plan``: a recovery's plan too), or None when
    the endpoint does not serve it (or serves more than the client's cap, or garbage)."""
    try:
        return await client.plan()
    except ControlError:
        return None
