"""The runner's rendezvous store process, and what every child process of a local run shares.

`StoreServer` is `python -m malleus.trainer store` as a child of the runner: the job's
rendezvous store, hosted by no trainer, so that losing any rank (rank 0 included) does not lose
the job (`malleus.runner.processes` starts it before the ranks and hands them its address).
Beside it, the plumbing both it and the trainer processes use: free ports picked by the OS
(`free_port`, and `free_ports` for the ranks' consecutive control ports) and the Linux
parent-death signal that keeps a child from outliving a runner that died without cleaning up.

Apart from `malleus.runner.processes` (the trainer processes) because the store is a process of
its own, with its own life: started fresh for every launch, stopped after the ranks.

What the runner tells the trainers through it (`mark_dead`: a GPU's process ended) is sealed
here with the job's store key (malleus/control/sealed.py, derived from the run's control token,
which the ranks read too): the ranks believe only sealed dead marks (trainer/world/sealed.py),
and the store process never holds the key.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from malleus.control.sealed import seal

__all__ = ["DEAD_KEY", "JOB_PREFIX", "StoreServer", "death_signal", "free_port", "free_ports"]

JOB_PREFIX = "malleus/0/"
"""The ranks' `PrefixStore("malleus/<attempt>/")` (trainer/launch/distributed.py): it joins
prefix and key with one more "/", so the raw key of their `rec/dead/3` is
``malleus/0//rec/dead/3``."""
DEAD_KEY = "rec/dead/"
"""trainer/world/errors.py DEAD_KEY: a GPU's process ended (as the ranks name it)."""

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS's pick). Bound by a trainer moments later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1", tries: int = 100) -> list[int]:
    """`count` consecutive ports free right now: `base, base + 1, ...` (the trainers' control
    ports: with `$MALLEUS_STORE` each rank serves at `--control-port` + its local rank)."""
    for _ in range(tries):
        base = free_port(host)
        if base + count > 65535:
            continue
        ok = True
        for port in range(base + 1, base + count):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    ok = False
                    break
        if ok:
            return list(range(base, base + count))
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def death_signal() -> Callable[[], None] | None:
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


class StoreServer:
    """The job's rendezvous store as a child process (`python -m malleus.trainer store`),
    bound to 127.0.0.1 on a port the OS picks; `address` is `127.0.0.1:PORT` once it listens.
    `key`: the job's store key (malleus/control/sealed.py `store_key`), which `mark_dead` seals
    with; None: no dead mark can be written."""

    def __init__(self, python: str, log: Path, key: bytes | None = None) -> None:
        self.python = python
        self.log = log
        self._key = key
        self.address: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0, *, port: int = 0) -> str:
        """Start the server on `port` (0: the OS picks; a restart: the lost one's, which the
        ranks' clients dial again, trainer/world/store_client.py)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        err = open(self.log, "ab")  # noqa: SIM115 (the child holds it; closed below)
        try:
            self._proc = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "malleus.trainer",
                    "store",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                preexec_fn=death_signal(),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            err.close()
        got: list[bytes] = []
        stdout = self._proc.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = got[0].decode(errors="replace").strip() if got else ""
        if not line.startswith("store ready on "):
            self.stop()
            detail = self.log.read_text(errors="replace").strip()[-2000:]
            raise RuntimeError(
                f"the rendezvous store did not start within {timeout:g} s"
                + (f": {detail}" if detail else "")
            )
        self.address = line.rsplit(" ", 1)[1]
        return self.address

    def set(self, key: str, value: str) -> bool:
        """Set `key` in the store (through the server's stdin); False if it is gone."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            return False
        try:
            proc.stdin.write(f"set {key} {value}\n".encode())
            proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def mark_dead(self, rank: int, why: str) -> bool:
        """Tell the ranks that GPU `rank`'s process ended (`why`: "hung", "1", ...), sealed with
        the job's key so that they believe it; False if the store is gone or there is no key."""
        if self._key is None:
            return False
        name = f"{DEAD_KEY}{rank}"
        return self.set(f"{JOB_PREFIX}/{name}", seal(self._key, name, why).decode())

    @property
    def port(self) -> int:
        assert self.address is not None
        return int(self.address.rsplit(":", 1)[1])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def lost(self) -> int | None:
        """The exit code of a server that ended on its own (None while it runs or once
        stopped on purpose)."""
        return None if self._proc is None else self._proc.poll()

    def restart(self, timeout: float = 60.0) -> str:
        """Start a fresh, empty server on the same port (the lost one's keys are gone)."""
        port = self.port
        self.stop()
        return self.start(timeout, port=port)

    def stop(self, grace: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
