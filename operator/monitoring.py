"""The job's PodMonitor: how a Prometheus (the Prometheus Operator's) scrapes its trainers.

One PodMonitor per job, in the job's namespace, made by the operator when its settings ask
(`Settings.pod_monitors`, the chart's ``metrics.podMonitor.enabled``), because only a per-job
monitor can verify the endpoints: each job has a CA of its own (`tls`), and the Prometheus
Operator's ``tlsConfig.ca.secret`` names a Secret of the monitor's own namespace. So the scrape
trusts the job's CA alone (``<job>-control``'s ``ca.crt``) and checks the certificate for the
workers' stable name (``serverName``: one certificate names every worker), never
``insecureSkipVerify``: a party on the pod network cannot serve forged series for the job.

The monitor selects the job's worker pods only, on their ``control`` port, where every worker
pod serves ``/metrics`` for its own ranks (the coordinator's endpoint, or the pod's first rank's
metrics-only one): N pods, N live targets (Prometheus reaches them where the job's NetworkPolicy admits it:
``networkPolicy.controlPortPeers``), with ``honorLabels: false``, so ``pod`` and ``namespace``
are what service discovery says, never what a series claims: the Prometheus rate source
(`malleus.controller.prometheus`) relies on that. The worker pods carry no
``prometheus.io/scrape`` annotation: the common annotation-driven scrape job honours a series'
own labels. The garbage collector deletes the monitor with its job (controller owner).

A monitor that cannot be made (no PodMonitor CRD, no right to create one, a name taken) never
holds the job back: a warning and a ``PodMonitorFailed`` Warning event say why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from malleus.job import ResolvedJob

from . import tls
from .context import Context
from .identity import COMPONENT, JOB_LABEL, MANAGED_BY, JobRef, metadata, secret_name
from .k8s import ApiError, NameConflict
from .resources import CONTROL_PORT_NAME

__all__ = ["API_VERSION", "PLURAL", "build_pod_monitor", "ensure_pod_monitor", "pod_monitor_name"]

log = logging.getLogger(__name__)

API_VERSION = "monitoring.coreos.com/v1"
PLURAL = "podmonitors"


def pod_monitor_name(job: str) -> str:
    """The job's PodMonitor."""
    return f"{job}-trainers"


def build_pod_monitor(
    job: ResolvedJob,
    ref: JobRef,
    *,
    interval: str = "15s",
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The PodMonitor of the job's workers: HTTPS verified against the job's CA for the
    job's metrics name every worker's certificate carries (`tls.metrics_name`),
    ``honorLabels: false``, the pod's node as ``node``. `labels`: extra
    labels a Prometheus selects its monitors by (``release: ...``)."""
    del job  # one port name and one certificate for every node, whatever the layout
    meta = metadata(ref, pod_monitor_name(ref.name))
    meta["labels"] = {**meta.get("labels", {}), **(labels or {})}
    return {
        "apiVersion": API_VERSION,
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "namespaceSelector": {"matchNames": [ref.namespace]},
            "selector": {
                "matchLabels": {
                    JOB_LABEL: ref.name,
                    "app.kubernetes.io/managed-by": MANAGED_BY,
                    "app.kubernetes.io/component": COMPONENT,
                }
            },
            "podMetricsEndpoints": [
                {
                    "port": CONTROL_PORT_NAME,
                    "path": "/metrics",
                    "scheme": "https",
                    "interval": interval,
                    "honorLabels": False,
                    "tlsConfig": {
                        "ca": {"secret": {"name": secret_name(ref.name), "key": tls.CA_KEY}},
                        "serverName": tls.metrics_name(ref),
                        "insecureSkipVerify": False,
                    },
                    "relabelings": [
                        {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
                    ],
                }
            ],
        },
    }


async def ensure_pod_monitor(ctx: Context, job: ResolvedJob, ref: JobRef) -> bool:
    """Create the job's PodMonitor when the settings ask for one (idempotent by name and
    owner); True when this call created it. Failures are a warning and an event, never an
    error."""
    settings = ctx.settings
    if not settings.pod_monitors:
        return False
    wanted = build_pod_monitor(
        job,
        ref,
        interval=settings.pod_monitor_interval,
        labels=settings.pod_monitor_label_map(),
    )
    try:
        _, created = await ctx.cluster.create_custom(wanted, PLURAL)
    except NameConflict as e:
        why = str(e)
    except ApiError as e:
        why = (
            "the PodMonitor API (monitoring.coreos.com/v1) is not served"
            if e.status == 404
            else f"{e.status} {e.reason}"
        )
    else:
        return created
    message = f"PodMonitor {ref.namespace}/{pod_monitor_name(ref.name)} not created: {why}"
    log.warning("%s/%s: %s", ref.namespace, ref.name, message)
    await ctx.cluster.post_event(ref, "Warning", "PodMonitorFailed", message)
    return False
