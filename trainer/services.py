"""What the training loop plugs into: clock, rate profiler, metrics, control endpoint, status,
and on rank 0 the plan inbox and stop request that the switch protocol reads at step boundaries.

The loop calls the same few methods whether these are real (emulated clock, Prometheus metrics,
HTTP control server) or the no-op defaults, so tests and the reference need none of them.
`WorkerState` is the loop's own thread-safe record of where it is, read by GET /status.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import TrainConfig
from .plan_inbox import PlanInbox
from .profiling import RateProfiler
from .switch import StopControl

__all__ = ["NullClock", "Services", "WorkerState"]

log = logging.getLogger(__name__)


class NullClock:
    """Real timings: charges nothing, takes no injections."""

    factor = 1.0
    reference_s: float | None = None

    def set_step(self, step: int) -> float:
        return 1.0

    def compute(self, kind: str, shards: int, started: float) -> float:
        return 0.0

    def inject(self, factor: float) -> None:
        raise ValueError("slowdowns can be injected only with emulation enabled")


class WorkerState:
    """Where this rank's loop is (plan in force, step, last figures); safe to read from HTTP."""

    def __init__(self, job: str, rank: int) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {
            "job": job,
            "rank": rank,
            "role": None,
            "generation": None,
            "step": 0,
            "loss": None,
            "grad_norm": None,
            "lr": None,
            "step_seconds": None,
            "tokens_per_second": None,
            "rates": {},
            "migration": dict.fromkeys(
                ("generation", "step", "seconds", "bytes", "minimal_bytes", "transfers")
            ),
        }

    def update(self, **values: Any) -> None:
        with self._lock:
            self._data.update(values)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out = dict(self._data)
            out["rates"] = {str(k): v for k, v in sorted(self._data["rates"].items())}
            out["migration"] = dict(self._data["migration"])
            return out


@dataclass
class Services:
    """The loop's collaborators for one rank."""

    state: WorkerState
    clock: Any = field(default_factory=NullClock)  # EmulatedClock-like
    profiler: RateProfiler = field(default_factory=lambda: RateProfiler(None))
    metrics: Any | None = None  # TrainerMetrics
    server: Any | None = None  # ControlServer
    injections: Any | None = None  # InjectionQueue (processes serving HTTP, emulation on)
    inbox: PlanInbox | None = None  # the coordinator's (rank 0) plan inbox
    stop: StopControl | None = None  # the coordinator's stop request
    note: Callable[[str], None] | None = None  # tells the local launcher what the job is doing

    @property
    def emulated(self) -> bool:
        return not isinstance(self.clock, NullClock)

    @classmethod
    def null(cls, cfg: TrainConfig, rank: int) -> Services:
        """Clock and profiler only (emulated when the job says so); no metrics, no HTTP."""
        clock: Any = NullClock()
        if cfg.emulation is not None:
            from .emulation import EmulatedClock, SlowdownEvent

            schedule = [SlowdownEvent(s, r, f) for s, r, f in cfg.emulation.schedule]
            clock = EmulatedClock(
                rank, cfg.emulation.forward_s, cfg.emulation.backward_s, schedule, cfg.tp
            )
        svc = cls(WorkerState(cfg.name, rank), clock, RateProfiler(clock.reference_s))
        if rank == 0:  # the coordinator: plans and stop requests enter the job here
            svc.inbox, svc.stop = PlanInbox(cfg.problem(), 0), StopControl()
        return svc

    @classmethod
    def create(
        cls, cfg: TrainConfig, rank: int, *, control_port: int | None, host: str = "0.0.0.0"
    ) -> Services:
        """Everything, with an HTTP control endpoint on `control_port` when it is not None."""
        from .metrics import TrainerMetrics

        svc = cls.null(cfg, rank)
        svc.metrics = TrainerMetrics(cfg.name, rank, rank // cfg.gpus_per_node)
        if control_port is not None:
            from .control import ControlServer, load_token
            from .emulation import InjectionQueue

            if svc.emulated:
                svc.injections = InjectionQueue()
            svc.server = ControlServer(
                host,
                control_port,
                load_token(),
                status=svc.status,
                inbox=svc.inbox,
                metrics=svc.metrics,
                inject=svc.injections.put if svc.injections is not None else None,
                stop=svc.stop.request if svc.stop is not None else None,
            ).start()
        return svc

    def status(self) -> dict[str, Any]:
        out = self.state.snapshot()
        if self.inbox is not None:  # current/pending/applying generation, last error
            out.update(self.inbox.status())
            out["stopping"] = self.stop is not None and self.stop.code != 0
        if self.metrics is not None:
            out["metrics"] = self.metrics.snapshot()
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
