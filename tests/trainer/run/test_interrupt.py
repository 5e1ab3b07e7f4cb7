"""`malleus train` stops on the first Ctrl-C or SIGTERM: every rank gone within seconds, one
line, exit 130.

A real run of examples/tiny-cpu.yaml (8 rank processes, gloo) is interrupted while it trains:
by Ctrl-C as a terminal sends it (SIGINT to the whole process group, the ranks included), twice,
or by SIGTERM to the launcher alone (as a supervisor sends it). The rank processes are found in
/proc, not assumed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MALLEUS = Path(sys.executable).with_name("malleus")


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc/*/stat)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == pid:
            out.add(int(entry.name))
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its new parent may never reap it)


def _ctrl_c_twice(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)  # impatient: the second changes nothing
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)


def _sigterm(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("stop", [_ctrl_c_twice, _sigterm], ids=["ctrl-c twice", "sigterm"])
def test_the_first_signal_stops_every_rank_quietly(stop) -> None:
    proc = subprocess.Popen(
        [str(MALLEUS), "train", "examples/tiny-cpu.yaml", "--steps", "1000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[malleus] step 1 (2/"):
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(240), "".join(lines)[-3000:]
        ranks = _children(proc.pid)
        assert len(ranks) >= 8  # the 8 ranks (and multiprocessing's resource tracker)
        t0 = time.monotonic()
        stop(proc)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    assert code == 130, out[-3000:]
    assert took < 10, took
    assert "Traceback" not in out, out[-3000:]
    ends = [line for line in lines if line.startswith("malleus train:")]
    assert ends == ["malleus train: interrupted; stopped 8 ranks\n"], out[-3000:]
    deadline = time.monotonic() + 60  # the resource tracker leaves once its pipe closes
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _running(pid)]
