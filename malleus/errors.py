"""The one exception family for bad input: every fault carries a field path and a message.

Everything a user hands Malleus (a MalleusJob manifest, a PlanningProblem, a plan, command-line
values, a file) is judged before anything starts; what is wrong is raised as `BadInput`, listing
every fault at once, each with where it is (`spec.parallelism.tp`, `rates.3`, `--rates`) and what
is allowed, and optionally a `hint`: the way out that applies to all of them (a command-line
option, say). Commands print `str(error)` and exit `BAD_INPUT_EXIT` (2); the operator turns the
faults into an InvalidSpec condition; the trainers' control endpoint answers 400 with them.

It also holds how a trainer process ends when that is not one more failure, which the runner
and the operator read: the exit codes and the reasons that head a trainer's termination message
(torchrun exits 1 whatever its ranks' codes, so in a pod the message is what tells the operator).

A leaf module (no imports from the rest of Malleus) so that the planner, the bottom layer, can
raise it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BAD_INPUT_EXIT",
    "BAD_INPUT_REASON",
    "ENDING_REASONS",
    "LEFT_OUT_EXIT",
    "LEFT_OUT_REASON",
    "NO_PLAN_EXIT",
    "NO_PLAN_REASON",
    "BadInput",
    "Fault",
]

BAD_INPUT_EXIT = 2
"""Exit code of every command (and of a trainer in a pod) that refused its input."""
BAD_INPUT_REASON = "BadInput"
"""The reason a job fails with when its trainers refuse its input; also the first word of such a
trainer's termination message (torchrun exits 1 whatever its ranks' codes, so the message is
what tells the operator)."""
LEFT_OUT_EXIT = 3
"""A trainer's exit code when the job went on without it (a rank that hung through a recovery
and woke up after it): the job is not failing."""
LEFT_OUT_REASON = "LeftOut"
NO_PLAN_EXIT = 4
"""A trainer's exit code when no valid plan exists on the GPUs left: the end of the job, not one
more failure to replace."""
NO_PLAN_REASON = "NoValidPlan"
ENDING_REASONS = {
    BAD_INPUT_EXIT: BAD_INPUT_REASON,
    LEFT_OUT_EXIT: LEFT_OUT_REASON,
    NO_PLAN_EXIT: NO_PLAN_REASON,
}
"""Exit code -> the reason that heads the trainer's termination message for it."""


@dataclass(frozen=True)
class Fault:
    """One thing wrong with an input: where (``spec.training.steps``) and what is allowed."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<input>'}: {self.message}"


class BadInput(ValueError):
    """Input that cannot be used as given; ``faults`` lists every fault found.

    ``what`` names the kind of input (``MalleusJob``, ``PlanningProblem``, ``plan``) and
    ``source`` where it came from (a file name), both for the first line of the message;
    ``hint``, when given, is the message's last line.
    """

    def __init__(
        self,
        faults: Sequence[Fault],
        source: str | None = None,
        *,
        what: str = "MalleusJob",
        hint: str | None = None,
    ) -> None:
        self.faults: list[Fault] = list(faults)
        self.source = source
        self.what = what
        self.hint = hint
        where = f" in {source}" if source else ""
        count = len(self.faults)
        lines = [f"invalid {what}{where} ({count} fault{'s' if count != 1 else ''}):"]
        lines += [f"  - {fault}" for fault in self.faults]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))

    @classmethod
    def one(
        cls, path: str, message: str, source: str | None = None, *, what: str = "MalleusJob"
    ) -> BadInput:
        """A `BadInput` with a single fault."""
        return cls([Fault(path, message)], source, what=what)

    @property
    def paths(self) -> list[str]:
        """The field paths of the faults, in order."""
        return [fault.path for fault in self.faults]
