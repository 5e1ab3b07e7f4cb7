"""What every handler needs, made once at startup and handed over through kopf's memo.

The API client (`k8s.Cluster`), the operator's settings and its metrics live here rather than
in module globals, so two operators (or two tests) in one process never share them and no test
resets process-wide state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from malleus.controller.planning import Planner, default_planner
from malleus.controller.processes import PlannerProcesses
from malleus.job.limits import PlanningLimits

from .k8s import Cluster
from .metrics import OperatorMetrics
from .settings import Settings
from .syncs import SyncQueue

__all__ = ["MEMO_KEY", "Context"]

MEMO_KEY = "malleus"
"""The memo key the startup handler stores the `Context` under."""


@dataclass(frozen=True)
class Context:
    """The cluster to call, the settings in force and the metrics to count in; the planner
    processes every job's plans run in (None: threads of this process); the queue that
    coalesces each job's pod events."""

    cluster: Cluster
    settings: Settings
    metrics: OperatorMetrics
    planners: PlannerProcesses | None = None
    pod_syncs: SyncQueue[Any] = field(default_factory=SyncQueue)
    """Each job's pod events coalesced into few syncs (`children.sync_pods`)."""

    def planner(self, key: str) -> Planner:
        """Job ``key``'s planner: its share of the planner processes, else the search in a
        thread (`default_planner`)."""
        return self.planners.for_job(key) if self.planners is not None else default_planner

    @property
    def limits(self) -> PlanningLimits:
        """The operator's planning limits (validated at startup)."""
        return self.settings.limits()

    @classmethod
    def of(cls, memo: Mapping[str, Any]) -> Context:
        """The context a handler's ``memo`` carries (set by the startup handler)."""
        ctx = memo.get(MEMO_KEY)
        if not isinstance(ctx, Context):
            raise RuntimeError("the operator's startup handler has not run: no context in memo")
        return ctx
