"""What the training loop plugs into: clock, rate profiler, metrics, control endpoint, status,
and on rank 0 the plan inbox and stop request that the switch protocol reads at step boundaries.

The loop calls the same few methods whether these are real (emulated clock, Prometheus metrics,
HTTP control server) or the no-op defaults, so tests and the reference need none of them.
`WorkerState` is the loop's own thread-safe record of where it is; `Services.status()` joins it
with the coordinator's inbox and stop request into the `ControlStatus` that GET /status serves.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from malleus.control import ControlStatus, MigrationRecord, RecoveryRecord
from malleus.trainer.measure.profiling import RateProfiler
from malleus.trainer.switching.plan_inbox import PlanInbox
from malleus.trainer.switching.protocol import StopControl

if TYPE_CHECKING:
    from malleus.job import ResolvedJob

__all__ = ["LoopState", "NullClock", "Services", "WorkerState"]

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


@dataclass(frozen=True)
class LoopState:
    """Where this rank's loop is: replaced whole on every update, so a reader of /status never
    sees a step's figures beside another step's generation."""

    generation: int = 0
    """The plan generation in force; 0 until the loop has taken up its first plan."""
    step: int = 0
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    rates: Mapping[int, float | None] = field(default_factory=dict)
    """The job's rates of the last step (every rank; None = no figure)."""
    migration: MigrationRecord | None = None
    plan: Any = None
    """The plan in force (`GET /plan`); None before the loop took up its first."""
    out: Mapping[int, str] = field(default_factory=dict)
    """GPUs out of the job since they failed (recovery), with why."""
    recovery: RecoveryRecord | None = None
    calibration: Mapping[str, Any] | None = None
    """The cost model's terms as the trainers measured them (trainer/engine/calibrator.py)."""
    link_rates: Mapping[int, float] = field(default_factory=dict)
    """Per node: its links' slowdown as measured (1.0 = healthy)."""


class WorkerState:
    """The loop's `LoopState`, written by the training thread and read by the HTTP thread."""

    def __init__(self, job: str, world: int, steps: int) -> None:
        self.job, self.world, self.steps = job, world, steps
        self._lock = threading.Lock()
        self._state = LoopState()

    def update(self, **values: Any) -> None:
        """Replace some `LoopState` fields (an unknown name is a TypeError, not a new key)."""
        with self._lock:
            self._state = replace(self._state, **values)

    def snapshot(self) -> LoopState:
        with self._lock:
            return self._state


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
    job: Any = None  # the ResolvedJob (what a rank promoted to coordinator needs)
    control_port: int | None = None  # served while this rank is the coordinator
    host: str | None = None

    @property
    def emulated(self) -> bool:
        return not isinstance(self.clock, NullClock)

    @classmethod
    def null(
        cls, job: ResolvedJob, rank: int, *, steps: int | None = None, coordinator: int = 0
    ) -> Services:
        """Clock and profiler only (emulated when the job says so); no metrics, no HTTP.
        `steps`: the run's length when not the job's (`--steps`); `coordinator`: the GPU that
        coordinates now (`World.coordinator()`: 0 until a recovery moves it)."""
        clock: Any = NullClock()
        seconds = job.layer_seconds()
        if seconds is not None:
            from malleus.trainer.measure.emulation import EmulatedClock, SlowdownEvent

            schedule = [SlowdownEvent(s, r, f) for s, r, f in job.schedule]
            clock = EmulatedClock(
                rank, *seconds, schedule, job.tp, job.link_schedule, catch_up=True
            )
        state = WorkerState(job.name, job.world, steps if steps is not None else job.steps)
        svc = cls(state, clock, RateProfiler(clock.reference_s))
        svc.job = job
        if rank == coordinator:  # plans and stop requests enter the job here
            svc.inbox, svc.stop = PlanInbox(job.problem(), 0), StopControl()
        return svc

    @classmethod
    def create(
        cls,
        job: ResolvedJob,
        rank: int,
        *,
        control_port: int | None,
        steps: int | None = None,
        host: str | None = None,
        serve_when_coordinator: bool = False,
        coordinator: int = 0,
        pod: bool = False,
    ) -> Services:
        """Everything, with a control endpoint on `control_port` when it is not None.

        The endpoint listens on `host`, by default where `credentials.control_host` says (the
        pod IP, else 127.0.0.1), and serves HTTPS when the environment names a certificate.
        `serve_when_coordinator`: listen only while this rank is the coordinator (rank 0 at the
        start; `promote` after a recovery moved the role here); `coordinator`: as for `null`.
        `pod`: this process is a rank of a worker pod (one node): its ``/metrics`` page shows
        this node's ranks only, and the node's first rank (local rank 0) serves that page on
        its port even while another rank coordinates, so that every worker pod is a live
        Prometheus target for its own GPUs (`metrics_only`).
        """
        from malleus.trainer.endpoint.metrics import TrainerMetrics

        svc = cls.null(job, rank, steps=steps, coordinator=coordinator)
        gpn = job.gpus_per_node
        svc.metrics = TrainerMetrics(job.name, rank, rank // gpn, gpu=rank % gpn, own_node_only=pod)
        svc.control_port, svc.host = control_port, host
        lead = not serve_when_coordinator or rank == coordinator
        if control_port is not None and lead:
            svc._serve()
        elif control_port is not None and pod and rank % gpn == 0:
            svc._serve(metrics_only=True)
        return svc

    def _serve(self, *, metrics_only: bool = False) -> None:
        """Start the control endpoint; `metrics_only`: ``/healthz`` and the metrics pages alone
        (a pod's first rank while another coordinates: ``/status`` 404 and no writes, so the
        operator's search for the coordinator passes it by)."""
        from malleus.trainer.endpoint.credentials import control_host, load_tls, load_token
        from malleus.trainer.endpoint.server import ControlServer
        from malleus.trainer.measure.emulation import InjectionQueue

        if self.emulated and self.injections is None:
            self.injections = InjectionQueue()
        assert self.control_port is not None
        if metrics_only:
            self.server = ControlServer(
                self.host if self.host is not None else control_host(),
                self.control_port,
                load_token(),
                status=None,
                inbox=None,
                metrics=self.metrics,
                inject=None,
                tls=load_tls(),
            ).start()
            return
        self.server = ControlServer(
            self.host if self.host is not None else control_host(),
            self.control_port,
            load_token(),
            status=self.status,
            inbox=self.inbox,
            metrics=self.metrics,
            inject=self.injections.put if self.injections is not None else None,
            stop=self.stop.request if self.stop is not None else None,
            tls=load_tls(),
            plan=self._plan_json,
        ).start()

    def _plan_json(self) -> dict[str, Any] | None:
        plan = self.state.snapshot().plan
        return None if plan is None else plan.model_dump(mode="json")

    def promote(self, generation: int) -> None:
        """This rank became the coordinator (a recovery moved the role): take the plan inbox
        and the stop request, and serve the control endpoint on this rank's port, if any."""
        if self.inbox is None:
            self.inbox = PlanInbox(self.job.problem(), generation)
        if self.stop is None:
            self.stop = StopControl()
        if self.control_port is not None:
            if self.server is not None:
                self.server.stop()
                self.server = None
            try:
                self._serve()
            except OSError as e:  # the port still held (a hung predecessor's, say)
                log.warning("coordinator now, but port %d: %s", self.control_port, e)
            else:
                log.info("coordinator now: control endpoint on port %d", self.control_port)

    def status(self) -> ControlStatus:
        """GET /status: this rank's loop, and on the coordinator its inbox and stop request."""
        st, inbox = self.state.snapshot(), self.inbox
        return ControlStatus(
            job=self.state.job,
            world=self.state.world,
            generation=st.generation,
            pending_generation=inbox.pending_generation if inbox is not None else None,
            step=st.step,
            steps=self.state.steps,
            done=st.step >= self.state.steps,
            stopping=self.stop is not None and self.stop.code != 0,
            rates={r: _finite(v) for r, v in sorted(st.rates.items())},
            step_seconds=st.step_seconds,
            tokens_per_second=st.tokens_per_second,
            last_migration=st.migration,
            last_failure=inbox.last_failure if inbox is not None else None,
            out=dict(st.out),
            last_recovery=st.recovery,
            calibration=dict(st.calibration) if st.calibration is not None else None,
            link_rates=dict(st.link_rates),
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def _finite(rate: float | None) -> float | None:
    """NaN (the metrics' "failed") and None ("no figure") both read None in the status."""
    return rate if rate is not None and math.isfinite(rate) else None
