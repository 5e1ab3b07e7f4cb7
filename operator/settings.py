"""Operator-wide settings: from ``MALLEUS_OPERATOR_*`` environment variables or the CLI.

Environment variables (the Helm chart sets them) so the same values reach the operator however
kopf was started (``python -m malleus.operator`` hands its settings to kopf's memo; under ``kopf
run -m malleus.operator.handlers`` the startup handler reads them from the environment). Nothing
here is process-wide: the handlers get the settings from the memo. In the environment a list is
comma-separated and a flag is ``true``/``false``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import urllib.parse
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from malleus.control.capped import MAX_RESPONSE_BYTES
from malleus.errors import Fault
from malleus.job.limits import PlanningLimits
from malleus.job.podpolicy import PodTemplatePolicy

__all__ = ["DEFAULT_ENDPOINT", "Settings", "url_allowed"]

_PRIORITY_RANGE = 1_000_000

DEFAULT_ENDPOINT = "https://{pod}.{service}.{namespace}.svc:{port}"
"""How the operator reaches a worker's control port: its stable DNS name via the headless
Service, over HTTPS (the job's certificate, verified against the job's CA for that name
whatever the URL's host). Fields: pod, service, namespace, port, index, pod_ip. Tests and
out-of-cluster runs use e.g. ``https://{pod_ip}:{port}`` or ``https://127.0.0.1:{port}``."""

_PREFIX = "MALLEUS_OPERATOR_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_and_path(url: str) -> tuple[tuple[str, str, int], str] | None:
    """(scheme, host, port) and the path of a plain http(s) URL; None for anything else (user
    info, a query or fragment, ``.``/``..`` segments, another scheme, no host), which no
    allowlist admits."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or "@" in parts.netloc:
        return None
    segments = urllib.parse.unquote(parts.path).split("/")
    if parts.query or parts.fragment or "." in segments or ".." in segments:
        return None
    origin = (scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme])
    return origin, "/" + parts.path.strip("/")


def url_allowed(url: str, allowed: Iterable[str]) -> bool:
    """Whether ``url`` is one of the ``allowed`` base URLs or a path below one.

    Compared as URLs, not as strings: the scheme, host and port must be equal (a default port
    written or not) and the path must equal the entry's or continue it after a ``/``, so
    ``http://prom:9090`` admits ``http://prom:9090/api`` but neither ``http://prom:9090.evil``
    nor ``http://prom:90901``.
    """
    wanted = _origin_and_path(url)
    if wanted is None:
        return False
    for entry in allowed:
        base = _origin_and_path(entry)
        if base is None or base[0] != wanted[0]:
            continue
        prefix, path = base[1].rstrip("/"), wanted[1]
        if path == prefix or path == prefix + "/" or path.startswith(prefix + "/"):
            return True
    return False


def _pairs(text: str) -> dict[str, str]:
    """``key=value,key=value`` as a dict."""
    pairs = (item.partition("=") for item in text.split(",") if item.strip())
    return {k.strip(): v.strip() for k, _, v in pairs}


def _parse(raw: str, default: object, name: str) -> object:
    if isinstance(default, bool):
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError(f"{_PREFIX}{name.upper()}={raw!r}: expected true or false")
        return word in _TRUE
    if isinstance(default, tuple):
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    return type(default)(raw)


def _unparse(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


@dataclass(frozen=True)
class Settings:
    """Knobs of the operator process (not of a job: those live in the MalleusJob spec)."""

    metrics_port: int = 8081
    """Port of the operator's own /metrics (0 = off). kopf's liveness uses 8080."""
    endpoint_template: str = DEFAULT_ENDPOINT
    """URL template of a worker's control endpoint (see `DEFAULT_ENDPOINT`)."""
    ack_timeout_seconds: float = 600.0
    """How long the trainers may take to switch to a posted plan (a migration included)."""
    http_timeout_seconds: float = 5.0
    """Deadline of one whole request to a trainer or to Prometheus (connect, headers and body:
    a server that drips its answer is cut off at it, not at each read)."""
    max_response_bytes: int = MAX_RESPONSE_BYTES
    """The largest answer the operator reads from a trainer or from Prometheus; a larger one
    fails the request (a job's coordinator runs its author's image: a 400 MiB ``/status``
    must not take the operator's memory). The default fits a 65,536-GPU job's ``/metrics``."""
    kubeconfig: str = ""
    """Kubeconfig for the operator's own API calls; empty = in-cluster, then the default file."""
    context: str = ""
    """Kubeconfig context; empty = the current one."""
    prometheus_allowed_urls: tuple[str, ...] = ()
    """Base URLs a job's ``spec.metrics.prometheus.url`` may name (see `url_allowed`): the
    operator fetches that URL from its own pod, so anything else would let a job's author make
    it call any address it can reach. Empty: no job may use the Prometheus source."""
    network_policies: bool = True
    """Give every job a NetworkPolicy (`resources.build_network_policy`). Off only where no
    NetworkPolicy controller runs (the chart's ``networkPolicy.enabled``)."""
    pod_monitors: bool = False
    """Give every job a PodMonitor (`monitoring.build_pod_monitor`: the Prometheus Operator's,
    TLS verified against the job's own CA). The chart's ``metrics.podMonitor.enabled``."""
    pod_monitor_interval: str = "15s"
    """The scrape interval of the jobs' PodMonitors."""
    pod_monitor_labels: str = ""
    """Labels of the jobs' PodMonitors, ``key=value,key=value`` (what a Prometheus selects its
    monitors by)."""
    disruption_budgets: bool = True
    """Give every job a PodDisruptionBudget (`resources.build_disruption_budget`). Off only
    where the API has no ``policy/v1`` (the end-to-end tests' core-only cluster)."""
    operator_namespace: str = ""
    """The operator pod's namespace; with `operator_labels`, who a job's NetworkPolicy admits
    to the trainers' control port. Empty (out of the cluster): no operator peer."""
    operator_labels: str = ""
    """The operator pod's labels, ``key=value,key=value``."""
    control_port_peers: str = ""
    """More NetworkPolicyPeers for the control port (e.g. a Prometheus), a JSON list."""
    peering_name: str = ""
    """kopf's peering object (``KopfPeering`` in each watched namespace, ``ClusterKopfPeering``
    cluster-wide): with it, replicas see each other and only the highest priority works, the
    rest stand by. Empty: standalone, safe only as a single replica (the chart's
    ``peering.enabled``)."""
    peering_priority: int = 0
    """This replica's kopf priority; 0: derived from the pod name (``HOSTNAME``), so two
    replicas of one Deployment differ (kopf pauses every peer of equal priority)."""
    peering_lifetime_seconds: int = 60
    """How long a replica's heartbeat in the peering object counts (kopf's
    ``peering.lifetime``): a standby takes over this long after the active replica's last
    heartbeat (it heartbeats every lifetime minus 5-10 s, at least every second)."""

    pod_template_policy: str = ""
    """What a job's ``spec.podTemplate`` may put in its pods (`malleus.job.podpolicy`), a JSON
    object with the chart's ``podTemplatePolicy`` keys; empty: the policy's defaults. The
    operator checks it before it creates any pod (`template_policy`)."""
    service_account: str = ""
    """The operator pod's own ServiceAccount (the chart sets it from the downward API): no
    job's ``serviceAccountName`` may name it, whatever the policy says. Empty: unknown."""

    planning_limits: str = ""
    """What one job may ask of the planner (`malleus.job.limits.PlanningLimits`: maxGpus,
    maxPlanningSeconds, minCooldownSeconds), a JSON object with the chart's ``planningLimits``
    keys; empty: the defaults. Checked at startup (`limits`)."""
    certificate_validity_seconds: int = 30 * 86400
    """How long a job's TLS certificates are valid (`tls`); they are renewed while the job runs
    once a third of that is left, so a job may run for any time. Short values are for tests."""
    planner_processes: int = 4
    """Planner processes the jobs share (`malleus.controller.processes`): at most this many
    plans run at once, each job at most one; 0: plan in threads of the operator's process
    (no isolation: one job's planning then slows every other job's handling)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(raw, getattr(cls(), f.name), f.name)
        settings = cls(**values)  # type: ignore[arg-type]
        settings.control_port_peer_list()  # a malformed list fails at startup, not per job
        settings.template_policy()  # and so does a malformed policy
        settings.limits()  # and malformed planning limits
        if settings.certificate_validity_seconds < 60:
            raise ValueError(
                f"{_PREFIX}CERTIFICATE_VALIDITY_SECONDS={settings.certificate_validity_seconds}: "
                "need 60 or more (a certificate is renewed a third of its lifetime early)"
            )
        if settings.planner_processes < 0:
            raise ValueError(
                f"{_PREFIX}PLANNER_PROCESSES={settings.planner_processes}: need 0 or more"
            )
        return settings

    def to_env(self) -> dict[str, str]:
        """The environment that makes `from_env` return these settings."""
        return {_PREFIX + f.name.upper(): _unparse(getattr(self, f.name)) for f in fields(self)}

    def prometheus_url_allowed(self, url: str) -> bool:
        """Whether the operator may fetch ``url`` (`url_allowed` over the allowlist)."""
        return url_allowed(url, self.prometheus_allowed_urls)

    def metrics_faults(self, spec: Mapping[str, Any]) -> list[Fault]:
        """A fault when a job's ``spec.metrics.prometheus.url`` is not on the allowlist.

        Checked whatever ``spec.metrics.source`` says (the source is a live setting: switching
        it must not unlock a URL nobody checked).
        """
        prometheus = ((spec.get("metrics") or {}).get("prometheus")) or {}
        url = prometheus.get("url") if isinstance(prometheus, Mapping) else None
        if not url or self.prometheus_url_allowed(str(url)):
            return []
        allowed = ", ".join(self.prometheus_allowed_urls) or "none"
        return [
            Fault(
                "spec.metrics.prometheus.url",
                f"{url!r} is not on the operator's Prometheus allowlist (allowed: {allowed}; "
                "the chart's prometheus.allowedUrls)",
            )
        ]

    def template_policy(self) -> PodTemplatePolicy:
        """`pod_template_policy` parsed; pydantic's ValidationError when malformed."""
        return PodTemplatePolicy.from_json_text(self.pod_template_policy)

    def certificate_validity(self) -> dt.timedelta:
        return dt.timedelta(seconds=self.certificate_validity_seconds)

    def limits(self) -> PlanningLimits:
        """`planning_limits` parsed; ValueError naming the setting when malformed."""
        try:
            return PlanningLimits.from_json_text(self.planning_limits)
        except ValueError as e:  # pydantic's ValidationError is one
            raise ValueError(
                f"{_PREFIX}PLANNING_LIMITS (the chart's planningLimits) is invalid: {e}"
            ) from None

    def operator_selector(self) -> dict[str, str]:
        """`operator_labels` as a label selector's ``matchLabels``."""
        return _pairs(self.operator_labels)

    def pod_monitor_label_map(self) -> dict[str, str]:
        """`pod_monitor_labels` as a dict."""
        return _pairs(self.pod_monitor_labels)

    def control_port_peer_list(self) -> list[dict[str, Any]]:
        """`control_port_peers` parsed; ValueError unless a JSON list of objects."""
        peers = json.loads(self.control_port_peers) if self.control_port_peers.strip() else []
        if not isinstance(peers, list) or not all(isinstance(p, dict) and p for p in peers):
            raise ValueError(
                f"{_PREFIX}CONTROL_PORT_PEERS must be a JSON list of NetworkPolicyPeer objects, "
                f"got {self.control_port_peers!r}"
            )
        return peers

    def priority(self, environ: Mapping[str, str] | None = None) -> int:
        """`peering_priority`, else 1 + crc32 of the pod name (``HOSTNAME``) below a million:
        stable for a pod, distinct between replicas but for a one-in-a-million clash (which
        kopf resolves safely: every peer pauses and warns)."""
        if self.peering_priority:
            return self.peering_priority
        host = (os.environ if environ is None else environ).get("HOSTNAME", "")
        return 1 + zlib.crc32(host.encode()) % _PRIORITY_RANGE

    def peering_options(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """kopf.run's peering arguments: standalone, or the peering name and our priority."""
        if not self.peering_name:
            return {"standalone": True}
        return {
            "standalone": False,
            "peering_name": self.peering_name,
            "priority": self.priority(environ),
        }

    def apply_peering(self, peering: Any, environ: Mapping[str, str] | None = None) -> None:
        """The same onto kopf's ``settings.peering`` (under a bare ``kopf run``, whose startup
        handler reads the settings from the environment)."""
        options = self.peering_options(environ)
        peering.standalone = options["standalone"]
        if not peering.standalone:
            peering.mandatory = True
            peering.name = options["peering_name"]
            peering.priority = options["priority"]
            peering.lifetime = max(1, self.peering_lifetime_seconds)

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]
