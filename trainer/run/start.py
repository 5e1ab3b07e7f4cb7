"""How one rank enters its job: the process group formed (or, for a replacement, admitted into
the running one), the collectives bounded, and the plan every rank starts under agreed.

`enter_job` is what `malleus-trainer` does before training (trainer/cli.py), and what the
failure tests and bench/recovery_cost.py spawn their ranks with, so that they start their
ranks the way a pod does rather than with a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.launch.distributed import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DistEnv,
    fault_tolerant,
    init_distributed,
)
from malleus.trainer.recovery.join import Admission, await_admission
from malleus.trainer.recovery.protocol import hang_timeout_s
from malleus.trainer.world.exchange import broadcast_bytes
from malleus.trainer.world.world import World

__all__ = ["Entered", "enter_job", "join_job"]


@dataclass(frozen=True)
class Entered:
    """A rank in its job: what `run_rank` takes."""

    world: World
    """This process's view of the job's process group."""
    device: Any
    """Its device (a `torch.device`)."""
    plan: Plan
    """The plan it starts under: the coordinator's, or the one its admission carries."""
    admission: Admission | None
    """A replacement's admission (None: a rank of the job's start)."""


def enter_job(
    env: DistEnv, job: ResolvedJob, plan: Plan | None, *, init_timeout_s: float, join: bool = False
) -> Entered:
    """Form the job's process group as `env`, its collectives bounded by the job's hang timeout
    when failures are survivable (`fault_tolerant()`), else by the default; then every rank
    adopts the coordinator's `plan` (a planner need not be deterministic across processes: JSON
    bytes, never a pickle, validated again by `Plan.from_json`). With `join`, a replacement
    asks the running job to admit it instead and starts under the plan its admission carries
    (`plan` unused)."""
    timeout = hang_timeout_s(job) if fault_tolerant() else DEFAULT_COLLECTIVE_TIMEOUT_S
    world = World(env.world_size)
    world.set_collective_timeout(timeout)
    if join:
        device, store = init_distributed(env, world, init_timeout_s=init_timeout_s, join=True)
        admission = join_job(store, env.rank, world, init_timeout_s)
        return Entered(world, device, Plan.from_json(admission.plan), admission)
    device = init_distributed(
        env, world, init_timeout_s=init_timeout_s, collective_timeout_s=timeout
    )
    assert plan is not None, "a rank of the job's start needs its plan"
    mine = plan.to_json().encode() if env.rank == world.coordinator() else None
    agreed = broadcast_bytes(mine, world=world, device=device, what="the starting plan")
    return Entered(world, device, Plan.from_json(agreed), None)


def join_job(store: Any, gpu: int, world: World, timeout_s: float) -> Admission:
    """A replacement for `gpu` (`--join`): ask the running job to admit it, wait until it
    does at a step boundary, and form the process group with the members; then its alarm
    listens like theirs (trainer/world/alarm.py)."""
    admission = await_admission(world, store, gpu, timeout_s)
    world.start_alarm(store, gpu)
    return admission
