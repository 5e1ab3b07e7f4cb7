"""No orphans: Ctrl-C stops every trainer; a run left without trainers stops and names them.

Real processes (two ranks of a slow emulated job); every wait polls against a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import manifest, write_job

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")


def wait_for(what: str, check: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def trainers(workdir: Path) -> dict[int, int]:
    """rank -> pid of the trainer processes started for `workdir` (found through /proc)."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if b"malleus.trainer" not in cmd or not any(str(workdir).encode() in c for c in cmd):
                continue
            env = dict(
                kv.split(b"=", 1)
                for kv in (proc / "environ").read_bytes().split(b"\0")
                if b"=" in kv
            )
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            found[int(env[b"RANK"])] = int(proc.name)
    return found


def start(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    job = write_job(
        tmp_path / "slow.yaml",
        manifest(gpus=2, layers=2, global_batch=2, steps=500, forward_ms=50, backward_ms=100),
    )
    workdir = tmp_path / "work"
    cmd = [sys.executable, "-m", "malleus.cli", "run", job, "--workdir", str(workdir)]
    cmd += ["--progress", "lines", "--progress-interval", "1", "--report", str(tmp_path / "r.json")]
    runner = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
    )
    log = workdir / "logs" / "launch-1" / "rank-0.log"

    def first_step() -> bool:
        if runner.poll() is not None:  # say why at once rather than time out
            _, err = runner.communicate()
            raise AssertionError(f"malleus run ended ({runner.returncode}): {err[-3000:]}")
        return log.exists() and "[malleus] step 0 (1/" in log.read_text()

    wait_for("the first step", first_step, 180)
    return runner, workdir


def test_ctrl_c_stops_every_trainer_and_still_reports(tmp_path: Path) -> None:
    runner, workdir = start(tmp_path)
    assert sorted(trainers(workdir)) == [0, 1]
    os.killpg(runner.pid, signal.SIGINT)  # what a terminal sends to the foreground job
    _, err = runner.communicate(timeout=60)
    assert runner.returncode == 130, err
    # no spec.checkpoint in this job: a local run saves one when stopped all the same
    assert "interrupted: saved a checkpoint of step" in err, err
    assert f"continue with: malleus run --resume {workdir}" in err
    assert trainers(workdir) == {}
    assert '"code": 130' in (tmp_path / "r.json").read_text()


def test_a_run_left_without_trainers_fails_naming_the_first_dead_one(tmp_path: Path) -> None:
    # One dead rank is survivable (tests/runner/test_faults.py); with both dead before any
    # replacement is due (the failure policy's backoff, 10 s by default), no member of the
    # job is left and the run fails, naming the rank that died first and every rank's fate.
    runner, workdir = start(tmp_path)
    pids = trainers(workdir)
    os.kill(pids[1], signal.SIGKILL)
    # rank 1 dies first for the runner too: it has reaped it (the thread that reaps a process
    # notes when it ended) before rank 0 is killed, however late a loaded machine runs it
    wait_for("the runner to reap rank 1", lambda: not Path(f"/proc/{pids[1]}").exists(), 60)
    os.kill(pids[0], signal.SIGKILL)
    _, err = runner.communicate(timeout=120)
    assert runner.returncode == 1, err
    assert "malleus run: trainer rank 1 killed by SIGKILL" in err
    assert str(workdir / "logs" / "launch-1" / "rank-1.log") in err
    assert "every rank is gone after" in err
    assert "rank 0 killed by SIGKILL; rank 1 killed by SIGKILL" in err
    wait_for("the other trainer to be gone", lambda: trainers(workdir) == {}, 10)
