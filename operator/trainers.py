"""Where a job's trainers are: the URL of a worker's control endpoint (DESIGN §4.4).

Not the Kubernetes API (that is `k8s.py`): these are the workers' control endpoints, by default
reached through their stable DNS names under the job's headless Service. The URL comes from a
template (`settings.DEFAULT_ENDPOINT`) so tests and out-of-cluster operators can point it
elsewhere; ``{pod_ip}`` in the template is resolved by reading the pod through the cluster.

The coordinator (node 0, global rank 0) publishes every rank's rate, takes plans and reports
the plan in force, so the operator talks to it alone, through `malleus.job.control`'s client.
"""

from __future__ import annotations

from . import resources
from .k8s import Cluster

__all__ = ["Endpoints"]


class Endpoints:
    """Base URLs of a job's workers from a template such as ``https://{pod}.{service}...``."""

    def __init__(self, cluster: Cluster, ref: resources.JobRef, port: int, template: str) -> None:
        self.cluster = cluster
        self.ref = ref
        self.port = port
        self.template = template

    async def url(self, index: int = 0) -> str:
        """Base URL of worker ``index`` (0 = the coordinator); ConnectionError if unknown yet."""
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
            port=self.port,
            index=index,
            pod_ip=pod_ip,
        ).rstrip("/")
