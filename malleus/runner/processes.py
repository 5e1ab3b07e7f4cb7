"""The trainer processes of a local run: one `python -m malleus.trainer` per emulated GPU.

Each rank is started the way torchrun would start it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so a local run exercises the exact entry point a pod runs; rank 0 serves the
rendezvous and the control endpoint. Separate processes rather than `malleus train`'s spawn:
the runner sees every rank's exit code (a dead trainer is named, not guessed), can stop and
relaunch the whole group (restart mode), and stays free of torch.

No orphans: children run in their own session (a terminal's Ctrl-C reaches the runner only,
which then stops them in order), and on Linux each child asks the kernel for SIGTERM should the
runner die without cleaning up (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["LaunchSpec", "RankExited", "TrainerProcesses", "describe_exit", "free_port"]

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS's pick). Bound by a trainer moments later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_exit(code: int) -> str:
    """`exited with code 1` or `killed by SIGKILL`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _death_signal() -> Callable[[], None] | None:
    """A preexec function asking Linux to SIGTERM the child when the runner dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return arm


class RankExited(RuntimeError):
    """A trainer process ended on its own while the job was running."""

    def __init__(self, rank: int, code: int, log: Path, tail: list[str]) -> None:
        self.rank, self.code, self.log, self.tail = rank, code, log, tail
        lines = "\n".join(f"    {t}" for t in tail) or "    (empty)"
        super().__init__(
            f"trainer rank {rank} {describe_exit(code)}; last lines of {log}:\n{lines}"
        )


@dataclass(frozen=True)
class LaunchSpec:
    """How to start the trainers (what stays the same across relaunches)."""

    job: str
    world: int
    workdir: Path
    token_file: Path
    steps: int | None = None
    save_model: str | None = None
    save_hf: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    init_timeout: float = 120.0
    threads_per_rank: int = 1
    python: str = sys.executable

    def argv(self, rank: int, plan: Path, control_port: int, resume: bool) -> list[str]:
        args = [self.python, "-m", "malleus.trainer", self.job, "--plan", str(plan)]
        args += ["--log-every", "1", "--init-timeout", f"{self.init_timeout:g}"]
        args += ["--control-port", str(control_port if rank == 0 else -1)]
        if self.steps is not None:
            args += ["--steps", str(self.steps)]
        if self.save_model:
            args += ["--save-model", self.save_model]
        if self.save_hf:
            args += ["--save-hf", self.save_hf]
        if self.checkpoint_dir:
            args += ["--checkpoint-dir", self.checkpoint_dir]
            args += ["--checkpoint-every", str(self.checkpoint_every)]
            if resume:
                args.append("--resume")
        return args

    def env(self, rank: int, master_port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("MALLEUS_EXTERNAL_STORE", None)  # rank 0 hosts the rendezvous, as under torchrun
        env.pop("MALLEUS_CONTROL_TOKEN", None)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),  # one machine: the rank is also the local GPU index
            WORLD_SIZE=str(self.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
            OMP_NUM_THREADS=str(self.threads_per_rank),
            MALLEUS_CONTROL_TOKEN_FILE=str(self.token_file),
            PYTHONUNBUFFERED="1",
        )
        return env


class TrainerProcesses:
    """Start, watch and stop one launch of the job's `world` trainer processes at a time."""

    def __init__(self, spec: LaunchSpec, on_line: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.on_line = on_line
        self.launches = 0
        self.control_port: int | None = None
        self.expect_exit = False
        """Set while the group is being stopped on purpose (restart): exits are not failures."""
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []
        self._files: list[IO[bytes]] = []
        self._reader: threading.Thread | None = None
        self._tail: deque[str] = deque(maxlen=20)
        self._exited_at: dict[int, float] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, plan: Path, *, resume: bool = False) -> None:
        """Launch every rank under `plan` (resuming from the checkpoint directory if asked)."""
        if any(p.poll() is None for p in self._procs):
            raise RuntimeError("the previous launch is still running")
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._close_files()
        self.launches += 1
        logs = self.spec.workdir / "logs" / f"launch-{self.launches}"
        logs.mkdir(parents=True, exist_ok=True)
        # The control port stays across relaunches: the controller keeps scraping one address.
        if self.control_port is None:
            self.control_port = free_port()
        control = self.control_port
        master = free_port()
        while master == control:
            master = free_port()
        self._procs, self._logs, self._tail = [], [], deque(maxlen=20)
        self._exited_at = {}
        preexec = _death_signal()
        for rank in range(self.spec.world):
            log = logs / f"rank-{rank}.log"
            out = open(log, "wb")  # noqa: SIM115 (closed in _close_files)
            self._files.append(out)
            self._logs.append(log)
            proc = subprocess.Popen(
                self.spec.argv(rank, plan, control, resume),
                env=self.spec.env(rank, master),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if rank == 0 else out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )
            self._procs.append(proc)
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True).start()
        first = self._procs[0]
        assert first.stdout is not None
        self._reader = threading.Thread(
            target=self._read, args=(first.stdout, self._files[0]), daemon=True
        )
        self._reader.start()
        self.expect_exit = False

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Note when a rank ends: when one dies, the others fail soon after (their collectives
        break), and only the order tells which one to blame."""
        proc.wait()
        self._exited_at.setdefault(rank, time.monotonic())

    def _read(self, stream: IO[bytes], log: IO[bytes]) -> None:
        """Rank 0's output: into its log, the tail, and the line callback (step lines)."""
        for raw in iter(stream.readline, b""):
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            if self.on_line is not None:
                self.on_line(line)
        stream.close()

    @property
    def url(self) -> str:
        """Rank 0's control endpoint."""
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self._procs]

    def running(self) -> bool:
        return any(c is None for c in self.codes())

    def all_exited(self) -> bool:
        return bool(self._procs) and not self.running()

    def failure(self) -> RankExited | None:
        """The first rank that ended badly, or that ended while others still run; else None.

        A rank ending with 0 while others run is normal for a moment at the end of training;
        it becomes a failure only if the others are then stuck, which `finished()` bounds.
        """
        if self.expect_exit:
            return None
        codes = self.codes()
        bad = [r for r, c in enumerate(codes) if c is not None and c != 0]
        if not bad:
            return None
        first = min(bad, key=lambda r: (self._exited_at.get(r, math.inf), r))
        code = codes[first]
        assert code is not None
        return RankExited(first, code, self._logs[first], self.log_tail(first))

    def finished(self) -> bool:
        """Every rank ended with 0: training is done."""
        return self.all_exited() and all(c == 0 for c in self.codes())

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until rank 0's output has been read to its end (after it exited)."""
        if self._reader is not None:
            self._reader.join(timeout=timeout)

    def log_tail(self, rank: int, lines: int = 12) -> list[str]:
        if rank == 0 and self._reader is not None:
            self._reader.join(timeout=2)
            return list(self._tail)[-lines:]
        try:
            text = self._logs[rank].read_text(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every rank to end; True if they did."""
        deadline = time.monotonic() + timeout
        for p in self._procs:
            left = deadline - time.monotonic()
            if left <= 0:
                return not self.running()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=left)
        return not self.running()

    def terminate(self, grace: float = 5.0) -> None:
        """SIGTERM every rank still running, SIGKILL whatever remains after `grace` seconds."""
        self.expect_exit = True
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        if not self.wait(grace):
            for p in self._procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            self.wait(grace)
        if self._reader is not None:
            self._reader.join(timeout=2)
        self._close_files()

    def _close_files(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        self._files = []
