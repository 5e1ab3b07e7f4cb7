"""What every handler needs, made once at startup and handed over through kopf's memo.

The API client (`k8s.Cluster`), the operator's settings and its metrics live here rather than
in module globals, so two operators (or two tests) in one process never share them and no test
resets process-wide state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .k8s import Cluster
from .metrics import OperatorMetrics
from .settings import Settings

__all__ = ["MEMO_KEY", "Context"]

MEMO_KEY = "malleus"
"""The memo key the startup handler stores the `Context` under."""


@dataclass(frozen=True)
class Context:
    """The cluster to call, the settings in force and the metrics to count in."""

    cluster: Cluster
    settings: Settings
    metrics: OperatorMetrics

    @classmethod
    def of(cls, memo: Mapping[str, Any]) -> Context:
        """The context a handler's ``memo`` carries (set by the startup handler)."""
        ctx = memo.get(MEMO_KEY)
        if not isinstance(ctx, Context):
            raise RuntimeError("the operator's startup handler has not run: no context in memo")
        return ctx
