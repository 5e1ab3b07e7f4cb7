"""Helpers for the precision tests: runs (a plan, then live switches) in a given precision.

One spawned job trains every `Run` in turn, reusing its process groups; rank 0 saves each run's
final full model (the master weights), its step reports and its migrations for the test process
to compare with the single-process reference. A run with `via_loop` goes through `run_rank`
(so `RunOptions.float64` is what sets its precision) instead of a bare `Trainer`.
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
from malleus.trainer.model.precision import Precision
from malleus.trainer.parallel.groups import GroupCache
from malleus.trainer.run.loop import run_rank
from malleus.trainer.run.options import RunOptions
from malleus.trainer.world.world import World


@dataclass(frozen=True)
class Run:
    name: str
    job: ResolvedJob
    plan: Plan
    steps: int
    switches: tuple[tuple[int, Plan], ...] = ()  # (step, plan): in force from that step
    float64: bool = False
    via_loop: bool = False
    checkpoint_at: int | None = None  # save, resume into a fresh Trainer, continue from there


def run_all(runs: list[Run], out_dir: str) -> None:
    """Spawned-job body: every run from scratch; rank 0 writes OUT/<name>.pt."""
    env = DistEnv.from_env()
    world = World(env.world_size)
    device = init_distributed(env, world, init_timeout_s=60)
    groups = GroupCache(world)
    try:
        for run in runs:
            result = (
                _via_loop(run, env, world, device, out_dir)
                if run.via_loop
                else _with_trainer(run, env, world, device, groups, out_dir)
            )
            if env.rank == 0:
                torch.save(result, Path(out_dir) / f"{run.name}.pt")
    finally:
        dist.destroy_process_group()


def _via_loop(run: Run, env: DistEnv, world: World, device: torch.device, out_dir: str) -> dict:
    model_path = Path(out_dir) / f"{run.name}-model.pt"
    opts = RunOptions(steps=run.steps, quiet=True, float64=run.float64, save_model=str(model_path))
    reports = run_rank(run.job, run.plan, opts, rank=env.rank, world=world, device=device)
    dist.barrier()
    full = torch.load(model_path) if env.rank == 0 else None
    return {"full": full, "reports": [asdict(r) for r in reports], "migrations": []}


def _with_trainer(
    run: Run,
    env: DistEnv,
    world: World,
    device: torch.device,
    groups: GroupCache,
    out_dir: str,
) -> dict:
    precision = Precision.of(run.job.spec.training.precision, float64=run.float64)

    def fresh(plan: Plan) -> Trainer:
        services = Services.null(run.job, env.rank)
        return Trainer(
            run.job,
            plan,
            rank=env.rank,
            world=world,
            device=device,
            groups=groups,
            services=services,
            precision=precision,
            steps=run.steps,
        )

    trainer = fresh(run.plan)
    due = dict(run.switches)
    reports, migrations = [], []
    while trainer.step < run.steps:
        if trainer.step in due:  # collective: every rank switches at the same boundary
            migrations.append(asdict(trainer.switch(due[trainer.step])))
        if trainer.step == run.checkpoint_at:
            directory = Path(out_dir) / f"{run.name}-ckpt"
            save_checkpoint(trainer, directory)
            trainer = fresh(trainer.plan)
            assert resume(trainer, directory) is not None
        reports.append(asdict(trainer.train_step()))
    return {"full": gather_full(trainer, 0), "reports": reports, "migrations": migrations}
