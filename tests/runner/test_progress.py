"""Progress text (pure) and when it is written: a bar in place on a TTY, periodic lines else."""

from __future__ import annotations

import io

from malleus.runner.progress import (
    Progress,
    ProgressState,
    bar_text,
    line_text,
    stragglers_text,
)

STATE = ProgressState(
    steps_done=57,
    total_steps=180,
    elapsed=83.4,
    tokens_per_second=1234.4,
    generation=2,
    stragglers={6: 2.04, 1: 3.0},
)


def test_bar_shows_fraction_step_throughput_generation_and_stragglers() -> None:
    text = bar_text(STATE, width=20)
    assert text.startswith("[######--------------] 57/180")
    assert "1,234 tok/s" in text and "plan gen 2" in text
    assert "stragglers: r1 x3.0, r6 x2.0" in text and text.endswith("1m23s")


def test_line_has_no_bar_and_names_the_phase_when_not_training() -> None:
    text = line_text(ProgressState(0, 10, 5.0, phase="starting"))
    assert (
        text == "[malleus run] 0/10 steps  - tok/s  plan gen 0  stragglers: none  0m05s  [starting]"
    )


def test_unusable_ranks_are_shown_as_down() -> None:
    assert stragglers_text({3: None}) == "r3 down"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_mode_follows_the_terminal() -> None:
    assert Progress.auto_mode(Tty()) == "bar"
    assert Progress.auto_mode(io.StringIO()) == "lines"


def test_bar_redraws_in_place_and_events_clear_it() -> None:
    out = Tty()
    p = Progress(out, "bar")
    p.update(STATE)
    p.update(STATE)  # nothing changed: nothing written
    p.update(ProgressState(58, 180, 84.0))
    p.message("step 42: Replanned: published plan generation 1")
    p.update(ProgressState(58, 180, 84.0))  # the event line took the bar's place: redrawn
    p.close()
    text = out.getvalue()
    assert text.count("\r\x1b[2K[") == 3
    assert "\r\x1b[2Kstep 42: Replanned: published plan generation 1\n" in text
    assert text.endswith("\n")  # close() ends the bar's line


def test_lines_are_written_once_per_interval() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress(out, "lines", interval=10.0, clock=lambda: now[0])
    for t in (0.0, 3.0, 9.9, 10.0, 15.0, 20.5):
        now[0] = t
        p.update(STATE)
    p.update(STATE, force=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # at 0, 10, 20.5, and the forced final one
    assert all(ln.startswith("[malleus run] 57/180 steps") for ln in lines)
    assert "\r" not in out.getvalue()


def test_none_writes_nothing() -> None:
    out = io.StringIO()
    p = Progress(out, "none")
    p.update(STATE, force=True)
    p.message("event")
    p.close()
    assert out.getvalue() == ""
