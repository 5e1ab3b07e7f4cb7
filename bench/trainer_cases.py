"""The cases of bench/trainer.py and the spawned job that runs them: scales, straggler
situations, the job each one trains (a small model on the emulated clock, stragglers from the
emulation schedule) with its uniform and planner's plans, and the ranks' body, which alternates
the two plans' steps and leaves rank 0's figures in OUT/<i>.json."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from malleus.job import ResolvedJob
    from malleus.planner import Plan


@dataclass(frozen=True)
class Scale:
    """A cluster shape, the benchmark model's depth and the micro-batches per step."""

    nodes: int
    gpus_per_node: int
    tp: int
    layers: int
    micro_batches: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def label(self) -> str:
        return (
            f"{self.world} ({self.nodes}x{self.gpus_per_node}, tp {self.tp}, {self.layers} "
            f"layers, {self.micro_batches} micro-batches)"
        )


SCALES = {
    8: Scale(nodes=2, gpus_per_node=4, tp=2, layers=2, micro_batches=16),
    16: Scale(nodes=4, gpus_per_node=4, tp=2, layers=4, micro_batches=32),
}


def situations(s: Scale) -> dict[str, dict[int, float]]:
    """Injected straggling rates: one 2x, one 4x, and a 2x and a 4x in different nodes."""
    return {
        "one 2x": {1: 2.0},
        "one 4x": {1: 4.0},
        "2x + 4x, 2 nodes": {1: 2.0, s.gpus_per_node + 2: 4.0},
    }


@dataclass(frozen=True)
class Job:
    """One situation as the spawned ranks run it (plans made by the parent, once)."""

    name: str
    resolved: ResolvedJob
    plans: dict[str, Plan]  # "uniform" / "planner" -> Plan


def config(s: Scale, rates: dict[int, float], forward_s: float, backward_s: float) -> ResolvedJob:
    """The job: a small model, `rates` injected from step 0 by the emulation schedule."""
    from malleus.job import ResolvedJob

    model = {"layers": s.layers, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 256, "sequence": 16}
    schedule = [{"step": 0, "rank": r, "factor": f} for r, f in sorted(rates.items())]
    manifest = {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "bench-trainer"},
        "spec": {
            "image": "malleus:bench",
            "nodes": s.nodes,
            "gpusPerNode": s.gpus_per_node,
            "model": model,
            "training": {
                "globalBatchSize": s.micro_batches,
                "microBatchSize": 1,
                "steps": 1000,  # only the LR schedule sees this
                "learningRate": 1e-3,
            },
            "parallelism": {"tp": s.tp},
            "emulation": {
                "enabled": True,
                "layerForwardMs": forward_s * 1000,
                "layerBackwardMs": backward_s * 1000,
                "schedule": schedule,
            },
        },
    }
    return ResolvedJob.load(manifest).check()


def make_jobs(
    s: Scale, forward_s: float, backward_s: float, only: list[str] | None = None
) -> list[Job]:
    """Every situation of a scale (or those named in `only`), with its uniform plan and the
    planner's plan."""
    from malleus.planner import plan, uniform_plan

    jobs = []
    for name, rates in situations(s).items():
        if only and name not in only:
            continue
        resolved = config(s, rates, forward_s, backward_s)
        problem = resolved.problem(rates)
        uniform = uniform_plan(problem)
        assert uniform is not None
        jobs.append(Job(name, resolved, {"uniform": uniform, "planner": plan(problem)}))
    return jobs


# ---- the spawned job -----------------------------------------------------------------------
def run_scale(jobs: list[Job], warmup: int, steps: int, out: str) -> None:
    """Spawned-job body: per job, alternate the two plans' steps; rank 0 writes OUT/<i>.json."""
    import torch.distributed as dist

    from malleus.trainer.engine.services import Services
    from malleus.trainer.engine.trainer import Trainer
    from malleus.trainer.launch.distributed import DistEnv, init_distributed
    from malleus.trainer.parallel.groups import GroupCache
    from malleus.trainer.world.world import World

    env = DistEnv.from_env()
    world = World(env.world_size)
    device = init_distributed(env, world, init_timeout_s=120)
    groups = GroupCache(world)
    try:
        for index, job in enumerate(jobs):
            trainers = {
                name: Trainer(
                    job.resolved,
                    p,
                    rank=env.rank,
                    world=world,
                    device=device,
                    services=Services.null(job.resolved, env.rank),
                    groups=groups,
                )
                for name, p in job.plans.items()
            }
            seconds: dict[str, list[float]] = {name: [] for name in trainers}
            pipeline: dict[str, list[float]] = {name: [] for name in trainers}
            for name, t in trainers.items():
                _time_pipeline(t, pipeline[name])
            rates: dict[str, dict[int, float | None]] = {}
            order = list(trainers)
            for i in range(warmup + steps):
                for name in order if i % 2 == 0 else order[::-1]:
                    report = trainers[name].train_step()
                    if i >= warmup:
                        seconds[name].append(report.seconds)
                    rates[name] = report.rates
                if env.rank == 0:
                    phase = "warm-up" if i < warmup else f"step {i - warmup + 1}/{steps}"
                    last = "  ".join(f"{n} {seconds[n][-1]:.3f}s" for n in order if seconds[n])
                    print(f"  [{job.name}] {phase} {last}", flush=True)
            mine = {
                "clock": {name: t.services.clock.stats() for name, t in trainers.items()},
                "pipeline": {name: v[warmup:] for name, v in pipeline.items()},
            }
            gathered: list[Any] = [None] * world.size
            dist.all_gather_object(gathered, mine)
            if env.rank == 0:
                calibration = {
                    name: {
                        "calibration": t.calibrator.calibration,
                        "link_rates": t.calibrator.link_rates,
                    }
                    for name, t in trainers.items()
                }
                result = {
                    "seconds": seconds,
                    "rates": rates,
                    "ranks": gathered,
                    "calibration": calibration,
                }
                (Path(out) / f"{index}.json").write_text(json.dumps(result))
            del trainers
    finally:
        dist.destroy_process_group()


def _time_pipeline(trainer: Any, sink: list[float]) -> None:
    """Append the seconds of every `pipeline.run()` (this rank's 1F1B schedule, without the
    step's gradient sync, world all-reduce and optimizer) to `sink`."""
    stage = getattr(trainer, "pipeline", None)
    if stage is None:  # an excluded rank
        return
    run = stage.run

    def timed() -> Any:  # the stage's loss sum
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            sink.append(time.perf_counter() - t0)

    stage.run = timed
