"""Spawned body of tests/trainer/measure/test_calibration.py (imported by path, so children can
unpickle it; no test_ prefix, not collected)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.services import Services
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.world.world import World


def run(job: ResolvedJob, plans: list[Plan], steps: int, out: str) -> None:
    """Train `steps` steps under each plan in turn (a live switch between them); rank 0 writes
    OUT/result.json: per plan the step seconds, the calibration and the link rates."""
    env = DistEnv.from_env()
    world = World(env.world_size)
    device = init_distributed(env, world, init_timeout_s=60)
    try:
        trainer = Trainer(
            job,
            plans[0],
            rank=env.rank,
            world=world,
            device=device,
            services=Services.null(job, env.rank),
        )
        result = []
        for i, plan in enumerate(plans):
            if i:
                trainer.switch(plan.model_copy(update={"generation": trainer.plan.generation + 1}))
            seconds = [trainer.train_step().seconds for _ in range(steps)]
            cal = trainer.calibrator
            status = trainer.services.status()
            result.append(
                {
                    "seconds": seconds,
                    "calibration": cal.calibration,
                    "link_rates": cal.link_rates,
                    "generation": cal.generation,
                    "status_calibration": status.model_dump(mode="json")["calibration"],
                    "status_links": status.model_dump(mode="json")["link_rates"],
                }
            )
        if env.rank == 0:
            (Path(out) / "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
