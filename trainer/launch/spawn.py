"""Spawning the trainer processes locally (`spawn_local`) and supervising them to the end.

Locally, the parent process hosts the rendezvous store on a port the OS picks, so concurrent
runs (tests) never race for a "free" port; when a child dies it stops the rest and names the
rank and what the job was doing (a note rank 0 leaves in that store, e.g. during a switch).
With fault tolerance a child's death does not end the job: the launcher marks the GPU dead in
the store and watches the survivors to the end (`_watch`).

Stopping: the launcher alone decides. On its first SIGINT (Ctrl-C) or SIGTERM it sends SIGTERM to
every rank, gives them `STOP_S` seconds, kills what is left and raises `Interrupted`; a second
signal meanwhile changes nothing. The ranks die of the signal itself (`quiet_signals`), with no
Python handler and so no traceback, whatever collective they are blocked in.

Each child starts exactly as under torchrun (trainer/launch/distributed.py: `DistEnv.from_env`,
`init_distributed`), which is where one rank's side lives.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from malleus.errors import LEFT_OUT_EXIT
from malleus.trainer.world.errors import DEAD_KEY, LaunchError
from malleus.trainer.world.sealed import STORE_KEY_ENV, Sealer

from .distributed import (
    EXTERNAL_STORE_ENV,
    FAULT_TOLERANT_ENV,
    NOTE_KEY,
    NOTE_PREFIX,
    STOP_SIGNALS,
    quiet_signals,
)
from .output import whole_lines
from .rendezvous import listening_store

__all__ = ["Interrupted", "spawn_local"]

GRACE_S = 5.0  # after one local rank fails, how long the others may take to fail on their own
STOP_S = 5.0  # after SIGINT/SIGTERM, how long the ranks may take to exit before being killed


class _NoGlobals(pickle.Unpickler):
    """Unpickles plain data only: a pickle that names any class or function (the way every
    pickle runs code) is refused before anything of it is called."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}: a pickle naming code is not read")


def _traceback_in(path: str) -> str:
    """The traceback torch.multiprocessing's wrapper pickled into a failed child's error file
    (a str): read without letting the file name any code, whatever the child wrote."""
    with open(path, "rb") as fh:
        return str(_NoGlobals(fh).load())


class Interrupted(Exception):
    """The launcher got SIGINT or SIGTERM and stopped every rank."""

    def __init__(self, signum: int, stopped: int, killed: int) -> None:
        self.signum, self.stopped, self.killed = signum, stopped, killed
        late = f" ({killed} killed after {STOP_S:g} s)" if killed else ""
        super().__init__(f"interrupted; stopped {stopped} ranks{late}")


class _Stop(BaseException):
    """Raised by the launcher's signal handler to leave the wait for the ranks."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def spawn_local(
    nprocs: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    grace_s: float = GRACE_S,
    *,
    fault_tolerant: bool = False,
) -> list[int | None]:
    """Run `fn(*args)` in `nprocs` fresh processes forming one job on 127.0.0.1.

    Each child gets torchrun's environment variables, so `fn` starts with
    `init_distributed(DistEnv.from_env())` exactly as under torchrun. When a child fails (an
    exception, or death by a signal), the others get `grace_s` seconds to fail on their own
    (printing their errors) and are then terminated; the LaunchError raised names the rank and
    what the job was doing (the ranks' last note). On SIGINT or SIGTERM (from the main thread
    only, where Python delivers signals) every child is stopped and `Interrupted` raised.

    `fault_tolerant`: a child's death does not stop the others (they recover among themselves,
    trainer/recovery/protocol.py): the launcher says so on stderr, marks the GPU dead in the store
    (`rec/dead/GPU`, sealed with a key drawn for this launch and given to the children as
    `$MALLEUS_STORE_KEY`, trainer/world/sealed.py) and goes on; once a child has finished (exit 0) a stopped one (a hung
    rank left out of the job) is killed after `grace_s`, any other after `FINISH_S`. LaunchError only when no child
    finished or a survivor failed (exit code other than 0 and 3, "left out of the job").
    Returns the children's exit codes.
    """
    host = "127.0.0.1"
    # lives while we wait; listens on loopback alone (a TCPStore given a host binds them all)
    store = listening_store(host, 0, timeout=timedelta(seconds=300))
    # The store's values are believed only when sealed with the job's key: one per launch,
    # shared with the children alone (their environment), never with the store.
    sealer = Sealer.fresh()
    handle = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if handle else {}
    got: list[int] = []
    try:
        if handle:  # inherited by the children until `_child` runs: no traceback from startup
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        ctx = mp.start_processes(
            _child,
            args=(fn, args, nprocs, host, store.port, fault_tolerant, sealer.hex),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )

        def on_signal(signum: int, frame: FrameType | None) -> None:
            for sig in STOP_SIGNALS:  # the first signal decides; later ones change nothing
                signal.signal(sig, signal.SIG_IGN)
            got.append(signum)
            raise _Stop(signum)

        for sig in previous:
            signal.signal(sig, on_signal)
        try:
            if fault_tolerant:
                notes = dist.PrefixStore("malleus/0/", store)
                return _watch(ctx.processes, ctx.error_files, notes, grace_s, sealer)
            while not ctx.join(grace_period=grace_s):
                pass
        except _Stop as stop:
            raise Interrupted(stop.signum, *_stop_all(ctx.processes)) from None
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            if got:  # the ranks saw the Ctrl-C before the launcher did
                raise Interrupted(got[0], *_stop_all(ctx.processes)) from None
            codes = [p.exitcode for p in ctx.processes]
            raise LaunchError(_failure(e, codes, dist.PrefixStore(NOTE_PREFIX, store))) from e
    finally:
        if not got:  # after a stop signal, later ones stay ignored while the command ends
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        del store
    return [p.exitcode for p in ctx.processes]


FINISH_S = 120.0
"""Once a rank finished, how long a fault-tolerant launcher waits for the others to end (a
stopped process, a hung rank left out of the job, is killed after `grace_s`)."""


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP: state T in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _watch(
    processes: list[Any], error_files: list[str], store: Any, grace_s: float, sealer: Sealer
) -> list[int | None]:
    """Fault-tolerant wait: report deaths, let the survivors go on, end with the job."""
    reported: set[int] = set()
    finished_at: float | None = None
    while True:
        now = time.monotonic()
        for i, p in enumerate(processes):
            code = p.exitcode
            if code is None or i in reported:
                continue
            reported.add(i)
            if code == 0:
                finished_at = finished_at or now
                continue
            how = f"signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
            why = "killed" if code < 0 else ("left" if code == LEFT_OUT_EXIT else "failed")
            with contextlib.suppress(RuntimeError, OSError):
                # a rank declared hung (by itself or its watcher) keeps that word
                if sealer.get(store, f"{DEAD_KEY}{i}") != "hung":
                    sealer.put(store, f"{DEAD_KEY}{i}", why)
            # one write per message: the ranks write to the same stderr (output.py)
            if code != LEFT_OUT_EXIT:
                sys.stderr.write(f"malleus train: rank {i} died ({how}); the others go on\n")
            if code > 0 and os.access(error_files[i], os.R_OK):  # its traceback, as join() shows
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"rank {i}: {_traceback_in(error_files[i])}\n")
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            break
        if finished_at is not None:  # training is over: what is stopped was left out of the job
            late = now - finished_at
            gone = [p for p in alive if late > FINISH_S or (late > grace_s and _stopped(p.pid))]
            for p in gone:
                reported.add(processes.index(p))
                p.kill()
                p.join()
            if gone:
                continue
        time.sleep(0.05)
    codes = [p.exitcode for p in processes]
    if not any(c == 0 for c in codes):
        raise LaunchError(f"every rank failed (exit codes {codes})")
    bad = [i for i, c in enumerate(codes) if c is not None and c > 0 and c != LEFT_OUT_EXIT]
    if bad:
        raise LaunchError(f"rank {bad[0]} failed (exit code {codes[bad[0]]}); see its error above")
    return codes


def _stop_all(processes: list[Any]) -> tuple[int, int]:
    """SIGTERM every live process, wait up to `STOP_S` in all, SIGKILL the rest.

    Returns (processes stopped, of which killed)."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + STOP_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [p for p in alive if p.is_alive()]
    for p in late:
        p.kill()
        p.join()
    return len(processes), len(late)


def _failure(
    e: mp.ProcessExitedException | mp.ProcessRaisedException,
    exitcodes: list[int | None],
    notes: Any,
) -> str:
    """'rank 3 died (signal SIGKILL) during the switch to ...; the other ranks were stopped'.

    A rank killed by a signal (not our SIGTERM) is the likely cause even when another rank's
    error (its peer's "connection reset") reached the launcher first; both are named.
    """
    try:
        # Advice, not sealed (trainer/world/sealed.py): quoted, never decoded strictly.
        doing = (
            notes.get(NOTE_KEY).decode(errors="replace")[:500] if notes.check([NOTE_KEY]) else ""
        )
    except (RuntimeError, OSError):
        doing = ""
    during = f" during {doing}" if doing else ""
    killed = [
        (i, _signal_name(-c))
        for i, c in enumerate(exitcodes)
        if c is not None and c < 0 and -c != signal.SIGTERM and i != e.error_index
    ]
    if isinstance(e, mp.ProcessExitedException):
        how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        cause, detail = f"rank {e.error_index} died ({how})", ""
    else:
        cause, detail = f"rank {e.error_index} failed", f" Its error:{e}"
    if killed:
        i, name = killed[0]
        cause, detail = (
            f"rank {i} died (signal {name})",
            f" Rank {e.error_index} failed too.{detail}",
        )
    return f"{cause}{during}; the other ranks were stopped.{detail}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _child(
    index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world: int,
    host: str,
    port: int,
    fault_tolerant: bool = False,
    store_key: str = "",
) -> None:
    quiet_signals()  # also lets the launcher's death (PR_SET_PDEATHSIG: SIGINT) end this rank
    whole_lines()  # the ranks share the launcher's stdout and stderr
    os.environ.update(
        {
            "RANK": str(index),
            "LOCAL_RANK": str(index),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
            EXTERNAL_STORE_ENV: "1",
            STORE_KEY_ENV: store_key,
        }
    )
    if fault_tolerant:
        os.environ[FAULT_TOLERANT_ENV] = "1"
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    code = fn(*args)
    if code:
        sys.exit(int(code))
