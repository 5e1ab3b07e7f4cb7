"""The trainer processes of a local run: one `python -m malleus.trainer` per emulated GPU.

Each rank is started the way torchrun would start it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so a local run exercises the exact entry point a pod runs. The rendezvous store is
hosted by none of them: the runner starts `python -m malleus.trainer store` first (a process of
its own, `StoreServer`) and every rank meets there (`MALLEUS_STORE=host:port`), so losing any
rank, rank 0 included, does not lose the job. Every rank has its own control port (the job's
base port + its rank) and serves it while it is the coordinator (the lowest GPU of the current
membership). Separate processes
rather than `malleus train`'s spawn: the runner sees every rank's exit code (a dead trainer is
named, not guessed), can replace one rank's process (`replace`: the same command plus
`--join`), stop and relaunch the whole group (restart mode), and stays free of torch.

No orphans: children (the store included) run in their own session (a terminal's Ctrl-C reaches
the runner only, which then stops them in order), and on Linux each child asks the kernel for
SIGTERM should the runner die without cleaning up (PR_SET_PDEATHSIG).

Layout: this module holds the trainer processes (`TrainerProcesses`, one `RankProcess` per
rank, `RankExited` when one ends); the store's process and the ports and parent-death signal
every child shares are `malleus.runner.store_server`'s, and the ranks' command line and
environment `malleus.runner.launch`'s (`LaunchSpec`). All their public names are importable
from here too.
"""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from malleus.control.sealed import store_key

from .launch import LaunchSpec
from .store_server import StoreServer, death_signal, free_port, free_ports

__all__ = [
    "EXPELLED",
    "LaunchSpec",
    "RankExited",
    "StoreServer",
    "TrainerProcesses",
    "describe_exit",
    "free_port",
    "free_ports",
]

EXPELLED = 3
"""A trainer's exit code when the job left it out (a hung rank that woke up too late)."""


def describe_exit(code: int) -> str:
    """`exited with code 1` or `killed by SIGKILL` (`was left out of the job` for code 3)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXPELLED:
        return f"was left out of the job (exit code {EXPELLED})"
    return f"exited with code {code}"


class RankExited(RuntimeError):
    """A trainer process ended on its own while the job was running."""

    def __init__(self, rank: int, code: int, log: Path, tail: list[str]) -> None:
        self.rank, self.code, self.log, self.tail = rank, code, log, tail
        lines = "\n".join(f"    {t}" for t in tail) or "    (empty)"
        super().__init__(
            f"trainer rank {rank} {describe_exit(code)}; last lines of {log}:\n{lines}"
        )


@dataclass
class RankProcess:
    """One process of one rank: the original of a launch or a replacement (`joins` > 0)."""

    rank: int
    proc: subprocess.Popen[bytes]
    log: Path
    joins: int = 0
    """0: started with the launch; n: the n-th replacement of this rank (started with --join)."""
    started: float = field(default_factory=time.monotonic)
    exited_at: float | None = None
    joined_step: int | None = None
    """The step a replacement joined at (its `[malleus] rank G joined at step S` line)."""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    reader: threading.Thread | None = None

    @property
    def code(self) -> int | None:
        return self.proc.poll()


def _launches_logged(workdir: Path) -> int:
    """The highest N of the `logs/launch-N` folders in `workdir` (0 when none)."""
    found = [0]
    for d in (workdir / "logs").glob("launch-*"):
        suffix = d.name.removeprefix("launch-")
        if suffix.isdigit():
            found.append(int(suffix))
    return max(found)


class TrainerProcesses:
    """Start, watch, replace and stop the job's `world` trainer processes.

    `on_line(line)` gets every line any rank prints (step lines come from the coordinator);
    `on_rank_line(rank, line)` the same with the rank. Lines are read on one thread per
    process; the callbacks must be thread-safe.
    """

    def __init__(
        self,
        spec: LaunchSpec,
        on_line: Callable[[str], None] | None = None,
        *,
        on_rank_line: Callable[[int, str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.on_line = on_line
        self.on_rank_line = on_rank_line
        self.launches = _launches_logged(spec.workdir)
        """Launches so far in this work directory, earlier runs' included: a resumed run's
        logs go to the next `logs/launch-N`, never over the ones it continues."""
        self.ports: list[int] = free_ports(spec.world)
        """Every rank's control port, `ports[0] + rank` (kept across relaunches and
        replacements: the controller keeps scraping one set). Each rank is given
        `--control-port ports[0]` and serves at that + its local rank (= its rank here) while
        it is the coordinator; without fault tolerance only rank 0 serves."""
        self.expect_exit = False
        """Set while the group is being stopped on purpose (restart): exits are not failures."""
        self.store: StoreServer | None = None
        self._ranks: list[RankProcess] = []
        self._retired: list[RankProcess] = []
        self._files: list[IO[bytes]] = []
        self._plan: Path | None = None
        self._resume = False
        self._master = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, plan: Path, *, resume: bool = False) -> None:
        """Launch every rank under `plan` (resuming from the checkpoint directory if asked),
        after a fresh rendezvous store (a relaunch must not meet the last launch's keys)."""
        if any(r.code is None for r in self._ranks):
            raise RuntimeError("the previous launch is still running")
        self._join_readers()
        self._close_files()
        first = self.store is None
        self.launches += 1
        logs = self.logs_dir
        logs.mkdir(parents=True, exist_ok=True)
        if self.store is not None:
            self.store.stop()
        self.store = StoreServer(self.spec.python, logs / "store.log", key=self._store_key())
        self.store.start(timeout=max(60.0, self.spec.init_timeout))
        if self.store.port in self.ports and first:  # the OS's pick, in our block
            self.ports = free_ports(self.spec.world)
        self._plan, self._resume, self._master = plan, resume, self.store.port
        self._retired += self._ranks
        self._ranks = []
        for rank in range(self.spec.world):
            self._ranks.append(self._spawn(rank, logs / f"rank-{rank}.log", 0))
        self.expect_exit = False

    def _store_key(self) -> bytes:
        """The job's store key, from the control token the ranks read too (their
        `MALLEUS_CONTROL_TOKEN_FILE`): the runner's dead marks are sealed with it."""
        return store_key(self.spec.token_file.read_text(encoding="utf-8").strip())

    def _spawn(self, rank: int, log: Path, joins: int) -> RankProcess:
        assert self._plan is not None and self.store is not None
        out = open(log, "wb")  # noqa: SIM115 (closed in _close_files)
        self._files.append(out)
        proc = subprocess.Popen(
            self.spec.argv(rank, self._plan, self.ports[0], self._resume, join=joins > 0),
            env=self.spec.env(rank, self._master, self.store.address),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=death_signal(),
        )
        rp = RankProcess(rank, proc, log, joins)
        assert proc.stdout is not None
        rp.reader = threading.Thread(target=self._read, args=(rp, proc.stdout, out), daemon=True)
        rp.reader.start()
        threading.Thread(target=self._watch, args=(rp,), daemon=True).start()
        return rp

    def replace(self, rank: int) -> RankProcess:
        """Start a new process for `rank` (whose process has ended) that joins the running
        job: the original's command line and environment plus `--join`."""
        old = self._ranks[rank]
        if old.code is None:
            raise RuntimeError(f"rank {rank}'s process {old.proc.pid} is still running")
        joins = old.joins + 1
        new = self._spawn(rank, self.logs_dir / f"rank-{rank}.join-{joins}.log", joins)
        self._retired.append(old)
        self._ranks[rank] = new
        return new

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to `rank`'s process (a hung rank the trainers left out)."""
        rp = self._ranks[rank]
        if rp.code is None:
            with contextlib.suppress(ProcessLookupError):
                rp.proc.send_signal(sig)
                if sig == signal.SIGKILL:  # a stopped process must not wait for SIGCONT
                    rp.proc.send_signal(signal.SIGCONT)

    def _watch(self, rp: RankProcess) -> None:
        """Note when a process ends: when one dies, others may fail soon after, and only the
        order tells which one to blame."""
        rp.proc.wait()
        if rp.exited_at is None:
            rp.exited_at = time.monotonic()

    def _read(self, rp: RankProcess, stream: IO[bytes], log: IO[bytes]) -> None:
        """A rank's output: into its log, its tail, and the line callbacks."""
        for raw in iter(stream.readline, b""):
            with contextlib.suppress(ValueError, OSError):
                log.write(raw)
                log.flush()
            line = raw.decode(errors="replace").rstrip()
            rp.tail.append(line)
            if self.on_rank_line is not None:
                self.on_rank_line(rp.rank, line)
            if self.on_line is not None:
                self.on_line(line)
        stream.close()

    # ---- views -----------------------------------------------------------------------------
    @property
    def logs_dir(self) -> Path:
        return self.spec.workdir / "logs" / f"launch-{max(1, self.launches)}"

    @property
    def control_port(self) -> int | None:
        """Rank 0's control port (None before the first launch)."""
        return self.ports[0] if self.ports else None

    def url_of(self, rank: int) -> str:
        return f"http://127.0.0.1:{self.ports[rank]}"

    @property
    def url(self) -> str:
        """Rank 0's control endpoint (the coordinator while every rank is in the job)."""
        return self.url_of(0)

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    @property
    def started(self) -> bool:
        """A launch has started (every rank has a process, running or ended)."""
        return bool(self._ranks)

    def process(self, rank: int) -> RankProcess:
        return self._ranks[rank]

    def codes(self) -> list[int | None]:
        return [r.code for r in self._ranks]

    def alive(self) -> list[int]:
        """The ranks whose current process is running."""
        return [r.rank for r in self._ranks if r.code is None]

    def running(self) -> bool:
        return any(c is None for c in self.codes())

    def all_exited(self) -> bool:
        return bool(self._ranks) and not self.running()

    def exited_at(self, rank: int) -> float:
        rp = self._ranks[rank]
        return rp.exited_at if rp.exited_at is not None else math.inf

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
        first = min(bad, key=lambda r: (self.exited_at(r), r))
        return self.exited(first)

    def exited(self, rank: int) -> RankExited:
        """`rank`'s current process, which has ended, as a RankExited (its log's last lines)."""
        rp = self._ranks[rank]
        code = rp.code
        assert code is not None
        return RankExited(rank, code, rp.log, self.log_tail(rank))

    def finished(self) -> bool:
        """Every rank ended with 0: training is done."""
        return self.all_exited() and all(c == 0 for c in self.codes())

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until the output of the processes that ended has been read to its end."""
        deadline = time.monotonic() + timeout
        for r in self._ranks:
            if r.reader is not None and r.code is not None:
                r.reader.join(timeout=max(0.0, deadline - time.monotonic()))

    def log_tail(self, rank: int, lines: int = 12) -> list[str]:
        rp = self._ranks[rank]
        if rp.reader is not None and rp.code is not None:
            rp.reader.join(timeout=2)
        return list(rp.tail)[-lines:]

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every rank to end; True if they did."""
        deadline = time.monotonic() + timeout
        for r in self._ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                return not self.running()
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=left)
        return not self.running()

    def terminate(self, grace: float = 5.0, *, store: bool = True) -> None:
        """SIGTERM every rank still running, SIGKILL whatever remains after `grace` seconds;
        then the store (unless `store` is False: a relaunch replaces it anyway)."""
        self.expect_exit = True
        for r in self._ranks:
            if r.code is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.send_signal(signal.SIGTERM)
                    r.proc.send_signal(signal.SIGCONT)  # a stopped (hung) rank too
        if not self.wait(grace):
            for r in self._ranks:
                if r.code is None:
                    with contextlib.suppress(ProcessLookupError):
                        r.proc.kill()
            self.wait(grace)
        self._join_readers()
        self._close_files()
        if store and self.store is not None:
            self.store.stop()

    def _join_readers(self) -> None:
        for r in self._ranks:
            if r.reader is not None:
                r.reader.join(timeout=2)

    def _close_files(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        self._files = []


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (`T` = stopped), None when unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()[0] if ")" in text else None
