"""Helpers for the trainer tests: small jobs, plans, and many cases in one spawned job.

Spawning gloo processes is slow (~15 s for 8 ranks on 2 cores), so one spawned job runs a list
of cases back to back, reusing its process groups; rank 0 saves each case's final full state
and step reports for the test process to compare with the single-process reference.
Not collected by pytest (no test_ prefix); imported by path so spawned children can unpickle it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from rank_cases import spawned_rank

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.state import gather_full
from malleus.trainer.parallel import grad_sync

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
SMALL = {"layers": 6, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 256, "sequence": 16}
TRAINING = {
    "globalBatchSize": 12,
    "microBatchSize": 1,
    "steps": 3,
    "learningRate": 3e-3,
    "warmupSteps": 1,
}


def small_job(
    nodes: int = 2,
    gpus: int = 4,
    *,
    tp: int = 2,
    model: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
    emulation: dict[str, Any] | None = None,
) -> ResolvedJob:
    """examples/tiny-cpu.yaml as job "test" with a smaller model (`SMALL`), `TRAINING` and no
    emulation, each overridden by the manifest fields given; judged as every entry point
    judges it."""
    manifest = yaml.safe_load(TINY.read_text())
    manifest["metadata"]["name"] = "test"
    spec = manifest["spec"]
    spec.update(nodes=nodes, gpusPerNode=gpus, parallelism={"tp": tp})
    spec["model"] = SMALL | (model or {})
    spec["training"] = TRAINING | (training or {})
    spec["emulation"] = emulation or {"enabled": False}
    return ResolvedJob.load(manifest).check()


def emulation(
    forward_s: float, backward_s: float, schedule: Iterable[tuple[int, int, float]] = ()
) -> dict[str, Any]:
    """spec.emulation: these per-layer-shard times and (step, rank, factor) slowdowns."""
    return {
        "enabled": True,
        "layerForwardMs": forward_s * 1000,
        "layerBackwardMs": backward_s * 1000,
        "schedule": [{"step": s, "rank": r, "factor": f} for s, r, f in schedule],
    }


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
    job: ResolvedJob
    plan: Plan
    steps: int


def run_cases(cases: list[Case], out_dir: str) -> None:
    """Spawned-job body: train every case from scratch; rank 0 writes OUT/<name>.pt."""
    with spawned_rank() as rank:
        assert rank.groups is not None
        for case in cases:
            trainer = rank.trainer(case.job, case.plan)
            reports = [asdict(trainer.train_step()) for _ in range(case.steps)]
            full = gather_full(trainer, 0)
            record = {"full": full, "reports": reports, "groups": len(rank.groups)}
            rank.save(out_dir, f"{case.name}.pt", record)


def run_chunk_cases(cases: list[Case], caps: list[int | None], out_dir: str) -> None:
    """Spawned-job body: train every case once per gradient chunk size in `caps` (None: the
    default, `grad_sync.CHUNK_BYTES`); rank 0 writes OUT/<name>-<cap>.pt with every rank's
    (chunks, chunks posted during the last step's backward) beside the model."""
    default = grad_sync.CHUNK_BYTES
    with spawned_rank() as rank:
        for case in cases:
            for cap in caps:
                grad_sync.CHUNK_BYTES = default if cap is None else cap  # read by new layouts
                trainer = rank.trainer(case.job, case.plan)
                reports = [asdict(trainer.train_step()) for _ in range(case.steps)]
                mine = torch.tensor([len(trainer.grad_sync.chunks), trainer.grad_sync.early])
                every = [torch.zeros_like(mine) for _ in range(trainer.world.size)]
                dist.all_gather(every, mine)
                record = {
                    "full": gather_full(trainer, 0),
                    "reports": reports,
                    "chunks": [tuple(int(v) for v in row) for row in every],
                }
                rank.save(out_dir, f"{case.name}-{cap}.pt", record)
        grad_sync.CHUNK_BYTES = default


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a-b| / (1 + max|b|): the exactness measure."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max() / (1 + b[k].abs().max())) for k in a)
