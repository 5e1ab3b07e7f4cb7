"""A local run across failures: the session's eyes on the trainer processes, tick by tick.

Each tick of the session's supervisor loop calls `Supervisor.tick()`: a rank whose process ended
badly (an exit code, a signal, exit 3: the job left it out) counts a failure under
`spec.failurePolicy` (`failures.Supervision`): it is logged in the progress, the trainers are
told through the store (`malleus/0//rec/dead/GPU`, so recovery need not wait out its join window),
and its replacement (`--join`) starts after the backoff and once the survivors committed a step
after the failure (so that its start does not slow their recovery), or it stays out. Every few ticks
`poll_status()` reads the coordinator's `/status` (through the `CoordinatorClient`, which
follows the coordinator): a rank the trainers report hung (`out`) is killed (and then counts as
a failure like any other), a new `last_recovery` is logged with the runner's own timing (the
fault to the first step committed after it).

The run fails only when no member of the job is left (every process that took part has ended,
and the replacements that are waiting cannot be admitted by anyone) without training every
step; the reason names every rank and why. A survivor's exit 4 (`NO_PLAN_EXIT`) is the end of
the job, not a failure: nothing is replaced after it, and the reason begins `no valid plan on
the GPUs left:` with the trainers' verdict. In restart mode a failure restarts every process
from the latest checkpoint instead (what TorchElastic does; `bench/faults.py`'s baseline):
`supervise_restart`.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable

from malleus.control import ControlError, RecoveryRecord
from malleus.errors import NO_PLAN_EXIT

from .failures import (
    Failure,
    FailureLog,
    Replacement,
    Supervision,
    parse_trainer_event,
    recovered_text,
    why_no_plan,
)
from .prepare import Prepared
from .processes import TrainerProcesses, describe_exit, proc_state
from .record import PlanSwitch, RunRecord
from .sinks import CoordinatorClient
from .store_server import DEAD_KEY as STORE_DEAD_KEY
from .store_server import JOB_PREFIX
from .supervise_restart import RestartMode

__all__ = ["DEAD_KEY", "Supervisor"]

DEAD_KEY = f"{JOB_PREFIX}/{STORE_DEAD_KEY}"
"""Where the runner tells the trainers that a GPU's process ended: trainer/launch/distributed.py DEAD_KEY
(`rec/dead/`) under the job's `PrefixStore("malleus/<attempt>/")`, which joins prefix and key
with one more "/" (hence the double slash: the raw key the trainers read). Written sealed
(`StoreServer.mark_dead`): the trainers believe nothing else there."""
_STATUS_EVERY = 0.5
HOLD_REPLACEMENT_S = 30.0
"""The longest a due replacement waits for the survivors to commit a step after its failure
(`Supervisor._survivors_recovering`); past it, it starts anyway."""


class Supervisor(RestartMode):
    """Failures, replacements and recoveries of one run (see the module)."""

    def __init__(
        self,
        prepared: Prepared,
        procs: TrainerProcesses,
        record: RunRecord,
        client: CoordinatorClient,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prepared = prepared
        self.procs = procs
        self.record = record
        self.client = client
        self.clock = clock
        self.policy = prepared.job.spec.failure_policy
        self.supervision = Supervision(self.policy)
        self.log = FailureLog()
        self.messages: queue.SimpleQueue[str] = queue.SimpleQueue()
        """Lines for the progress, printed by the event loop (the readers are threads)."""
        self.first_failure: str | None = None
        """The first failure's full text (with its log's last lines), for the run's reason."""
        self._handled: set[int] = set()
        """Pids whose end (or hang) has been counted."""
        self._marked: set[int] = set()
        """Pids of stopped processes already marked dead in the store (live mode)."""
        self._stopped_since: dict[int, float] = {}
        """Pid -> when the runner first saw it stopped (SIGSTOP: an emulated hang)."""
        self._fates: dict[int, str] = {}
        """Rank -> how its newest process ended."""
        self._unmatched: list[tuple[RecoveryRecord, float]] = []
        self._pending_restart: tuple[Failure, int, int] | None = None
        self._last_status = 0.0
        self.restarting = False
        """Restart mode: every process is being restarted after a failure."""
        self.hang_seconds = float(self.policy.hang_timeout_seconds or 30)
        self._restart_for: Failure | None = None
        """Restart mode: the failure every process is to be restarted for."""
        self.no_plan: set[int] = set()
        """Ranks that exited `NO_PLAN_EXIT`: no valid plan on the GPUs left, the job is over."""

    # ---- clocks ------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the run started (the record's clock)."""
        return self.clock() - self.record.started

    @property
    def live(self) -> bool:
        return self.prepared.options.mode != "restart"

    # ---- feeds (reader threads) --------------------------------------------------------------
    def on_rank_line(self, rank: int, line: str) -> None:
        event = parse_trainer_event(line)
        if event is None:
            return
        kind, data = event
        if kind == "joined":
            got = self.log.joined(int(data["rank"]), int(data["step"]), self.now())
            if got is not None:
                self.messages.put(f"step {data['step']}: rank {data['rank']} rejoined the job")
        # "recovered": not repeated; the runner says it once, with its own timing, when
        # /status reports the recovery (`_match_recoveries`, `recovered_text`)

    # ---- each tick (event loop) --------------------------------------------------------------
    def tick(self) -> None:
        """Count the processes that ended, watch for stopped ones, start due replacements."""
        if self.procs.expect_exit or not self.procs.started:
            return
        self._keep_store()
        now = self.now()
        # In the order they ended: the first is the one to blame, the others may follow it.
        for rank in sorted(range(self.prepared.world), key=self.procs.exited_at):
            rp = self.procs.process(rank)
            code = rp.code
            if code is None:
                if proc_state(rp.proc.pid) != "T":
                    self._stopped_since.pop(rp.proc.pid, None)
                    continue
                since = self._stopped_since.setdefault(rp.proc.pid, now)
                if now - since < self.hang_seconds:
                    continue
                if not self.live:
                    # Restart mode: the trainers do not detect hangs; a process stopped for
                    # the hang timeout counts as failed (what a torchrun watchdog would do).
                    self.procs.kill(rank)
                    self._failed(rank, "hung", now)
                elif self.procs.store is not None and rp.proc.pid not in self._marked:
                    # Live: the survivors' collectives time out about now and their leader
                    # waits for every member not known dead; the runner knows this one is
                    # stopped, so it says so (the trainers later list it out, and it is
                    # killed and replaced then).
                    self._marked.add(rp.proc.pid)
                    self.procs.store.mark_dead(rank, "hung")
                continue
            if rp.proc.pid in self._handled or code == 0:
                continue
            if code == NO_PLAN_EXIT and self.live:
                self._no_plan(rank, rp.proc.pid)
                continue
            self._failed(rank, describe_exit(code), now)
        if not self.live or self.restarting or self.no_plan or not self.members_alive():
            return  # no job left to join: `gone()` ends the run
        for rank in self.supervision.due(self.clock()):
            if self.finishing():
                continue
            if self.procs.process(rank).code is None:  # a killed hung rank still ending
                self.supervision.pending[rank] = self.clock() + 0.5
                continue
            if self._survivors_recovering(rank):
                self.supervision.pending[rank] = self.clock() + 0.05
                continue
            new = self.procs.replace(rank)
            attempt = self.supervision.failures.get(rank, 0)
            self.log.add_replacement(Replacement(rank, attempt, self.now(), new.proc.pid))
            self.messages.put(
                f"step {self.record.steps_done()}: rank {rank}: started a replacement "
                f"(pid {new.proc.pid}, restart {attempt} of {self.policy.max_restarts}), "
                "joining at a step boundary"
            )

    def _keep_store(self) -> None:
        """A rendezvous store that died is started again, empty, on its port: the ranks'
        clients dial it again (trainer/world/store_client.py), so a later failure is still survived."""
        store = self.procs.store
        if store is None or (code := store.lost()) is None:
            return
        self.messages.put(
            f"step {self.record.steps_done()}: the rendezvous store died ({describe_exit(code)}); "
            f"starting it again, empty, on port {store.port}"
        )
        try:
            store.restart()
        except RuntimeError as e:  # not retried: a failure from now on ends the run
            self.messages.put(f"the rendezvous store could not be started again: {e}")

    def _survivors_recovering(self, rank: int) -> bool:
        """Whether `rank`'s replacement should wait for the survivors: until they commit a
        step after its failure (at most `HOLD_REPLACEMENT_S`). A replacement joins only at a
        step boundary after the recovery anyway, and here every rank shares this host: its
        start (seconds of CPU importing torch) would slow the very recovery it waits for."""
        fault = self.log.fault_time([rank])
        if fault is None or self.now() - fault > HOLD_REPLACEMENT_S:
            return False
        latest = self.record.latest()
        return latest is None or latest.time is None or latest.time <= fault

    def _failed(self, rank: int, why: str, now: float) -> None:
        rp = self.procs.process(rank)
        self._handled.add(rp.proc.pid)
        if not self.live and self._restart_for is not None:
            return  # restart mode: the others end after the first failure; one restart for all
        self._fates[rank] = why
        if self.first_failure is None:
            self.first_failure = (
                str(self.procs.exited(rank))
                if rp.code is not None
                else (f"trainer rank {rank} {why}; its log: {rp.log}")
            )
        fault_at = self._stopped_since.get(rp.proc.pid, now)
        step = self.record.steps_done()
        if self.live:
            action = self.supervision.failed(rank, why, self.clock())
        else:
            action = "restart every process from the latest checkpoint"
            self.supervision.failures[rank] = self.supervision.failures.get(rank, 0) + 1
        self.log.add_failure(
            Failure(
                rank, why, step, fault_at, self.supervision.failures[rank], action, str(rp.log), now
            )
        )
        if self.procs.store is not None:
            self.procs.store.mark_dead(rank, "1")
        if not self.live:
            self._restart_for = self.log.failures[-1]
        self.messages.put(f"step {step}: rank {rank} {why}: {action}")

    def _no_plan(self, rank: int, pid: int) -> None:
        """No valid plan on the GPUs left: the job's end (every survivor exits so), no failure."""
        self._handled.add(pid)
        self._fates[rank] = "no valid plan"
        self.no_plan.add(rank)
        self.supervision.pending.clear()
        self.messages.put(
            f"step {self.record.steps_done()}: rank {rank} exited: no valid plan on the GPUs left"
        )

    def finishing(self) -> bool:
        """Every step has been trained (what is left is the end of the run)."""
        return self.record.steps_done() >= self.prepared.total_steps

    # ---- the run's verdict -------------------------------------------------------------------
    def members_alive(self) -> list[int]:
        """Ranks whose process takes part in the job: an original one, or a replacement that
        joined (one still waiting to be admitted cannot go on alone)."""
        alive = []
        for rank in self.procs.alive():
            rp = self.procs.process(rank)
            if rp.joins == 0 or self._joined(rank, rp.proc.pid):
                alive.append(rank)
        return alive

    def _joined(self, rank: int, pid: int) -> bool:
        return any(
            r.rank == rank and r.pid == pid and r.joined_step is not None
            for r in self.log.replacements
        )

    def gone(self) -> str | None:
        """Why the run cannot go on, or None: no member is left and not every step trained."""
        if not self.procs.started or self.procs.expect_exit or self.restarting:
            return None
        if self._restart_for is not None:  # restart mode: every process starts again
            return None
        if self.members_alive():
            return None
        codes = self.procs.codes()
        if self.finishing() and any(c == 0 for c in codes):
            return None  # every step trained: the session's end-of-run checks
        if all(c == 0 for c in codes if c is not None) and not self.log.failures:
            return None  # every rank ended cleanly: the session's own end-of-run check
        tails = {r: self.procs.log_tail(r, 20) for r in range(self.prepared.world)}
        verdict = why_no_plan(tails)
        fates = []
        for rank in range(self.prepared.world):
            code = codes[rank]
            fate = describe_exit(code) if code is not None else "waiting to join"
            if code == NO_PLAN_EXIT and rank in self.no_plan:
                fate += " (no valid plan)"
            if rank in self.supervision.out:
                fate += f" (left out: {self.supervision.out[rank]})"
            fates.append(f"rank {rank} {fate}")
        first = self.first_failure or "every trainer ended"
        reason = f"{first}\nevery rank is gone after {self.record.steps_done()} steps: "
        reason += "; ".join(fates)
        if self.no_plan or verdict is not None:
            # The trainers' own words when they printed them: the planner's faults say why.
            said = verdict or f"ranks {sorted(self.no_plan)} exited {NO_PLAN_EXIT}"
            reason = f"no valid plan on the GPUs left: {said}\n{reason}"
        return reason

    # ---- /status (event loop, every _STATUS_EVERY s) -----------------------------------------
    async def poll_status(self) -> None:
        if self.clock() - self._last_status < _STATUS_EVERY or self.procs.expect_exit:
            return
        self._last_status = self.clock()
        await self.client.follow()
        try:
            status = await self.client.status()
        except ControlError:
            return
        seen = self.now()
        for rank, why in sorted(status.out.items()):
            if not 0 <= rank < self.prepared.world:
                continue
            rp = self.procs.process(rank)
            if rp.code is not None or rp.proc.pid in self._handled:
                continue
            # A replacement still joining (or just joined: a /status older than its join) is
            # not the process the trainers left out.
            if rp.joins and not self._joined_before(rank, rp.proc.pid, seen - 2.0):
                continue
            self.procs.kill(rank)
            self._failed(rank, f"hung ({why})" if why != "hung" else "hung", seen)
        rec = status.last_recovery
        if (
            rec is not None
            and not self.log.knows(rec.epoch)
            and all(r.epoch != rec.epoch for r, _ in self._unmatched)
        ):
            self._unmatched.append((rec, seen))
        self._match_recoveries()

    def _joined_before(self, rank: int, pid: int, when: float) -> bool:
        return any(
            r.rank == rank and r.pid == pid and r.joined_time is not None and r.joined_time <= when
            for r in self.log.replacements
        )

    def _match_recoveries(self) -> None:
        """Recoveries whose first committed step the runner has seen, with its timing."""
        left = []
        for rec, seen in self._unmatched:
            step = self.record.get(rec.step)
            fault = self.log.fault_time([int(g) for g in rec.failed])
            if step is None or step.time is None or fault is None or step.time < fault:
                if self.finishing() or seen < self.now() - 60:
                    got = self.log.add_record(rec, None, fault)
                    if got is not None:
                        self.messages.put(recovered_text(got))
                else:
                    left.append((rec, seen))
                continue
            got = self.log.add_record(rec, step.time, fault)
            if got is not None:
                self.messages.put(recovered_text(got))
                # the survivors' own plan, from the step they redid or went on with: the
                # report's per-step generations (the controller never published it)
                self.record.add_switch(PlanSwitch(rec.generation, rec.step))
        self._unmatched = left

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
