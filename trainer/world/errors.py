"""The errors and store keys every room of the trainer shares, below everything else.

`LaunchError` (the process group could not be formed or entered), `first_line` (an error's first
line, for a message that quotes it) and `DEAD_KEY` (what a launcher writes into the job's store
when it sees a GPU's process end). They live here, and not with the code that raises or writes
them, because the store client, migration and recovery all need them and none may import the
launch or recovery rooms.
"""

from __future__ import annotations

__all__ = ["DEAD_KEY", "LaunchError", "first_line"]

DEAD_KEY = "rec/dead/"
"""`rec/dead/GPU` in the job's store: a launcher saw that GPU's process exit (recovery need not
wait out its join window for it)."""


class LaunchError(RuntimeError):
    """The process group could not be formed (or a replacement could not enter it)."""


def first_line(e: BaseException) -> str:
    """An error's first line, for a message that names it (its type when it has no text)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
