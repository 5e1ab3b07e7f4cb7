"""Helpers for the trainer tests: small jobs, plans, and many cases in one spawned job.

Spawning gloo processes is slow (~15 s for 8 ranks on 2 cores), so one spawned job runs a list
of cases back to back, reusing its process groups; rank 0 saves each case's final full state
and step reports for the test process to compare with the single-process reference.
Not collected by pytest (no test_ prefix); imported by path so spawned children can unpickle it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from malleus.planner import Plan
from malleus.trainer.config import EmulationConfig, TrainConfig
from malleus.trainer.launch import DistEnv, init_distributed
from malleus.trainer.model import GPTConfig
from malleus.trainer.parallel.groups import GroupCache
from malleus.trainer.services import Services
from malleus.trainer.worker import Trainer

SMALL = GPTConfig(layers=6, hidden=32, heads=4, ffn=64, vocab=256, sequence=16, tp=2)


def small_config(nodes: int = 2, gpus: int = 4, **over: Any) -> TrainConfig:
    base = TrainConfig(
        name="test",
        nodes=nodes,
        gpus_per_node=gpus,
        model=SMALL,
        global_batch=12,
        micro_batch=1,
        steps=3,
        learning_rate=3e-3,
        warmup_steps=1,
    )
    return replace(base, **over)


def plan(
    pipelines: list[tuple[int, list[tuple[list[int], tuple[int, int]]]]], excluded=(), tp=2
) -> Plan:
    """plan([(micro_batches, [(ranks, (first, end)), ...]), ...], excluded)."""
    return Plan.model_validate(
        {
            "tp": tp,
            "pipelines": [
                {"micro_batches": m, "stages": [{"ranks": r, "layers": list(ls)} for r, ls in st]}
                for m, st in pipelines
            ],
            "excluded": list(excluded),
        }
    )


@dataclass(frozen=True)
class Case:
    name: str
    cfg: TrainConfig
    plan: Plan
    steps: int


def run_cases(cases: list[Case], out_dir: str) -> None:
    """Spawned-job body: train every case from scratch; rank 0 writes OUT/<name>.pt."""
    env = DistEnv.from_env()
    device = init_distributed(env, init_timeout_s=60)
    groups = GroupCache()
    try:
        for case in cases:
            trainer = Trainer(
                case.cfg,
                case.plan,
                rank=env.rank,
                world=env.world_size,
                device=device,
                services=Services.null(case.cfg, env.rank),
                groups=groups,
            )
            reports = [asdict(trainer.train_step()) for _ in range(case.steps)]
            full = trainer.gather_full(0)
            if env.rank == 0:
                torch.save(
                    {"full": full, "reports": reports, "groups": len(groups)},
                    Path(out_dir) / f"{case.name}.pt",
                )
    finally:
        dist.destroy_process_group()


def emulated(cfg: TrainConfig, forward_s: float, backward_s: float, schedule) -> TrainConfig:
    return replace(cfg, emulation=EmulationConfig(forward_s, backward_s, tuple(schedule)))


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a-b| / (1 + max|b|): the exactness measure."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max() / (1 + b[k].abs().max())) for k in a)
