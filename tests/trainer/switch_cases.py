"""Helpers for the switch tests: a spawned job that trains through a chain of plan switches.

Not collected by pytest (no test_ prefix); imported by path so spawned children can unpickle it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from rank_cases import offer_next, spawned_rank, switched_now

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.state import gather_full


def run_chain(
    job: ResolvedJob, first: Plan, switches: list[tuple[int, Plan]], steps: int, out: str
) -> None:
    """Spawned-job body: train under `first`; each (step, plan) of `switches` is offered to rank
    0's inbox so that it is in force from that step on. Rank 0 writes OUT/chain.pt: the full
    model right after every switch and at the end, the migration records, the step reports.

    Every rank checks that a piece it keeps across a switch is the very tensor it had (no copy)
    and that pieces it gives up are gone."""
    with spawned_rank(shared_groups=False) as rank:
        trainer = rank.trainer(job, first)
        due = dict(switches)
        models: dict[int, dict[str, torch.Tensor] | None] = {}
        migrations, reports = [], []
        while trainer.step < steps:
            offer_next(trainer, due)
            before = {n: t.data_ptr() for n, t in trainer.params.items()}
            reports.append(asdict(trainer.train_step()))
            m = switched_now(trainer)
            if m is not None:
                migrations.append(m.as_status())
                held = {p.name for p in trainer.layout.held()}
                assert set(trainer.params) == held == set(trainer.optim.state)
                for name in held & set(before):
                    assert trainer.params[name].data_ptr() == before[name], f"{name} copied"
                models[trainer.step] = gather_full(trainer, 0)
        models[trainer.step] = gather_full(trainer, 0)
        record = {"models": models, "migrations": migrations, "reports": reports}
        rank.save(out, "chain.pt", record)


def manifest(
    nodes: int, gpus: int, *, layers: int = 4, steps: int = 4, tied: bool = False, **spec: Any
) -> dict[str, Any]:
    """A small MalleusJob (tp 2, global batch 8) for `malleus train` runs."""
    model = {"layers": layers, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 256, "sequence": 16}
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "switch-test"},
        "spec": {
            "image": "malleus:test",
            "nodes": nodes,
            "gpusPerNode": gpus,
            "model": model | ({"tiedEmbeddings": True} if tied else {}),
            "training": {
                "globalBatchSize": 8,
                "microBatchSize": 1,
                "steps": steps,
                "learningRate": 0.003,
                "warmupSteps": 1,
            },
            "parallelism": {"tp": 2},
            **spec,
        },
    }


def plan_dict(*pipelines: tuple[int, list[tuple[list[int], int, int]]], excluded=()) -> dict:
    """plan_dict((micro_batches, [(ranks, first, end), ...]), ..., excluded=...) as JSON data."""
    return {
        "tp": 2,
        "pipelines": [
            {"micro_batches": m, "stages": [{"ranks": r, "layers": [a, b]} for r, a, b in st]}
            for m, st in pipelines
        ],
        "excluded": list(excluded),
    }
