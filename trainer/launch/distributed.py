"""Starting a trainer process: from torchrun's environment in a pod, or as a child of `spawn_local`.

One process per GPU; NCCL on CUDA, gloo on CPU. Joining is bounded: a rank that cannot reach
the master, or a job where some rank never shows up, fails within `init_timeout_s` with an
error naming MASTER_ADDR:MASTER_PORT, instead of hanging until the collective timeout.

This module is one rank's side (its environment, `init_distributed`, the store's address, the
note it leaves for the launcher); starting the processes locally and supervising them (the
stop signals, a child's death, fault-tolerant waits) is trainer/launch/spawn.py.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from malleus.trainer.world.errors import LaunchError, first_line
from malleus.trainer.world.membership import Membership
from malleus.trainer.world.sealed import STORE_KEY_ENV, TOKEN_FILE_ENV, Sealer, job_store_key
from malleus.trainer.world.store_client import RedialingStore
from malleus.trainer.world.world import World

__all__ = [
    "EXTERNAL_STORE_ENV",
    "FAULT_TOLERANT_ENV",
    "STORE_ENV",
    "DistEnv",
    "fault_tolerant",
    "init_distributed",
    "note_writer",
    "quiet_signals",
    "store_sealer",
]

log = logging.getLogger(__name__)

EXTERNAL_STORE_ENV = "MALLEUS_EXTERNAL_STORE"  # "1": the store is hosted outside rank 0
STORE_ENV = "MALLEUS_STORE"
"""`host:port` of a TCPStore no rank hosts (`python -m malleus.trainer store`, the runner's or
the operator's): every rank meets there, and failures are survivable (trainer/recovery/protocol.py)."""
FAULT_TOLERANT_ENV = "MALLEUS_FAULT_TOLERANT"
"""Set to "1" by `spawn_local(..., fault_tolerant=True)`: the launcher's store outlives any rank,
so survivors recover instead of the job failing."""
DEFAULT_INIT_TIMEOUT_S = 60.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
NOTE_PREFIX, NOTE_KEY = "malleus/note/", "doing"


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
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", "0"))
            # In a pod (operator/workers.py) torchrun launches only that pod's ranks: with the
            # job's store, the global identity is the pod's node index (node * gpus + local).
            node, nodes, gpus = (
                env.get(f"MALLEUS_{k}") for k in ("NODE_RANK", "NODES", "GPUS_PER_NODE")
            )
            if env.get(STORE_ENV) and node and nodes and gpus:
                rank, world = int(node) * int(gpus) + local, int(nodes) * int(gpus)
            return cls(
                rank=rank,
                world_size=world,
                local_rank=local,
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except ValueError as e:
            raise LaunchError(f"malformed torchrun environment: {e}") from None


def init_distributed(
    env: DistEnv,
    world: World,
    *,
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    join: bool = False,
) -> Any:
    """Join the job's process group; returns this rank's device. Fails within ~init_timeout_s.

    `world` (`World(env.world_size)`, made by the caller) holds the job's process group from
    then on: the first membership, and with fault tolerance (`fault_tolerant()`) the store
    client to recover by and the recovery alarm (trainer/world/world.py). `join`: a replacement
    entering a running job: returns (device, the job's store) and forms no process group; the
    rank's loop asks the job to admit it (trainer/run/loop.py `join_job`)."""
    if world.size != env.world_size:
        raise ValueError(f"World({world.size}) for WORLD_SIZE {env.world_size}")
    if join or fault_tolerant():  # the store decides membership and recovery: sealed values
        world.seal_with(store_sealer(env.rank))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    external = os.environ.get(EXTERNAL_STORE_ENV) == "1" or bool(os.environ.get(STORE_ENV))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = env.rank == 0 and not external and not agent_store
    timeout = timedelta(seconds=init_timeout_s)
    host, port = store_address(env)
    try:
        if external:  # no rank hosts it: a lost store restarts empty, and this client redials
            store: Any = RedialingStore(host, port, timeout)
            world.hold(store)  # for as long as the process: C++ keeps only its C++ half
        else:
            store = dist.TCPStore(
                host,
                port,
                env.world_size if is_master else None,
                is_master,
                timeout=timeout,
                wait_for_workers=False,
            )
    except (RuntimeError, OSError) as e:
        role = "serve the rendezvous on" if is_master else "reach the master at"
        raise LaunchError(
            f"rank {env.rank}: could not {role} MASTER_ADDR:MASTER_PORT = {env.where} "
            f"within {init_timeout_s:g}s: {first_line(e)}"
        ) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"malleus/{attempt}/", store)
    # Everything alive now (torch and the other imports: hundreds of thousands of objects) is
    # moved out of the collector's sight: recovery must gc.collect() to drop the last cycle
    # holding a broken group's sockets (trainer/recovery/groups.py), and a full collection
    # over the imports took 1.5 s of a 2 s recovery on a loaded machine.
    gc.freeze()
    if join:  # a replacement: the rank's loop asks the running job in (trainer/run/loop.py)
        return device, store
    store.set(f"joined/{env.rank}", "1")
    try:
        store.wait([f"joined/{r}" for r in range(env.world_size)], timeout)
    except (RuntimeError, OSError) as e:
        missing = [r for r in range(env.world_size) if not _joined(store, r)]
        raise LaunchError(
            f"rank {env.rank}: ranks {missing} of {env.world_size} did not join at "
            f"{env.where} within {init_timeout_s:g}s ({first_line(e)})"
        ) from None
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore("pg/", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=collective_timeout_s),
        device_id=device if cuda else None,
    )
    world.install(Membership.full(env.world_size), store if fault_tolerant() else None)
    if fault_tolerant():
        world.start_alarm(store, env.rank)
    return device


def store_sealer(rank: int, environ: Mapping[str, str] | None = None) -> Sealer:
    """The sealer of a fault-tolerant rank (trainer/world/sealed.py): the job's key, from
    `$MALLEUS_STORE_KEY` or the control token. None is refused: such a rank believes what the
    store says about who is dead, who leads and who is admitted, and without a key anyone who
    can write the store would decide it."""
    try:
        key = job_store_key(environ)
    except ValueError as e:
        raise LaunchError(f"rank {rank}: {e}") from None
    if key is None:
        raise LaunchError(
            f"rank {rank}: a fault-tolerant job needs the job's secret to seal the values of "
            f"its store: set {TOKEN_FILE_ENV} (the job's control token, as `malleus run` and "
            f"the operator do) or {STORE_KEY_ENV} (hex, the same for every rank)"
        )
    return Sealer(key)


def fault_tolerant() -> bool:
    """Failures are survivable: the rendezvous store is hosted by no rank (`$MALLEUS_STORE`, or
    `spawn_local(..., fault_tolerant=True)`)."""
    return bool(os.environ.get(STORE_ENV)) or os.environ.get(FAULT_TOLERANT_ENV) == "1"


def store_address(env: DistEnv) -> tuple[str, int]:
    """Where the job's TCPStore is: `$MALLEUS_STORE` (host:port), else MASTER_ADDR:MASTER_PORT."""
    given = os.environ.get(STORE_ENV)
    if not given:
        return env.master_addr, env.master_port
    host, sep, port = given.rpartition(":")
    if not sep or not port.isdigit():
        raise LaunchError(f"{STORE_ENV}={given!r}: expected host:port")
    return host or "127.0.0.1", int(port)


def _joined(store: Any, rank: int) -> bool:
    try:
        return bool(store.check([f"joined/{rank}"]))
    except (RuntimeError, OSError):
        return False


def note_writer(env: DistEnv) -> Callable[[str], None] | None:
    """Under `spawn_local`, a way for a rank to tell the launcher what the job is doing (say,
    "the switch to plan generation 2 at step 3"), quoted if a rank dies. None elsewhere."""
    if os.environ.get(EXTERNAL_STORE_ENV) != "1":
        return None
    host, port = store_address(env)
    return _Note(RedialingStore(host, port, timedelta(seconds=30)))


class _Note:
    """`note_writer`'s writer. It dials the store again when the store was lost and started
    again (its own client: a plain TCPStore's socket stays broken, and a switch that wrote its
    note through one failed with "Broken pipe" on every try after a store restart). A note is
    advice for the launcher's failure message: one that cannot be written is logged and
    dropped, never the failure of what it describes."""

    def __init__(self, client: RedialingStore) -> None:
        self.client = client  # held: the PrefixStore keeps only the C++ half of a Python store
        self.store = dist.PrefixStore(NOTE_PREFIX, client)

    def __call__(self, text: str) -> None:
        try:
            self.store.set(NOTE_KEY, text)
        except (RuntimeError, OSError) as e:
            log.warning("could not leave a note for the launcher: %s", first_line(e))
