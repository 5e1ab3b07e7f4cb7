"""Where a job's trainers are, and what the coordinator reports (DESIGN §4.4).

Not the Kubernetes API (that is `k8s.py`): these are the workers' control endpoints, by default
reached through their stable DNS names under the job's headless Service. The URL comes from a
template (`settings.DEFAULT_ENDPOINT`) so tests and out-of-cluster operators can point it
elsewhere; ``{pod_ip}`` in the template is resolved by reading the pod through `k8s`.

The coordinator (node 0, global rank 0) publishes every rank's rate, takes plans and reports
the plan in force, so the operator talks to it alone.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from . import k8s, resources

__all__ = ["Endpoints", "read_status"]


class Endpoints:
    """Base URLs of a job's workers from a template such as ``http://{pod}.{service}...``."""

    def __init__(self, ref: resources.JobRef, port: int, template: str) -> None:
        self.ref = ref
        self.port = port
        self.template = template

    async def url(self, index: int = 0) -> str:
        """Base URL of worker ``index`` (0 = the coordinator); ConnectionError if unknown yet."""
        pod = resources.pod_name(self.ref.name, index)
        pod_ip = ""
        if "{pod_ip}" in self.template:
            body = await k8s.read("Pod", self.ref.namespace, pod)
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


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


async def read_status(url: str, timeout: float) -> dict[str, Any] | None:
    """The coordinator's ``GET /status`` JSON, or None when it cannot be read now.

    urllib in a worker thread, like the controller's own HTTP ports: no HTTP client library
    beyond the operator's dependencies.
    """
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an HTTP URL: {url!r}")
    try:
        data = await asyncio.to_thread(_get_json, url + "/status", timeout)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
