"""Starting the trainer processes: from torchrun's environment in a pod, or spawned locally.

One process per GPU; NCCL on CUDA, gloo on CPU. Joining is bounded: a rank that cannot reach
the master, or a job where some rank never shows up, fails within `init_timeout_s` with an
error naming MASTER_ADDR:MASTER_PORT, instead of hanging until the collective timeout.
Locally, the parent process hosts the rendezvous store on a port the OS picks, so concurrent
runs (tests) never race for a "free" port; when a child dies it stops the rest and names the
rank and what the job was doing (a note rank 0 leaves in that store, e.g. during a switch).

Stopping: the launcher alone decides. On its first SIGINT (Ctrl-C) or SIGTERM it sends SIGTERM to
every rank, gives them `STOP_S` seconds, kills what is left and raises `Interrupted`; a second
signal meanwhile changes nothing. The ranks die of the signal itself (`quiet_signals`), with no
Python handler and so no traceback, whatever collective they are blocked in.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "EXTERNAL_STORE_ENV",
    "DistEnv",
    "Interrupted",
    "LaunchError",
    "init_distributed",
    "note_writer",
    "quiet_signals",
    "spawn_local",
]

EXTERNAL_STORE_ENV = "MALLEUS_EXTERNAL_STORE"  # "1": the store is hosted outside rank 0
DEFAULT_INIT_TIMEOUT_S = 60.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
GRACE_S = 5.0  # after one local rank fails, how long the others may take to fail on their own
STOP_S = 5.0  # after SIGINT/SIGTERM, how long the ranks may take to exit before being killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
NOTE_PREFIX, NOTE_KEY = "malleus/note/", "doing"


class LaunchError(RuntimeError):
    """The process group could not be formed."""


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


def quiet_signals() -> None:
    """A rank dies of SIGINT or SIGTERM outright (the default action), so a stopped job prints
    no KeyboardInterrupt traceback from wherever each rank happened to be."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


@dataclass(frozen=True)
class DistEnv:
    """torchrun's contract: who am I, how many are we, where is the rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def where(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [n for n in names if not env.get(n)]
        if missing:
            raise LaunchError(
                f"missing {', '.join(missing)}: run under torchrun (or use `malleus train`, "
                "which starts the processes itself)"
            )
        try:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except ValueError as e:
            raise LaunchError(f"malformed torchrun environment: {e}") from None


def init_distributed(
    env: DistEnv,
    *,
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> torch.device:
    """Join the job's process group; returns this rank's device. Fails within ~init_timeout_s."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    external = os.environ.get(EXTERNAL_STORE_ENV) == "1"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = env.rank == 0 and not external and not agent_store
    timeout = timedelta(seconds=init_timeout_s)
    try:
        store: Any = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size if is_master else None,
            is_master,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        role = "serve the rendezvous on" if is_master else "reach the master at"
        raise LaunchError(
            f"rank {env.rank}: could not {role} MASTER_ADDR:MASTER_PORT = {env.where} "
            f"within {init_timeout_s:g}s: {_first_line(e)}"
        ) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"malleus/{attempt}/", store)
    store.set(f"joined/{env.rank}", "1")
    try:
        store.wait([f"joined/{r}" for r in range(env.world_size)], timeout)
    except (RuntimeError, OSError) as e:
        missing = [r for r in range(env.world_size) if not _joined(store, r)]
        raise LaunchError(
            f"rank {env.rank}: ranks {missing} of {env.world_size} did not join at "
            f"{env.where} within {init_timeout_s:g}s ({_first_line(e)})"
        ) from None
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore("pg/", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=collective_timeout_s),
        device_id=device if cuda else None,
    )
    return device


def _joined(store: Any, rank: int) -> bool:
    try:
        return bool(store.check([f"joined/{rank}"]))
    except (RuntimeError, OSError):
        return False


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def note_writer(env: DistEnv) -> Callable[[str], None] | None:
    """Under `spawn_local`, a way for a rank to tell the launcher what the job is doing (say,
    "the switch to plan generation 2 at step 3"), quoted if a rank dies. None elsewhere."""
    if os.environ.get(EXTERNAL_STORE_ENV) != "1":
        return None
    client = dist.TCPStore(
        env.master_addr, env.master_port, None, False, timeout=timedelta(seconds=30)
    )
    store = dist.PrefixStore(NOTE_PREFIX, client)
    return lambda text: store.set(NOTE_KEY, text)


def spawn_local(
    nprocs: int, fn: Callable[..., Any], args: tuple[Any, ...] = (), grace_s: float = GRACE_S
) -> None:
    """Run `fn(*args)` in `nprocs` fresh processes forming one job on 127.0.0.1.

    Each child gets torchrun's environment variables, so `fn` starts with
    `init_distributed(DistEnv.from_env())` exactly as under torchrun. When a child fails (an
    exception, or death by a signal), the others get `grace_s` seconds to fail on their own
    (printing their errors) and are then terminated; the LaunchError raised names the rank and
    what the job was doing (the ranks' last note). On SIGINT or SIGTERM (from the main thread
    only, where Python delivers signals) every child is stopped and `Interrupted` raised.
    """
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)  # lives while we wait
    handle = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if handle else {}
    got: list[int] = []
    try:
        if handle:  # inherited by the children until `_child` runs: no traceback from startup
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        ctx = mp.start_processes(
            _child,
            args=(fn, args, nprocs, host, store.port),
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
        doing = notes.get(NOTE_KEY).decode() if notes.check([NOTE_KEY]) else ""
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
    index: int, fn: Callable[..., Any], args: tuple[Any, ...], world: int, host: str, port: int
) -> None:
    quiet_signals()  # also lets the launcher's death (PR_SET_PDEATHSIG: SIGINT) end this rank
    os.environ.update(
        {
            "RANK": str(index),
            "LOCAL_RANK": str(index),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
            EXTERNAL_STORE_ENV: "1",
        }
    )
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    code = fn(*args)
    if code:
        sys.exit(int(code))
