"""One local run, start to end: launch the trainers, run the controller beside them, watch.

Three tasks share the event loop: the controller (or, in static mode, a plain reader of the
same metrics), the supervisor (process exits, replacements, Ctrl-C, progress), and the reader
threads that feed every rank's lines to the record. A rank's death is not the end of the run:
`supervise.Supervisor` replaces it under spec.failurePolicy while the trainers recover, and
the run fails only when no member of the job is left. Ctrl-C or SIGTERM asks the coordinator to
checkpoint at the next step boundary and stop first (bounded by the failure policy's grace
period), and says how to `--resume`. Whatever ends the run, the trainers (and the
rendezvous store) are stopped before this returns: none outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from malleus.control import AsyncControlClient
from malleus.controller import Controller, DecisionEvent, EventKind, TrainerScrapeSource
from malleus.controller.events import Migrated

from .changes import describe
from .prepare import Prepared
from .processes import TrainerProcesses
from .progress import Progress, ProgressState
from .record import RecordingSource, RunRecord, parse_step_line, stragglers
from .sinks import CoordinatorClient, LiveSink, RestartSink, latest_checkpoint_step
from .supervise import Supervisor

__all__ = ["Outcome", "Session"]

_TICK = 0.2
_FINISH_GRACE = 60.0
"""Seconds the other ranks may keep running after one ended cleanly before it is a hang."""


@dataclass
class Outcome:
    """How the run ended."""

    code: int = 0
    reason: str = "completed"
    history: list[DecisionEvent] = field(default_factory=list)
    wall_seconds: float = 0.0


class Session:
    """Runs a prepared job; `run()` returns its Outcome with the trainers stopped."""

    def __init__(self, prepared: Prepared, progress: Progress) -> None:
        self.prepared = prepared
        self.progress = progress
        self.record = RunRecord(
            prepared.tokens_per_step, initial_generation=prepared.plan.generation
        )
        self.record.total_steps = prepared.total_steps
        self.procs = TrainerProcesses(
            prepared.launch, self._on_line, on_rank_line=self._on_rank_line
        )
        self.client = CoordinatorClient(self.procs, prepared.token)
        self.supervisor = Supervisor(prepared, self.procs, self.record, self.client)
        self.controller: Controller | None = None
        self.saved: tuple[int, str] | None = None
        """(step, directory) of the checkpoint a graceful stop wrote."""
        self._graceful_done = False
        self._fatal: BaseException | None = None
        self._interrupted = 0
        self._phase = "starting"
        self._stop = asyncio.Event()
        self._in_force = prepared.plan
        """The plan the trainers run (for the re-plan lines: what each switch changed)."""

    # ---- feeds -------------------------------------------------------------------------------
    def _on_line(self, line: str) -> None:
        parsed = parse_step_line(line)
        if parsed is not None:
            self.record.add_line(parsed)

    def _on_rank_line(self, rank: int, line: str) -> None:
        self.supervisor.on_rank_line(rank, line)

    def _on_event(self, event: DecisionEvent) -> None:
        if event.kind == EventKind.PLANNED:
            return
        if event.kind == EventKind.REPLANNED:
            self._phase = "restarting" if self.prepared.options.mode == "restart" else "switching"
        elif event.kind in (EventKind.MIGRATED, EventKind.REPLAN_FAILED):
            self._phase = "training"
        text = f"step {event.step}: {event.kind.value}: {event.message}"
        if isinstance(event.data, Migrated):  # what the switch changed, as the summary says it
            text += f"; {describe(self._in_force, event.data.plan).text()}"
            self._in_force = event.data.plan
        self.progress.message(text)

    def _set_fatal(self, error: BaseException) -> None:
        if self._fatal is None:
            self._fatal = error

    def _signal(self) -> None:
        self._interrupted += 1
        self._stop.set()
        if self._interrupted > 1:  # a second Ctrl-C: no more patience
            self.procs.terminate(grace=0.5)

    def _ended(self) -> bool:
        return self._stop.is_set() or (self.procs.all_exited() and not self.procs.expect_exit)

    # ---- the run -----------------------------------------------------------------------------
    async def run(self) -> Outcome:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._signal)
                installed.append(sig)
        try:
            outcome = await self._run()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            self.procs.terminate()
            if self.controller is not None:
                self.controller.close()
            self._messages()
            await self.supervisor.close()
            self.progress.close()
        outcome.wall_seconds = time.monotonic() - started
        if self.controller is not None:
            outcome.history = self.controller.history
        return outcome

    async def _run(self) -> Outcome:
        p = self.prepared
        self.procs.start(
            p.workdir / "plans" / f"gen-{p.plan.generation}.json", resume=p.resume_step is not None
        )
        resumed = f", resumed at step {p.resume_step}" if p.resume_step is not None else ""
        self.progress.message(
            f"malleus run {p.job.name} ({p.options.mode}{resumed}): {p.world} trainer "
            f"processes, control on {self.procs.url}, store on {self._store()}, "
            f"logs in {p.workdir / 'logs'}"
        )
        endpoint: AsyncControlClient = self.client
        outcome = await self._wait_ready(endpoint, p.options.init_timeout + 120.0)
        if outcome is not None:
            return outcome
        self._phase = "training"
        worker = asyncio.ensure_future(self._decide(endpoint))
        try:
            return await self._supervise(worker)
        finally:
            self._stop.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(worker), timeout=1.0)
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker

    async def _wait_ready(self, endpoint: AsyncControlClient, timeout: float) -> Outcome | None:
        """Until rank 0 serves its endpoint (every rank joined); an Outcome if that fails.

        Restart mode restarts every process here too when one fails before the job is up (it
        waited for the whole timeout before: the restart was `_supervise`'s alone)."""
        deadline = time.monotonic() + timeout
        while not await endpoint.healthz():
            stop = self._check()
            if stop is not None:
                return stop
            self._messages()
            restarted, outcome = await self._restart_if_needed()
            if outcome is not None:
                return outcome
            if restarted:
                deadline = time.monotonic() + timeout
            if time.monotonic() > deadline:
                return Outcome(1, f"the trainers did not come up within {timeout:g} s")
            self._show()
            await asyncio.sleep(_TICK)
        return None

    async def _decide(self, endpoint: AsyncControlClient) -> None:
        """The controller (live, restart) or a plain metrics reader (static)."""
        p = self.prepared
        scrape = TrainerScrapeSource(
            self.procs.url, p.token, job=p.job.name, interval=p.options.scrape_interval
        )
        scrape.client = self.client  # follows the coordinator
        source = RecordingSource(
            scrape,
            self.record,
            self._ended,
            retry_seconds=p.options.scrape_interval,
        )
        if p.options.mode == "static":
            while not self._stop.is_set() and await source.read() is not None:
                pass
            return
        sink: Any
        if p.options.mode == "live":
            sink = LiveSink(
                self.procs.url,
                p.token,
                self.record,
                client=self.client,
                plans_dir=p.workdir / "plans",
            )
        else:
            sink = RestartSink(
                self.procs,
                endpoint,
                self.record,
                p.workdir / "plans",
                p.workdir / "checkpoints",
                on_fatal=self._set_fatal,
            )
        self.controller = Controller(
            source,
            sink,
            initial_plan=p.plan,
            problem_builder=p.problem_builder(),
            policy=p.policy,
            on_event=self._on_event,
            read_retry_seconds=_TICK,
            ack_timeout_seconds=300.0,
        )
        await self.controller.run(self._stop)

    def _check(self) -> Outcome | None:
        """Is the run over? Signals first, then a failed switch, then the processes."""
        if self._interrupted:
            return Outcome(130, self._interrupted_reason())
        if self._fatal is not None:
            return Outcome(1, f"plan switch failed: {self._fatal}")
        self.supervisor.tick()
        gone = self.supervisor.gone()
        if gone is not None:
            return Outcome(1, gone)
        if self._members_done():
            self.procs.drain()
            return Outcome(0, "completed")
        if not self.procs.expect_exit and self.procs.finished():
            self.procs.drain()
            done = self.record.steps_done()
            if done < self.prepared.total_steps:
                return Outcome(
                    1, f"the trainers exited after {done} of {self.prepared.total_steps} steps"
                )
            return Outcome(0, "completed")
        return None

    def _members_done(self) -> bool:
        """Every step trained and every member's process ended, one of them cleanly, after a
        failure (without one, `TrainerProcesses.finished` decides); a replacement still
        waiting to join is stopped."""
        if self.procs.expect_exit or not self.supervisor.log.failures:
            return False
        if not self.supervisor.finishing() or self.supervisor.members_alive():
            return False
        return any(c == 0 for c in self.procs.codes())

    def _store(self) -> str:
        store = self.procs.store
        return store.address if store is not None and store.address else "-"

    def _messages(self) -> None:
        while not self.supervisor.messages.empty():
            self.progress.message(self.supervisor.messages.get_nowait())

    def _interrupted_reason(self) -> str:
        """What stopped, and whether and how the run can be continued."""
        again = f"malleus run --resume {self.prepared.workdir}"
        if self.saved is not None:
            step, directory = self.saved
            return (
                f"interrupted: saved a checkpoint of step {step} in {directory}; continue with: "
                f"{again}"
            )
        directory = self.prepared.launch.checkpoint_dir
        older = latest_checkpoint_step(Path(directory)) if directory else None
        if older is not None:
            return (
                f"interrupted: trainers stopped before saving a checkpoint; continue from the "
                f"one of step {older} with: {again}"
            )
        return (
            "interrupted: trainers stopped before any checkpoint was saved, so this run cannot "
            "be continued; start it again (a single Ctrl-C lets the trainers save one first)"
        )

    async def _graceful_stop(self) -> None:
        """Ctrl-C / SIGTERM (a local run always has a checkpoint directory): POST /stop
        {"checkpoint": true} to the coordinator, wait up to spec.failurePolicy.
        gracePeriodSeconds for the trainers to write it at their next step boundary and exit
        (a second signal cuts this short); then the usual stop."""
        p = self.prepared
        directory = p.launch.checkpoint_dir
        if directory is None or not self.procs.running() or self._interrupted > 1:
            return
        grace = float(p.job.spec.failure_policy.grace_period_seconds)
        before = latest_checkpoint_step(Path(directory))
        self.progress.message(
            f"stopping: asking the trainers to checkpoint first (at most {grace:g} s; "
            "Ctrl-C again to stop at once)"
        )
        self.procs.expect_exit = True
        try:
            await self.client.stop(checkpoint=True)
        except Exception as e:
            self.progress.message(f"stopping: no checkpoint ({e})")
            return
        deadline = time.monotonic() + grace
        while self.procs.running() and time.monotonic() < deadline and self._interrupted < 2:
            await asyncio.sleep(_TICK)
        step = latest_checkpoint_step(Path(directory))
        if step is not None and (step != before or not self.procs.running()):
            self.saved = (step, directory)

    async def _restart_if_needed(self) -> tuple[bool, Outcome | None]:
        """Restart mode: every process restarted when a failure calls for it. (restarted, the
        run's end when a rank failed more often than maxRestarts allows)."""
        if self.supervisor.restart_needed() is None:
            return False, None
        reason = await self.supervisor.restart_all(self._plan_in_force(), asyncio.sleep)
        return True, (Outcome(1, reason) if reason is not None else None)

    async def _supervise(self, worker: asyncio.Future[None]) -> Outcome:
        first_exit: float | None = None
        while True:
            if self._interrupted and not self._graceful_done:
                self._graceful_done = True
                await self._graceful_stop()
            await self.supervisor.poll_status()
            self.supervisor.match_restart()
            self._messages()
            _, outcome = await self._restart_if_needed()
            if outcome is not None:
                return outcome
            outcome = self._check()
            if outcome is not None:
                self._messages()
                self._show(force=True)
                return outcome
            if worker.done() and not worker.cancelled() and worker.exception() is not None:
                return Outcome(1, f"the controller failed: {worker.exception()!r}")
            codes = self.procs.codes()
            if not self.procs.expect_exit and any(c == 0 for c in codes):
                first_exit = first_exit or time.monotonic()
                if time.monotonic() - first_exit > _FINISH_GRACE:
                    stuck = [r for r, c in enumerate(codes) if c is None]
                    return Outcome(
                        1,
                        f"ranks {stuck} still running {_FINISH_GRACE:g} s after the others finished",
                    )
            else:
                first_exit = None
            self._show()
            await asyncio.sleep(_TICK)

    def _plan_in_force(self) -> Path:
        """The plan file of the generation in force (restart mode restarts under it)."""
        plans = self.prepared.workdir / "plans"
        generation = self.controller.plan.generation if self.controller is not None else None
        path = plans / f"gen-{generation}.json"
        if generation is None or not path.exists():
            path = plans / f"gen-{self.prepared.plan.generation}.json"
        return path

    def _show(self, force: bool = False) -> None:
        p = self.prepared
        last = self.record.latest()
        self.progress.update(
            ProgressState(
                steps_done=max(self.record.steps_done(), p.resume_step or 0),
                total_steps=p.total_steps,
                elapsed=time.monotonic() - self.record.started,
                tokens_per_second=last.tokens_per_second if last else None,
                generation=self.record.last_generation,
                stragglers=stragglers(last.rates, p.policy) if last else {},
                phase=self._phase,
            ),
            force=force,
        )
