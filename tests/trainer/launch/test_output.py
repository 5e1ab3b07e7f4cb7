"""Ranks that share one stdout never split each other's lines (trainer/launch/output.py).

Unbuffered (PYTHONUNBUFFERED=1), `print(text)` was two system calls, the text and then the
newline, and the recovery test once read `...in 1.18 s[malleus] rank 3 joined at step 2`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from malleus.trainer.launch.output import WholeLines

ROOT = Path(__file__).resolve().parents[3]


class Recorder:
    """A stream that records each write it gets."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_print_reaches_the_stream_as_one_write_of_whole_lines() -> None:
    rec = Recorder()
    out = WholeLines(rec)  # type: ignore[arg-type]
    print("[malleus] rank 3 joined at step 2", file=out, flush=True)
    print("two\nlines", file=out, flush=True)
    assert rec.writes == ["[malleus] rank 3 joined at step 2\n", "two\nlines\n"]
    out.write("half a line")
    out.flush()  # a flush (another thread's, say) does not send half a line
    assert rec.writes[2:] == []
    out.write(" and its end\nthe next")
    assert rec.writes[2:] == []  # held until a write ends a line
    out.write(" line\n")
    assert rec.writes[2:] == ["half a line and its end\nthe next line\n"]
    out.write("x" * 70_000 + "\nno end")  # writes that never end a line: held up to 64 Ki
    assert rec.writes[3:] == ["x" * 70_000 + "\n"]
    out.close_pending()  # at exit: the rest
    assert rec.writes[4:] == ["no end"]


def test_threads_printing_at_once_write_whole_lines() -> None:
    rec = Recorder()
    out = WholeLines(rec)  # type: ignore[arg-type]

    def speak(i: int) -> None:
        for n in range(500):
            print(f"thread {i} line {n}", file=out)

    threads = [threading.Thread(target=speak, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(w.endswith("\n") for w in rec.writes)
    lines = "".join(rec.writes).splitlines()
    assert len(lines) == 2000 and all(re.fullmatch(r"thread \d line \d+", x) for x in lines)


CHILD = """
import sys
from malleus.trainer.launch.output import whole_lines
whole_lines()
i = int(sys.argv[1])
for n in range(2000):
    print(f"[malleus] process {i} says line {n} " + "x" * (n % 37), flush=True)
"""


def test_processes_sharing_one_unbuffered_pipe_write_whole_lines() -> None:
    # Six processes print into one pipe at once, unbuffered as in our images. Without
    # whole_lines() a run like this merged lines (each print was two writes); with it each
    # line is one write, which no other process's write can split.
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(i)],
            stdout=write_end,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
        )
        for i in range(6)
    ]
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()
    assert [p.wait(60) for p in procs] == [0] * 6
    lines = text.splitlines()
    pattern = re.compile(r"\[malleus\] process \d says line \d+ x*")
    bad = [x for x in lines if not pattern.fullmatch(x)]
    assert bad == [] and len(lines) == 6 * 2000
