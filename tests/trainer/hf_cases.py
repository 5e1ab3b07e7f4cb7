"""Spawned-job body for tests/trainer/model/test_hf_parallel.py: Hugging Face models trained under
heterogeneous plans with a live switch, several runs in one process group.

Not collected by pytest (no test_ prefix); imported by path so spawned children can unpickle it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.services import Services
from malleus.trainer.engine.state import gather_full, resume, save_checkpoint
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.parallel.groups import GroupCache
from malleus.trainer.world.world import World


@dataclass(frozen=True)
class Chain:
    """Train `job` under `first`; each (step, plan) of `switches` is in force from that step."""

    name: str
    job: ResolvedJob
    first: Plan
    switches: tuple[tuple[int, Plan], ...]
    steps: int


def run_chains(chains: list[Chain], out: str) -> None:
    """Every chain in turn, sharing the process groups; rank 0 writes OUT/<name>.pt with the
    final full model, the step reports, the generations switched to, and the model resumed
    from a checkpoint of the last plan under the first."""
    env = DistEnv.from_env()
    world = World(env.world_size)
    device = init_distributed(env, world, init_timeout_s=60)
    groups = GroupCache(world)
    try:
        for chain in chains:
            services = Services.null(chain.job, env.rank)
            trainer = Trainer(
                chain.job,
                chain.first,
                rank=env.rank,
                world=world,
                device=device,
                services=services,
                groups=groups,
            )
            due = dict(chain.switches)
            reports, switched = [], []
            while trainer.step < chain.steps:
                plan = due.get(trainer.step + 1)
                if plan is not None and trainer.coordinator is not None:
                    code, answer = trainer.coordinator.inbox.offer(plan.model_dump_json())
                    assert code == 202, answer
                reports.append(asdict(trainer.train_step()))
                m = trainer.last_migration
                if m is not None and m.step == trainer.step:
                    switched.append((m.step, m.generation, m.bytes, m.minimal_bytes))
            full = gather_full(trainer, 0)
            # A plan-independent checkpoint, resumed under the first plan again.
            directory = Path(out) / f"{chain.name}-checkpoints"
            save_checkpoint(trainer, directory)
            again = Trainer(
                chain.job,
                chain.first,
                rank=env.rank,
                world=world,
                device=device,
                services=Services.null(chain.job, env.rank),
                groups=groups,
            )
            resume(again, directory)
            resumed = gather_full(again, 0)
            if env.rank == 0:
                record = {"full": full, "reports": reports, "switched": switched}
                record |= {"resumed": resumed, "resumed_step": again.step}
                torch.save(record, Path(out) / f"{chain.name}.pt")
    finally:
        dist.destroy_process_group()
