"""Operator-wide settings: from ``MALLEUS_OPERATOR_*`` environment variables or the CLI.

Environment variables (the Helm chart sets them) so the same values reach the operator however
kopf was started (``python -m malleus.operator`` hands its settings to kopf's memo; under ``kopf
run -m malleus.operator.handlers`` the startup handler reads them from the environment). Nothing
here is process-wide: the handlers get the settings from the memo.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

__all__ = ["DEFAULT_ENDPOINT", "Settings"]

DEFAULT_ENDPOINT = "http://{pod}.{service}.{namespace}.svc:{port}"
"""How the operator reaches a worker's control port: its stable DNS name via the headless
Service. Fields: pod, service, namespace, port, index, pod_ip. Tests and out-of-cluster runs
use e.g. ``http://{pod_ip}:{port}`` or ``http://127.0.0.1:{port}``."""

_PREFIX = "MALLEUS_OPERATOR_"


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
    """Timeout of one request to a trainer or to Prometheus."""
    kubeconfig: str = ""
    """Kubeconfig for the operator's own API calls; empty = in-cluster, then the default file."""
    context: str = ""
    """Kubeconfig context; empty = the current one."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            default = getattr(cls(), f.name)
            values[f.name] = type(default)(raw)
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The environment that makes `from_env` return these settings."""
        return {_PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in fields(self)}

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]
