"""What a local run does when a trainer fails, and what it remembers of it: pure, clock-injected.

`Supervision` is `spec.failurePolicy` applied to the processes of one run: a rank whose process
ended (an exit code, a signal, exit 3 = the job left it out) or that the trainers report hung
(`ControlStatus.out`) counts one failure; it is replaced (the same command plus `--join`) after
`restartBackoffSeconds`, doubled for each earlier failure of the same rank and capped at 300 s,
at most `maxRestarts` times; after that it stays out and the trainers plan around it. A rank
that exits `NO_PLAN_EXIT` (4) did not fail: no valid plan exists on the GPUs left, the job is
over (`why_no_plan` quotes the trainers' verdict). Nothing here starts a process: the session
asks `due()` which replacements to start now.

`FailureLog` keeps the run's failures, the replacements and the recoveries the coordinator
measured (`RecoveryRecord`), each with the runner's own measurement: seconds from the fault (the
moment the runner saw the process end, or the hang reported) to the first step committed after
recovery. It renders them for the report (`to_report`) and the summary (`summary_lines`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from malleus.control import RecoveryRecord
from malleus.job import FailurePolicy
from malleus.notation import size

__all__ = [
    "BACKOFF_CAP_SECONDS",
    "Failure",
    "FailureLog",
    "Recovery",
    "Replacement",
    "Supervision",
    "backoff_seconds",
    "parse_trainer_event",
    "why_no_plan",
]

BACKOFF_CAP_SECONDS = 300.0


def backoff_seconds(policy: FailurePolicy, failures: int) -> float:
    """The wait before the replacement after a rank's `failures`-th failure (1 = the first)."""
    base = float(policy.restart_backoff_seconds)
    return min(BACKOFF_CAP_SECONDS, base * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class Failure:
    """One failure of one rank's process."""

    rank: int
    why: str
    """`killed by SIGKILL`, `exited with code 1`, `hung`, `was left out of the job ...`."""
    step: int
    """Steps committed when it was seen (it failed during step index `step`)."""
    time: float
    """Seconds since the run started."""
    attempt: int
    """This rank's failures so far (1 = the first)."""
    action: str
    """What the runner does: `replace in 10 s`, `left out: 3 restarts used`, `restart all`."""
    log: str = ""
    seen: float | None = None
    """Seconds since the run started, when the runner acted on it: `time` for an exit; for a
    stopped (hung) process the moment the hang was taken for a failure (restart mode: after
    the hang timeout), so that `seen - time` is the runner's detection time."""


@dataclass(frozen=True)
class Replacement:
    """A new process for a failed rank, started with `--join`."""

    rank: int
    attempt: int
    time: float
    """Seconds since the run started, when it was started."""
    pid: int
    joined_step: int | None = None
    joined_time: float | None = None


@dataclass(frozen=True)
class Recovery:
    """One recovery the trainers made (or a restart of every process, in restart mode)."""

    failed: dict[int, str]
    step: int
    """The first step committed after the recovery."""
    steps_lost: int
    bytes_restored: int
    mode: str
    """`replicas`, `checkpoint` (the trainers' live recovery) or `restart` (every process)."""
    trainer_seconds: float | None = None
    """The coordinator's figure: detection to the first committed step after it."""
    seconds: float | None = None
    """The runner's figure: the fault to the first committed step after recovery."""
    generation: int | None = None
    epoch: int | None = None


class Supervision:
    """`spec.failurePolicy` over one run's ranks: who is replaced when, who stays out."""

    def __init__(self, policy: FailurePolicy) -> None:
        self.policy = policy
        self.failures: dict[int, int] = {}
        """Failures so far per rank."""
        self.pending: dict[int, float] = {}
        """Rank -> when (run clock) its replacement is due."""
        self.out: dict[int, str] = {}
        """Ranks left out for good (restarts used up), with why."""

    def failed(self, rank: int, why: str, now: float) -> str:
        """Count a failure of `rank` at `now`; returns what happens next (`Failure.action`)."""
        n = self.failures[rank] = self.failures.get(rank, 0) + 1
        self.pending.pop(rank, None)
        if n > self.policy.max_restarts:
            used = self.policy.max_restarts
            self.out[rank] = why
            return f"left out: {used} restart{'s' if used != 1 else ''} used"
        wait = backoff_seconds(self.policy, n)
        self.pending[rank] = now + wait
        return f"replace in {wait:g} s"

    def due(self, now: float) -> list[int]:
        """The ranks whose replacement should start now (removed from `pending`)."""
        ready = sorted(r for r, t in self.pending.items() if t <= now)
        for r in ready:
            del self.pending[r]
        return ready

    def next_due(self) -> float | None:
        return min(self.pending.values()) if self.pending else None


_RECOVERED = re.compile(
    r"\[malleus\] recovered from the failure of rank\(s\) \[(?P<ranks>[0-9, ]*)\] at step (?P<step>\d+)"
)
_JOINED = re.compile(r"\[malleus\] rank (?P<rank>\d+) joined at step (?P<step>\d+)")
_NO_PLAN = re.compile(r"no valid plan|RecoveryError: ", re.IGNORECASE)
"""The trainers' verdict that the survivors cannot go on (trainer/recovery/protocol.py RecoveryError)."""


def parse_trainer_event(line: str) -> tuple[str, dict[str, Any]] | None:
    """`("recovered", {ranks, step})` or `("joined", {rank, step})` for those trainer lines."""
    m = _RECOVERED.search(line)
    if m is not None:
        ranks = [int(x) for x in m["ranks"].replace(" ", "").split(",") if x]
        return "recovered", {"ranks": ranks, "step": int(m["step"]), "line": line.strip()}
    m = _JOINED.search(line)
    if m is not None:
        return "joined", {"rank": int(m["rank"]), "step": int(m["step"])}
    return None


def why_no_plan(tails: Mapping[int, Sequence[str]]) -> str | None:
    """The trainers' verdict that the GPUs left cannot go on: the last `no valid plan ...` (or
    `RecoveryError: ...`) line in any rank's last lines, with the planner's faults that follow it
    (`  - memory: ...` lines) joined on; None when no rank printed one."""
    for _, lines in sorted(tails.items()):
        found = [i for i, line in enumerate(lines) if _NO_PLAN.search(line)]
        if not found:
            continue
        # The last one is the trainer's own exit message (trainer/cli.py); the earlier ones are
        # the same verdict logged on the way (the leader's decision).
        at = found[-1]
        parts = [lines[at].strip()]
        for line in lines[at + 1 :]:
            if not line.startswith("  - "):
                break
            parts.append(line.strip().removeprefix("- "))
        return " ".join(parts)
    return None


@dataclass
class FailureLog:
    """Failures, replacements and recoveries of one run (thread-safe: lines arrive on threads)."""

    failures: list[Failure] = field(default_factory=list)
    replacements: list[Replacement] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    _epochs: set[int] = field(default_factory=set)
    _matched: set[int] = field(default_factory=set)
    """Indices of the failures a recovery has accounted for."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_failure(self, failure: Failure) -> None:
        with self._lock:
            self.failures.append(failure)

    def add_replacement(self, replacement: Replacement) -> None:
        with self._lock:
            self.replacements.append(replacement)

    def joined(self, rank: int, step: int, now: float) -> Replacement | None:
        """The newest replacement of `rank` joined at `step`; the updated record, if any."""
        with self._lock:
            for i in range(len(self.replacements) - 1, -1, -1):
                r = self.replacements[i]
                if r.rank == rank and r.joined_step is None:
                    new = Replacement(r.rank, r.attempt, r.time, r.pid, step, now)
                    self.replacements[i] = new
                    return new
        return None

    def fault_time(self, ranks: Sequence[int]) -> float | None:
        """When the earliest failure of `ranks` not yet matched to a recovery was seen (run
        clock); None while the runner has seen none (a process may outlive its failure)."""
        with self._lock:
            times = [
                f.time
                for i, f in enumerate(self.failures)
                if f.rank in ranks and i not in self._matched
            ]
            return min(times) if times else None

    def add_record(
        self, record: RecoveryRecord, committed_at: float | None, fault_at: float | None
    ) -> Recovery | None:
        """A coordinator's RecoveryRecord (once per epoch); `committed_at`: when its first step
        was committed (run clock), `fault_at`: when the fault was seen. None if already known."""
        with self._lock:
            if record.epoch in self._epochs:
                return None
            self._epochs.add(record.epoch)
            failed = {int(g) for g in record.failed}
            for i, f in enumerate(self.failures):
                if f.rank in failed and (committed_at is None or f.time <= committed_at):
                    self._matched.add(i)
            seconds = None
            if committed_at is not None and fault_at is not None:
                seconds = max(0.0, committed_at - fault_at)
            rec = Recovery(
                failed=dict(record.failed),
                step=record.step,
                steps_lost=record.steps_lost,
                bytes_restored=record.bytes_restored,
                mode=record.mode,
                trainer_seconds=record.seconds,
                seconds=seconds,
                generation=record.generation,
                epoch=record.epoch,
            )
            self.recoveries.append(rec)
            return rec

    def knows(self, epoch: int) -> bool:
        with self._lock:
            return epoch in self._epochs

    def add_recovery(self, recovery: Recovery) -> None:
        with self._lock:
            self.recoveries.append(recovery)

    def to_report(self) -> dict[str, Any]:
        """The report's `failures`, `replacements` and `recoveries` lists."""
        with self._lock:
            return {
                "failures": [asdict(f) for f in self.failures],
                "replacements": [asdict(r) for r in self.replacements],
                "recoveries": [asdict(r) for r in self.recoveries],
            }


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's failures and recoveries table (nothing when none failed). A recovery says
    the step its fault hit (`failed at`: the step it went on from plus the steps lost) and the
    step training went on from (`resumed at`), one duration (the runner's, from the fault to
    the first step committed after it; the trainers' own when the runner has none) and one size
    unit (`malleus.notation.size`)."""
    failures = report.get("failures") or []
    recoveries = report.get("recoveries") or []
    if not failures and not recoveries:
        return []
    lines = ["", f"failures: {len(failures)}"]
    for f in failures:
        lines.append(f"  rank {f['rank']} {f['why']} at step {f['step']}: {f['action']}")
    joined = [r for r in report.get("replacements") or [] if r.get("joined_step") is not None]
    for r in joined:
        lines.append(
            f"  rank {r['rank']} replaced (pid {r['pid']}), joined at step {r['joined_step']}"
        )
    lines += ["", f"recoveries: {len(recoveries)}"]
    if recoveries:
        lines.append(
            "  failed      failed at  resumed at  mode       fault->step s  steps lost  restored"
        )
    for r in recoveries:
        failed = ",".join(f"r{k}" for k in sorted(r["failed"], key=int)) or "-"
        lines.append(
            f"  {failed:<11} {r['step'] + r['steps_lost']:>9}  {r['step']:>10}  "
            f"{r['mode']:<10} {_num(_seconds(r), '.2f'):>13}  {r['steps_lost']:>10}  "
            f"{size(r.get('bytes_restored')):>9}"
        )
    return lines


def _seconds(r: Mapping[str, Any]) -> float | None:
    """A recovery's one duration: the runner's (the fault to the first step committed after
    it), else the trainers' (detection to that step)."""
    return r.get("seconds") if r.get("seconds") is not None else r.get("trainer_seconds")


def recovered_text(r: Recovery) -> str:
    """The runner's one line for one recovery (the trainers' own line is not repeated)."""
    failed = ", ".join(f"rank {k} ({v})" for k, v in sorted(r.failed.items()))
    secs = _seconds(asdict(r))
    took = f" {secs:.2f} s after the fault" if secs is not None else ""
    lost = r.steps_lost
    redo = f" (steps {r.step}-{r.step + lost - 1} trained again)" if lost > 1 else ""
    redo = f" (step {r.step} trained again)" if lost == 1 else redo
    source = "replicas" if r.mode == "replicas" else r.mode
    return (
        f"step {r.step + lost}: recovered from the failure of {failed}{took}: "
        f"{lost} steps lost{redo}, {size(r.bytes_restored)} restored from {source}, "
        f"plan generation {r.generation}"
    )
