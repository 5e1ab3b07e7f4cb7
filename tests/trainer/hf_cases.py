"""Spawned-job body for tests/trainer/model/test_hf_parallel.py: Hugging Face models trained under
heterogeneous plans with a live switch, several runs in one process group.

Not collected by pytest (no test_ prefix); imported by path so spawned children can unpickle it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from rank_cases import offer_next, spawned_rank, switched_now

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.state import gather_full, resume, save_checkpoint


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
    with spawned_rank() as rank:
        for chain in chains:
            trainer = rank.trainer(chain.job, chain.first)
            due = dict(chain.switches)
            reports, switched = [], []
            while trainer.step < chain.steps:
                offer_next(trainer, due)
                reports.append(asdict(trainer.train_step()))
                m = switched_now(trainer)
                if m is not None:
                    switched.append((m.step, m.generation, m.bytes, m.minimal_bytes))
            full = gather_full(trainer, 0)
            # A plan-independent checkpoint, resumed under the first plan again.
            directory = Path(out) / f"{chain.name}-checkpoints"
            save_checkpoint(trainer, directory)
            again = rank.trainer(chain.job, chain.first)
            resume(again, directory)
            resumed = gather_full(again, 0)
            record = {"full": full, "reports": reports, "switched": switched}
            record |= {"resumed": resumed, "resumed_step": again.step}
            rank.save(out, f"{chain.name}.pt", record)
