"""``python -m malleus.operator``: run the MalleusJob operator (kopf) with its handlers.

Equivalent to ``kopf run -m malleus.operator.handlers --liveness=...`` plus the operator's own
settings. With ``--peering NAME`` (the chart's ``peering.enabled``) replicas elect one active
operator through kopf's peering object, by priority (`Settings.priority`); without, standalone:
safe only as one replica (the chart then uses the Recreate strategy).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .settings import Settings

__all__ = ["build_parser", "main"]

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def build_parser() -> argparse.ArgumentParser:
    defaults = Settings.from_env()
    p = argparse.ArgumentParser(
        prog="python -m malleus.operator",
        description="Run the Malleus operator: watches MalleusJobs, creates their workers, "
        "re-plans around straggling GPUs.",
    )
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; globs allowed); default: all namespaces",
    )
    p.add_argument(
        "--liveness",
        default=os.environ.get("MALLEUS_OPERATOR_LIVENESS", DEFAULT_LIVENESS),
        help=f"kopf's liveness endpoint URL ('' = off); default {DEFAULT_LIVENESS}",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=defaults.metrics_port,
        help=f"port of the operator's Prometheus /metrics (0 = off); default {defaults.metrics_port}",
    )
    p.add_argument(
        "--endpoint-template",
        default=defaults.endpoint_template,
        help="URL template of a worker's control endpoint; fields {pod} {service} {namespace} "
        "{port} {index} {pod_ip}; default %(default)s",
    )
    p.add_argument(
        "--ack-timeout",
        type=float,
        default=defaults.ack_timeout_seconds,
        help="seconds the trainers may take to switch to a posted plan; default %(default)s",
    )
    p.add_argument(
        "--allow-prometheus",
        action="append",
        default=list(defaults.prometheus_allowed_urls),
        metavar="URL",
        help="a Prometheus base URL jobs may name in spec.metrics.prometheus.url (repeatable); "
        "default: none",
    )
    p.add_argument(
        "--network-policies",
        action=argparse.BooleanOptionalAction,
        default=defaults.network_policies,
        help="give every job a NetworkPolicy (off where no NetworkPolicy controller runs); "
        "default %(default)s",
    )
    p.add_argument(
        "--peering",
        default=defaults.peering_name,
        metavar="NAME",
        help="kopf peering object for leader election between replicas ('' = standalone); "
        "default %(default)r",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=defaults.peering_priority,
        help="this replica's peering priority (0 = derived from the pod name); default %(default)s",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=defaults.peering_lifetime_seconds,
        metavar="SECONDS",
        help="how long a replica's peering heartbeat counts: a standby takes over this long "
        "after the active replica's last one; default %(default)s",
    )
    p.add_argument("--kubeconfig", default=defaults.kubeconfig or None, help="kubeconfig file")
    p.add_argument("--context", default=defaults.context or None, help="kubeconfig context")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    p.add_argument("--debug", action="store_true", help="log everything, kopf's internals too")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kubeconfig:
        # kopf logs in through the kubernetes client, which reads KUBECONFIG on import.
        os.environ["KUBECONFIG"] = args.kubeconfig
    settings = Settings.from_env().with_(
        metrics_port=args.metrics_port,
        endpoint_template=args.endpoint_template,
        ack_timeout_seconds=args.ack_timeout,
        prometheus_allowed_urls=tuple(args.allow_prometheus),
        network_policies=args.network_policies,
        peering_name=args.peering,
        peering_priority=args.priority,
        peering_lifetime_seconds=args.peering_lifetime,
        kubeconfig=args.kubeconfig or "",
        context=args.context or "",
    )
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose, debug=args.debug)
    kopf.run(
        **settings.peering_options(),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(settings=settings),  # the startup handler builds the Context from it
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
