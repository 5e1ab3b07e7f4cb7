"""The errors and store keys every room of the trainer shares, below everything else.

`LaunchError` (the process group could not be formed or entered), `first_line` (an error's first
line, for a message that quotes it) and `DEAD_KEY` (what a launcher writes into the job's store
when it sees a GPU's process end). They live here, and not with the code that raises or writes
them, because the store client, migration and recovery all need them and none may import the
launch or recovery rooms. `say_ending` writes how a rank ends (`malleus.errors`'
`ENDING_REASONS`) as the container's termination message, which the operator reads.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from malleus.errors import ENDING_REASONS

__all__ = ["DEAD_KEY", "TERMINATION_LOG", "LaunchError", "first_line", "say_ending"]

TERMINATION_LOG = Path("/dev/termination-log")
"""The container's termination message file (Kubernetes' default terminationMessagePath); the
kubelet makes it, so it exists only in a pod."""

DEAD_KEY = "rec/dead/"
"""`rec/dead/GPU` in the job's store: a launcher saw that GPU's process exit (recovery need not
wait out its join window for it)."""


class LaunchError(RuntimeError):
    """The process group could not be formed (or a replacement could not enter it)."""


def first_line(e: BaseException) -> str:
    """An error's first line, for a message that names it (its type when it has no text)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def say_ending(code: int, text: str) -> None:
    """In a pod: `text` headed by the reason of exit `code` (`ENDING_REASONS`) as the container's
    termination message. Elsewhere (no such file), nothing; the caller has said it on stderr."""
    path = TERMINATION_LOG
    if path.is_file():
        with contextlib.suppress(OSError):  # stderr still has it, in the pod's log
            path.write_text(f"{ENDING_REASONS[code]}: {text}"[:4000])
