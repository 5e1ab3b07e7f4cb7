"""Restart mode of a local run: every process restarted from the latest checkpoint.

What `malleus run --mode restart` does after a failure instead of replacing the one rank (what
TorchElastic does; `bench/faults.py`'s baseline): stop every trainer, start them all again from
the latest checkpoint, and time the recovery from the fault to the first step committed after
the restart. Kept apart from `supervise` (the live mode's failures, replacements and
recoveries) because it is the other mode's whole story; `RestartMode` has no state of its own:
it is a base of `supervise.Supervisor` and works on the Supervisor's (annotated below).
"""

from __future__ import annotations

import queue
from collections.abc import Awaitable, Callable
from pathlib import Path

from malleus.job import FailurePolicy
from malleus.notation import size

from .failures import Failure, FailureLog, Recovery
from .launch import without_faults
from .prepare import Prepared
from .processes import TrainerProcesses
from .record import RunRecord
from .sinks import checkpoint_bytes, latest_checkpoint_step

__all__ = ["RestartMode"]


class RestartMode:
    """Restart every process from the latest checkpoint after a failure (restart mode)."""

    # The Supervisor's, declared here for the reader (no values: nothing changes at run time).
    prepared: Prepared
    procs: TrainerProcesses
    record: RunRecord
    policy: FailurePolicy
    log: FailureLog
    messages: queue.SimpleQueue[str]
    first_failure: str | None
    live: bool
    restarting: bool
    _restart_for: Failure | None
    _pending_restart: tuple[Failure, int, int] | None

    def restart_needed(self) -> int | None:
        """Restart mode: the rank whose failure calls for a restart of every process."""
        if self.live or self.restarting or self.procs.expect_exit or self._restart_for is None:
            return None
        return self._restart_for.rank

    async def restart_all(
        self, plan: Path, sleep: Callable[[float], Awaitable[None]]
    ) -> str | None:
        """Stop every process, start them all again from the latest checkpoint under `plan`;
        a reason when the rank has failed more often than maxRestarts allows."""
        failure = self._restart_for
        assert failure is not None
        self._restart_for = None
        if failure.attempt > self.policy.max_restarts:
            return (
                f"{self.first_failure}\nrank {failure.rank} failed {failure.attempt} times "
                f"(spec.failurePolicy.maxRestarts = {self.policy.max_restarts})"
            )
        self.restarting = True
        try:
            self.procs.terminate(grace=5.0)
            checkpoints = Path(self.prepared.workdir) / "checkpoints"
            resume = latest_checkpoint_step(checkpoints) or 0
            restored = checkpoint_bytes(checkpoints)
            wait = float(self.policy.restart_backoff_seconds)
            if wait:
                await sleep(wait)
            workdir = Path(self.prepared.workdir)
            self.procs.spec = without_faults(
                self.procs.spec, failure.step, workdir, self.procs.launches + 1
            )
            self.procs.start(plan, resume=True)
            self._pending_restart = (failure, resume, restored)
        finally:
            self.restarting = False
        return None

    def match_restart(self) -> None:
        """The restart's first committed step: the recovery, timed from the fault."""
        pending = self._pending_restart
        if pending is None:
            return
        failure, resume, restored = pending
        step = self.record.get(resume)
        if step is None or step.time is None or step.time <= failure.time:
            return
        self._pending_restart = None
        rec = Recovery(
            failed={failure.rank: failure.why},
            step=resume,
            steps_lost=max(0, failure.step - resume),
            bytes_restored=restored,
            mode="restart",
            seconds=step.time - failure.time,
        )
        self.log.add_recovery(rec)
        lost = rec.steps_lost
        redo = f" (steps {resume}-{failure.step - 1} trained again)" if lost > 1 else ""
        redo = f" (step {resume} trained again)" if lost == 1 else redo
        self.messages.put(
            f"step {failure.step}: restarted every process from the checkpoint of step {resume} "
            f"{rec.seconds:.2f} s after the fault: {lost} steps lost{redo}, "
            f"{size(restored)} read back"
        )
