"""Live progress of a local run: a bar redrawn in place on a terminal, plain lines otherwise.

The text is built by pure functions (tested alone); `Progress` only decides when to write it.
A log file or CI output gets one line every `interval` seconds, never carriage returns.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TextIO

__all__ = ["Progress", "ProgressMode", "ProgressState", "bar_text", "line_text", "stragglers_text"]

ProgressMode = Literal["bar", "lines", "none"]


@dataclass(frozen=True)
class ProgressState:
    """What the progress shows."""

    steps_done: int
    total_steps: int
    elapsed: float
    tokens_per_second: float | None = None
    generation: int = 0
    stragglers: Mapping[int, float | None] = field(default_factory=dict)
    phase: str = "training"
    """starting | training | re-planning | restarting | done."""


def stragglers_text(stragglers: Mapping[int, float | None]) -> str:
    """`r1 x3.0, r6 x2.0` (`r3 down` for an unusable rank); `none` when there are none."""
    if not stragglers:
        return "none"
    return ", ".join(
        f"r{r} down" if v is None else f"r{r} x{v:.1f}" for r, v in sorted(stragglers.items())
    )


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


def _fields(state: ProgressState) -> str:
    tps = "-" if state.tokens_per_second is None else f"{state.tokens_per_second:,.0f}"
    text = (
        f"{state.steps_done}/{state.total_steps} steps  {tps} tok/s  plan gen {state.generation}  "
        f"stragglers: {stragglers_text(state.stragglers)}  {_clock(state.elapsed)}"
    )
    return text if state.phase == "training" else f"{text}  [{state.phase}]"


def bar_text(state: ProgressState, width: int = 24) -> str:
    """`[#########-------] 57/180 steps  1,234 tok/s  plan gen 2  stragglers: r1 x3.0  1m23s`."""
    frac = state.steps_done / state.total_steps if state.total_steps else 0.0
    filled = min(width, round(frac * width))
    return f"[{'#' * filled}{'-' * (width - filled)}] {_fields(state)}"


def line_text(state: ProgressState) -> str:
    """`[malleus run] 57/180 steps  1,234 tok/s  plan gen 2  stragglers: r1 x3.0  1m23s`: steps
    done (a count; a step itself is named by its 0-based index, `malleus.notation`)."""
    return f"[malleus run] {_fields(state)}"


class Progress:
    """Writes progress to `stream`: a bar (TTY), periodic lines, or nothing."""

    def __init__(
        self,
        stream: TextIO,
        mode: ProgressMode,
        *,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.mode = mode
        self.interval = interval
        self._clock = clock
        self._last_line: float | None = None
        self._bar_shown = False
        self._last_bar = ""

    @staticmethod
    def auto_mode(stream: TextIO) -> ProgressMode:
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"

    def update(self, state: ProgressState, *, force: bool = False) -> None:
        if self.mode == "bar":
            # One terminal line at most (a wrapped bar cannot be redrawn in place); only changes.
            text = bar_text(state)[: max(20, shutil.get_terminal_size().columns - 1)]
            if text != self._last_bar or not self._bar_shown:
                self.stream.write("\r\x1b[2K" + text)
                self.stream.flush()
                self._last_bar, self._bar_shown = text, True
        elif self.mode == "lines":
            now = self._clock()
            if force or self._last_line is None or now - self._last_line >= self.interval:
                self._last_line = now
                self.stream.write(line_text(state) + "\n")
                self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (an event), above the bar."""
        if self.mode == "none":
            return
        if self._bar_shown:
            self.stream.write("\r\x1b[2K")
            self._bar_shown = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_shown = False
