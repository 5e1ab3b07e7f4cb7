"""Live recovery, the process groups: letting go of the broken one, forming the next.

Kept apart from the protocol (trainer/recovery/protocol.py) because it is the one place that deals with
torch.distributed's registry and the sockets behind it: a survivor must release every reference
to the old group for its peers' collectives to fail at once, and every member (a joiner too,
trainer/recovery/join.py) forms the next epoch's group the same way. `wait_sealed` is the
bounded wait on a sealed key of the job's store (a replacement's admission).
"""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from malleus.trainer.world.membership import Membership
from malleus.trainer.world.sealed import Sealer
from malleus.trainer.world.world import World

if TYPE_CHECKING:
    from malleus.trainer.engine.trainer import Trainer

__all__ = ["form_group", "release_groups", "wait_sealed"]

log = logging.getLogger(__name__)


def release_groups(trainer: Trainer, failure: BaseException | None) -> None:
    """Let go of every process group, so that their sockets close now and the peers blocked
    on this rank fail their collectives at once instead of waiting out the timeout: a gloo
    group closes its connections when its last reference goes (the group cache, the
    pipeline's TP group, the frames of the failed step's traceback), not when destroyed."""
    trainer.drop_groups()
    seen: set[int] = set()
    e = failure
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
    if not _forget(trainer.world):
        _destroy()
    gc.collect()  # cheap: the imports are frozen out of its sight (trainer/launch/distributed.py)


def _forget(world: World) -> bool:
    """When collectives this rank left pending (its alarm rang while it waited, trainer/world/world.py
    `World.wait`) still wait on a peer: take every process group out of torch's registry without
    tearing it down (which would wait for them, the hang timeout when that peer is stopped), and
    let `world` keep them until those collectives are done. False (nothing done) otherwise.
    Their sockets then close later, not now: the peers do not need them to, their alarms tell
    them (trainer/world/alarm.py)."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return False
    reg = c10d._world
    if not world.bury(list(reg.pg_map)):
        return False
    # What torch's own _abort_process_group does for the whole world, less the abort.
    c10d._update_default_pg(None)
    for table in (
        reg.pg_map,
        reg.pg_names,
        reg.pg_group_ranks,
        reg.pg_backend_config,
        reg.pg_to_tag,
        reg.tags_to_pg,
        reg.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()
    reg.group_count = 0
    return True


def _destroy() -> None:
    """Abort and destroy every process group (the registry lets go of them)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    try:
        if dist.is_initialized():
            _abort_process_group()
    except (RuntimeError, ValueError) as e:  # already broken: nothing to release
        log.debug("abort: %s", e)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError) as e:
        log.debug("destroy_process_group: %s", e)


def form_group(world: World, store: Any, prefix: str, m: Membership, gpu: int) -> None:
    """Form the process group of membership `m` (collective among its members) and install
    `m` into `world`."""
    try:
        dist.init_process_group(
            "gloo" if not torch.cuda.is_available() else "nccl",
            store=dist.PrefixStore(prefix + "pg/", store),
            rank=m.pg(gpu),
            world_size=m.size,
            timeout=timedelta(seconds=world.collective_timeout_s),
        )
    except BaseException:
        _forget_failed_init()
        raise
    world.install(m)
    log.info("rank %d: process group of epoch %d formed: %s", gpu, m.epoch, list(m.members))


def _forget_failed_init() -> None:
    """After a process group that could not be formed (a member died meanwhile): torch counted
    it in the names it gives groups (`pg/N/` in the rendezvous keys) and resets the count only
    when a formed group is destroyed; left so, this process would meet the next group under
    another name than its peers (a replacement that failed an admission waited on `pg/1/` for
    members on `pg/0/`)."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def wait_sealed(store: Any, seal: Sealer, key: str, timeout_s: float) -> Any:
    """The JSON value at `key` once it is there and sealed by this job (a value a stranger
    planted is waited past, trainer/world/sealed.py); None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := seal.get(store, key)) is not None:
            return json.loads(got)
        time.sleep(0.02)
    return None
