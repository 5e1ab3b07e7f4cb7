"""Whole lines on stdout and stderr: many ranks share one terminal, pipe or log file.

Local ranks (`spawn_local`, torchrun) inherit their launcher's stdout and stderr, so their
lines meet in one file. `print(text)` is two writes (the text, then the newline), and
unbuffered (`PYTHONUNBUFFERED=1`, as in our images and many CI shells) each is its own system
call: another rank's line can land between them (`...in 1.18 s[malleus] rank 3 joined at step
2`). `whole_lines()` makes each process hand the file whole lines only, each batch in one write
(one system call, which other processes' writes do not split: on a pipe up to PIPE_BUF bytes,
on a file they all inherited, any length).
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Any, TextIO

__all__ = ["WholeLines", "whole_lines"]

_HOLD_AT_MOST = 1 << 16
"""Characters a stream holds while its writes do not end a line; then its whole lines go."""


class WholeLines:
    """A text stream that passes whole lines to `stream`, each batch in one `write` and a flush.

    Text waits here until a write ends a line (so a message of many lines goes in one write,
    and a flush from another thread does not send half a line); `close_pending()` (at exit)
    sends what is left. Everything else (fileno, encoding, buffer, isatty) is the wrapped
    stream's.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if self._pending.endswith("\n"):  # print(a message of many lines): one write
                whole, self._pending = self._pending, ""
            elif len(self._pending) > _HOLD_AT_MOST and "\n" in self._pending:
                cut = self._pending.rfind("\n") + 1
                whole, self._pending = self._pending[:cut], self._pending[cut:]
            else:
                return len(text)
            self.stream.write(whole)
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self.stream.flush()

    def close_pending(self) -> None:
        """Send a last line that has no newline (at exit: nothing is lost)."""
        with self._lock:
            if self._pending:
                self.stream.write(self._pending)
                self._pending = ""
            self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def whole_lines() -> None:
    """Make this process's stdout and stderr write whole lines only (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, WholeLines):
            continue
        wrapped = WholeLines(stream)
        setattr(sys, name, wrapped)
        atexit.register(wrapped.close_pending)
