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
from rank_cases import SpawnedRank, spawned_rank

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.state import gather_full, resume, save_checkpoint
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.model.precision import Precision
from malleus.trainer.run.loop import run_rank
from malleus.trainer.run.options import RunOptions


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
    with spawned_rank() as rank:
        for run in runs:
            result = (
                _via_loop(run, rank, out_dir) if run.via_loop else _with_trainer(run, rank, out_dir)
            )
            rank.save(out_dir, f"{run.name}.pt", result)


def _via_loop(run: Run, rank: SpawnedRank, out_dir: str) -> dict:
    model_path = Path(out_dir) / f"{run.name}-model.pt"
    opts = RunOptions(steps=run.steps, quiet=True, float64=run.float64, save_model=str(model_path))
    reports = run_rank(
        run.job, run.plan, opts, rank=rank.rank, world=rank.world, device=rank.device
    )
    dist.barrier()
    full = torch.load(model_path) if rank.rank == 0 else None
    return {"full": full, "reports": [asdict(r) for r in reports], "migrations": []}


def _with_trainer(run: Run, rank: SpawnedRank, out_dir: str) -> dict:
    precision = Precision.of(run.job.spec.training.precision, float64=run.float64)

    def fresh(plan: Plan) -> Trainer:
        return rank.trainer(run.job, plan, precision=precision, steps=run.steps)

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
