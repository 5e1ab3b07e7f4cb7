"""The start-up and tear-down every spawned-rank body of the trainer tests shares
(trainer_cases, calibration_cases, precision_cases, switch_cases, hf_cases, fault_cases).

A body runs in each spawned process (tests/trainer/*_cases.py, spawned by `spawn_local`):
`with spawned_rank() as rank:` joins the job's process group, gives `rank.trainer(job, plan)`
(a Trainer on this rank with null services) and `rank.save(out, name, record)` (rank 0 writes
the result the test process reads), and destroys the group at the end. `offer_next` and
`switched_now` are the two steps of a body that drives live switches through rank 0's inbox.
Not collected by pytest (no test_ prefix); imported by bare name (tests insert tests/trainer on
sys.path) so spawned children can unpickle the case files that import it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.services import Services
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.parallel.groups import GroupCache
from malleus.trainer.switching.protocol import Migration
from malleus.trainer.world.world import World


@dataclass(frozen=True)
class SpawnedRank:
    """One spawned rank, in the job's process group. `groups`: the process groups every Trainer
    of this rank reuses, or None where each Trainer builds its own."""

    env: DistEnv
    world: World
    device: torch.device
    groups: GroupCache | None

    @property
    def rank(self) -> int:
        return self.env.rank

    def trainer(
        self, job: ResolvedJob, plan: Plan, *, services: Services | None = None, **options: Any
    ) -> Trainer:
        """A Trainer of `job` under `plan` on this rank: `services` else `Services.null` (a
        fresh one each call), the shared groups, and `options` (precision=, steps=, ...)."""
        return Trainer(
            job,
            plan,
            rank=self.rank,
            world=self.world,
            device=self.device,
            services=services if services is not None else Services.null(job, self.rank),
            groups=self.groups,
            **options,
        )

    def save(self, out: str | Path, name: str, record: Any) -> None:
        """Rank 0 writes `record` to OUT/name: JSON for a .json name, else `torch.save`."""
        if self.rank != 0:
            return
        path = Path(out) / name
        if path.suffix == ".json":
            path.write_text(json.dumps(record))
        else:
            torch.save(record, path)


def start_rank(
    env: DistEnv | None = None,
    *,
    init_timeout_s: float = 60,
    collective_timeout_s: float | None = None,
    shared_groups: bool = True,
) -> SpawnedRank:
    """Join the job's process group as `env` (else the spawned environment's) within
    `init_timeout_s`; `collective_timeout_s` bounds its collectives (the World's and the default
    group's) where given, else init_distributed's default; `shared_groups`: one GroupCache for
    every Trainer of this rank (else each builds its own)."""
    env = env if env is not None else DistEnv.from_env()
    world = World(env.world_size)
    timeouts: dict[str, float] = {"init_timeout_s": init_timeout_s}
    if collective_timeout_s is not None:
        world.set_collective_timeout(collective_timeout_s)
        timeouts["collective_timeout_s"] = collective_timeout_s
    device = init_distributed(env, world, **timeouts)
    return SpawnedRank(env, world, device, GroupCache(world) if shared_groups else None)


def stop_rank() -> None:
    """Leave the job: destroy the process group, where one is formed."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def spawned_rank(
    *,
    init_timeout_s: float = 60,
    collective_timeout_s: float | None = None,
    shared_groups: bool = True,
) -> Iterator[SpawnedRank]:
    """`start_rank` from the spawned environment; the process group is destroyed on the way
    out, whether the body finished or failed."""
    rank = start_rank(
        init_timeout_s=init_timeout_s,
        collective_timeout_s=collective_timeout_s,
        shared_groups=shared_groups,
    )
    try:
        yield rank
    finally:
        stop_rank()


def offer_next(trainer: Trainer, due: Mapping[int, Plan]) -> None:
    """Offer the plan `due` at the next step to rank 0's inbox, one step early so that it is in
    force from that step on, and assert the inbox accepted it (202). Other ranks do nothing."""
    plan = due.get(trainer.step + 1)
    if plan is None or trainer.rank != 0:
        return
    assert trainer.coordinator is not None
    code, answer = trainer.coordinator.inbox.offer(plan.model_dump_json())
    assert code == 202, answer


def switched_now(trainer: Trainer) -> Migration | None:
    """The switch made at the step just run (before it ran), else None."""
    m = trainer.last_migration
    return m if m is not None and m.step == trainer.step else None
